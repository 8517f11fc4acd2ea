"""Issue 32, part 2: what would stop the first run of benchmarks/gpu_check.py, each checked on
CPU (the GPU facts stubbed, the tiers simulated).

1. MoE routing compared by what it selects (bf16 ties may reorder or swap tied experts).
2. The environment phase records every field as it is read, under a 45 s limit.
3. Where the shared-memory ring cannot be registered, the tiers run over the in-process ring.
4. Tier B's driver failures name the call; instantiation uses cuGraphInstantiateWithParams,
   names the result and the error node and dumps the graph; model_1b survives a tier B failure.
5. A tier B loop that ignores ``stop(drain=False)`` is called hung after ~3 s, not 45.
6. steady_decode: interleaved windows, the client in its own process, non-empty steps.
7. The kernels and serve_e2e limits, within the 9-minute budget.
8. Tier B runs on a dedicated non-blocking stream; no device-wide synchronize in the tiers.
9. Tier B destroys its executable and graph and releases its pool at close.
"""
from __future__ import annotations

import ast
import json
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed
sys.path.insert(0, str(Path(__file__).parent))

from benchmarks import gpu_check, gpu_kernels, gpu_loop  # noqa: E402
from blink.engine.gpu import base as gpu_base  # noqa: E402
from blink.engine.gpu import host_sim, tier_b  # noqa: E402
from blink.engine.gpu.abi import HC_STOP, STOP_NOW  # noqa: E402
from blink.errors import BlinkError  # noqa: E402
from blink.kernels.reference import layers as ref  # noqa: E402


# ------------------------------------------------------------------------- 1. routing


def test_route_compare_accepts_reordered_and_swapped_ties_and_refuses_a_wrong_expert():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, -1.0],
                           [3.0, 0.0, 1.0, 1.0, -2.0, 0.5]], dtype=torch.bfloat16)
    w, ids = ref.moe_topk_route(logits, 2, True)
    compare = gpu_kernels.route_compare(logits)
    assert compare((w, ids), (w, ids))[0]
    # Row 0: experts 1, 2, 4 tie; any two of them, in any order, are a correct top-2.
    # Row 1: experts 2 and 3 tie for the second place.
    tied = torch.tensor([[4, 1], [0, 3 if int(ids[1, 1]) == 2 else 2]])
    ok, detail = compare((w, tied), (w, ids))
    assert ok, detail
    wrong = torch.tensor([[1, 0], [0, 2]])
    assert not compare((w, wrong), (w, ids))[0]
    duplicated = torch.tensor([[1, 1], [0, 2]])
    assert not compare((w, duplicated), (w, ids))[0]
    assert not compare((w * 1.01, ids), (w, ids))[0]  # weights still checked


def test_route_compare_on_many_bf16_rows_with_ties_permuted():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randint(-4, 5, (512, 64), generator=gen).float() / 4).to(torch.bfloat16)  # many ties
    w, ids = ref.moe_topk_route(logits, 8, True)
    perm = torch.argsort(torch.rand(ids.shape, generator=gen), dim=1)
    ok, detail = gpu_kernels.route_compare(logits)((w.gather(1, perm), ids.gather(1, perm)), (w, ids))
    assert ok, detail


# --------------------------------------------------------------------- 2. environment


def test_environment_reports_every_field_as_it_is_read(monkeypatch):
    from blink.engine import gpu_probe

    seen: list[list[str]] = []
    monkeypatch.setattr(gpu_probe, "sandbox", lambda: seen.append(["sandbox"]) or {"kind": "unknown"})
    snapshots: list[list[str]] = []
    env = gpu_probe.environment(on_field=lambda e: snapshots.append(list(e)))
    assert snapshots[-1] == list(env)
    # The fields read before the (possibly slow) sandbox probe were already reported.
    before_sandbox = next(s for s in snapshots if "sandbox" in s)
    assert {"python", "packages", "cpu_count"} <= set(before_sandbox)
    assert len(snapshots) >= len(env)  # one report per field at least
    assert env["gpu"]["cuda_available"] is False


def test_environment_keeps_what_the_gpu_field_read_before_failing(monkeypatch):
    from blink.engine import gpu_probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: (_ for _ in ()).throw(RuntimeError("cuInit hung up")))
    env = gpu_probe.environment()
    assert env["gpu"]["torch"] == torch.__version__ and "cuInit hung up" in env["gpu"]["error"]


def test_environment_phase_limit_is_45_s():
    assert gpu_check.PHASE_BY_NAME["environment"].timeout_s >= 45


