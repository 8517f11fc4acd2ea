"""The CPU loop's sampler on a greedy step, before vs now, in one run: ``now`` takes the greedy
tokens from the log-normaliser's pass over the logits (``argmax_logsumexp_rows``, one C call,
blink.kernels.cpu.fused), ``before`` the log-normaliser's C call and then torch's chunked
argmax over the logits again (``argmax_rows``: four more ops and two more reads), as the
sampler did before.

``--sampled temperature=0.7,top_p=0.9`` (any of temperature, top_p, top_k, min_p) times sampled
rows instead: ``now`` the CPU table's C filter and draw (blink.kernels.cpu.sampling), ``before``
their torch references (kernels/reference/sampling.py), the same tokens checked. The logits are
``randn * 4`` (``--scale``): a real model's are peakier, which the C filter finds faster.

Each call samples fp32 logits [rows, vocab] with every row greedy under the CPU loop's
host-side plan (``SamplerPlan.of``), as a served greedy step does; the two are timed
alternately, ``--rounds`` rounds of ``--steps`` calls, and ``--flush-mb`` MB are read before
each call (untimed) as a forward's weight stream leaves the caches between two of the
engine's steps (0: hot caches). The table gives the median per-call wall time of each and
their ratio, and checks that both sampled the same tokens and logprobs.

    python -m benchmarks.bench_sampler                           # SmolLM2's 49,152, 1 and 16 rows
    python -m benchmarks.bench_sampler --vocab 128256 --rows 1 16   # Llama 3.2's
    python -m benchmarks.bench_sampler --sampled temperature=0.7,top_p=0.9
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=20, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--flush-mb", type=int, default=100, help="MB read before each call (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the CPU loop's: 1)")
    p.add_argument("--sampled", default=None, metavar="FIELD=VALUE,...",
                   help="sampled rows with these fields (temperature, top_p, top_k, min_p): the C filter "
                        "and draw against the references")
    p.add_argument("--scale", type=float, default=4.0, help="the logits' standard deviation")
    args = p.parse_args()
    fields: dict[str, float] = {}
    if args.sampled:
        for item in args.sampled.split(","):
            name, eq, value = item.partition("=")
            if not eq or name not in ("temperature", "top_p", "top_k", "min_p"):
                p.error(f"--sampled: {item!r} is not temperature=, top_p=, top_k= or min_p=")
            try:
                fields[name] = int(value) if name == "top_k" else float(value)
            except ValueError:
                p.error(f"--sampled: {item!r} has no number")
        if fields.get("temperature", 1.0) <= 0:
            p.error("--sampled needs a temperature above 0 (0 is the greedy step: leave --sampled out)")

    import torch

    from blink.engine.sampler import Sampler, SamplerPlan, SamplingTensors
    from blink.kernels import ops_for
    from blink.kernels.reference import sampling as reference
    from blink.kernels.reference.sampling import argmax_rows
    from blink.shared.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    now_ops = ops_for("cpu")
    if fields:
        before_ops = SimpleNamespace(**{**vars(now_ops), "sample": reference.sample,
                                        "apply_top_k_top_p_min_p": reference.apply_top_k_top_p_min_p})
    else:
        before_ops = SimpleNamespace(**{**vars(now_ops), "argmax_logsumexp_rows":
                                        lambda x: (argmax_rows(x), now_ops.logsumexp_rows(x))})
    samplers = {"before": Sampler(ops=before_ops), "now": Sampler(ops=now_ops)}
    flush = torch.ones(max(args.flush_mb, 1) << 18) if args.flush_mb else None
    print(f"vocab {args.vocab}, flush {args.flush_mb} MB, {args.rounds} rounds x {args.steps} calls, alternating; "
          + (f"sampled rows ({args.sampled}), logits randn x {args.scale}" if fields else "greedy rows"))
    rows_out = []
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        logits = torch.randn(rows, args.vocab, generator=g) * args.scale
        params = [SamplingParams(**fields, seed=i) if fields else SamplingParams(temperature=0) for i in range(rows)]
        st = SamplingTensors.from_params(params)
        lens = torch.full((rows,), 8, dtype=torch.int32)
        counters = torch.zeros(rows, dtype=torch.int64)
        plan = SamplerPlan.of(st)

        def call(name):
            return samplers[name](logits, st, None, lens, lens, counters, plan=plan)

        outs = {name: call(name) for name in samplers}
        if not (torch.equal(outs["before"].tokens, outs["now"].tokens)
                and torch.equal(outs["before"].logprob, outs["now"].logprob)):
            raise SystemExit("before and now sampled different tokens or logprobs")
        walls = {name: [] for name in samplers}
        for _ in range(args.rounds):
            for name in samplers:
                times = []
                for _ in range(args.steps):
                    if flush is not None:
                        flush.sum()
                    t0 = time.perf_counter()
                    call(name)
                    times.append(time.perf_counter() - t0)
                walls[name].append(statistics.median(times))
        w = {name: 1e6 * statistics.median(v) for name, v in walls.items()}
        rows_out.append((rows, w["before"], w["now"]))
        print(f"{rows} rows: before {w['before']:.1f} us, now {w['now']:.1f} us ({w['before'] / w['now']:.2f}x)",
              flush=True)
    print("\n| rows | before us | now us | speed-up |\n|---:|---:|---:|---:|")
    for rows, before, now in rows_out:
        print(f"| {rows} | {before:.1f} | {now:.1f} | {before / now:.2f}x |")


if __name__ == "__main__":
    main()
