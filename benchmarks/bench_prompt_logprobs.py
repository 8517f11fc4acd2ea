"""What prompt logprobs cost: the prefill of one prompt with and without ``prompt_logprobs``.

A request with ``prompt_logprobs`` makes the engine apply the LM head to every prompt position
(blink.engine.prompt_logprobs: blocks of 128 positions, fp32 log-softmax, rank, top-N) on top
of the prefill it runs anyway. This times ``LLM.generate`` of one ``--prompt-len``-token prompt
with ``max_tokens=1`` (so the time is the prefill and one sampled token), prefix cache off (a
repeat would otherwise skip the plain prefill), ``--repeats`` times each for: no prompt
logprobs, ``prompt_logprobs=0`` (the prompt token's logprob and rank) and ``prompt_logprobs=20``
(the top 20 as well), and prints the median seconds and the ratio to the plain prefill. Run it
on a quiet machine:

    python benchmarks/bench_prompt_logprobs.py --threads 2
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()

    from blink.llm import LLM
    from blink.shared.sampling_params import SamplingParams

    rng = random.Random(0)
    with LLM(args.model, threads=args.threads, dtype=args.dtype,
             max_model_len=max(2048, args.prompt_len + 16),
             max_num_batched_tokens=args.max_num_batched_tokens,
             enable_prefix_caching=False, prompt_logprob_lanes=1) as llm:
        vocab = llm.tokenizer.vocab_size
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        arms = {"plain": None, "prompt_logprobs=0": 0, "prompt_logprobs=20": 20}
        for n in arms.values():  # warm-up: one of each
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=n))
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.repeats):
            for name, n in arms.items():  # interleaved: drift hits every arm alike
                t0 = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=n))
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"])
    print(f"model {args.model}, prompt {args.prompt_len} tokens, {args.threads} threads, "
          f"median of {args.repeats}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:20s} {med * 1e3:9.1f} ms  x{med / base:.2f}")


if __name__ == "__main__":
    main()