# ------------------------------------------------------------ 3. the in-process ring


def test_make_engine_asks_for_the_in_process_fallback(monkeypatch):
    from blink.engine import factory

    calls = []
    monkeypatch.setattr(factory, "create_engine", lambda cfg, loop, **kw: calls.append(kw) or types.SimpleNamespace())
    gpu_loop.make_engine(lambda **kw: kw, Path("m"), {}, "host", "cuda", start=False)
    assert calls[0]["in_process_frontend"] is True


def test_tier_b_blockers_do_not_count_a_refused_registration(monkeypatch, tmp_path):
    from blink.engine import gpu_probe
    from blink.engine.gpu import checks

    monkeypatch.setattr(checks, "tier_b_problems", lambda device=None: [])
    monkeypatch.setattr(gpu_probe, "host_register_problem", lambda device=None: "cudaHostRegister refused")
    args = gpu_check.build_parser().parse_args(["--work-dir", str(tmp_path)])
    ctx = gpu_check.Context("t", args, None)
    assert gpu_check.tier_b_blockers(ctx) == []
    assert ctx.result["values"]["ring_registration"] == "cudaHostRegister refused"


def test_simulated_tiers_run_over_the_in_process_ring(tmp_path):
    """Both tiers' own code over an in-process ring, driven by the benchmark's client: the
    same tokens as over shared memory."""
    from test_engine import BASE, random_prompts, tiny_model_dir

    from blink.engine.engine import EngineConfig
    from blink.shared.sampling_params import SamplingParams

    model = tiny_model_dir(tmp_path)
    prompts = random_prompts(3, 5, 20, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(BASE, max_num_batched_tokens=64)
    out = {}
    for transport in ("inprocess", "loopback"):
        for loop in ("host", "device"):
            tokens, info = gpu_loop.generate_prestaged(EngineConfig, model, dict(kw, transport=transport), loop,
                                                       prompts, params, "cpu", timeout_s=60, simulate=True)
            out[transport, loop] = tokens
    assert out["inprocess", "host"] == out["loopback", "host"] == out["inprocess", "device"]
    assert all(len(t) == 6 for t in out["inprocess", "device"])


# ----------------------------------------------------------- 4. tier B's driver errors


class _Enum:
    def __init__(self, name: str, value: int) -> None:
        self.name, self.value = name, value

    def __int__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return int(other) == self.value if isinstance(other, (int, _Enum)) else NotImplemented

    __hash__ = object.__hash__


def _fake_driver(tmp_path: Path, instantiate_error: bool = True) -> types.SimpleNamespace:
    """What tier B's CudaGraphApi calls of cuda-bindings, recorded; errors on demand."""
    calls: list[tuple] = []
    ok, bad = _Enum("CUDA_SUCCESS", 0), _Enum("CUDA_ERROR_INVALID_VALUE", 1)

    class Params:
        flags = 0
        hUploadStream = None
        hErrNode_out = 0
        result_out = _Enum("CUDA_GRAPH_INSTANTIATE_SUCCESS", 0)

    def instantiate(graph, params):
        calls.append(("cuGraphInstantiateWithParams", graph, params.flags))
        if instantiate_error:
            params.hErrNode_out = 0xBEEF
            params.result_out = _Enum("CUDA_GRAPH_INSTANTIATE_NODE_OPERATION_NOT_SUPPORTED", 3)
            return (bad, None)
        return (ok, "exec")

    def dot(graph, path, flags):
        calls.append(("cuGraphDebugDotPrint", path))
        Path(path.decode()).write_text("digraph {}")
        return (ok,)

    def rec(name, result=None):
        def fn(*a):
            calls.append((name, *a))
            return (ok,) if result is None else (ok, result)
        return fn

    return types.SimpleNamespace(
        calls=calls,
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=ok),
        CUDA_GRAPH_INSTANTIATE_PARAMS=Params,
        CUgraphInstantiate_flags=types.SimpleNamespace(CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD=2),
        CUstream_flags=types.SimpleNamespace(CU_STREAM_NON_BLOCKING=1),
        cuGetErrorName=lambda e: (ok, e.name.encode()),
        cuGetErrorString=lambda e: (ok, b"invalid argument"),
        cuGraphInstantiateWithParams=instantiate,
        cuGraphDebugDotPrint=dot,
        cuGraphNodeGetType=lambda node: (ok, _Enum("CU_GRAPH_NODE_TYPE_MEM_ALLOC", 10)),
        cuStreamCreate=rec("cuStreamCreate", 0x1234),
        cuGraphExecDestroy=rec("cuGraphExecDestroy"), cuGraphDestroy=rec("cuGraphDestroy"),
        cuStreamSynchronize=rec("cuStreamSynchronize"), cuStreamDestroy=rec("cuStreamDestroy"),
        cuModuleUnload=rec("cuModuleUnload"),
        cuGraphLaunch=lambda exec_, stream: (bad,),
        cuCtxSetCurrent=rec("cuCtxSetCurrent"),
    )


