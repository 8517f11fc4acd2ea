"""The fused CPU ops (kernels/cpu/fused.c) per call, in one run: this host's build, a build of
the same source without AVX512-BF16 (the scalar loops the compiler vectorises itself, what
every build ran before the intrinsics), and the torch references.

Times add+RMSNorm (576 channels), SiLU-mul (2 x 1536) and the rotary embedding (SmolLM2's 9
query and 3 KV heads of 64 channels, out of its fused QKV projection) at each ``--rows``, best of
``--rounds`` rounds of ``--calls`` calls, one thread, and prints ns per element and the
speed-up of this build over the scalar one.

    python -m benchmarks.bench_cpu_fused --rows 16 512
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import torch

    from blink.kernels.cpu import fused as cpu_fused
    from blink.kernels.reference import layers as reference
    from blink.shared.native_build import build_library

    torch.set_num_threads(1)
    lib = cpu_fused.library()
    if lib is None:
        raise SystemExit("the fused ops did not build here (see the warning above)")
    with tempfile.TemporaryDirectory() as tmp:  # the scalar build: cc without AVX512-BF16
        wrapper = Path(tmp) / "cc"
        wrapper.write_text('#!/bin/sh\nexec cc -mno-avx512bf16 "$@"\n')
        wrapper.chmod(0o755)
        saved = {k: os.environ.get(k) for k in ("CC", "XDG_CACHE_HOME")}
        os.environ.update(CC=str(wrapper), XDG_CACHE_HOME=tmp)
        try:
            L = cpu_fused.LIBRARY
            scalar = build_library(L.source, L.flags, L.fallback_flags, L.headers)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    cpu_fused._declare(scalar)

    def best_ns(fn, elements: int) -> float:
        for _ in range(3):
            fn()
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - start) / args.calls)
        return best / elements * 1e9

    print(f"this build: vector ops {'yes' if lib.blink_has_vector_ops() else 'no'}; ns per element, one thread")
    print("| op | rows | this build | scalar build | torch reference | this / scalar |\n|---|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        h, res = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
        weight, x = torch.randn(576).bfloat16(), (torch.randn(rows, 3072) * 4).bfloat16()
        qkv = torch.randn(rows, 15, 64).bfloat16()
        positions, cos_sin = torch.arange(rows) % 2048, reference.rope_cos_sin_cache(64, 2048, 10000.0)
        cases = {"add+RMSNorm": (lambda: cpu_fused.fused_add_rms_norm(h, res, weight, 1e-5),
                                 lambda: reference.fused_add_rms_norm(h, res, weight, 1e-5), rows * 576),
                 "SiLU-mul": (lambda: cpu_fused.silu_and_mul(x), lambda: reference.silu_and_mul(x), rows * 1536),
                 "rotary": (lambda: cpu_fused.apply_rope(qkv[:, :9], qkv[:, 9:12], positions, cos_sin),
                            lambda: reference.apply_rope(qkv[:, :9], qkv[:, 9:12], positions, cos_sin),
                            rows * 12 * 64)}
        for name, (fused, ref, elements) in cases.items():
            now = best_ns(fused, elements)
            with cpu_fused.LIBRARY.using(scalar):  # the scalar build in this one's place
                before = best_ns(fused, elements)
            torch_ns = best_ns(ref, elements)
            print(f"| {name} | {rows} | {now:.2f} | {before:.2f} | {torch_ns:.2f} | {before / now:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
