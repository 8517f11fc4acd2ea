"""Offline throughput: ``LLM.generate`` against transformers ``generate`` on the same prompts.

64 prompts of mixed lengths (token ids, the same for both), each with its own output length
in [64, 128], greedy, EOS ignored so both generate exactly the requested tokens. Blink gets
all prompts at once (continuous batching through the ring and the engine thread);
transformers runs ``generate`` over left-padded batches (``--hf-batch``, default all 64 in
one batch) with ``max_new_tokens`` = the batch's longest request. Throughput counts the
requested output tokens only, so transformers' static-batching waste counts against it.

The run also prints where Blink's time goes (engine thread: scheduler / executor forward /
sampler / update, and the client thread's ring polling) and how many prompts' greedy
outputs agree with transformers'. For a per-function profile of the engine thread use py-spy
(``py-spy record --format raw -o out.txt -- python benchmarks/bench_offline.py --skip-hf``;
torch.profiler in the main thread does not see the engine thread). Example (the numbers in
docs/performance.md#offline come from it):

    python benchmarks/bench_offline.py --threads 2
"""
from __future__ import annotations

import argparse
import copy
import random
import os
import threading
import time
from collections import defaultdict

import torch

_TEXT = (
    "The scheduler batches every request that is ready and gives each a share of the token "
    "budget. Paged attention keeps the key and value cache in fixed blocks, so memory is never "
    "fragmented. A prefix cache lets requests that share a system prompt skip its prefill. "
    "The frontend writes each request into a slot of the ring and reads the tokens back. "
    "Our team met in the small library to plan the spring festival and the bake sale. "
    "The river rose after three days of rain, and the old bridge was closed to traffic. "
    "She wrote the letter twice before she was happy with the tone and the last line. "
    "Good soup starts with onions cooked slowly in butter until they turn golden. "
)


def length_range(text: str) -> tuple[int, int]:
    """``--prompt-len``/``--output-len``: "MIN,MAX" or "N" (MIN = MAX = N), positive."""
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 0 < parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: give MIN,MAX (0 < MIN <= MAX) or one length N")
    return parts[0], parts[1]


