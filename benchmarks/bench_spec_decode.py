"""Speculative decoding with n-gram drafts (issue 36): output tok/s, ITL and acceptance, with
and without ``--speculative-config``, on a repetitive and a non-repetitive workload, in one
run (the ratios are printed from the same run).

Workloads (greedy, ``ignore_eos``):

- ``repetitive``: "rewrite this code with one change" prompts: a code snippet, an
  instruction, then the snippet's first line, so a model that copies finds its continuation
  in the prompt (what prompt lookup is for);
- ``random``: random token ids (synthetic 128 in / 128 out), greedy. A small model's greedy
  continuation of noise soon loops, so drafts hit here too (see the acceptance rate);
- ``sampled``: the same prompts sampled at temperature 1 (seeded): the output is not
  repetitive and drafts rarely hit, which measures what speculation costs when it does not
  pay.

Both modes run the engine as ``blink serve`` does by default (CPU graphs where they apply:
the plain decode steps replay them with speculation on as well).

Each at 1 and 16 streams (``--streams``), speculation off and on. Per cell: output tok/s
(generated tokens / wall time of the batch), ``itl_ms_p50`` (the median over the streams of
wall time / the stream's tokens: the offline API gives no per-token timestamps, so no p99),
the acceptance rate (accepted / draft tokens) and the drafts verified; and whether the greedy
output is the same with and without speculation. Run on an idle machine:

    python -m benchmarks.bench_spec_decode [--model smollm2-135m] [--k 4] [--lookup 1 3]
        [--streams 1 16] [--max-tokens 128] [--prompt-len 128] [--repeats R] [--json out.json]

``--smoke``: a tiny random model (the tests' helper) and tiny sizes: a correctness run of
this script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda item: item[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''

EDITS = ["rename merge_intervals to combine_ranges", "rename merged to result",
         "rename intervals to spans", "rename last to previous"]


def repetitive_prompts(n: int) -> list[str]:
    return [f"Here is a Python function:\n\n{CODE}\nRewrite the whole function unchanged except: "
            f"{EDITS[i % len(EDITS)]}.\n\n{CODE.splitlines()[0]}\n" for i in range(n)]


WORKLOADS = ("repetitive", "random", "sampled")


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def workload_params(workload: str, max_tokens: int):
    """Greedy, except the ``sampled`` workload (temperature 1, one fixed seed: the same tokens
    with and without speculation)."""
    from blink.shared.sampling_params import SamplingParams

    if workload == "sampled":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1234, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_cell(llm, prompts, params, repeats: int = 1) -> dict:
    """One batch of ``prompts``, ``repeats`` times: the median wall time, the counters' mean."""
    sched = llm.engine.scheduler
    before = sched.spec_counters.clone() if hasattr(sched, "spec_counters") else None
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, timeout_s=3600)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    tokens = sum(len(o.token_ids) for o in outs)
    cell = {"streams": len(prompts), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2),
            # a stream's mean time per token (the batch runs together: wall / its tokens)
            "itl_ms_p50": round(1000 * statistics.median(wall / max(len(o.token_ids), 1) for o in outs), 2)}
    if before is not None:
        drafts, draft_tokens, accepted = ((sched.spec_counters - before) / repeats).tolist()
        cell.update(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                    acceptance_rate=round(accepted / draft_tokens, 3) if draft_tokens else 0.0)
    return cell


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="random workload's prompt length")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each cell this many times and take the median wall time (a "
                         "one-stream cell is one ~2 s request: one run moves by about 5%%)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, tiny sizes (no measurement)")
    args = ap.parse_args(argv)

    from blink.llm import LLM

    engine_kwargs: dict = dict(dtype=args.dtype, max_num_seqs=max(args.streams))
    model = args.model
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from test_engine import tiny_model_dir  # noqa: PLC0415 - the tests' tiny model

        model = str(tiny_model_dir(Path(tempfile.mkdtemp())))
        args.max_tokens, args.prompt_len, args.streams = 12, 16, [1, 2]
        engine_kwargs.update(dtype="float32", max_model_len=256, kv_cache_tokens=4096, max_num_seqs=2)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]})
    results: dict = {"model": model, "speculative_config": spec, "cells": []}
    outputs: dict = {}
    for mode in ("off", "ngram"):
        kwargs = dict(engine_kwargs, **({"speculative_config": spec} if mode == "ngram" else {}))
        with LLM(model, **kwargs) as llm:
            vocab = llm.engine.model_config.vocab_size
            for workload in WORKLOADS:
                for streams in args.streams:
                    prompts = (repetitive_prompts(streams) if workload == "repetitive"
                               else random_prompts(streams, args.prompt_len, vocab))
                    if args.smoke and workload == "repetitive":  # the tiny model's 256 positions
                        prompts = [p[-200:] for p in prompts]
                    params = workload_params(workload, args.max_tokens)
                    run_cell(llm, prompts[:1], workload_params(workload, 4))  # warm-up
                    cell = run_cell(llm, prompts, params, args.repeats)
                    cell.update(mode=mode, workload=workload)
                    results["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
                    outputs[(mode, workload, streams)] = [o.token_ids for o in llm.generate(
                        prompts[:1], params, timeout_s=3600)]
    print("\nspeculative / off (output tok/s), same run:")
    ratios = {}
    for workload in WORKLOADS:
        for streams in args.streams:
            off = next(c for c in results["cells"] if (c["mode"], c["workload"], c["streams"]) == ("off", workload, streams))
            on = next(c for c in results["cells"] if (c["mode"], c["workload"], c["streams"]) == ("ngram", workload, streams))
            ratio = on["output_tok_s"] / off["output_tok_s"]
            same = outputs[("off", workload, streams)] == outputs[("ngram", workload, streams)]
            ratios[f"{workload}/{streams}"] = round(ratio, 3)
            print(f"  {workload:10s} {streams:3d} streams: {ratio:.2f}x  (acceptance "
                  f"{on.get('acceptance_rate', 0):.2f}, output identical: {same})")
    results["ratios"] = ratios
    results["command"] = " ".join(["python -m benchmarks.bench_spec_decode", *(argv or sys.argv[1:])])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
