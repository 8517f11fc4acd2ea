"""The CPU forward, before vs now, in one run: SmolLM2-135M through ``ModelExecutor.execute``.

Two executors over the same weights: ``before`` is the forward as it was (``--before
reference``, the default: plain weights, every projection through ``F.linear``:
``pack_weights=False``; every op the torch reference, the paged attention included; or
``--before no-int4``: today's forward with ``int4_decode=False``, which isolates the int4
path for small steps, blink.models.int4_linear; or ``--before sdpa-attention``: today's
forward with the paged attention always on the torch path, which isolates the C attention
kernel, blink.kernels.cpu.attention; or ``--before torch-elementwise``: today's forward with
the torch references for the norms, rotary embedding, KV write and SiLU, which isolates
blink.kernels.cpu.fused; or ``--before torch-int4``: today's forward with the 4-bit copies in
torch's int4 kernel's layout (``$BLINK_CPU_Q4=torch`` while it loads), which isolates the AMX
kernel, blink.kernels.cpu.q4_linear; or ``--before attention-no-prefetch``: today's forward
with the C attention kernel built without its prefetch of the next KV block; or ``--before
attention-no-tiles``: today's forward with the C attention kernel built without its tiles
for prompt rows (AMX's and AVX-512's), so that prefills take SDPA and mixed steps the
per-token pass, as before them; or ``--before bf16-head``: today's forward with the logits from a packed bf16 copy of
a tied head that the file stores as Q8_0, which isolates the 8-bit head on the AMX kernel;
or ``--before no-cpu-graphs``: today's forward eager, against decode steps replayed from
their CPU graphs (blink.decode_graphs; the other baselines compare eager with eager); or
``--before unfused-silu``: today's forward with the MLP's SiLU as its own op after the
gate/up projection, which isolates the 4-bit kernel's gated epilogue; or ``--before
one-kernel-thread``: today's forward with its C kernels on the calling thread alone, against
them split over the kernel threads, torch's ``--threads``: blink.kernels.cpu.threads); or
``--before python-replay``: today's forward with its decode graphs' calls made from Python, one
ctypes call each, against replay.c making them in one call (both replay the same graphs:
blink.kernels.cpu.graph); or
``--before q4-one-pass``: today's forward with the 4-bit kernel's many-rows products over all
of K in one pass, without the streamed weight tiles, which isolates its K slabs
(blink.kernels.cpu.q4_linear); or ``--before q4-tile-parts``: today's forward with the 4-bit
kernel's many-rows calls split over the kernel threads by output tiles only, never by rows
(blink.kernels.cpu.q4_linear); or ``--before 4k-pages``: today's forward with its weights and KV
cache left in torch's own 4 KB pages (``$BLINK_CPU_HUGE_PAGES=0``), against 2 MB pages
(blink.huge_pages), both replaying decode graphs as served; or ``--before amx-every-step``:
today's forward with every step of the AMX kernel's projections (and Q8_0 head) on that kernel,
against steps of few rows on the int8 VNNI build over the same codes
(blink.models.int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL), both replaying decode graphs as
served; or ``--before int8-coarse-split``: today's forward with the int8 VNNI build's calls
split over the kernel threads only from 256K weights a row pass per thread (so a small
projection such as SmolLM2's o_proj ran on one thread), against today's 64K, both replaying
decode graphs as served; or ``--before int8-per-group-scales``: today's forward with the int8
builds' one-pass products converting a K-quant super-block's fp16 scales again for each of its
groups and (VNNI) shifting 4-bit codes' high nibbles down (both as before 2026-12-06: the same
bits), both replaying decode graphs as served (``BLINK_CPU_Q4=avx2_int8`` for the AVX2 build);
or ``--before attention-generic-decode``: today's forward with the C attention kernel's per-token
pass (decode rows) as before 2026-12-07, its group size read at run time and without the bf16
chunks of ``vdpbf16ps`` scores (``-DDECODE_CASES=0``), both replaying decode graphs as served;
or ``--before attention-no-values-prefetch``: today's forward with the C attention kernel's
chunks' values pass without its prefetches (a key's rows of the other KV heads, the next block's
rows: ``-DVALUES_PREFETCH=0``), both replaying decode graphs as served;
and ``now`` the default one.
For each dtype and shape the two are timed alternately, ``--rounds`` rounds of ``--steps``
calls each, so a load spike on this shared machine hits both; the table gives the median
per-call wall time and process CPU time of each, and their ratio.

Shapes: ``decode B`` = B rows of one new token each over ``--context`` cached tokens (the
logits of every row); ``prefill BxP`` = B rows of P new tokens (the logits of each row's last);
``mixed BxP+D`` = both in one step, as a served step that admits prompts while others decode;
``verify BxK[+D]`` = a speculative verify step: B rows of 1 + K new tokens (the last token and a
draft) beside D decode rows, over ``--context`` cached tokens, the logits of every token (every
position is a lane); with ``--before no-cpu-graphs`` the ``now`` executor replays them from the
decode graphs as the speculative runner does (``DecodeGraphs.allow_rows_of``).

    python -m benchmarks.bench_forward --dtype bfloat16 float32 --decode 1 16 --prefill 16x128
    python -m benchmarks.bench_forward --before no-int4 --dtype bfloat16 --decode 1 4 8 16 --prefill
    python -m benchmarks.bench_forward --before sdpa-attention --dtype bfloat16 --decode 1 16 --context 256
    python -m benchmarks.bench_forward --before torch-elementwise --dtype bfloat16 --decode 1 16 --prefill 1x128
    python -m benchmarks.bench_forward --before torch-int4 --dtype bfloat16 --decode 1 4 8 16 32
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 BLINK_CPU_Q4=avx512 python -m benchmarks.bench_forward --before torch-int4 \
        --dtype bfloat16 --decode 1 4 8 16 --threads 1   # a CPU without AMX: its kernel against torch's int4
    python -m benchmarks.bench_forward --before attention-no-prefetch --dtype bfloat16 --decode 1 16 --context 128 256
    python -m benchmarks.bench_forward --before attention-no-tiles --dtype bfloat16 --decode 16 --prefill 4x128 1x512 \
        --mixed 4x128+12 --context 192
    python -m benchmarks.bench_forward --before bf16-head --dtype bfloat16 --decode 1 16 --prefill 4x128
    python -m benchmarks.bench_forward --before bf16-head --dtype bfloat16 --decode 32 48 64 --prefill --q8-head-max-rows 64
    python -m benchmarks.bench_forward --before unfused-silu --dtype bfloat16 --decode 1 16 --prefill 4x128 1x512
    python -m benchmarks.bench_forward --before no-cpu-graphs --dtype bfloat16 --decode 1 4 8 16 32 --threads 1
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.bench_forward --before python-replay --dtype bfloat16 --decode 1 4 16 \
        --context 192 --threads 2
    python -m benchmarks.bench_forward --before no-cpu-graphs --dtype bfloat16 --decode --prefill \
        --verify 1x4 4x4 4x4+12 8x4+8 16x4 --context 192 --threads 1
    python -m benchmarks.bench_forward --before q4-one-pass --dtype bfloat16 --decode --prefill 16x128 4x128 1x512
    python -m benchmarks.bench_forward --before q4-tile-parts --dtype bfloat16 --decode --prefill 16x128 4x128 1x128 \
        --threads 2
    python -m benchmarks.bench_forward --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf \
        --before 4k-pages --dtype bfloat16 --decode 1 16 --prefill 1x128 --context 256 --threads 2
    python -m benchmarks.bench_forward --before one-kernel-thread --dtype bfloat16 --decode 1 16 --prefill 16x128 \
        --context 192 --threads 2
    python -m benchmarks.bench_forward --before amx-every-step --dtype bfloat16 --decode 1 4 8 16 \
        --context 192 --threads 2
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path


def _seqs(rows: list[tuple[int, int]], block_size: int) -> list[tuple[list[int], int, list[int]]]:
    """``rows`` = [(new tokens, cached tokens)] -> build_metadata's sequences, blocks in order."""
    seqs, first = [], 0
    for i, (new, cached) in enumerate(rows):
        blocks = -(-(cached + new) // block_size)
        seqs.append(([100 + 7 * i + j for j in range(new)], cached, list(range(first, first + blocks))))
        first += blocks
    return seqs


def _time(ex, args_, steps: int) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        ex.execute(*args_)
    return (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """While it lasts, ``$name`` is ``value`` (None: as it was)."""
    was = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if was is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = was


@contextlib.contextmanager
def _amx_int4_off(off: bool):
    """While ``off``, the 4-bit copies made take torch's int4 kernel's layout."""
    from blink.kernels.cpu import q4_linear as cpu_q4_linear

    if not off:
        yield
        return
    from blink.kernels.cpu import quant_linear as cpu_quant_linear

    was = os.environ.get(cpu_q4_linear.IMPL_ENV)  # (=avx512|avx2: "now" runs a CPU without AMX's path)
    os.environ[cpu_q4_linear.IMPL_ENV] = "torch"
    cpu_quant_linear.reset()  # (the AMX kernel's choice too)
    try:
        yield
    finally:
        if was is None:
            del os.environ[cpu_q4_linear.IMPL_ENV]
        else:
            os.environ[cpu_q4_linear.IMPL_ENV] = was
        cpu_quant_linear.reset()


def _built_with(native, define: str | tuple[str, ...]):
    """The C kernel of the NativeLibrary ``native`` (``cpu_attention.LIBRARY``,
    ``cpu_q4_linear.LIBRARY``, one of ``cpu_quant_linear.LIBRARIES``) built with
    ``-D<define>`` (each of them, for several), and declared as its own build is (its ``setup``)."""
    from blink.shared.native_build import build_library

    defines = (define,) if isinstance(define, str) else define
    library = build_library(native.source, (*native.flags, *(f"-D{d}" for d in defines)), None, native.headers)
    native.setup(library)
    return library


def _with_library(ex, native, library) -> None:
    """``ex.execute`` runs with ``library`` (None: none, its fallback) as the NativeLibrary
    ``native``'s, the others with the usual ones."""
    execute = ex.execute

    def swapped(*args, **kwargs):
        with native.using(library):
            return execute(*args, **kwargs)

    ex.execute = swapped


def _with_bf16_head(ex) -> None:
    """``ex``'s logits from a packed bf16 copy of the head, as before the Q8_0 head."""
    from blink.models import packed_linear

    model = ex.model
    if model.q8_head is None:
        raise SystemExit("--before bf16-head: this model's head does not run on Q8_0 codes here")
    model.q8_head = None
    weight = model.model.embed_tokens.weight if model.lm_head is None else None
    if weight is None:
        raise SystemExit("--before bf16-head: only a tied head is rebuilt (its embedding holds the weights)")
    model.packed_head = packed_linear.pack(weight)


def _without_gated_epilogue(ex) -> None:
    """The MLPs of ``ex`` take the gate/up projection and the SiLU as two calls."""
    from blink.models.decoder import Linear

    fused = [m for m in ex.model.modules() if isinstance(m, Linear) and m.int4 is not None and m.int4.gates]
    if not fused:
        raise SystemExit("--before unfused-silu: no projection here runs the gated 4-bit kernel")
    for module in fused:
        module.gated = lambda x: None


def _amx_every_step(ex) -> None:
    """``ex``'s AMX kernel weights without their int8 view: every step on the AMX kernel."""
    from dataclasses import replace

    from blink.models.decoder import Linear

    model = ex.model
    viewed = [m for m in model.modules() if isinstance(m, Linear) and m.int4 is not None
              and m.int4.int8_view is not None]
    head_viewed = model.q8_head is not None and model.q8_head.int8_view is not None
    if not viewed and not head_viewed:
        raise SystemExit("--before amx-every-step: no projection here runs few rows on the int8 "
                         "build beside the AMX kernel")
    for module in viewed:
        module.int4 = replace(module.int4, int8_view=None)
    if head_viewed:  # the Q8_0 head's few rows too
        model.q8_head = replace(model.q8_head, int8_view=None)


def _on_one_kernel_thread(ex) -> None:
    """``ex`` with its C kernels on the calling thread (its decode graphs recorded so: a graph
    is kept per kernel thread count)."""
    from blink.kernels.cpu.threads import set_kernel_threads

    execute = ex.execute

    def one_thread(*args, **kwargs):
        set_kernel_threads(1)
        try:
            return execute(*args, **kwargs)
        finally:
            set_kernel_threads(None)

    ex.execute = one_thread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--decode", type=int, nargs="*", default=[1, 16], help="decode batch sizes")
    p.add_argument("--prefill", nargs="*", default=["16x128"], help="prefill shapes, ROWSxTOKENS")
    p.add_argument("--mixed", nargs="*", default=[],
                   help="mixed steps, ROWSxTOKENS+DECODES: prompts beside decode rows (as a served "
                        "step that admits prompts while others decode)")
    p.add_argument("--verify", nargs="*", default=[],
                   help="speculative verify steps, ROWSxDRAFT[+DECODES]: rows of 1 + DRAFT tokens "
                        "beside decode rows, every token's logits")
    p.add_argument("--context", type=int, default=128, help="cached tokens per decode row")
    p.add_argument("--steps", type=int, default=5, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--q8-head-max-rows", type=int, default=None,
                   help="steps of up to this many logits rows take a Q8_0 head (default: "
                        "blink.models.decoder.Q8_HEAD_MAX_ROWS); with --before bf16-head, where "
                        "that threshold should lie on a new CPU")
    p.add_argument("--before", choices=["reference", "no-int4", "sdpa-attention", "torch-elementwise", "torch-int4",
                                             "attention-no-prefetch", "attention-no-tiles", "bf16-head",
                                             "unfused-silu", "no-cpu-graphs", "one-kernel-thread", "q4-one-pass",
                                             "q4-tile-parts", "python-replay", "4k-pages", "amx-every-step",
                                             "int8-coarse-split", "int8-per-group-scales", "attention-generic-decode",
                                             "attention-no-values-prefetch"],
                   default="reference",
                   help="the baseline: the reference forward, or today's without one feature (the int4 path, the C attention kernel, the C elementwise ops, ..., the decode steps' CPU graphs)")
    p.add_argument("--now-graphs", action="store_true",
                   help="``now`` replays its decode steps from CPU graphs where they record (with "
                        "--before torch-int4 on a CPU without AMX: the path before, eager, against "
                        "today's, whose C kernels make graphs possible there)")
    args = p.parse_args()

    from types import SimpleNamespace

    import torch

    from blink.executor import ModelExecutor
    from blink.kernels import ops_for
    from blink.kernels.cpu import attention as cpu_attention, q4_linear as cpu_q4_linear, quant_linear as cpu_quant_linear
    from blink.kernels.reference import layers as reference
    from blink.kernels.ops import _CPU_FUSED_NAMES
    from blink.loader import open_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from executor_helpers import build_metadata  # the step inputs, built on the host

    torch_elementwise = {name: getattr(reference, name) for name in _CPU_FUSED_NAMES}
    reference_ops = SimpleNamespace(**{**vars(ops_for("cpu")), **torch_elementwise,
                                       "paged_attention": reference.paged_attention})
    sdpa_ops = SimpleNamespace(**{**vars(ops_for("cpu")), "paged_attention": cpu_attention.sdpa_paged_attention})
    torch_ops = SimpleNamespace(**{**vars(ops_for("cpu")), **torch_elementwise})

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.q8_head_max_rows is not None:
        from blink.models import decoder

        decoder.Q8_HEAD_MAX_ROWS = args.q8_head_max_rows
    files = open_model(args.model)
    shapes = [(f"decode {b}", [(1, args.context)] * b) for b in args.decode]
    for spec in args.prefill:
        rows, tokens = (int(v) for v in spec.lower().split("x"))
        shapes.append((f"prefill {rows}x{tokens}", [(tokens, 0)] * rows))
    for spec in args.mixed:
        prompts, decodes = spec.lower().split("+")
        rows, tokens = (int(v) for v in prompts.split("x"))
        shapes.append((f"mixed {spec}", [(tokens, 0)] * rows + [(1, args.context)] * int(decodes)))
    for spec in args.verify:
        drafting, _, decodes = spec.lower().partition("+")
        rows, draft = (int(v) for v in drafting.split("x"))
        shapes.append((f"verify {spec}", [(1 + draft, args.context)] * rows
                       + [(1, args.context)] * int(decodes or 0)))
    need = max(sum(-(-(c + n) // 16) for n, c in rows) for _, rows in shapes)
    longest = max(c + n for _, rows in shapes for n, c in rows)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rounds} rounds x {args.steps} calls, alternating", flush=True)
    rows_out = []
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        before = {"reference": {"pack_weights": False}, "no-int4": {"int4_decode": False},
                  "sdpa-attention": {}, "torch-elementwise": {}, "torch-int4": {},
                  "attention-no-prefetch": {}, "attention-no-tiles": {}, "bf16-head": {},
                  "unfused-silu": {}, "no-cpu-graphs": {}, "one-kernel-thread": {},
                  "q4-one-pass": {}, "q4-tile-parts": {}, "python-replay": {}, "4k-pages": {},
                  "amx-every-step": {}, "int8-coarse-split": {}, "int8-per-group-scales": {},
                  "attention-generic-decode": {}, "attention-no-values-prefetch": {}}[args.before]
        # Decode graphs in "now" only for no-cpu-graphs, and in both for the baselines in `served`
        # (as served): the other baselines measure their feature eager against eager (a baseline
        # with torch ops would not be recorded).
        served = ("one-kernel-thread", "python-replay", "4k-pages", "amx-every-step", "int8-coarse-split",
                  "int8-per-group-scales", "attention-generic-decode", "attention-no-values-prefetch")
        graphs = args.before in ("no-cpu-graphs", *served) or args.now_graphs
        execs = {}
        for name, kw in (("before", {**before, "cpu_graphs": args.before in served}),
                         ("now", {"cpu_graphs": graphs})):
            with _amx_int4_off(name == "before" and args.before == "torch-int4"), \
                    _env("BLINK_CPU_HUGE_PAGES", "0" if name == "before" and args.before == "4k-pages" else None):
                execs[name] = ModelExecutor(files, dtype=dtype, num_blocks=need, max_model_len=longest, **kw)
        if args.before == "reference":
            execs["before"].model.use_ops(reference_ops)
        elif args.before == "sdpa-attention":
            execs["before"].model.use_ops(sdpa_ops)
        elif args.before == "torch-elementwise":
            execs["before"].model.use_ops(torch_ops)
        elif args.before == "attention-no-prefetch":
            _with_library(execs["before"], cpu_attention.LIBRARY, _built_with(cpu_attention.LIBRARY, "PREFETCH=0"))
        elif args.before == "attention-no-tiles":
            _with_library(execs["before"], cpu_attention.LIBRARY, _built_with(cpu_attention.LIBRARY, "TILES=0"))
        elif args.before == "attention-generic-decode":
            _with_library(execs["before"], cpu_attention.LIBRARY, _built_with(cpu_attention.LIBRARY, "DECODE_CASES=0"))
        elif args.before == "attention-no-values-prefetch":
            _with_library(execs["before"], cpu_attention.LIBRARY, _built_with(cpu_attention.LIBRARY, "VALUES_PREFETCH=0"))
        elif args.before in ("q4-one-pass", "q4-tile-parts"):
            if not cpu_q4_linear.available():
                raise SystemExit(f"--before {args.before}: the 4-bit AMX kernel does not run here")
            define = "SLABS=0" if args.before == "q4-one-pass" else "ROWS_PER_THREAD=1073741824"
            _with_library(execs["before"], cpu_q4_linear.LIBRARY, _built_with(cpu_q4_linear.LIBRARY, define))
        elif args.before == "unfused-silu":
            _without_gated_epilogue(execs["before"])
        elif args.before == "one-kernel-thread":
            _on_one_kernel_thread(execs["before"])
        elif args.before == "python-replay":
            from blink.kernels.cpu import graph as cpu_graph

            if cpu_graph.REPLAY.get() is None:
                raise SystemExit("--before python-replay: replay.c does not build here")
            _with_library(execs["before"], cpu_graph.REPLAY, None)  # the calls from Python
        elif args.before == "bf16-head":
            _with_bf16_head(execs["before"])
        elif args.before == "amx-every-step":
            _amx_every_step(execs["before"])
        elif args.before in ("int8-coarse-split", "int8-per-group-scales"):
            build = cpu_quant_linear.variant()
            changed = ("avx512_vnni",) if args.before == "int8-coarse-split" else tuple(sorted(cpu_quant_linear.INT8_BUILDS))
            if build not in changed:
                raise SystemExit(f"--before {args.before}: the projections run the {build} build here, "
                                 f"not one it changes ({', '.join(changed)})")
            native = cpu_quant_linear.LIBRARIES[build]
            define = ("BLINK_QUANT_INT8_PER_THREAD=((int64_t)1<<18)" if args.before == "int8-coarse-split"
                      else ("HIGH_NIBBLE_IN_PLACE=0", "HOIST_SUPER_SCALES=0"))
            _with_library(execs["before"], native, _built_with(native, define))
        for label, rows in shapes:
            call_args = {}
            for name, ex in execs.items():
                ids, md, last = build_metadata(ex, _seqs(rows, ex.block_size))
                if label.startswith("verify"):
                    last = torch.arange(ids.shape[0])  # every position is a lane
                    if ex.decode_graphs is not None:  # as SpecCpuGraphsRunner (before recording)
                        ex.decode_graphs.allow_rows_of(max(n for n, _ in rows))
                call_args[name] = (ids, md, last)
                _time(ex, call_args[name], 2)  # warm-up
            walls = {name: [] for name in execs}
            cpus = {name: [] for name in execs}
            for _ in range(args.rounds):
                for name, ex in execs.items():
                    wall, cpu = _time(ex, call_args[name], args.steps)
                    walls[name].append(wall)
                    cpus[name].append(cpu)
            w = {n: 1e3 * statistics.median(v) for n, v in walls.items()}
            c = {n: 1e3 * statistics.median(v) for n, v in cpus.items()}
            rows_out.append((dtype_name, label, w["before"], w["now"], w["before"] / w["now"],
                             c["before"], c["now"], c["before"] / c["now"]))
            print(f"{dtype_name} {label}: before {w['before']:.1f} ms, now {w['now']:.1f} ms "
                  f"({w['before'] / w['now']:.2f}x)", flush=True)
        del execs
    print("\n| dtype | shape | before ms | now ms | speed-up (wall) | before CPU ms | now CPU ms "
          "| speed-up (CPU) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows_out:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f}x | {r[5]:.1f} | {r[6]:.1f} "
              f"| {r[7]:.2f}x |")


if __name__ == "__main__":
    main()