def make_requests(tokenizer, n: int, prompt_lens: tuple[int, int], out_lens: tuple[int, int],
                  seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs; prompts are windows of real text."""
    rng = random.Random(seed)
    corpus = tokenizer.encode(_TEXT * 8, add_special_tokens=False)
    requests = []
    for _ in range(n):
        length = rng.randint(*prompt_lens)
        start = rng.randrange(len(corpus) - length)
        requests.append((corpus[start:start + length], rng.randint(*out_lens)))
    return requests


class Timers:
    """Wall time per named section, thread-safe enough for one writer per name."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, fn, label: str):
        """``fn`` with its wall time and calls added to ``label``."""

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t0
                self.calls[label] += 1

        return timed

    def wrap(self, obj, name: str, label: str):
        """Time ``obj.name`` as ``label``; returns the undo."""
        fn = getattr(obj, name)
        setattr(obj, name, self.timed(fn, label))
        return lambda: setattr(obj, name, fn)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process, by thread id (Linux)."""
    out = {}
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            comm = open(f"/proc/self/task/{task}/comm").read().strip()
            fields = open(f"/proc/self/task/{task}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task)] = (comm, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def cpu_by_role(before, after, loop_id: int) -> dict[str, float]:
    """CPU seconds spent between two :func:`thread_cpu` samples: engine loop thread, the
    client (main) thread, and everything else (torch's intra-op worker threads...)."""
    main_id = threading.main_thread().native_id
    roles: dict[str, float] = defaultdict(float)
    for tid, (comm, cpu) in after.items():
        used = cpu - before.get(tid, (comm, 0.0))[1]
        role = "engine loop thread" if tid == loop_id else "client (main) thread" if tid == main_id \
            else "other threads (torch workers)"
        roles[role] += used
    return dict(roles)


def bench_blink(args, requests) -> dict:
    from blink.engine.sampler import Sampler
    from blink.llm import LLM
    from blink.shared.sampling_params import SamplingParams
    from blink.ring import C_STAT_STEPS

    t0 = time.perf_counter()
    llm = LLM(args.model, threads=args.threads, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    restore = []
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
        llm.generate([p for p, _ in requests[:4]], [SamplingParams(temperature=0.0, max_tokens=4)] * 4)

        timers = Timers()
        if args.breakdown:
            timers.wrap(engine, "step", "engine: step (all)")
            timers.wrap(engine.scheduler, "schedule", "engine: scheduler.schedule")
            timers.wrap(engine.scheduler, "update", "engine: scheduler.update")
            timers.wrap(engine.scheduler, "token_history", "engine: token_history")
            timers.wrap(engine.executor, "execute", "engine: executor forward")
            # the step holds the engine's sampler: time its class's call (this process only)
            restore.append(timers.wrap(Sampler, "__call__", "engine: sampler"))
            timers.wrap(llm._ring, "poll_many", "client: ring poll_many")
            timers.wrap(llm._ring, "try_submit", "client: ring try_submit")
            timers.wrap(llm, "_consume", "client: detokenize/consume")
        loop_id = engine._thread.native_id
        cpu0 = thread_cpu()
        steps0 = int(engine.ring.control[C_STAT_STEPS])

        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params)
        elapsed = time.perf_counter() - t0
        cpu = cpu_by_role(cpu0, thread_cpu(), loop_id)
        steps = int(engine.ring.control[C_STAT_STEPS]) - steps0
    finally:
        llm.close()
        for undo in restore:
            undo()
    tokens = [o.token_ids for o in outs]
    assert all(len(t) == m for t, (_, m) in zip(tokens, requests)), "wrong output lengths"
    return dict(load_s=load_s, elapsed=elapsed, tokens=tokens, timers=timers, steps=steps, cpu=cpu,
                dtype=str(engine.dtype).removeprefix("torch."))


def load_transformers(model: str):
    from transformers import AutoModelForCausalLM

    from blink.loader import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@torch.inference_mode()
def bench_transformers(args, requests, pad_id: int) -> dict:
    t0 = time.perf_counter()
    model = load_transformers(args.model)
    load_s = time.perf_counter() - t0
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # like ignore_eos: generate exactly max_new_tokens
    config.do_sample, config.pad_token_id = False, pad_id
    config.temperature = config.top_p = config.top_k = None

    def run(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        config.max_new_tokens = max(m for _, m in batch)
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        return [out[i, width:width + m].tolist() for i, (_, m) in enumerate(batch)]

    run(requests[:2])  # warm-up
    t0 = time.perf_counter()
    tokens = []
    for i in range(0, len(requests), args.hf_batch):
        tokens += run(requests[i:i + args.hf_batch])
    elapsed = time.perf_counter() - t0
    return dict(load_s=load_s, elapsed=elapsed, tokens=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", default="16,192", type=length_range,
                        help="prompt tokens: MIN,MAX (each drawn in between) or N (all N)")
    parser.add_argument("--output-len", default="64,128", type=length_range,
                        help="output tokens: MIN,MAX or N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers batch size")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="Blink's --dtype (transformers runs float32; float32 on both sides "
                             "makes the greedy outputs agree token for token)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from blink.dpu.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.model)
    prompt_lens, out_lens = args.prompt_len, args.output_len
    requests = make_requests(tokenizer, args.num_prompts, prompt_lens, out_lens, args.seed)
    n_prompt = sum(len(p) for p, _ in requests)
    n_out = sum(m for _, m in requests)
    print(f"model={args.model} threads={args.threads} torch={torch.__version__} "
          f"prompts={len(requests)} prompt tokens={n_prompt} (len {prompt_lens[0]}-{prompt_lens[1]}) "
          f"output tokens={n_out} (len {out_lens[0]}-{out_lens[1]}) greedy, ignore_eos", flush=True)

    b = bench_blink(args, requests)
    print(f"blink:        dtype {b['dtype']}, load {b['load_s']:.1f} s, generate {b['elapsed']:.2f} s, "
          f"{n_out / b['elapsed']:.1f} output tok/s, {(n_prompt + n_out) / b['elapsed']:.1f} total tok/s, "
          f"{b['steps']} steps ({b['elapsed'] / max(b['steps'], 1) * 1e3:.1f} ms/step)", flush=True)
    print("  CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in b["cpu"].items())
          + f" (over {b['elapsed']:.1f} s wall)")
    if args.breakdown:
        timers = b["timers"]
        print("  time breakdown (wall, per thread):")
        for label in sorted(timers.total, key=lambda k: (k.split(":")[0], -timers.total[k])):
            t = timers.total[label]
            print(f"    {label:30s} {t:8.2f} s  {100 * t / b['elapsed']:5.1f}%  "
                  f"({timers.calls[label]} calls, {t / max(timers.calls[label], 1) * 1e3:.2f} ms/call)")
        step = timers.total.get("engine: step (all)", 0.0)
        print(f"    {'engine: outside step (idle/backoff/loop)':30s} {b['elapsed'] - step:8.2f} s")

    if args.skip_hf:
        return
    pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    h = bench_transformers(args, requests, pad_id)
    print(f"transformers: load {h['load_s']:.1f} s, generate {h['elapsed']:.2f} s, "
          f"{n_out / h['elapsed']:.1f} output tok/s (batch {args.hf_batch}, left padding)", flush=True)

    same = sum(x == y for x, y in zip(b["tokens"], h["tokens"]))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / len(x)
              for x, y in zip(b["tokens"], h["tokens"])]
    print(f"greedy agreement: {same}/{len(requests)} outputs identical, mean common prefix "
          f"{100 * sum(prefix) / len(prefix):.0f}% of the output")
    print(f"RATIO blink/transformers output throughput: {h['elapsed'] / b['elapsed']:.2f}x")


if __name__ == "__main__":
    main()
