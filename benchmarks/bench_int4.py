"""The 4-bit projection kernels vs the packed bf16 one as a decode step streams them, in one run.

Builds SmolLM2-135M-shaped projections (30 layers of qkv, o, gate_up, down, and the
49152 x 576 head) from random 4-bit codes with fp16 scales (as a GGUF file holds them), each
once as a packed bf16 weight (blink.models.packed_linear), once in torch's int4 kernel's
layout and, where the AMX kernel runs here, once in its layout (blink.models.int4_linear,
blink.kernels.cpu.q4_linear), and times all of them in model order per "step", so every
weight comes from memory as in a real step (a loop over one weight would measure the
cache). Alternates the kinds, takes the best of ``--rounds``. The row counts where a 4-bit
kernel stops winning are what ``int4_linear.TORCH_MAX_ROWS`` / ``AMX_MAX_ROWS`` should follow
on a new CPU (the whole step decides it: ``benchmarks/bench_forward.py --before no-int4``
or ``--before torch-int4``).

    python -m benchmarks.bench_int4 --rows 1 2 4 8 16 32 64 --threads 1

The kernels for CPUs without AMX (blink.kernels.cpu.quant_linear, every build the CPU
runs) are timed too; on a CPU with AMX ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` keeps
oneDNN's bf16 product off AMX, as on a CPU without it. Where oneDNN has no native bf16 (an
AVX2 CPU, or ``ONEDNN_MAX_CPU_ISA=AVX2`` to act as one) the "bf16" column is the plain bf16
weight through ``F.linear``, which is what the engine runs there (no packed copy):

    ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks.bench_int4 --rows 1 16 128 512 --threads 1 --k-quants
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k-quants", action="store_true",
                   help="the kernels without AMX on a Q4_K_M-like file instead: 4-bit codes with fp32 "
                        "scales (Q4_K) and a Q6_K head (8-bit codes, groups of 16); the others as before")
    args = p.parse_args()

    import torch

    from blink.kernels.cpu import q4_linear as cpu_q4_linear, quant_linear as cpu_quant_linear
    from blink.models import int4_linear, packed_linear

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    if not int4_linear._torch_kernel_runs():
        raise SystemExit("this CPU/torch has no int4 CPU kernel")
    # without native oneDNN bf16 the engine keeps no packed copy: plain bf16 weights, F.linear
    packed = packed_linear.packing_available(torch.bfloat16, cpu)
    kinds = ["bf16", "torch int4"] + (["amx"] if cpu_q4_linear.available() else [])
    flags = cpu_quant_linear.cpu_flags()
    kinds += [name for name, (_, needs, _, _) in cpu_quant_linear.VARIANTS.items()
              if all(f in flags for f in needs) and cpu_quant_linear.LIBRARIES[name].get() is not None]
    group = int4_linear.GROUP
    hidden, inter, kv, vocab = 576, 1536, 192, 49152
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]

    def make(n: int, k: int) -> tuple[dict, int]:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = (torch.rand(n, k // group) * 0.01 + 1e-3).half().float()
        zero = (-torch.rand(n, k // group) * 0.05).half().float() + 8 * scale  # Q4_1: m + 8d
        dense = int4_linear.dequantize(codes, scale, zero).to(torch.bfloat16)
        weights = {"bf16": packed_linear.pack(dense) if packed else dense,
                   "torch int4": int4_linear.pack(codes, scale, zero, kernel="torch")}
        if "amx" in kinds:
            weights["amx"] = int4_linear.pack(codes, scale, zero, kernel="amx")
        if args.k_quants and n == vocab:  # Q6_K: int8 q - 32, d per 16
            native = cpu_quant_linear.pack((codes.to(torch.int8) * 4 - 32), scale.repeat_interleave(2, 1) / 4,
                                           None, 16, 8)
        elif args.k_quants:  # Q4_K: d = fp16 d x 6-bit scale, not an fp16
            native = cpu_quant_linear.pack(codes, scale * 1.0001, zero - 8 * scale)
        else:
            native = cpu_quant_linear.pack(codes, scale, zero - 8 * scale)
        for name in cpu_quant_linear.VARIANTS:
            weights[name] = native
        return weights, k

    weights = [make(n, k) for _ in range(args.layers) for n, k in shapes] + [make(vocab, hidden)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(weights)} projections; "
          f"kernels: {', '.join(kinds)}; bf16: {'packed (oneDNN)' if packed else 'plain weights, F.linear'}",
          flush=True)

    def step(rows: int, kind: str) -> float:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (hidden, inter)}
        t0 = time.perf_counter()
        for by_kind, k in weights:
            if kind == "bf16" and packed:
                packed_linear.linear(xs[k], by_kind[kind], None)
            elif kind == "bf16":
                torch.nn.functional.linear(xs[k], by_kind[kind])
            elif kind in cpu_quant_linear.VARIANTS:
                cpu_quant_linear.linear(xs[k], [by_kind[kind]], None, build=kind)
            else:
                int4_linear.linear(xs[k], by_kind[kind], None)
        return (time.perf_counter() - t0) * 1e3

    header = " | ".join(f"{kind} ms" for kind in kinds)
    ratios = " | ".join(f"bf16 / {kind}" for kind in kinds[1:])
    print(f"\n| rows | {header} | {ratios} |\n|---:|" + "---:|" * (2 * len(kinds) - 1))
    for rows in args.rows:
        best = {kind: float("inf") for kind in kinds}
        for kind in kinds:  # warm-up
            step(rows, kind)
        for _ in range(args.rounds):
            for kind in kinds:
                best[kind] = min(best[kind], step(rows, kind))
        cells = " | ".join(f"{best[kind]:.1f}" for kind in kinds)
        speedups = " | ".join(f"{best['bf16'] / best[kind]:.2f}x" for kind in kinds[1:])
        print(f"| {rows} | {cells} | {speedups} |", flush=True)


if __name__ == "__main__":
    main()
