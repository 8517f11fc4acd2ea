"""int4 vs packed bf16 projections as a decode step streams them, in one run.

Builds SmolLM2-135M-shaped projections (30 layers of qkv, o, gate_up, down, and the
49152 x 576 head) with random 4-bit codes, each once as a packed bf16 weight
(blink.models.packed_linear) and once in the int4 kernel's layout
(blink.models.int4_linear), and times all of them in model order per "step", so every
weight comes from memory as in a real step (a loop over one weight would measure the
cache). Alternates the two kinds, takes the best of ``--rounds``. The row count where the
int4 path stops winning is what ``int4_linear.MAX_ROWS`` should follow on a new CPU
(the whole step, not only its projections, decides it: ``benchmarks/bench_forward.py
--before no-int4``).

    python -m benchmarks.bench_int4 --rows 1 2 4 8 16 --threads 1
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import torch

    from blink.models import int4_linear, packed_linear

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not (packed_linear.packing_available(torch.bfloat16, torch.device("cpu"))
            and int4_linear.available(torch.bfloat16, torch.device("cpu"))):
        raise SystemExit("this CPU/torch has no native oneDNN bf16 or no int4 CPU kernel")
    group = int4_linear.GROUP
    hidden, inter, kv, vocab = 576, 1536, 192, 49152
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]

    def make(n: int, k: int):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = torch.rand(n, k // group) * 0.01 + 1e-3
        zero = -torch.rand(n, k // group) * 0.05
        dense = int4_linear.dequantize(codes, scale, zero).to(torch.bfloat16)
        return packed_linear.pack(dense), int4_linear.pack(codes, scale, zero), k

    weights = [make(n, k) for _ in range(args.layers) for n, k in shapes] + [make(vocab, hidden)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(weights)} projections", flush=True)

    def step(rows: int, kind: str) -> float:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (hidden, inter)}
        t0 = time.perf_counter()
        for bf16, int4, k in weights:
            if kind == "bf16":
                packed_linear.linear(xs[k], bf16, None)
            else:
                int4_linear.linear(xs[k], int4, None)
        return (time.perf_counter() - t0) * 1e3

    print("\n| rows | bf16 ms | int4 ms | bf16 / int4 |\n|---:|---:|---:|---:|")
    for rows in args.rows:
        best = {"bf16": float("inf"), "int4": float("inf")}
        step(rows, "bf16"), step(rows, "int4")  # warm-up
        for _ in range(args.rounds):
            for kind in best:
                best[kind] = min(best[kind], step(rows, kind))
        print(f"| {rows} | {best['bf16']:.1f} | {best['int4']:.1f} | {best['bf16'] / best['int4']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
