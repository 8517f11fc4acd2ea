"""Bare model-executor throughput against transformers on the same weights, on CPU.

For each engine (Blink's executor per dtype, transformers per dtype) it measures prefill
tokens/s (one prompt in one step), single-stream decode tokens/s (one token per step; for
Blink the host-side metadata build is included, for transformers ``generate``'s own loop),
the CPU time per single-stream token (process time: steadier than wall time on a shared
machine, though spinning OpenMP threads count too) and batch-16 decode tokens/s.

The engines take turns, round by round, and each keeps its best round: on a shared machine
the load changes by the minute, and alternating gives every engine the same chances.
Example (the numbers in docs/performance.md#bf16 come from this):

    python benchmarks/bench_executor.py --threads 2
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from blink.executor import ModelExecutor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from executor_helpers import build_metadata  # noqa: E402  (the step inputs, built on the host)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


class BlinkEngine:
    """The bare executor with a host-side greedy loop."""

    def __init__(self, args, dtype: torch.dtype) -> None:
        self.args = args
        self.per_seq = -(-max(args.prompt_len, args.decode_prompt_len + 4 * args.decode_tokens) // 16)
        self.ex = ModelExecutor(
            args.model, dtype=dtype, block_size=16, num_blocks=self.per_seq * max(args.batch, 1)
        )
        self.vocab = self.ex.config.vocab_size

    def _blocks(self, row: int) -> list[int]:
        return list(range(row * self.per_seq, (row + 1) * self.per_seq))

    def prefill(self) -> float:
        ids, md, last = build_metadata(self.ex, [(_prompt(self.args.prompt_len, 0, self.vocab), 0, self._blocks(0))])
        t0 = time.perf_counter()
        self.ex.execute(ids, md, last)
        return self.args.prompt_len / (time.perf_counter() - t0)

    def decode(self, batch: int) -> tuple[float, float]:
        n_new = self.args.decode_tokens
        prompts = [_prompt(self.args.decode_prompt_len, 1 + i, self.vocab) for i in range(batch)]
        blocks = [self._blocks(i) for i in range(batch)]
        lens = [len(p) for p in prompts]
        ids, md, last = build_metadata(self.ex, [(p, 0, b) for p, b in zip(prompts, blocks)])
        nxt = self.ex.execute(ids, md, last).argmax(-1).tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n_new):
            ids, md, last = build_metadata(self.ex, [([t], n, b) for t, n, b in zip(nxt, lens, blocks)])
            nxt = self.ex.execute(ids, md, last).argmax(-1).tolist()
            lens = [n + 1 for n in lens]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return batch * n_new / wall, 1e3 * cpu / (batch * n_new)


class TransformersEngine:
    """transformers' forward (prefill) and ``generate`` (decode, greedy, no early stop)."""

    def __init__(self, args, model) -> None:
        self.args = args
        self.model = model
        self.vocab = model.config.vocab_size

    @torch.inference_mode()
    def prefill(self) -> float:
        prompt = torch.tensor([_prompt(self.args.prompt_len, 0, self.vocab)])
        t0 = time.perf_counter()
        self.model(prompt)
        return self.args.prompt_len / (time.perf_counter() - t0)

    @torch.inference_mode()
    def decode(self, batch: int) -> tuple[float, float]:
        inp = torch.tensor([_prompt(self.args.decode_prompt_len, 1 + i, self.vocab) for i in range(batch)])
        kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(inp))

        def gen(n: int) -> tuple[float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            self.model.generate(inp, max_new_tokens=n, min_new_tokens=n, **kw)
            return time.perf_counter() - t0, time.process_time() - c0

        first_wall, first_cpu = gen(1)  # prefill + first token, subtracted below
        all_wall, all_cpu = gen(self.args.decode_tokens + 1)
        n = batch * self.args.decode_tokens
        return n / (all_wall - first_wall), 1e3 * (all_cpu - first_cpu) / n


def load_transformers(model: str):
    from transformers import AutoModelForCausalLM

    from blink.loader import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="executor dtypes, comma-separated")
    parser.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers dtypes ('' to skip)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="batched decode rows (<= 1: skip)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; each engine keeps its best")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"model={args.model} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"prefill={args.prompt_len} tokens; decode: {args.decode_tokens} tokens after a "
          f"{args.decode_prompt_len}-token prompt, batch 1 and {args.batch}; best of {args.rounds} rounds")

    engines: dict[str, object] = {}
    for name in filter(None, args.dtypes.split(",")):
        engines[f"blink {name}"] = BlinkEngine(args, getattr(torch, name))
    hf_dtypes = list(filter(None, args.hf_dtypes.split(",")))
    if hf_dtypes:
        base = load_transformers(args.model)
        for name in hf_dtypes:
            model = base if name == "float32" else copy.deepcopy(base).to(getattr(torch, name))
            engines[f"transformers {name}"] = TransformersEngine(args, model)

    metrics = ["prefill_tok_s", "decode_tok_s", "decode_cpu_ms_per_tok"]
    if args.batch > 1:
        metrics.append(f"decode_b{args.batch}_tok_s")
    best: dict[str, dict[str, float]] = {e: {} for e in engines}
    for engine in engines.values():  # warm-up: first calls allocate and pick kernels
        engine.prefill()
        engine.decode(1)
    for r in range(args.rounds):
        for name, engine in engines.items():
            row = {"prefill_tok_s": engine.prefill()}
            row["decode_tok_s"], row["decode_cpu_ms_per_tok"] = engine.decode(1)
            if args.batch > 1:
                row[f"decode_b{args.batch}_tok_s"] = engine.decode(args.batch)[0]
            for k, v in row.items():
                better = min if "ms" in k else max
                best[name][k] = better(best[name].get(k, v), v)
            print(f"round {r} {name:22s}", "  ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)

    print("\n| engine | " + " | ".join(metrics) + " |")
    print("|---|" + "---:|" * len(metrics))
    for name, row in best.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.1f}" for k in metrics) + " |")
    for base in (e for e in best if e.startswith("transformers")):
        for name in (e for e in best if e.startswith("blink")):
            # speed-ups; for CPU ms per token lower is better, so that ratio is inverted
            ratios = ", ".join(
                f"{k} {best[base][k] / best[name][k] if 'ms' in k else best[name][k] / best[base][k]:.2f}x"
                for k in metrics
            )
            print(f"{name} vs {base}: {ratios}")


if __name__ == "__main__":
    main()
