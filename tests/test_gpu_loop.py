"""The GPU device loops, tested on CPU and, where a GPU is present, on CUDA.

- Graph plan: which buckets get graphs, capture order, shared pool, rows per bucket, the
  host mirror of the device bucket index; bucket metadata are views (static buffers).
- Tier A's step (HostGraphStep) over the eager graph runner, and tier B's graph built by the
  same builder the CUDA path uses (recorded and interpreted on the host by EagerGraphApi,
  kernels run by their host models): both produce exactly the CPU loop's tokens, through
  the real ring, engine thread and ring client (LLM), greedy and seeded sampling, with
  chunked prefill over several buckets.
- The built graph's structure: WHILE → gate → IF(step) → [schedule] → dispatch → IF per
  bucket → [forward] → fence; handles created on the graphs that hold their nodes; the
  parameter block points at the schedule's outputs.
- The gate's protocol (host model of the CUDA kernel, over a real ring): idle polling is
  bounded and bumps the heartbeat, a WRITTEN slot triggers a step, stop-now, drain (done
  and timed out), the frontend's C_SHUTDOWN, back-off after an empty step.
- Engine lifecycle for tier B: shutdown word, stop with and without drain.
- Tier selection and the refusals on a machine without a GPU.
- On a machine with a CUDA GPU, the same checks on the real tiers (tokens equal the CPU
  loop's, tier B idles and stops); they skip elsewhere, and tier B's skip names what is
  missing.
"""
from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import BASE, random_prompts, tiny_model_dir, wait_for  # noqa: E402

from blink import llm as llm_module  # noqa: E402
from blink.engine import step  # noqa: E402
from blink.engine.engine import Engine, EngineConfig  # noqa: E402
from blink.engine.factory import create_engine  # noqa: E402
from blink.engine.gpu import abi, host_sim, tier_b  # noqa: E402
from blink.engine.gpu.plan import plan_graphs  # noqa: E402
from blink.engine.gpu.base import GpuEngine  # noqa: E402
from blink.engine.gpu.checks import tier_a_problems, tier_b_problems  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.engine.sched.state import SchedulerConfig, ring_tensors, ring_views  # noqa: E402
from blink.errors import BlinkError  # noqa: E402
from blink.ring import (  # noqa: E402
    C_ENGINE_STATE,
    C_HEARTBEAT,
    C_SHUTDOWN,
    ENGINE_DRAINING,
    ENGINE_STOPPED,
    SLOT_FREE,
    SLOT_RUNNING,
    SLOT_WRITTEN,
    Ring,
    RingConfig,
    RingLayout,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)
