"""How ``LLM.generate`` waits for tokens: on the engine's doorbell (rung after each step of the
CPU loop, blink.transport.doorbell) against its own backoff (0.1 ms after output, doubling to
2 ms), alternating in one process (A B, then B A), so that the VM's minute-to-minute memory
speed falls on both.

On two cores the engine's two kernel threads run every step, so each wake of the thread that
called ``generate`` that lands mid-step preempts one of them, and the step waits for the part
that thread holds. The table gives, per variant, the decode rate of each round (greedy,
``--tokens`` tokens for each of ``--batch`` prompts, EOS ignored), its median, and the
preemptions per step of the threads that run the kernels (``nonvoluntary_ctxt_switches`` of
``blink-loop``, the calling thread, and ``blink-kern-*``, /proc); then bell / backoff by round
and its median.

    python -m benchmarks.bench_llm_wait --rounds 10
    python -m benchmarks.bench_llm_wait --batch 16 --tokens 64 --rounds 6
"""
from __future__ import annotations

import argparse
import glob
import statistics
import time


def kernel_thread_preemptions() -> int:
    """Nonvoluntary context switches of the threads that run the kernels: the engine's loop (the
    calling thread of every kernel call, ``blink-loop``) and the kernel pool's (``blink-kern-*``)."""
    total = 0
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as f:
                if not f.read().startswith(("blink-kern", "blink-loop")):
                    continue
            with open(f"{task}/status") as f:
                total += int(f.read().split("nonvoluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="engine compute threads (blink serve's on two cores: 1)")
    p.add_argument("--kernel-threads", type=int, default=2, help="the C kernels' threads (blink serve's on two cores: 2)")
    p.add_argument("--batch", type=int, default=1, help="prompts generated together")
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    if min(args.batch, args.tokens, args.rounds) < 1:
        p.error("--batch, --tokens and --rounds must be at least 1")

    from blink.llm import LLM
    from blink.shared.sampling_params import SamplingParams

    llm = LLM(args.model, threads=args.threads, kernel_threads=args.kernel_threads,
              max_num_seqs=max(16, args.batch), max_model_len=args.max_model_len)
    try:
        bell = llm._bell
        if bell is None:
            raise SystemExit("this engine rings no doorbell (not the CPU loop, or not Linux): nothing to compare")
        prompts = [f"Request {i}: the sea and the wind." for i in range(args.batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        rates: dict[str, list[float]] = {"bell": [], "backoff": []}
        preempted: dict[str, list[float]] = {"bell": [], "backoff": []}
        for r in range(args.rounds):
            for name in ("bell", "backoff") if r % 2 == 0 else ("backoff", "bell"):
                llm._bell = bell if name == "bell" else None
                before = kernel_thread_preemptions()
                start = time.perf_counter()
                llm.generate(prompts, params)
                rates[name].append(args.batch * args.tokens / (time.perf_counter() - start))
                preempted[name].append((kernel_thread_preemptions() - before) / args.tokens)
        llm._bell = bell
    finally:
        llm.close()
    print(f"{args.model}: {args.batch} prompt(s) x {args.tokens} tokens, greedy, {args.rounds} rounds, "
          f"threads {args.threads}, kernel threads {args.kernel_threads}")
    print("| generate() waits on | tok/s, median | rounds | kernel threads' preemptions a step |")
    print("|---|---:|---|---:|")
    for name in rates:
        print(f"| {name} | {statistics.median(rates[name]):.1f} | {' '.join(f'{x:.0f}' for x in rates[name])} | "
              f"{statistics.median(preempted[name]):.2f} |")
    ratios = [b / t for b, t in zip(rates["bell"], rates["backoff"])]
    print(f"bell / backoff: {statistics.median(ratios):.3f}x (rounds {' '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