def _api(cu) -> tier_b.CudaGraphApi:
    api = object.__new__(tier_b.CudaGraphApi)  # no GPU: the driver is the fake
    api.cu, api.ctx, api.cu_stream, api.watch_cu_stream = cu, "ctx", "stream", "watch"
    api.module, api.index, api.pool, api._keep, api.destroyed = "module", 0, (0, 1), [], False
    return api


def test_a_failing_driver_call_is_named(tmp_path, monkeypatch):
    cu = _fake_driver(tmp_path)
    monkeypatch.setattr(tier_b, "cuda_bindings_driver", lambda: cu)
    with pytest.raises(BlinkError, match=r"cuGraphLaunch failed: CUDA_ERROR_INVALID_VALUE: invalid argument"):
        _api(cu).launch_graph("exec")


def test_instantiation_failure_names_the_result_and_node_and_dumps_the_graph(tmp_path, monkeypatch):
    cu = _fake_driver(tmp_path)
    monkeypatch.setattr(tier_b, "cuda_bindings_driver", lambda: cu)
    monkeypatch.setenv("BLINK_GRAPH_DUMP_DIR", str(tmp_path / "dump"))
    with pytest.raises(BlinkError) as info:
        _api(cu).instantiate("graph")
    msg = str(info.value)
    assert "cuGraphInstantiateWithParams failed: CUDA_ERROR_INVALID_VALUE" in msg
    assert "CUDA_GRAPH_INSTANTIATE_NODE_OPERATION_NOT_SUPPORTED" in msg
    assert "0xbeef" in msg and "CU_GRAPH_NODE_TYPE_MEM_ALLOC" in msg
    dots = list((tmp_path / "dump").glob("tier_b_graph_*.dot"))
    assert len(dots) == 1 and str(dots[0]) in msg
    assert cu.calls[0] == ("cuGraphInstantiateWithParams", "graph", 2)  # uploaded with the instantiation


def test_instantiation_success_returns_the_exec(tmp_path, monkeypatch):
    cu = _fake_driver(tmp_path, instantiate_error=False)
    monkeypatch.setattr(tier_b, "cuda_bindings_driver", lambda: cu)
    assert _api(cu).instantiate("graph") == "exec"


def test_model_1b_runs_the_logits_check_after_a_tier_b_failure(monkeypatch, tmp_path):
    args = gpu_check.build_parser().parse_args(["--work-dir", str(tmp_path), "--simulate"])
    ctx = gpu_check.Context("model_1b", args, None)
    monkeypatch.setattr(gpu_check, "big_model", lambda c: tmp_path)
    monkeypatch.setattr(gpu_check, "inputs", lambda c: {"EngineConfig": None, "engine_kwargs": {},
                                                         "prompts": [[1, 2, 3]] * 8, "greedy_short": None})

    def generate(EC, model, kw, loop, *a, **k):
        if loop == "device":
            raise BlinkError("CUDA driver call cuGraphInstantiateWithParams failed: stubbed")
        return [[1]], {}

    monkeypatch.setattr(gpu_loop, "generate_prestaged", generate)
    monkeypatch.setattr(gpu_check, "prefill_logits", lambda model, dev, dtype, prompt: torch.ones(3, 4))
    gpu_check.phase_model_1b(ctx)
    checks = {c["name"].split(" (")[0]: c for c in ctx.result["checks"]}
    assert checks["tier A tokens == tier B"]["status"] == "FAIL"
    assert "cuGraphInstantiateWithParams" in checks["tier A tokens == tier B"]["detail"]
    assert checks["GPU bf16 prefill logits vs CPU fp32"]["status"] == "PASS"


# -------------------------------------------------------------- 5. a hung stop-now


class _NeverDone:
    def launch_graph(self, exec_):
        pass

    def query(self):
        return False


