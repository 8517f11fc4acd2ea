"""Where a CPU-loop step's time goes, in-process: one greedy ``LLM.generate`` run with the
loop's parts timed (wall time per step, mean over the run's steps).

Parts: ``schedule`` (Scheduler.schedule), ``sampler_inputs``, ``forward``
(ModelExecutor.execute), ``sample`` (Sampler), ``update`` (Scheduler.update), and ``step``
(the whole ``Engine.step``, so ``step`` minus the parts is the step's own glue). ``replay``
(CpuGraph.replay, inside ``forward``): the C kernel calls of the steps replayed from CPU graphs
(a decode step's layers and head), so ``step`` minus ``replay`` is the host's Python and torch
work of a decode step, during which the kernels' other threads wait; the header's wall per
step minus ``step`` is the engine loop's own between steps. The parts are timed by wrapping
those methods for this process only; a warm-up request runs first.

    python -m benchmarks.bench_step_parts --threads 1 --batch 1 --tokens 64
    python -m benchmarks.bench_step_parts --threads 1 --batch 16 --tokens 64

``--kernel-threads``: the C kernels' threads (default: the engine's, ``--threads``). ``blink
serve`` on two cores runs its engine with ``--threads 1 --kernel-threads 2`` and passive
OpenMP waits (``OMP_WAIT_POLICY=PASSIVE``): give the same to time what it serves.

``--flush-mb N`` reads N MB (a tensor's sum) before every step, untimed, as
``bench_scheduler --flush-mb`` does, so that each step finds the weights in memory rather than
in the last-level cache: a machine whose cache holds the whole model (SmolLM2's ~97 MB in a
480 MB L3) times a step as one with a smaller cache (a Zen 4 CCD's 32 MB) or a busy neighbour
would not. Give it more than twice the cache (``lscpu | grep L3``); it empties the host's caches
too, which a real host's L2 partly keeps.

    python -m benchmarks.bench_step_parts --threads 1 --kernel-threads 2 --batch 1 --flush-mb 1536
"""
from __future__ import annotations

import argparse
import time

from benchmarks.bench_offline import Timers

PARTS = ("step", "schedule", "sampler_inputs", "forward", "replay", "sample", "update")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=None, help="engine compute threads (default: all cores)")
    p.add_argument("--kernel-threads", type=int, default=None,
                   help="the C kernels' threads (default: the engine's compute threads)")
    p.add_argument("--batch", type=int, default=1, help="prompts generated together")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the engine's --dtype (default auto)")
    p.add_argument("--flush-mb", type=int, default=0,
                   help="read this many MB before each step, untimed (0: none)")
    args = p.parse_args()
    if args.flush_mb < 0:
        p.error("--flush-mb must be >= 0")

    import blink.engine.engine as engine_module
    from blink.engine.sampler import Sampler
    from blink.engine.sched.scheduler import Scheduler
    from blink.executor import ModelExecutor
    from blink.kernels.cpu.graph import CpuGraph
    from blink.llm import LLM
    from blink.shared.sampling_params import SamplingParams

    timers = Timers()
    totals, counts = timers.total, timers.calls
    undo = [timers.wrap(owner, name, label) for owner, name, label in (
        (engine_module.Engine, "step", "step"),  # the loop's step, whichever its runner
        (Scheduler, "schedule", "schedule"), (Scheduler, "sampler_inputs", "sampler_inputs"),
        (Scheduler, "update", "update"), (ModelExecutor, "execute", "forward"),
        (CpuGraph, "replay", "replay"), (Sampler, "__call__", "sample"))]
    flush_seconds = 0.0
    if args.flush_mb > 0:
        import torch

        flush = torch.ones(args.flush_mb << 17, dtype=torch.int64)  # MB of 8-byte words
        timed_step = engine_module.Engine.step

        def flush_then_step(self, *a, **kw):
            nonlocal flush_seconds
            t = time.perf_counter()
            flush.sum()  # every line of it read: the cache holds it, not the weights
            flush_seconds += time.perf_counter() - t
            return timed_step(self, *a, **kw)

        engine_module.Engine.step = flush_then_step
        undo.append(lambda: setattr(engine_module.Engine, "step", timed_step))
    llm = None
    try:
        llm = LLM(args.model, threads=args.threads, kernel_threads=args.kernel_threads, max_num_seqs=max(16, args.batch),
                  max_model_len=args.max_model_len, dtype=args.dtype)
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate(["A warm-up prompt."], SamplingParams(max_tokens=4, temperature=0))
        totals.clear()
        counts.clear()
        flush_seconds = 0.0
        prompts = [f"Request {i}: the sea and the wind." for i in range(args.batch)]
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0 - flush_seconds
    finally:
        if llm is not None:
            llm.close()
        for restore in reversed(undo):  # the last wrapper first
            restore()
    steps = max(1, counts["step"])
    print(f"{args.model}: batch {args.batch}, {args.tokens} tokens each, {counts['step']} steps, "
          f"{wall / steps * 1e3:.2f} ms wall per step"
          + (f" (each after reading {args.flush_mb} MB, not counted)" if args.flush_mb else ""))
    print("| part | ms per step |\n|---|---:|")
    for part in PARTS:
        print(f"| {part} | {totals[part] / steps * 1e3:.3f} |")
    # the host's share: the step less its kernel calls' replay
    print(f"| host (step - replay) | {(totals['step'] - totals['replay']) / steps * 1e3:.3f} |")


if __name__ == "__main__":
    main()
