"""GPU device loops on one GPU: CPU reference vs tier A (host-driven CUDA graphs) vs tier B
(CPU-free WHILE-graph loop). One prepared script, < 8 minutes on an H200.

What it does, in order (results table on stdout, full numbers as JSON):

1. **Correctness, fp32, small random Llama** (hidden 256, 4 layers): the same greedy
   requests through the CPU loop on the CPU, tier A and tier B on the GPU. Reported:
   whether the three token sequences are identical (A and B run the same captured code
   and must agree exactly; against the CPU a difference can only come from a numerical
   near-tie, and the first divergence's position is printed).
2. **A 1B-class random Llama in bf16** (transformers' ``LlamaConfig``: hidden 2048, 16
   layers, 32 q / 8 kv heads, intermediate 8192, vocab 32000; weights drawn on the GPU and
   saved as an HF directory): greedy outputs of tier A, tier B and the CPU loop's own step
   run eagerly on the GPU (``run_step``, no graphs) compared.
3. **Steady decode** for ``--steady-s`` (20) seconds with ``--requests`` (64) long requests,
   per tier: engine-host CPU seconds (process CPU time minus the benchmark client's own
   thread), steps and tokens per second, mean step time. Tier B's should be ~0 CPU s.
4. **Makespan**: ``--requests`` requests of ``--prompt-len`` prompt tokens and
   ``--max-tokens`` outputs submitted at once; wall time until all finished, per tier.
5. 3 and 4 again with a CPU hog (one busy process per core).

Usage on the device machine (its image has torch, transformers, cuda-bindings, NVRTC)::

    pip install --no-deps --no-build-isolation -e . && python benchmarks/gpu_loop.py

Without a CUDA device the script builds its inputs (model configs, prompts, sampling
parameters, engine configs), says "no CUDA device" and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA_SMALL = dict(LLAMA_1B, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                   max_position_embeddings=1024)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steady-s", type=float, default=20.0)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-hog", action="store_true", help="skip the CPU-hog repetition")
    p.add_argument("--json", default=None, help="results file (default: $OUT/gpu_loop.json or ./)")
    return p.parse_args(argv)


def build_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the runs need that does not need a GPU."""
    from blink.engine.engine import EngineConfig
    from blink.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    small_prompts = [[rng.randrange(3, LLAMA_SMALL["vocab_size"]) for _ in range(rng.randint(5, 60))]
                     for _ in range(8)]
    prompts = [[rng.randrange(3, LLAMA_1B["vocab_size"]) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    engine_kwargs = dict(max_model_len=4096, max_num_seqs=max(64, args.requests),
                         max_num_batched_tokens=512, kv_cache_tokens=max(64, args.requests) * 4096,
                         block_size=16)
    return {
        "small_prompts": small_prompts,
        "prompts": prompts,
        "greedy_short": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "greedy_makespan": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
        "greedy_long": SamplingParams(max_tokens=4096 - args.prompt_len - 1, temperature=0.0, ignore_eos=True),
        "engine_kwargs": engine_kwargs,
        "small_config": dict(engine_kwargs, max_model_len=1024, max_num_seqs=16,
                             kv_cache_tokens=16 * 1024, max_num_batched_tokens=128),
        "EngineConfig": EngineConfig,
    }


# --------------------------------------------------------------------------- model files


def _byte_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from blink.dpu.tokenizer import _byte_level_decoder

    tok = Tokenizer(models.BPE(vocab=dict(_byte_level_decoder()), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def make_model(root: Path, dims: dict[str, Any], dtype: torch.dtype, name: str) -> Path:
    """A random Llama saved as an HF directory (weights drawn on the GPU: fast)."""
    import transformers as tf

    path = root / name
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**dims)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(_byte_tokenizer_json(), encoding="utf-8")
    del model
    torch.cuda.empty_cache()
    return path


# ------------------------------------------------------------------------------ running


class Client:
    """The frontend's ring client over the engine's loopback region, token ids in/out."""

    def __init__(self, engine: Any) -> None:
        from blink.dpu.ring_client import RingClient
        from blink.transport import LoopbackTransport

        self.engine = engine
        self.ring = RingClient(LoopbackTransport(engine.region.name, engine.region.total_bytes))
        self.rid = 0

    def run(self, prompts: list[list[int]], params: Any, timeout_s: float = 300) -> tuple[list[list[int]], float]:
        from blink.dpu.ring_client import ring_fields

        pending = list(reversed(range(len(prompts))))
        active: dict[Any, int] = {}
        out: list[list[int]] = [[] for _ in prompts]
        t0 = time.monotonic()
        while pending or active:
            if not self.engine.alive:
                raise RuntimeError(f"engine stopped: {self.engine.error!r}")
            while pending:
                i = pending[-1]
                self.rid += 1
                fields = ring_fields(params, len(prompts[i]), self.engine.max_model_len, self.ring.config)
                h = self.ring.try_submit(self.rid, prompts[i], **fields)
                if h is None:
                    break
                pending.pop()
                active[h] = i
            for h, delta in self.ring.poll_many(list(active)).items():
                out[active[h]] += delta.token_ids
                if delta.finished:
                    del active[h]
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError("requests did not finish")
            time.sleep(5e-4)
        return out, time.monotonic() - t0

    def steady(self, prompts: list[list[int]], params: Any, window_s: float) -> dict[str, float]:
        """Keep ``prompts`` decoding; measure ``window_s`` of steady state."""
        from blink.dpu.ring_client import ring_fields
        from blink.ring import C_STAT_GENERATED_TOKENS, C_STAT_STEPS

        def submit(p: list[int]) -> Any:
            self.rid += 1
            fields = ring_fields(params, len(p), self.engine.max_model_len, self.ring.config)
            h = self.ring.try_submit(self.rid, p, **fields)
            assert h is not None, "ring full"
            return h

        handles = [submit(p) for p in prompts]
        started = set()
        deadline = time.monotonic() + 120
        while len(started) < len(handles):  # every request past its prefill
            for h, d in self.ring.poll_many(handles).items():
                if d.token_ids:
                    started.add(h)
            assert time.monotonic() < deadline, "requests did not start"
            time.sleep(1e-3)
        control = self.engine.ring.control
        cpu0, mine0, t0 = time.process_time(), time.thread_time(), time.monotonic()
        steps0, tok0 = int(control[C_STAT_STEPS]), int(control[C_STAT_GENERATED_TOKENS])
        while time.monotonic() - t0 < window_s:
            # Consume, so the streams never fill; a request that reached its max_tokens
            # is replaced, so the batch stays full for the whole window.
            for h, d in self.ring.poll_many(handles).items():
                if d.finished:
                    i = handles.index(h)
                    handles[i] = submit(prompts[i])
            time.sleep(2e-3)
        t1 = time.monotonic()
        cpu = time.process_time() - cpu0 - (time.thread_time() - mine0)
        steps, toks = int(control[C_STAT_STEPS]) - steps0, int(control[C_STAT_GENERATED_TOKENS]) - tok0
        for h in handles:
            self.ring.cancel(h)
        end = time.monotonic() + 30
        while any(not h.done for h in handles) and time.monotonic() < end:
            self.ring.poll_many(handles)
            time.sleep(1e-3)
        return {"window_s": t1 - t0, "engine_cpu_s": cpu, "steps": steps, "tokens": toks,
                "step_ms": 1e3 * (t1 - t0) / max(steps, 1), "tokens_per_s": toks / (t1 - t0)}

    def close(self) -> None:
        self.ring.close()


class CpuHog:
    """One busy process per core."""

    def __enter__(self) -> "CpuHog":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(os.cpu_count() or 1)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def start_engine(EngineConfig: Any, model: Path, kwargs: dict[str, Any], loop: str, device: str = "cuda",
                 eager_gpu: bool = False) -> Any:
    from blink.engine.gpu_loop import create_engine
    from blink.engine.graphs import run_step

    cfg = EngineConfig(**{"model": str(model), "device": device, "dtype": "auto", **kwargs})
    t0 = time.monotonic()
    engine = create_engine(cfg, loop)
    if eager_gpu:  # the CPU loop's step, run eagerly on GPU tensors (no graphs)
        engine.step = lambda: run_step(engine.parts)  # type: ignore[method-assign]
    engine.start()
    print(f"  {loop}{' (eager step)' if eager_gpu else ''}: engine ready in {time.monotonic() - t0:.1f} s "
          f"({type(engine).__name__} {getattr(engine, 'tier', '')})", flush=True)
    return engine


def first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    for r, (x, y) in enumerate(zip(a, b)):
        if x != y:
            i = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"request {r} token {i}"
    return "none"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    inputs = build_inputs(args)
    print(f"inputs: {len(inputs['prompts'])} prompts of {args.prompt_len} tokens, "
          f"{len(inputs['small_prompts'])} correctness prompts; engine {inputs['engine_kwargs']}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (inputs built; run this on a GPU machine)")
        return 0
    from blink.engine.gpu_loop import tier_b_problems

    problems = tier_b_problems()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"tier B problems: {problems or 'none'}", flush=True)
    EngineConfig = inputs["EngineConfig"]
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "tier_b_problems": problems}
    tiers = ["host"] + ([] if problems else ["device"])
    root = Path(tempfile.mkdtemp(prefix="blink-gpu-loop-"))

    # 1. correctness, fp32, small model: CPU loop vs A vs B
    small = make_model(root, LLAMA_SMALL, torch.float32, "llama-small")
    outs = {}
    for loop, device in [("cpu", "cpu")] + [(t, "cuda") for t in tiers]:
        engine = start_engine(EngineConfig, small, dict(inputs["small_config"], dtype="float32"), loop, device)
        client = Client(engine)
        try:
            outs[loop] = client.run(inputs["small_prompts"], inputs["greedy_short"])[0]
        finally:
            client.close()
            engine.close()
    results["small_fp32_identical"] = {t: outs[t] == outs["cpu"] for t in tiers}
    results["small_fp32_first_divergence"] = {t: first_divergence(outs["cpu"], outs[t]) for t in tiers}
    if "device" in outs:
        results["small_fp32_A_equals_B"] = outs["host"] == outs["device"]

    # 2-5. the 1B-class model in bf16
    big = make_model(root, LLAMA_1B, torch.bfloat16, "llama-1b")
    kwargs = inputs["engine_kwargs"]
    prompts = inputs["prompts"]
    eng = start_engine(EngineConfig, big, kwargs, "host", eager_gpu=True)
    client = Client(eng)
    try:
        ref = client.run(prompts[:8], inputs["greedy_short"])[0]
    finally:
        client.close()
        eng.close()
    per_tier: dict[str, Any] = {}
    for loop in tiers:
        engine = start_engine(EngineConfig, big, kwargs, loop)
        client = Client(engine)
        r: dict[str, Any] = {}
        try:
            got = client.run(prompts[:8], inputs["greedy_short"])[0]
            r["greedy_equals_eager_gpu"] = got == ref
            r["first_divergence_vs_eager"] = first_divergence(ref, got)
            r["greedy_tokens"] = got
            r["steady"] = client.steady(prompts, inputs["greedy_long"], args.steady_s)
            r["makespan_s"] = client.run(prompts, inputs["greedy_makespan"])[1]
            if not args.no_hog:
                with CpuHog():
                    r["steady_hog"] = client.steady(prompts, inputs["greedy_long"], args.steady_s)
                    r["makespan_hog_s"] = client.run(prompts, inputs["greedy_makespan"])[1]
            if hasattr(engine, "loop_counters"):
                r["loop_counters"] = engine.loop_counters()
        finally:
            client.close()
            engine.close()
        per_tier[loop] = r
        print(f"  {loop}: {json.dumps({k: v for k, v in r.items() if k != 'greedy_tokens'})}", flush=True)
    results["tiers"] = per_tier
    if "device" in per_tier:
        results["1b_A_equals_B"] = per_tier["host"]["greedy_tokens"] == per_tier["device"]["greedy_tokens"]

    # table
    print("\nresults")
    print(f"  small fp32 identical to the CPU loop: {results['small_fp32_identical']} "
          f"(first divergence {results['small_fp32_first_divergence']})")
    if "1b_A_equals_B" in results:
        print(f"  1B bf16: tier A == tier B greedy: {results['1b_A_equals_B']}")
    print(f"  {'tier':6} {'phase':10} {'eng CPU s':>9} {'steps/s':>8} {'step ms':>8} {'tok/s':>8} {'makespan s':>10}")
    for loop, r in per_tier.items():
        for tag, key, mk in (("steady", "steady", "makespan_s"), ("hog", "steady_hog", "makespan_hog_s")):
            if key in r:
                s = r[key]
                print(f"  {loop:6} {tag:10} {s['engine_cpu_s']:9.2f} {s['steps'] / s['window_s']:8.1f} "
                      f"{s['step_ms']:8.2f} {s['tokens_per_s']:8.0f} {r[mk]:10.2f}")
    out = Path(args.json or Path(os.environ.get("OUT", ".")) / "gpu_loop.json")
    results_json = {k: v for k, v in results.items()}
    for r in results_json.get("tiers", {}).values():
        r.pop("greedy_tokens", None)
    out.write_text(json.dumps(results_json, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