def _monitored_engine(drain_timeout_s: float = 30.0) -> tier_b.TierBEngine:
    eng = object.__new__(tier_b.TierBEngine)  # only what _monitor_device_loop reads
    eng.api = _NeverDone()
    eng.loop = types.SimpleNamespace(exec=None, host_ctl=torch.zeros(4, dtype=torch.int64))
    eng._stop = threading.Event()
    eng.drain_timeout_s = drain_timeout_s
    eng.simulate = False
    return eng


def test_a_loop_ignoring_stop_now_is_hung_after_about_3_s():
    eng = _monitored_engine()
    eng._drain = False
    eng.loop.host_ctl[HC_STOP] = STOP_NOW
    eng._stop.set()
    t0 = time.monotonic()
    with pytest.raises(BlinkError, match="did not stop 3 s after a stop now: hung"):
        eng._monitor_device_loop()
    assert time.monotonic() - t0 < tier_b._HUNG_AFTER_STOP_NOW_S + 1.0
    assert eng in gpu_base._RUNNING_LOOPS  # a hung loop stays registered: no device-wide sync after it
    gpu_base._RUNNING_LOOPS.discard(eng)


def test_a_drain_still_waits_for_the_drain_limit(monkeypatch):
    eng = _monitored_engine(drain_timeout_s=0.2)
    eng._drain = True
    monkeypatch.setattr(tier_b, "_STOP_SLACK_S", 0.1)
    monkeypatch.setattr(tier_b, "_HUNG_AFTER_S", 0.3)
    eng._stop.set()
    t0 = time.monotonic()
    with pytest.raises(BlinkError, match="stop request: hung"):
        eng._monitor_device_loop()
    assert time.monotonic() - t0 >= 0.2 + 0.1 + 0.3
    assert int(eng.loop.host_ctl[HC_STOP]) == STOP_NOW  # asked to stop now after the drain limit
    gpu_base._RUNNING_LOOPS.discard(eng)


# --------------------------------------------------------------- 6. steady decode


def test_steady_decode_interleaves_windows_and_counts_nonempty_steps(monkeypatch, tmp_path):
    """The measurement's shape with the engine stubbed: ABBA order, the hog only in hog
    windows, step time over non-empty steps, the median of the pair ratios."""
    order: list[bool] = []
    hog_on = {"v": False}

    class Hog:
        def __init__(self, n):
            pass

        def __enter__(self):
            hog_on["v"] = True

        def __exit__(self, *e):
            hog_on["v"] = False

    class Client:
        where = "process"

        def __init__(self, *a, **k):
            pass

        def close(self):
            pass

    rates = iter([100, 99, 98, 100, 100, 97])

    def window(engine, s):
        order.append(hog_on["v"])
        tokens = next(rates)
        return {"window_s": 1.0, "steps": 12, "nonempty_steps": 10, "tokens": tokens,
                "engine_cpu_s": 0.01, "loop_thread_cpu_s": 0.0}

    monkeypatch.setattr(gpu_loop, "CpuHog", Hog)
    monkeypatch.setattr(gpu_loop, "SteadyClient", Client)
    monkeypatch.setattr(gpu_loop, "measure_window", window)
    r = gpu_loop.steady_interleaved(object(), [[1]], None, 1.0, 3, 1, tmp_path)
    assert order == [False, True, True, False, False, True]
    assert r["quiet"]["step_ms"] == pytest.approx(100.0)  # 3 s over 30 non-empty steps
    assert r["quiet"]["empty_steps"] == 6
    assert r["pair_retention"] == pytest.approx([0.99, 0.98, 0.97])
    assert r["retention"] == pytest.approx(0.98)


def test_steady_client_runs_in_its_own_process(tmp_path):
    """The load generator as a separate process over the CPU loop's shared-memory ring: it
    starts every request, keeps them decoding while the engine steps, and stops on request."""
    from test_engine import BASE, random_prompts, tiny_model_dir

    from blink.engine.engine import EngineConfig
    from blink.shared.sampling_params import SamplingParams

    model = tiny_model_dir(tmp_path)
    eng = gpu_loop.make_engine(EngineConfig, model, dict(BASE, max_num_batched_tokens=64), "cpu", "cpu")
    try:
        client = gpu_loop.SteadyClient(eng, random_prompts(2, 4, 8, seed=1),
                                       SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), tmp_path)
        assert client.where == "process" and client.proc.poll() is None
        w = gpu_loop.measure_window(eng, 0.5)
        assert w["tokens"] > 0 and w["nonempty_steps"] is None  # CPU loop: no separate count
        client.close()
        assert client.proc is None
    finally:
        eng.close()


