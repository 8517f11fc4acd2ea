"""GPU device loops on one GPU: CPU reference vs tier A (host-driven CUDA graphs) vs tier B
(CPU-free WHILE-graph loop).

This module is both a script and the library :mod:`benchmarks.gpu_check` builds its phases
from (random model directories, the ring client, prestaged generation, steady decode, CPU
hog, makespan). The script, in order (results table on stdout, full numbers as JSON):

1. **Correctness, fp32, small random Llama** (hidden 256, 4 layers): the same greedy
   requests through the CPU loop on the CPU, tier A and tier B on the GPU. Requests are
   written into the ring *before* the engine starts, so every loop schedules the same
   batches; A and B run the same captured code and must agree exactly; against the CPU
   a difference can only come from a numerical near-tie (the first divergence is printed).
2. **A 1B-class random Llama in bf16** (hidden 2048, 16 layers, 32 q / 8 kv heads,
   intermediate 8192, vocab 32000; weights drawn on the GPU and written as an HF
   directory without transformers): greedy outputs of tier A, tier B and the CPU loop's
   own step run eagerly on the GPU (``run_step``, no graphs) compared.
3. **Steady decode** for ``--steady-s`` seconds with ``--requests`` long requests, per
   tier: engine host CPU seconds (process CPU time minus the benchmark client's own
   thread, and the engine loop thread's own), steps and tokens per second, step time.
4. **Makespan**: ``--requests`` requests of ``--prompt-len`` prompt tokens and
   ``--max-tokens`` outputs submitted at once; wall time until all finished, per tier.
5. 3 and 4 again with a CPU hog (one busy process per core).

Usage on the device machine::

    python3 -m pip install --no-deps -e . && python3 -m benchmarks.gpu_loop

(``python3 -m benchmarks.gpu_check`` runs the same measurements as separate, time-boxed
phases with pass/fail criteria; prefer it for a first run.) Without a CUDA device the
script builds its inputs, says "no CUDA device" and exits 0.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
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
# vocab == 256: every id decodes through the byte tokenizer (the HTTP end-to-end check).
LLAMA_BYTES = dict(LLAMA_SMALL, vocab_size=256, max_position_embeddings=512, eos_token_id=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steady-s", type=float, default=20.0)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-hog", action="store_true", help="skip the CPU-hog repetition")
    p.add_argument("--json", default=None, help="results file (default: $OUT/gpu_loop.json or ./)")
    return p.parse_args(argv)


def build_inputs(requests: int = 64, prompt_len: int = 128, max_tokens: int = 128) -> dict[str, Any]:
    """Everything the runs need that does not need a GPU (seeded: the same on every call)."""
    from blink.engine.engine import EngineConfig
    from blink.shared.sampling_params import SamplingParams

    rng = random.Random(0)
    small_prompts = [[rng.randrange(3, LLAMA_SMALL["vocab_size"]) for _ in range(rng.randint(5, 60))]
                     for _ in range(8)]
    prompts = [[rng.randrange(3, LLAMA_1B["vocab_size"]) for _ in range(prompt_len)]
               for _ in range(requests)]
    engine_kwargs = dict(max_model_len=4096, max_num_seqs=max(64, requests),
                         max_num_batched_tokens=512, kv_cache_tokens=max(64, requests) * 4096,
                         block_size=16)
    return {
        "small_prompts": small_prompts,
        "prompts": prompts,
        "greedy_short": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "greedy_makespan": SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        "greedy_long": SamplingParams(max_tokens=4096 - prompt_len - 1, temperature=0.0, ignore_eos=True),
        "engine_kwargs": engine_kwargs,
        "small_config": dict(engine_kwargs, max_model_len=1024, max_num_seqs=16,
                             kv_cache_tokens=16 * 1024, max_num_batched_tokens=128, dtype="float32"),
        "EngineConfig": EngineConfig,
    }


# --------------------------------------------------------------------------- model files


def byte_tokenizer_json() -> str:
    """A byte-level BPE without merges: token id == byte value (256 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from blink.shared.byte_level import unicode_to_bytes

    tok = Tokenizer(models.BPE(vocab=unicode_to_bytes(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def llama_config_json(dims: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a Llama with ``dims`` (what transformers' LlamaConfig would save)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "torch_dtype": str(dtype).removeprefix("torch."), **dims}


def llama_tensor_shapes(dims: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Llama with ``dims``."""
    h, inter, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    d = dims.get("head_dim") or h // dims["num_attention_heads"]
    q, kv = dims["num_attention_heads"] * d, dims["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    shapes["model.norm.weight"] = (h,)
    if not dims.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def write_random_llama(path: Path, dims: dict[str, Any], dtype: torch.dtype, device: str = "cpu",
                       seed: int = 0, std: float = 0.02) -> Path:
    """A random Llama as an HF directory (config.json, model.safetensors, a byte
    tokenizer), written without transformers. Weights ~ N(0, std) (transformers' own
    initialisation), norm weights 1 + N(0, 0.1) so a skipped norm shows; drawn on
    ``device`` (a GPU draws a 1B model in well under a second). Reused when a complete
    directory for the same dims, dtype and seed exists (a marker is written last)."""
    from safetensors.torch import save_file

    key = hashlib.sha256(json.dumps([dims, str(dtype), seed, std], sort_keys=True).encode()).hexdigest()[:16]
    marker = path / ".complete"
    if marker.is_file() and marker.read_text() == key:
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in llama_tensor_shapes(dims).items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        t = 1.0 + 0.1 * t if len(shape) == 1 else t * std
        tensors[name] = t.to(dtype).cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (path / "config.json").write_text(json.dumps(llama_config_json(dims, dtype), indent=1), encoding="utf-8")
    (path / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}), encoding="utf-8")
    marker.write_text(key)
    return path


# ------------------------------------------------------------------------------ running


def thread_cpu_s(native_id: int | None) -> float | None:
    """CPU seconds (user + system) of one thread of this process, from /proc."""
    if native_id is None:
        return None
    try:
        stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_thread_id(engine: Any) -> int | None:
    """The engine loop thread's kernel id (``Engine._thread``; None if it is not running)."""
    thread = getattr(engine, "_thread", None)
    return getattr(thread, "native_id", None)


class Client:
    """The frontend's ring client over the engine's loopback region, token ids in/out."""

    def __init__(self, engine: Any) -> None:
        from blink.dpu.ring_protocol import RingClient

        self.engine = engine
        self.ring = RingClient(ring_transport(engine))
        self.rid = 0

    def submit(self, prompt: list[int], params: Any) -> Any:
        """Write one request into the ring; None while no slot is free."""
        from blink.dpu.ring_packing import ring_fields

        self.rid += 1
        fields = ring_fields(params, len(prompt), self.engine.max_model_len, self.ring.config)
        return self.ring.try_submit(self.rid, prompt, fields)

    def submit_all(self, prompts: list[list[int]], params: Any) -> list[Any]:
        """Every prompt at once (all must fit in the ring's slots)."""
        handles = [self.submit(p, params) for p in prompts]
        if any(h is None for h in handles):
            raise RuntimeError(f"{len(prompts)} requests do not fit in the ring's "
                               f"{self.ring.config.n_slots} slots")
        return handles

    def collect(self, handles: list[Any], timeout_s: float = 300) -> list[list[int]]:
        """Tokens of ``handles`` until all finished (the engine must be running)."""
        out: list[list[int]] = [[] for _ in handles]
        index = {id(h): i for i, h in enumerate(handles)}
        active = list(handles)
        deadline = time.monotonic() + timeout_s
        while active:
            if not self.engine.alive:
                raise RuntimeError(f"engine stopped: {self.engine.error!r}")
            for h, delta in self.ring.poll_many(active).items():
                out[index[id(h)]] += delta.token_ids
                if delta.finished:
                    active.remove(h)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(active)} of {len(handles)} requests did not finish in {timeout_s:g} s")
            time.sleep(5e-4)
        return out

    def run(self, prompts: list[list[int]], params: Any, timeout_s: float = 300) -> tuple[list[list[int]], float]:
        """Submit as slots free up (the engine running) and collect; (tokens, wall s)."""
        pending = list(reversed(range(len(prompts))))
        active: dict[Any, int] = {}
        out: list[list[int]] = [[] for _ in prompts]
        t0 = time.monotonic()
        while pending or active:
            if not self.engine.alive:
                raise RuntimeError(f"engine stopped: {self.engine.error!r}")
            while pending:
                h = self.submit(prompts[pending[-1]], params)
                if h is None:
                    break
                active[h] = pending.pop()
            for h, delta in self.ring.poll_many(list(active)).items():
                out[active[h]] += delta.token_ids
                if delta.finished:
                    del active[h]
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError("requests did not finish")
            time.sleep(5e-4)
        return out, time.monotonic() - t0

    def steady(self, prompts: list[list[int]], params: Any, window_s: float,
               start_timeout_s: float = 120) -> dict[str, Any]:
        """Keep ``prompts`` decoding; measure ``window_s`` of steady state: steps, tokens,
        step time, and host CPU of the engine (process minus this client thread; and the
        engine loop thread alone)."""
        from blink.ring import C_STAT_GENERATED_TOKENS, C_STAT_STEPS

        handles = self.submit_all(prompts, params)
        started = set()
        deadline = time.monotonic() + start_timeout_s
        while len(started) < len(handles):  # every request past its prefill
            for h, d in self.ring.poll_many(handles).items():
                if d.token_ids:
                    started.add(id(h))
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(started)} of {len(handles)} requests started")
            if not self.engine.alive:
                raise RuntimeError(f"engine stopped: {self.engine.error!r}")
            time.sleep(1e-3)
        control = self.engine.ring.control
        tid = loop_thread_id(self.engine)
        loop0 = thread_cpu_s(tid)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, mine0, t0 = time.process_time(), time.thread_time(), time.monotonic()
        steps0, tok0 = int(control[C_STAT_STEPS]), int(control[C_STAT_GENERATED_TOKENS])
        while time.monotonic() - t0 < window_s:
            # Consume, so the streams never fill; a request that reached its max_tokens
            # is replaced, so the batch stays full for the whole window.
            for h, d in self.ring.poll_many([h for h in handles if h is not None]).items():
                if d.finished:
                    i = handles.index(h)
                    handles[i] = self.submit(prompts[i], params)  # None: no slot yet, left out
            time.sleep(2e-3)
        t1 = time.monotonic()
        cpu = time.process_time() - cpu0 - (time.thread_time() - mine0)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        loop1 = thread_cpu_s(tid)
        steps, toks = int(control[C_STAT_STEPS]) - steps0, int(control[C_STAT_GENERATED_TOKENS]) - tok0
        for h in handles:
            if h is not None:
                self.ring.cancel(h)
        end = time.monotonic() + 30
        while any(h is not None and not h.done for h in handles) and time.monotonic() < end:
            self.ring.poll_many([h for h in handles if h is not None])
            time.sleep(1e-3)
        window = t1 - t0
        return {"window_s": window, "engine_cpu_s": cpu,
                "engine_cpu_pct_of_core": 100 * cpu / window,
                "loop_thread_cpu_s": None if loop0 is None or loop1 is None else loop1 - loop0,
                "process_cpu_s_rusage": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
                "voluntary_ctx_switches": ru1.ru_nvcsw - ru0.ru_nvcsw,
                "steps": steps, "tokens": toks,
                "step_ms": 1e3 * window / max(steps, 1), "tokens_per_s": toks / window}

    def close(self) -> None:
        self.ring.close()


# ------------------------------------------------------------- steady decode, interleaved

#: tier B's step time may exceed tier A's by this much and still count as "<= tier A"
#: (run-to-run noise of two separate engines on one GPU; a first guess, to revise).
STEP_TIME_TOLERANCE = 0.05


def nonempty_steps(engine: Any) -> int | None:
    """Steps that ran a forward (an empty step -- nothing schedulable, e.g. every stream full
    -- is cheap and would shrink the mean step time): tier A's host count, tier B's device
    counter (read without waiting for the loop). None for the CPU loop."""
    if getattr(engine, "tier", None) == "B":
        return int(engine.loop_counters().get("steps", 0))
    runner = getattr(engine, "runner", None)
    return int(runner.steps) if getattr(engine, "tier", None) == "A" and runner is not None else None


def steady_client_main(spec_path: str) -> int:
    """``--steady-client SPEC``: keep the spec's requests decoding over the engine's
    shared-memory ring from this separate process (its GIL and CPU are not the engine's),
    consuming every token and resubmitting finished requests; prints ``started`` once every
    request has its first token, stops (cancelling what is left) when stdin closes or
    says ``stop``."""
    import select

    from blink.dpu.ring_packing import ring_fields
    from blink.dpu.ring_protocol import RingClient
    from blink.shared.sampling_params import SamplingParams
    from blink.transport import LoopbackTransport

    spec = json.loads(Path(spec_path).read_text())
    ring = RingClient(LoopbackTransport(spec["region"], spec["total_bytes"]))
    params = SamplingParams(**spec["params"])
    prompts = spec["prompts"]
    rid = 0

    def submit(prompt: list[int]) -> Any:
        nonlocal rid
        rid += 1
        return ring.try_submit(rid, prompt, ring_fields(params, len(prompt), spec["max_model_len"], ring.config))

    handles = [submit(p) for p in prompts]
    if any(h is None for h in handles):
        print(f"error: {len(prompts)} requests do not fit the ring", flush=True)
        return 1
    started: set[int] = set()
    announced = False
    try:
        while True:
            for h, d in ring.poll_many([h for h in handles if h is not None]).items():
                if d.token_ids:
                    started.add(id(h))
                if d.finished:
                    i = handles.index(h)
                    handles[i] = submit(prompts[i])
            if not announced and len(started) >= len(prompts):
                print("started", flush=True)
                announced = True
            ready, _, _ = select.select([sys.stdin], [], [], 0.002)
            if ready:
                line = sys.stdin.readline()
                if not line or line.strip() == "stop":
                    break
            for i, h in enumerate(handles):
                if h is None:
                    handles[i] = submit(prompts[i])
    finally:
        live = [h for h in handles if h is not None]
        for h in live:
            ring.cancel(h)
        end = time.monotonic() + 20
        while any(not h.done for h in live) and time.monotonic() < end:
            ring.poll_many(live)
            time.sleep(1e-3)
        ring.close()
    return 0


class SteadyClient:
    """The steady-decode load: in a process of its own over the shared-memory ring, or --
    where the ring is the engine's in-process memory (the GPU refused to register shared
    memory) -- in a thread of this process (then sharing the GIL with a host loop; said in
    ``where``)."""

    def __init__(self, engine: Any, prompts: list[list[int]], params: Any, work_dir: Path,
                 start_timeout_s: float = 120) -> None:
        import dataclasses
        import threading

        self.engine, self.proc, self.thread = engine, None, None
        if getattr(engine.region, "kind", "loopback") == "loopback":
            self.where = "process"
            spec = {"region": engine.region.name, "total_bytes": engine.region.total_bytes,
                    "max_model_len": engine.max_model_len, "prompts": prompts,
                    "params": {k: v for k, v in dataclasses.asdict(params).items()
                               if k in ("max_tokens", "temperature", "ignore_eos")}}
            work_dir.mkdir(parents=True, exist_ok=True)
            path = work_dir / f"steady-client-{os.getpid()}.json"
            path.write_text(json.dumps(spec))
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            repo = str(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_loop", "--steady-client", str(path)],
                                         cwd=repo, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
            ready, _, _ = __import__("select").select([self.proc.stdout], [], [], start_timeout_s)
            line = self.proc.stdout.readline() if ready else ""
            if line.strip() != "started":
                self.close()
                raise RuntimeError(f"the steady-decode client did not start its requests: {line.strip()!r}")
        else:
            self.where = "thread (in-process ring)"
            self._stop = threading.Event()
            self._started = threading.Event()
            self._error: BaseException | None = None
            client = Client(engine)

            def run() -> None:
                try:
                    handles = client.submit_all(prompts, params)
                    started: set[int] = set()
                    while not self._stop.is_set():
                        for h, d in client.ring.poll_many([h for h in handles if h is not None]).items():
                            if d.token_ids:
                                started.add(id(h))
                            if d.finished:
                                i = handles.index(h)
                                handles[i] = client.submit(prompts[i], params)
                        if len(started) >= len(prompts):
                            self._started.set()
                        time.sleep(2e-3)
                    for h in handles:
                        if h is not None:
                            client.ring.cancel(h)
                except BaseException as exc:  # noqa: BLE001 - reported by the caller
                    self._error = exc
                    self._started.set()
                finally:
                    client.close()

            self.thread = threading.Thread(target=run, name="steady-client", daemon=True)
            self.thread.start()
            if not self._started.wait(start_timeout_s) or self._error is not None:
                self.close()
                raise RuntimeError(f"the steady-decode client did not start its requests: {self._error!r}")

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.thread is not None:
            self._stop.set()
            self.thread.join(30)
            self.thread = None


def measure_window(engine: Any, window_s: float) -> dict[str, Any]:
    """One window of steady state: steps (all, and non-empty), tokens, engine host CPU
    (this process minus the measuring thread; the engine loop thread alone)."""
    from blink.ring import C_STAT_GENERATED_TOKENS, C_STAT_STEPS

    control = engine.ring.control
    tid = loop_thread_id(engine)
    loop0 = thread_cpu_s(tid)
    ne0 = nonempty_steps(engine)
    cpu0, mine0, t0 = time.process_time(), time.thread_time(), time.monotonic()
    steps0, tok0 = int(control[C_STAT_STEPS]), int(control[C_STAT_GENERATED_TOKENS])
    while time.monotonic() - t0 < window_s:
        if not engine.alive:
            raise RuntimeError(f"engine stopped: {engine.error!r}")
        time.sleep(0.01)
    t1 = time.monotonic()
    steps, toks = int(control[C_STAT_STEPS]) - steps0, int(control[C_STAT_GENERATED_TOKENS]) - tok0
    cpu = time.process_time() - cpu0 - (time.thread_time() - mine0)
    loop1, ne1 = thread_cpu_s(tid), nonempty_steps(engine)
    nonempty = None if ne0 is None or ne1 is None else ne1 - ne0
    window = t1 - t0
    return {"window_s": window, "steps": steps, "nonempty_steps": nonempty, "tokens": toks,
            "engine_cpu_s": cpu, "loop_thread_cpu_s": None if loop0 is None or loop1 is None else loop1 - loop0}


def _pool(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Windows of one condition summed: tokens/s, step time over non-empty steps, CPU."""
    t = sum(w["window_s"] for w in windows)
    steps = sum(w["steps"] for w in windows)
    ne = [w["nonempty_steps"] for w in windows]
    nonempty = None if any(n is None for n in ne) else sum(ne)
    counted = nonempty if nonempty else steps
    cpu = sum(w["engine_cpu_s"] for w in windows)
    loop = [w["loop_thread_cpu_s"] for w in windows]
    return {"window_s": t, "windows": len(windows), "steps": steps, "nonempty_steps": nonempty,
            "empty_steps": None if nonempty is None else steps - nonempty,
            "tokens": sum(w["tokens"] for w in windows), "tokens_per_s": sum(w["tokens"] for w in windows) / t,
            "step_ms": 1e3 * t / max(counted, 1), "engine_cpu_s": cpu, "engine_cpu_pct_of_core": 100 * cpu / t,
            "loop_thread_cpu_s": None if any(x is None for x in loop) else sum(loop)}


def steady_interleaved(engine: Any, prompts: list[list[int]], params: Any, window_s: float, reps: int,
                       hog_procs: int, work_dir: Path) -> dict[str, Any]:
    """Steady decode without and with a CPU hog, as ``reps`` interleaved pairs of windows of
    ``window_s`` (ABBA order: quiet-hog, hog-quiet, ...), so a drift of the machine falls on
    both conditions alike; the client keeps the batch full from its own process. Returns the
    pooled quiet and hog numbers, every window, and the hog retention (tokens/s under the
    hog / without) per pair, its median and spread."""
    client = SteadyClient(engine, prompts, params, work_dir)
    windows: list[dict[str, Any]] = []
    try:
        for rep in range(reps):
            for hog in ((False, True) if rep % 2 == 0 else (True, False)):
                if hog:
                    with CpuHog(hog_procs):
                        w = measure_window(engine, window_s)
                else:
                    w = measure_window(engine, window_s)
                windows.append(dict(w, hog=hog, rep=rep))
    finally:
        client.close()
    quiet = [w for w in windows if not w["hog"]]
    hogged = [w for w in windows if w["hog"]]
    ratios = [(h["tokens"] / h["window_s"]) / max(q["tokens"] / q["window_s"], 1e-9)
              for q, h in zip(quiet, hogged)]
    ratios_sorted = sorted(ratios)
    median = ratios_sorted[len(ratios) // 2] if len(ratios) % 2 else \
        (ratios_sorted[len(ratios) // 2 - 1] + ratios_sorted[len(ratios) // 2]) / 2
    return {"client": client.where, "quiet": _pool(quiet), "hog": _pool(hogged), "windows": windows,
            "pair_retention": ratios, "retention": median,
            "retention_spread": [ratios_sorted[0], ratios_sorted[-1]]}


class CpuHog:
    """``n`` (default: one per core) busy-looping processes, killed on exit."""

    def __init__(self, n: int | None = None) -> None:
        self.n = n or os.cpu_count() or 1
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "CpuHog":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.n)]
        time.sleep(0.5)  # let them reach the run queue before anything is measured
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def ring_transport(engine: Any) -> Any:
    """The frontend's transport to ``engine``'s ring: the shared-memory segment by name, or,
    where the GPU refused to register shared memory and the ring is the engine's own pinned
    memory (transport ``inprocess``), that memory directly (this process only)."""
    from blink.transport import InProcessTransport, LoopbackTransport

    if getattr(engine.region, "kind", "loopback") == "inprocess":
        return InProcessTransport(engine.region)
    return LoopbackTransport(engine.region.name, engine.region.total_bytes)


def make_engine(EngineConfig: Any, model: Path, kwargs: dict[str, Any], loop: str, device: str = "cuda",
                eager_gpu: bool = False, start: bool = True, simulate: bool = False) -> Any:
    """``create_engine`` for ``loop`` (cpu | host | device); started unless ``start`` is
    False (then requests can be written into the ring first). ``eager_gpu``: the CPU
    loop's step run eagerly on GPU tensors (no graphs). ``simulate``: the GPU loops' code
    on CPU tensors (``create_engine(simulation=HostSimulation())``; dry runs of the benchmarks).

    The benchmark's ring client is in this process (``in_process_frontend``): where the GPU
    refuses to register the shared-memory ring (gVisor), both tiers run over the engine's
    pinned in-process ring instead of refusing to start."""
    from blink.engine.factory import create_engine
    from blink.engine.step import run_step

    cfg = EngineConfig(**{"model": str(model), "device": device, "dtype": "auto", **kwargs})
    t0 = time.monotonic()
    simulation = None
    if simulate and loop != "cpu":
        from blink.engine.gpu.host_sim import HostSimulation

        simulation = HostSimulation()
    engine = create_engine(cfg, loop, simulation=simulation, in_process_frontend=True)
    if eager_gpu:
        engine.step = lambda: run_step(engine.parts)  # type: ignore[method-assign]
    engine.build_s = time.monotonic() - t0
    if start:
        engine.start()
    print(f"  {loop}{' (eager step)' if eager_gpu else ''}: engine built in {engine.build_s:.1f} s "
          f"({type(engine).__name__} {getattr(engine, 'tier', '')})", flush=True)
    return engine



def generate_prestaged(EngineConfig: Any, model: Path, kwargs: dict[str, Any], loop: str,
                       prompts: list[list[int]], params: Any, device: str = "cuda",
                       timeout_s: float = 120, eager_gpu: bool = False,
                       simulate: bool = False) -> tuple[list[list[int]], dict[str, Any]]:
    """Build an engine, write every request into its ring, *then* start it and collect:
    every loop sees the same ring at its first step, so batches (and bf16 rounding) are
    the same from run to run. Returns (tokens, info: build/run seconds, engine type)."""
    engine = make_engine(EngineConfig, model, kwargs, loop, device, eager_gpu=eager_gpu, start=False,
                         simulate=simulate)
    client = Client(engine)
    info: dict[str, Any] = {"engine": type(engine).__name__, "tier": getattr(engine, "tier", None),
                            "build_s": round(engine.build_s, 2)}
    try:
        handles = client.submit_all(prompts, params)
        t0 = time.monotonic()
        engine.start()
        out = client.collect(handles, timeout_s)
        info["run_s"] = round(time.monotonic() - t0, 3)
        if hasattr(engine, "loop_counters"):
            info["loop_counters"] = engine.loop_counters()
        info["exit_reason"] = getattr(engine, "exit_reason", None)
    finally:
        client.close()
        engine.close()
    return out, info


def first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    """Where two runs' token lists first differ ("none" if they do not)."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} requests"
    for r, (x, y) in enumerate(zip(a, b)):
        if x != y:
            i = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"request {r} token {i}"
    return "none"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--steady-client"]:
        return steady_client_main(argv[1])
    args = parse_args(argv)
    inputs = build_inputs(args.requests, args.prompt_len, args.max_tokens)
    print(f"inputs: {len(inputs['prompts'])} prompts of {args.prompt_len} tokens, "
          f"{len(inputs['small_prompts'])} correctness prompts; engine {inputs['engine_kwargs']}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (inputs built; run this on a GPU machine)")
        return 0
    from blink.engine.gpu.checks import tier_b_problems

    problems = tier_b_problems()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"tier B problems: {problems or 'none'}", flush=True)
    EngineConfig = inputs["EngineConfig"]
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "tier_b_problems": problems}
    tiers = ["host"] + ([] if problems else ["device"])
    root = Path(tempfile.mkdtemp(prefix="blink-gpu-loop-"))

    # 1. correctness, fp32, small model: CPU loop vs A vs B
    small = write_random_llama(root / "llama-small", LLAMA_SMALL, torch.float32, "cuda")
    outs = {}
    for loop, device in [("cpu", "cpu")] + [(t, "cuda") for t in tiers]:
        outs[loop] = generate_prestaged(EngineConfig, small, inputs["small_config"], loop,
                                        inputs["small_prompts"], inputs["greedy_short"], device)[0]
    results["small_fp32_identical"] = {t: outs[t] == outs["cpu"] for t in tiers}
    results["small_fp32_first_divergence"] = {t: first_divergence(outs["cpu"], outs[t]) for t in tiers}
    if "device" in outs:
        results["small_fp32_A_equals_B"] = outs["host"] == outs["device"]

    # 2-5. the 1B-class model in bf16
    big = write_random_llama(root / "llama-1b", LLAMA_1B, torch.bfloat16, "cuda")
    kwargs = inputs["engine_kwargs"]
    prompts = inputs["prompts"]
    ref = generate_prestaged(EngineConfig, big, kwargs, "host", prompts[:8], inputs["greedy_short"],
                             eager_gpu=True)[0]
    per_tier: dict[str, Any] = {}
    for loop in tiers:
        r: dict[str, Any] = {}
        got, r["generate"] = generate_prestaged(EngineConfig, big, kwargs, loop, prompts[:8], inputs["greedy_short"])
        r["greedy_equals_eager_gpu"] = got == ref
        r["first_divergence_vs_eager"] = first_divergence(ref, got)
        r["greedy_tokens"] = got
        engine = make_engine(EngineConfig, big, kwargs, loop)
        client = Client(engine)
        try:
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
        print(f"  {loop}: {json.dumps({k: v for k, v in r.items() if k != 'greedy_tokens'}, default=str)}", flush=True)
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
    for r in results.get("tiers", {}).values():
        r.pop("greedy_tokens", None)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
