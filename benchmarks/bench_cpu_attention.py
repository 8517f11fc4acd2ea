"""The eager CPU paged attention's two paths side by side, per layer: the C kernel (with its AMX
tiles for prompt rows where the CPU has them) and SDPA over gathered blocks
(blink.kernels.cpu.attention), on SmolLM2's heads, with the path the per-step cost estimate
picks.

Each step shape is a mix of (cached tokens, new tokens) rows; both paths run the same call
``--calls`` times after warm-ups, best of ``--rounds`` rounds, with the per-step memos kept
(as the model's layers share them); the last column says whether the estimate picked the
faster one.

    python -m benchmarks.bench_cpu_attention --threads 1

``--against DEFINE`` adds the C kernel built with ``-DDEFINE`` (``DECODE_CASES=0``: its
per-token pass as before 2026-12-07; ``PREFETCH=0``; ``TILES=0``), timed alternately with
today's build in the same rounds, and its speed-up column (today's against it); ``--heads
32 --kv-heads 8`` gives a Llama-3.2-1B's heads, ``--only decode`` the decode steps alone.

    python -m benchmarks.bench_cpu_attention --threads 2 --against DECODE_CASES=0 --only decode

``--cold MB`` times each call after reading MB megabytes of other memory (outside the timing),
as a decode step reaches each layer's attention after streaming the weights through the caches:
the KV cache comes from memory then, not from L2 as in back-to-back calls. One thread only (the
kernel pool's worker would fall asleep during each read, and its wake-up would be timed), e.g.
today's kernel against its values pass without its prefetches:

    python -m benchmarks.bench_cpu_attention --threads 1 --cold 64 --against VALUES_PREFETCH=0 --only decode
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

# step name -> rows of (cached, new)
STEPS: dict[str, list[tuple[int, int]]] = {
    "decode 1 x 128 ctx": [(128, 1)],
    "decode 1 x 1024": [(1023, 1)],
    "decode 16 x 128": [(128, 1)] * 16,
    "decode 16 x 256": [(255, 1)] * 16,
    "decode 16 x 2048": [(2047, 1)] * 16,
    "decode 1 x 4096": [(4095, 1)],
    "15 decodes @128 + 128-token prompt": [(128, 1)] * 15 + [(0, 128)],
    "15 decodes @255 + 256-token prompt": [(255, 1)] * 15 + [(0, 256)],
    "prefill 1 x 64": [(0, 64)],
    "prefill 1 x 128": [(0, 128)],
    "prefill 4 x 128": [(0, 128)] * 4,
    "prefill 1 x 512": [(0, 512)],
    "1 decode + 512-token prompt": [(100, 1), (0, 512)],
    "8 decodes + 512 chunk over 1536": [(300, 1)] * 8 + [(1536, 512)],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the C kernel splits by them too)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", metavar="DEFINE", default=None,
                   help="also time the C kernel built with -DDEFINE (e.g. DECODE_CASES=0), alternating")
    p.add_argument("--only", default=None, help="the steps whose name starts with this (e.g. decode)")
    p.add_argument("--cold", metavar="MB", type=int, default=0,
                   help="read this many MB of other memory before each timed call (with --threads 1)")
    args = p.parse_args()
    if args.cold and args.threads != 1:
        p.error("--cold times one thread (--threads 1): the kernel pool's worker sleeps through each "
                "read of other memory, and its wake-up would be timed")

    import torch

    from blink.kernels.cpu import attention as cpu_attention

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from attention_cases import make_batch

    torch.set_num_threads(args.threads)
    # --cold: MB of fp32 read before each timed call (a decode step's weights between layers)
    evict = torch.ones(args.cold << 18).sum if args.cold else None
    if cpu_attention.native_kernel() is None:
        sys.exit("the C kernel did not build here (see the warning above)")

    against = None
    if args.against:
        from blink.shared.native_build import build_library

        native = cpu_attention.LIBRARY
        against = build_library(native.source, (*native.flags, f"-D{args.against}"), None, native.headers)
        native.setup(against)

    def best_ms(fn, builds: tuple = (None,)) -> list[float]:
        """fn's best ms a call with each of ``builds`` in turn as the C kernel (None: the one
        loaded), round by round so that a slow second hits them all."""
        for _ in range(3):
            fn()
        times: list[list[float]] = [[] for _ in builds]
        for _ in range(args.rounds):
            for which, library in enumerate(builds):
                with cpu_attention.LIBRARY.using(library) if library is not None else contextlib.nullcontext():
                    if args.cold:
                        elapsed = 0.0
                        for _ in range(args.calls):
                            evict()
                            start = time.perf_counter()
                            fn()
                            elapsed += time.perf_counter() - start
                    else:
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            fn()
                        elapsed = time.perf_counter() - start
                    times[which].append(elapsed / args.calls * 1e3)
        return [min(t) for t in times]

    print(f"torch {torch.__version__}, {args.threads} thread(s), heads {args.heads}/{args.kv_heads}, "
          f"head dim {args.head_dim}, bf16, block 16; the C kernel's tiles for rows of at least "
          f"{cpu_attention.tile_min_tokens() or '(none: no AMX)'} new tokens"
          + (f"; each call after reading {args.cold} MB of other memory" if args.cold else ""))
    extra = f" | C -D{args.against} ms | C speed-up over it" if against is not None else ""
    print(f"| step | C ms | SDPA path ms | C speed-up | the estimate picks | right{extra} |")
    print("|---|---:|---:|---:|---|---|" + ("---:|---:|" if against is not None else ""))
    for name, rows in STEPS.items():
        if args.only and not name.startswith(args.only):
            continue
        k_cache, v_cache, _, _, md, _ = make_batch(rows, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                                   block_size=16, dtype=torch.bfloat16)
        md = dataclasses.replace(md, max_context=max(c + n for c, n in rows),
                                 max_query_len=max(n for _, n in rows))
        T = md.slot_mapping.shape[0]
        q = torch.randn(T, args.heads, args.head_dim).to(torch.bfloat16)
        scale = args.head_dim ** -0.5
        # as the model's calls decide it: with the kernel's tiles where it has them (bf16, AMX)
        tiles = cpu_attention.tile_min_tokens() if args.head_dim % 32 == 0 else 0
        picks_native = cpu_attention.prefer_native(md, T, 16, tiles)
        forced = dataclasses.replace(md, step_cache={"cpu_attention_prefer_native": True})
        call = lambda: cpu_attention.paged_attention(q, k_cache, v_cache, forced, scale)  # noqa: E731
        if against is not None:
            native, before = best_ms(call, (None, against))
            extra = f" | {before:.3f} | {before / native:.2f}x"
        else:
            (native,), extra = best_ms(call), ""
        # the step's plan and mask memoised, as the model's 30 layers share them
        memo = dataclasses.replace(md, step_cache={})
        (sdpa,) = best_ms(lambda: cpu_attention.sdpa_paged_attention(q, k_cache, v_cache, memo, scale))
        right = (native <= sdpa) == picks_native
        print(f"| {name} | {native:.3f} | {sdpa:.3f} | {sdpa / native:.2f}x | "
              f"{'C' if picks_native else 'SDPA'} | {'yes' if right else 'no'}{extra} |", flush=True)


if __name__ == "__main__":
    main()