def test_nonempty_steps_reads_each_tier():
    a = types.SimpleNamespace(tier="A", runner=types.SimpleNamespace(steps=7))
    b = types.SimpleNamespace(tier="B", loop_counters=lambda: {"steps": 5, "gate_calls": 9})
    assert gpu_loop.nonempty_steps(a) == 7 and gpu_loop.nonempty_steps(b) == 5
    assert gpu_loop.nonempty_steps(types.SimpleNamespace()) is None


# ------------------------------------------------------------------------ 7. limits


def test_phase_limits_fit_the_budget():
    limits = {p.name: p.timeout_s for p in gpu_check.PHASES}
    assert limits["kernels"] >= 120 and limits["serve_e2e"] >= 85 and limits["environment"] >= 45
    assert sum(limits.values()) <= 9 * 60
    assert sum(limits.values()) <= gpu_check.build_parser().parse_args([]).budget_s


# --------------------------------------------------------------- 8. streams and syncs


def test_tier_b_takes_a_dedicated_non_blocking_stream(monkeypatch, tmp_path):
    cu = _fake_driver(tmp_path)
    made = []
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr, device=None: made.append(ptr) or "ext")
    handle, stream = tier_b.dedicated_stream(cu, torch.device("cuda", 0))
    assert ("cuStreamCreate", 1) in cu.calls  # CU_STREAM_NON_BLOCKING, from the driver, not torch's pool
    assert handle == 0x1234 and made == [0x1234] and stream == "ext"


@pytest.mark.parametrize("path", ["blink/engine/gpu/base.py", "blink/engine/gpu/tier_b.py",
                                  "blink/engine/gpu/tier_a.py", "blink/engine/gpu_probe.py"])
def test_no_device_wide_synchronize_in_the_gpu_loops(path):
    """A device-wide synchronize waits forever behind a running WHILE graph: these files
    synchronize streams only (``torch.cuda.synchronize()`` and ``empty_cache`` are absent)."""
    tree = ast.parse((REPO / path).read_text())
    calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert not [c for c in calls if c in ("torch.cuda.synchronize", "torch.cuda.empty_cache")], path


def test_release_skips_empty_cache_while_a_device_loop_runs(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    class Running:
        def _device_may_touch_ring(self):
            return True

    r = Running()
    gpu_base._RUNNING_LOOPS.add(r)
    try:
        gpu_check.release()
        assert emptied == []
    finally:
        gpu_base._RUNNING_LOOPS.discard(r)
    gpu_check.release()
    assert emptied == [1]


# ------------------------------------------------------------------ 9. graph teardown


def test_cuda_api_destroy_releases_exec_graph_pool_and_streams(monkeypatch, tmp_path):
    cu = _fake_driver(tmp_path)
    monkeypatch.setattr(tier_b, "cuda_bindings_driver", lambda: cu)
    released = []
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda index, pool: released.append((index, pool)),
                        raising=False)
    api = _api(cu)
    api.destroy("exec", "graph")
    api.destroy("exec", "graph")  # once only
    names = [c[0] for c in cu.calls]
    assert names.count("cuGraphExecDestroy") == 1 and names.count("cuGraphDestroy") == 1
    assert names.count("cuStreamDestroy") == 2 and "cuModuleUnload" in names
    assert released == [(0, (0, 1))]


def test_simulated_tier_b_destroys_its_graph_at_close(tmp_path):
    from test_engine import BASE, tiny_model_dir

    from blink.engine.engine import EngineConfig
    from blink.engine.factory import create_engine

    model = tiny_model_dir(tmp_path)
    eng = create_engine(EngineConfig(model=str(model), device="cpu", **dict(BASE, max_num_batched_tokens=64)),
                        "device", simulation=host_sim.HostSimulation())
    api, graph = eng.api, eng.loop.graph
    eng.close()
    assert api.destroyed == [graph]


def test_a_hung_loop_keeps_its_graph(tmp_path):
    eng = object.__new__(tier_b.TierBEngine)
    destroyed = []
    eng.api = types.SimpleNamespace(destroy=lambda e, g: destroyed.append(g))
    eng.loop = types.SimpleNamespace(exec="e", graph="g")
    eng._device_may_touch_ring = lambda: True
    eng._destroy_loop()
    assert destroyed == []
    eng._device_may_touch_ring = lambda: False
    eng._destroy_loop()
    assert destroyed == ["g"]
