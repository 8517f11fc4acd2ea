"""Compiled vs eager CPU steps (``blink.engine.compiled``) on SmolLM2-135M, in one run.

For each dtype, two engines with the same sizes, one ``enforce_eager=True`` and one compiled:
``--batch`` greedy requests of ``--prompt`` tokens each generate ``--tokens`` tokens (EOS
ignored), through ``LLM.generate`` (ring, engine thread, scheduler: the real CPU loop). The
step time is the decode wall time divided by the engine steps taken (the scheduler's step
counter), so it includes schedule + forward + sample + update. Also printed: each compiled
engine's start (model load + compile; cold on the first run on a machine, cached after) and
the greedy outputs' agreement between eager and compiled.

    python benchmarks/bench_compiled.py --dtype float32 bfloat16 --batch 1 16
"""
from __future__ import annotations

import argparse
import time


def _run(llm, batch: int, prompt_len: int, tokens: int) -> tuple[float, int, list[list[int]]]:
    from blink.ring import C_STAT_STEPS
    from blink.shared.sampling_params import SamplingParams

    prompts = [[(17 * i + 31 * j) % 40000 + 100 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    # Prefill first (one token each), so the timed part is decode only.
    steps0 = int(llm.engine.ring.control[C_STAT_STEPS])
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, timeout_s=1200)
    wall = time.perf_counter() - t0
    steps = int(llm.engine.ring.control[C_STAT_STEPS]) - steps0
    return wall, steps, [o.token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--compiled-only", action="store_true",
                   help="skip the eager engines (thread-layout comparisons of the compiled step)")
    args = p.parse_args()

    from blink.llm import LLM

    rows = []
    for dtype in args.dtype:
        results = {}
        for eager in ((False,) if args.compiled_only else (True, False)):
            t0 = time.perf_counter()
            llm = LLM(args.model, dtype=dtype, enforce_eager=eager, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024,
                      kv_cache_tokens=32768, threads=args.threads,
                      compile_cache_dir=args.compile_cache_dir)
            start = time.perf_counter() - t0
            try:
                for batch in args.batch:
                    results[eager, batch] = _run(llm, batch, args.prompt, args.tokens)
                compiled = llm.engine.runner.compiled
                refused = compiled.refused if compiled is not None else 0
            finally:
                llm.close()
            print(f"{dtype} {'eager' if eager else 'compiled'}: start {start:.1f} s"
                  + (f" (compile {compiled.warm_seconds:.1f} s, refused recompiles {refused})"
                     if compiled is not None else ""), flush=True)
        for batch in args.batch:
            if args.compiled_only:
                wc, sc, _ = results[False, batch]
                print(f"{dtype} batch {batch}: compiled {1e3 * wc / sc:.1f} ms/step, "
                      f"{batch * args.tokens / wc:.1f} tok/s")
                continue
            (we, se, oe), (wc, sc, oc) = results[True, batch], results[False, batch]
            same = sum(a == b for a, b in zip(oe, oc))
            rows.append((dtype, batch, 1e3 * we / se, 1e3 * wc / sc, we / se / (wc / sc),
                         batch * args.tokens / we, batch * args.tokens / wc, f"{same}/{batch}"))
    print("\n| dtype | batch | eager ms/step | compiled ms/step | speed-up | eager tok/s | "
          "compiled tok/s | same greedy outputs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f}x | {r[5]:.1f} | {r[6]:.1f} | {r[7]} |")


if __name__ == "__main__":
    main()
