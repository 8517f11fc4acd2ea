"""Bare model-executor throughput against transformers on the same weights, on CPU.

Measures, for each executor dtype: prefill tokens/s (one prompt in one step), single-stream
decode tokens/s (one token per step, the host-side metadata build included) and the CPU
time it takes per token (process time: steadier than wall time on a shared machine, though
spinning OpenMP threads count too), and batch-16 decode tokens/s; then transformers'
forward/``generate`` on the same model in the same run, and prints the speed-ups. Example (the numbers in docs/benchmarks.md come from this):

    python benchmarks/bench_executor.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from blink.executor import ModelExecutor


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_blink(args, dtype: torch.dtype) -> dict[str, float]:
    per_seq_blocks = -(-(max(args.prompt_len, args.decode_prompt_len + args.decode_tokens + 8)) // 16)
    n_blocks = per_seq_blocks * max(args.batch, 1)
    ex = ModelExecutor(args.model, dtype=dtype, block_size=16, num_blocks=n_blocks)
    vocab = ex.config.vocab_size
    blocks = [list(range(i * per_seq_blocks, (i + 1) * per_seq_blocks)) for i in range(max(args.batch, 1))]

    # prefill: one prompt of prompt_len tokens in one step
    prompt = _prompt(args.prompt_len, 0, vocab)
    ids, md, last = ex.build_metadata([(prompt, 0, blocks[0])])
    ex.execute(ids, md, last)  # warm-up
    t_prefill = _median_time(lambda: ex.execute(ids, md, last), args.repeats)

    def decode(batch: int) -> float:
        prompts = [_prompt(args.decode_prompt_len, 1 + i, vocab) for i in range(batch)]
        lens = [len(p) for p in prompts]
        ids, md, last = ex.build_metadata([(p, 0, b) for p, b in zip(prompts, blocks)])
        nxt = ex.execute(ids, md, last).argmax(-1).tolist()

        def step() -> None:
            nonlocal nxt
            ids, md, last = ex.build_metadata(
                [([t], n, b) for t, n, b in zip(nxt, lens, blocks)]
            )
            nxt = ex.execute(ids, md, last).argmax(-1).tolist()
            for i in range(batch):
                lens[i] += 1

        for _ in range(3):  # warm-up
            step()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.decode_tokens):
            step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return batch * args.decode_tokens / wall, 1e3 * cpu / (batch * args.decode_tokens)

    single, single_cpu = decode(1)
    row = {
        "prefill_tok_s": args.prompt_len / t_prefill,
        "decode_tok_s": single,
        "decode_cpu_ms_per_tok": single_cpu,
    }
    if args.batch > 1:
        row[f"decode_b{args.batch}_tok_s"] = decode(args.batch)[0]
    return row


def bench_transformers(args, dtype: torch.dtype, hf_model) -> dict[str, float]:
    model = hf_model.to(dtype)
    vocab = model.config.vocab_size
    prompt = torch.tensor([_prompt(args.prompt_len, 0, vocab)])
    with torch.inference_mode():
        model(prompt)  # warm-up
        t_prefill = _median_time(lambda: model(prompt), args.repeats)

        def decode(batch: int) -> float:
            inp = torch.tensor([_prompt(args.decode_prompt_len, 1 + i, vocab) for i in range(batch)])
            kw = dict(do_sample=False, pad_token_id=model.config.eos_token_id or 0)

            def gen(n: int) -> None:
                model.generate(inp, max_new_tokens=n, min_new_tokens=n, **kw)

            gen(4)  # warm-up
            c0 = time.process_time()
            t_first = _median_time(lambda: gen(1), 1)  # prefill + first token
            c1 = time.process_time()
            t_all = _median_time(lambda: gen(args.decode_tokens + 1), 1)
            c2 = time.process_time()
            n = batch * args.decode_tokens
            return n / (t_all - t_first), 1e3 * ((c2 - c1) - (c1 - c0)) / n

        single, single_cpu = decode(1)
        row = {
            "prefill_tok_s": args.prompt_len / t_prefill,
            "decode_tok_s": single,
            "decode_cpu_ms_per_tok": single_cpu,
        }
        if args.batch > 1:
            row[f"decode_b{args.batch}_tok_s"] = decode(args.batch)[0]
        return row


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
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="batched decode rows (<= 1: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"model={args.model} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"prompt={args.prompt_len} decode: {args.decode_tokens} tokens after a "
          f"{args.decode_prompt_len}-token prompt, batch {args.batch}")

    rows: dict[str, dict[str, float]] = {}
    for name in filter(None, args.dtypes.split(",")):
        rows[f"blink {name}"] = bench_blink(args, getattr(torch, name))
        print(f"blink {name:9s}", _fmt(rows[f'blink {name}']), flush=True)
    hf_dtypes = list(filter(None, args.hf_dtypes.split(",")))
    if hf_dtypes:
        hf_model = load_transformers(args.model)
        for name in hf_dtypes:
            rows[f"transformers {name}"] = bench_transformers(args, getattr(torch, name), hf_model)
            print(f"transformers {name:9s}", _fmt(rows[f'transformers {name}']), flush=True)

    print("\n| engine | " + " | ".join(next(iter(rows.values())).keys()) + " |")
    print("|---|" + "---|" * len(next(iter(rows.values()))))
    for engine, row in rows.items():
        print(f"| {engine} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |")
    base_names = [k for k in rows if k.startswith("transformers")]
    for base in base_names:
        for engine in (k for k in rows if k.startswith("blink")):
            # speed-up: for CPU ms per token lower is better, so the ratio is inverted
            ratios = ", ".join(
                f"{k} {rows[base][k] / rows[engine][k] if 'ms' in k else rows[engine][k] / rows[base][k]:.2f}x"
                for k in rows[engine]
            )
            print(f"{engine} vs {base} (speed-up): {ratios}")


def _fmt(row: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.1f}" for k, v in row.items())


if __name__ == "__main__":
    main()