#: buckets 8, 16, 32, 64: prefill is chunked. device="cpu": the reference is the CPU loop and
#: the simulated tiers run on CPU tensors, on a GPU machine too (the CUDA tests are below).
SMALL = dict(BASE, max_num_batched_tokens=64, device="cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("gpu_loop_models"))


def _generate(model_dir: Path, loop: str, prompts, params, **overrides):
    """Outputs and the engine's counters, with ``loop`` in cpu | host | device (simulated)."""
    orig = llm_module.create_engine
    if loop != "cpu":
        llm_module.create_engine = lambda cfg, _loop="auto", **_kw: create_engine(cfg, loop, simulation=host_sim.HostSimulation())
    try:
        with llm_module.LLM(str(model_dir), **{**SMALL, **overrides}) as llm:
            outs = llm.generate(prompts, params, timeout_s=120)
            engine = llm.engine
            info = {"type": type(engine).__name__}
            if isinstance(engine, GpuEngine):
                info["tier"] = engine.tier
                if engine.tier == "A":
                    info["replays"] = list(engine.runner.graphs.replays)
                else:
                    info["counters"] = engine.loop_counters()
            return [[c.token_ids for c in o.outputs] for o in outs], info
    finally:
        llm_module.create_engine = orig


# ------------------------------------------------------------------------------ the plan


def test_plan_covers_every_bucket_schedule_first_then_largest_first():
    cfg = SchedulerConfig(num_blocks=64, max_model_len=256, max_num_batched_tokens=512)
    plan = plan_graphs(cfg, num_slots=16)
    assert plan.buckets == cfg.buckets == (8, 16, 32, 64, 128, 256, 512)
    assert plan.rows == (8, 16, 16, 16, 16, 16, 16)  # min(tokens, slots)
    assert plan.capture_order == ("schedule", "bucket:512", "bucket:256", "bucket:128",
                                  "bucket:64", "bucket:32", "bucket:16", "bucket:8")
    buckets = torch.tensor(cfg.buckets)
    for n in (0, 1, 7, 8, 9, 100, 511, 512):
        assert plan.bucket_index(n) == int(torch.bucketize(torch.tensor(n), buckets))
    with pytest.raises(ValueError):
        plan.bucket_index(513)


def test_bucket_metadata_are_views_of_the_static_batch(model_dir):
    engine = Engine(EngineConfig(model=str(model_dir), **SMALL))
    try:
        engine.scheduler.host_guards = False  # as a captured graph runs it (the budget's T lanes)
        batch = engine.scheduler.schedule()
        md = step.bucket_metadata(batch, 16)
        assert md.slot_mapping.shape[0] == md.positions.shape[0] == md.token_seq_idx.shape[0] == 16
        for a, b in ((md.slot_mapping, batch.attn.slot_mapping), (md.positions, batch.attn.positions),
                     (md.seq_lens, batch.attn.seq_lens), (md.block_tables, batch.attn.block_tables)):
            assert a.data_ptr() == b.data_ptr()  # a graph reads the schedule's output memory
        assert md.max_context is None and md.max_query_len is None  # no host-side bounds
    finally:
        engine.close()


def test_eager_runner_has_graph_output_semantics():
    runner = host_sim.EagerRunner()
    counter = torch.zeros(())

    def fn():
        counter.add_(1)
        return {"x": counter * 10}

    static = runner.capture("g", fn)
    x = static["x"]
    runner.replay("g")
    runner.replay("g")
    assert static["x"] is x and float(x) == 30.0  # same tensor, rewritten in place


# ------------------------------------------------------------------ tokens: A and B == CPU


def test_tier_a_and_tier_b_match_the_cpu_loop_greedy(model_dir):
    prompts = random_prompts(6, 3, 90, seed=3)  # up to 90 tokens: chunked over 64-token steps
    params = SamplingParams(max_tokens=10, **GREEDY)
    want, _ = _generate(model_dir, "cpu", prompts, params)
    got_a, info_a = _generate(model_dir, "host", prompts, params)
    got_b, info_b = _generate(model_dir, "device", prompts, params)
    assert (info_a["type"], info_b["type"]) == ("TierAEngine", "TierBEngine")
    assert got_a == want
    assert got_b == want
    # Several buckets ran: decode (8/16) and chunked prefill (64).
    used = {name for name in info_a["replays"] if name.startswith("bucket:")}
    assert {"bucket:64"} <= used and len(used) >= 2, used
    assert info_b["counters"]["steps"] >= 10


def test_tier_a_and_tier_b_match_the_cpu_loop_seeded_sampling(model_dir):
    prompts = random_prompts(4, 3, 20, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7,
                            repetition_penalty=1.1, ignore_eos=True)
    want, _ = _generate(model_dir, "cpu", prompts, params)
    assert _generate(model_dir, "host", prompts, params)[0] == want
    assert _generate(model_dir, "device", prompts, params)[0] == want


# ------------------------------------------------------------- tier B's graph, as built


def test_conditional_loop_graph_structure(model_dir):
    engine = create_engine(EngineConfig(model=str(model_dir), **SMALL), "device", simulation=host_sim.HostSimulation())
    try:
        loop, api = engine.loop, engine.api
        root = loop.exec
        assert [(n.kind, n.cond) for n in root.nodes] == [("conditional", "while")]
        assert root.handles == [loop.handles["loop"]]
        body = root.nodes[0].body
        gate = next(n for n in body.nodes if n.kind == "kernel")
        step = next(n for n in body.nodes if n.kind == "conditional")
        assert gate.kernel == "blink_gate" and step.cond == "if" and step.deps == [gate]
        assert body.handles == [loop.handles["step"]] and step.handle == loop.handles["step"]
        sg = step.body
        schedule, dispatch = sg.nodes[0], sg.nodes[1]
        assert schedule.kind == "segment" and dispatch.kernel == "blink_dispatch"
        assert dispatch.deps == [schedule]
        ifs = sg.nodes[2:]
        assert len(ifs) == len(engine.plan.buckets) == 4
        assert all(n.cond == "if" and n.deps == [dispatch] for n in ifs)
        assert [n.handle for n in ifs] == loop.handles["buckets"] == sg.handles
        for n in ifs:
            seg, fence = n.body.nodes
            assert seg.kind == "segment" and fence.kernel == "blink_publish_fence" and fence.deps == [seg]
        # The parameter block the kernels get.
        for p in (gate.params, dispatch.params):
            assert p.h_loop == loop.handles["loop"] and p.h_step == loop.handles["step"]
            assert list(p.h_bucket[:4]) == loop.handles["buckets"]
            assert p.n_buckets == 4 and p.n_slots == engine.ring_config.n_slots
            assert p.num_scheduled_tokens == loop.batch.num_scheduled_tokens.data_ptr()
            assert p.bucket_index == loop.batch.bucket_index.data_ptr()
            assert p.control == engine.scheduler.ring["control"].data_ptr()
            assert p.slot_state == engine.scheduler.ring["state"].data_ptr()
            assert p.host_ctl == loop.host_ctl.data_ptr()
            assert p.loop_state == loop.loop_state.data_ptr()
        assert api.defaults[loop.handles["loop"]] == 1 and api.defaults[loop.handles["step"]] == 0
    finally:
        engine.close()


# -------------------------------------------------------------------- the gate's protocol


class _GateRig:
    """A real ring plus the loop's words, and LoopParams pointing at them."""

    def __init__(self, n_slots=8, **opts) -> None:
        self.buf = bytearray(RingLayout(RingConfig(n_slots=n_slots, arena_tokens=4096,
                                                   max_model_len=256)).total_bytes)
        self.ring = Ring.create(self.buf, RingConfig(n_slots=n_slots, arena_tokens=4096, max_model_len=256))
        self.views = ring_tensors(self.ring)
        self.ls = torch.zeros(abi.LS_WORDS, dtype=torch.int64)
        self.hc = torch.zeros(abi.HC_WORDS, dtype=torch.int64)
        self.n_tokens = torch.zeros((), dtype=torch.int64)
        self.bucket = torch.zeros((), dtype=torch.int64)
        drain_ns = opts.pop("drain_timeout_ns", 30 * 10**9)
        o = abi.LoopOptions(**{"poll_budget_ns": 2_000_000, "max_polls": 64, **opts})
        p = tier_b.loop_params(self.views, n_slots, o, drain_ns / 1e9)
        p.host_ctl, p.loop_state = self.hc.data_ptr(), self.ls.data_ptr()
        p.num_scheduled_tokens, p.bucket_index = self.n_tokens.data_ptr(), self.bucket.data_ptr()
        p.n_buckets, p.engine_failed = 4, 4
        self.p = p

    def poll(self):
        t0 = time.monotonic()
        d, reason = host_sim.gate_poll_model(self.p)
        host_sim.gate_record_model(self.p, d, reason)
        return d, reason, time.monotonic() - t0


def test_gate_idle_is_bounded_and_keeps_the_heartbeat():
    rig = _GateRig(poll_budget_ns=3_000_000, max_polls=10_000, heartbeat_period_ns=0)
    hb = rig.ring.heartbeat
    d, reason, took = rig.poll()
    assert d == abi.GATE_IDLE and reason == abi.EXIT_RUNNING
    assert took < 1.0  # bounded by the poll budget (3 ms), with scheduling slack
    assert rig.ring.heartbeat > hb
    rig2 = _GateRig(poll_budget_ns=10**12, max_polls=5)
    assert rig2.poll()[0] == abi.GATE_IDLE  # the iteration cap bounds it too
    assert int(rig2.ls[abi.LS_IDLE_CALLS]) == 1 and int(rig2.ls[abi.LS_GATE_CALLS]) == 1


def test_gate_steps_on_a_written_slot_and_backs_off_after_an_empty_step():
    rig = _GateRig(empty_backoff_ns=10**12)
    rig.ring.state[3] = SLOT_WRITTEN
    assert rig.poll()[0] == abi.GATE_STEP
    rig.ring.state[3] = SLOT_RUNNING  # admitted; the schedule found nothing to run
    rig.n_tokens.fill_(0)
    assert host_sim.dispatch_record_model(rig.p) == -1 and int(rig.ls[abi.LS_LAST_STEP_EMPTY]) == 1
    assert rig.poll()[0] == abi.GATE_IDLE  # busy but backing off: no hot spin
    rig.ring.cancel[3] = 1  # new information (a cancel) ends the back-off
    assert rig.poll()[0] == abi.GATE_STEP
    rig.n_tokens.fill_(9)
    rig.bucket.fill_(1)
    assert host_sim.dispatch_record_model(rig.p) == 1 and int(rig.ls[abi.LS_STEPS]) == 1


def test_gate_stop_and_drain():
    rig = _GateRig(drain_timeout_ns=10**12)
    rig.hc[abi.HC_STOP] = abi.STOP_NOW
    assert rig.poll()[:2] == (abi.GATE_STOP, abi.EXIT_STOPPED)
    assert rig.ring.engine_state == ENGINE_STOPPED

    rig = _GateRig(drain_timeout_ns=10**12)
    rig.ring.state[0] = SLOT_RUNNING
    rig.ring.control[C_SHUTDOWN] = 1  # the frontend asks for shutdown: drain
    assert rig.poll()[0] == abi.GATE_STEP
    assert rig.ring.engine_state == ENGINE_DRAINING
    rig.ring.state[0] = SLOT_FREE
    assert rig.poll()[:2] == (abi.GATE_STOP, abi.EXIT_DRAINED)
    assert int(rig.ls[abi.LS_EXIT]) == abi.EXIT_DRAINED

    rig = _GateRig(drain_timeout_ns=1)
    rig.ring.state[0] = SLOT_RUNNING
    rig.hc[abi.HC_STOP] = abi.STOP_DRAIN
    rig.poll()  # drain starts
    time.sleep(0.001)
    assert rig.poll()[:2] == (abi.GATE_STOP, abi.EXIT_DRAIN_TIMEOUT)


# ------------------------------------------------------------------ tier B: lifecycle


def test_tier_b_idles_then_stops_on_the_shutdown_word(model_dir):
    engine = create_engine(EngineConfig(model=str(model_dir), **SMALL), "device",
                           simulation=host_sim.HostSimulation(), options=abi.LoopOptions(poll_budget_ns=1_000_000))
    try:
        engine.start()
        hb = engine.ring.heartbeat
        wait_for(lambda: engine.ring.heartbeat > hb + 2, what="heartbeat while idle")
        wait_for(lambda: engine.loop_counters()["idle_calls"] > 0, what="idle gate calls")
        assert engine.loop_counters()["steps"] == 0
        engine.ring.control[C_SHUTDOWN] = 1
        wait_for(lambda: not engine.alive, what="the loop to stop")
        assert engine.ring.engine_state == ENGINE_STOPPED and engine.exit_reason == "drained"
        assert engine.error is None
    finally:
        engine.close()


def test_tier_b_stop_now_and_drain(model_dir):
    for drain, reason in ((False, "stopped"), (True, "drained")):
        engine = create_engine(EngineConfig(model=str(model_dir), **SMALL), "device", simulation=host_sim.HostSimulation())
        try:
            engine.start()
            engine.stop(drain=drain)
            assert not engine.alive and engine.exit_reason == reason
            assert engine.ring.engine_state == ENGINE_STOPPED
        finally:
            engine.close()


# --------------------------------------------------------------- selection and refusals


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU answers")
def test_tier_selection_and_refusals_without_a_gpu(model_dir):
    cfg = EngineConfig(model=str(model_dir), **{**SMALL, "device": "auto"})
    engine = create_engine(cfg, "auto")
    try:
        assert type(engine) is Engine  # auto on a CPU machine: the CPU loop
    finally:
        engine.close()
    for loop in ("host", "device"):
        with pytest.raises(BlinkError, match=f"--loop {loop}.*needs a CUDA GPU"):
            create_engine(cfg, loop)
    with pytest.raises(BlinkError, match="unknown --loop"):
        create_engine(cfg, "gpu")
    assert tier_a_problems() and "no CUDA GPU" in tier_a_problems()[0]
    assert tier_b_problems() == tier_a_problems()
    with pytest.raises(BlinkError, match="CPU loop runs on --device cpu"):
        Engine(EngineConfig(model=str(model_dir), **{**SMALL, "device": "meta"}))


def test_device_ring_views_match_the_cpu_layout():
    cfg = RingConfig(n_slots=4, arena_tokens=1024, max_model_len=128)
    buf = bytearray(RingLayout(cfg).total_bytes)
    ring = Ring.create(buf, cfg)
    cpu = ring_tensors(ring)
    base = torch.frombuffer(buf, dtype=torch.uint8)
    views = ring_views(RingLayout(cfg), base)
    assert views.keys() == cpu.keys()
    for name in cpu:
        assert views[name].shape == cpu[name].shape and views[name].dtype == cpu[name].dtype
        assert views[name].data_ptr() == cpu[name].data_ptr()
    assert np.array_equal(views["stop_token_ids"].numpy(), ring.stop_token_ids)
    assert ctypes.sizeof(abi.LoopParams) == abi.LOOP_PARAMS_BYTES


# ------------------------------------------------------------------ on a real GPU, if any


def _generate_cuda(model_dir: Path, loop: str, prompts, params):
    """Outputs of the real ``--loop host|device`` on CUDA (fp32, the same tiny model)."""
    with llm_module.LLM(str(model_dir), loop=loop, **{**SMALL, "device": "cuda"}) as llm:
        outs = llm.generate(prompts, params, timeout_s=300)
        engine = llm.engine
        assert isinstance(engine, GpuEngine) and engine.tier == ("A" if loop == "host" else "B")
        assert not engine.simulate
        return [[c.token_ids for c in o.outputs] for o in outs], engine.loop_counters()


def _skip_unless_tier_b() -> None:
    problems = tier_b_problems(torch.device("cuda", 0))
    if problems:
        pytest.skip("tier B cannot start on this GPU: " + "; ".join(problems))


@needs_cuda
@pytest.mark.parametrize("loop", ["host", "device"])
def test_cuda_tiers_match_the_cpu_loop_greedy(model_dir, loop):
    if loop == "device":
        _skip_unless_tier_b()
    prompts = random_prompts(6, 3, 90, seed=3)
    params = SamplingParams(max_tokens=10, **GREEDY)
    want, _ = _generate(model_dir, "cpu", prompts, params)
    got, counters = _generate_cuda(model_dir, loop, prompts, params)
    assert got == want
    if loop == "device":
        assert counters["steps"] >= 10


@needs_cuda
@pytest.mark.parametrize("loop", ["host", "device"])
def test_cuda_tiers_match_the_cpu_loop_seeded_sampling(model_dir, loop):
    if loop == "device":
        _skip_unless_tier_b()
    prompts = random_prompts(4, 3, 20, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7,
                            repetition_penalty=1.1, ignore_eos=True)
    want, _ = _generate(model_dir, "cpu", prompts, params)
    assert _generate_cuda(model_dir, loop, prompts, params)[0] == want


@needs_cuda
def test_cuda_tier_b_idles_and_stops(model_dir):
    _skip_unless_tier_b()
    engine = create_engine(EngineConfig(model=str(model_dir), **{**SMALL, "device": "cuda"}), "device")
    try:
        engine.start()
        beat = engine.ring.control[C_HEARTBEAT]
        wait_for(lambda: engine.ring.control[C_HEARTBEAT] > beat + 2, what="the gate's heartbeat")
        engine.stop(drain=True)
        assert not engine.alive and engine.exit_reason == "drained"
        assert engine.ring.engine_state == ENGINE_STOPPED
    finally:
        engine.close()
