"""Metrics a vLLM user's monitoring reads: every series the Grafana dashboards query is
exported after a short load (through the fake engine client, and through the real ring client
over the ring's fake engine), with vLLM's names and buckets, and the queue time comes from the
engine's admission stamp (ring field ``admitted_step``) placed on the engine's step clock."""
from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import MESSAGES, MODEL, asgi_request, make_engine, tiny_tokenizer  # noqa: E402
from test_ring_client import Setup  # noqa: E402
from test_scheduler import FakeModel, Frontend, Req, _cfg  # noqa: E402
from test_scheduler import make_ring as make_scheduler_ring  # noqa: E402

from blink.dpu.app import create_app
from blink.dpu.metrics import build_1_2_5_buckets
from blink.dpu.ring_engine_client import ALIGN_MIN_STEP_S, RingEngineClient
from blink.dpu.ring_protocol import RingHandle
from blink.dpu.step_clock import StepClock
from blink.ring import C_STAT_STEPS, SLOT_WRITTEN

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "blink-dashboard.json"

#: The series vLLM's own dashboard (examples/online_serving/prometheus_grafana/grafana.json)
#: queries, with ``vllm:`` → ``blink:``: written down from it, since it cannot be fetched here.
VLLM_DASHBOARD_SERIES = [
    "blink:e2e_request_latency_seconds_bucket", "blink:e2e_request_latency_seconds_sum",
    "blink:e2e_request_latency_seconds_count", "blink:prompt_tokens_total",
    "blink:generation_tokens_total", "blink:time_per_output_token_seconds_bucket",
    "blink:time_per_output_token_seconds_sum", "blink:time_per_output_token_seconds_count",
    "blink:num_requests_running", "blink:num_requests_waiting",
    "blink:time_to_first_token_seconds_bucket", "blink:time_to_first_token_seconds_sum",
    "blink:time_to_first_token_seconds_count", "blink:gpu_cache_usage_perc",
    "blink:request_prompt_tokens_bucket", "blink:request_generation_tokens_bucket",
    "blink:request_success_total", "blink:request_queue_time_seconds_sum",
    "blink:request_prefill_time_seconds_sum", "blink:request_decode_time_seconds_sum",
    "blink:request_max_num_generation_tokens_sum",
]
#: The per-request series the issue lists as missing (each must have observations).
PER_REQUEST_HISTOGRAMS = [
    "blink:request_prompt_tokens", "blink:request_generation_tokens", "blink:request_params_n",
    "blink:request_params_max_tokens", "blink:request_time_per_output_token_seconds", "blink:request_prefill_time_seconds",
    "blink:request_decode_time_seconds", "blink:request_inference_time_seconds",
    "blink:request_queue_time_seconds",
]
#: Blink's own series, which only the ring client can report.
BLINK_SERIES = [
    "blink:engine_steps_total", "blink:engine_step_tokens_total",
    "blink:engine_heartbeat_age_seconds", "blink:ring_slots_used", "blink:ring_slots_total",
    "blink:ring_arena_tokens_used", "blink:ring_arena_tokens_total",
    "blink:iteration_tokens_total_count", "blink:cache_config_info",
]


def dashboard_series() -> set[str]:
    """Every ``blink:`` series name the repo's dashboard queries."""
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    assert exprs, "the dashboard has no queries"
    return {name for e in exprs for name in re.findall(r"blink:[a-z0-9_]+", e)}


def samples(text: str) -> dict[str, float]:
    """sample name → summed value over the model's label sets (one line per name)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") in (MODEL, "tiny-ring"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def _load(app) -> dict[str, float]:
    """Four engine requests (chat, chat with n=2, completion), then one scrape."""
    for body in ({"messages": MESSAGES, "max_tokens": 6},
                 {"messages": MESSAGES, "max_tokens": 4, "n": 2}):
        r = await asgi_request(app, "POST", "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    r = await asgi_request(app, "POST", "/v1/completions",
                           json={"prompt": "Say hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    return samples((await asgi_request(app, "GET", "/metrics")).text)


@pytest.fixture(scope="module")
def fake_engine_metrics() -> dict[str, float]:
    tok = tiny_tokenizer()
    engine = make_engine(tok, num_cached_tokens=2, queue_time_s=0.002, token_delay_s=0.001)
    return asyncio.run(_load(create_app(engine, tok, model_name=MODEL)))


@pytest.fixture(scope="module")
def ring_metrics() -> dict[str, float]:
    """The real RingEngineClient over a loopback ring served by the ring's fake engine."""
    tok = tiny_tokenizer()
    setup = Setup(max_model_len=128, arena_tokens=512)
    setup.engine.start()
    try:
        async def main() -> dict[str, float]:
            client = RingEngineClient(setup.client, model_name="tiny-ring")
            client.start()
            try:
                app = create_app(client, tok, model_name="tiny-ring")
                return await _load(app)
            finally:
                await client.close()

        return asyncio.run(main())
    finally:
        setup.close()


def test_repo_dashboard_series_are_exported_by_the_ring_client(ring_metrics):
    missing = sorted(dashboard_series() - set(ring_metrics))
    assert not missing, f"the dashboard queries series /metrics does not export: {missing}"


def test_vllm_dashboard_series_are_exported(fake_engine_metrics, ring_metrics):
    for exported in (fake_engine_metrics, ring_metrics):
        missing = sorted(set(VLLM_DASHBOARD_SERIES) - set(exported))
        assert not missing, f"vLLM's dashboard would show no data for {missing}"


@pytest.mark.parametrize("name", PER_REQUEST_HISTOGRAMS)
def test_per_request_histograms_have_data(fake_engine_metrics, ring_metrics, name):
    # 1 + 2 chat choices + 1 completion = 4 engine requests; params_n is per prompt (3).
    want = 3 if name == "blink:request_params_n" else 4
    assert fake_engine_metrics[f"{name}_count"] == want
    assert ring_metrics[f"{name}_count"] == want


def test_blink_series_report_the_engine_and_the_ring(ring_metrics):
    missing = sorted(set(BLINK_SERIES) - set(ring_metrics))
    assert not missing, f"missing Blink series: {missing}"
    assert ring_metrics["blink:engine_steps_total"] > 0
    assert ring_metrics["blink:ring_slots_total"] == 8
    assert ring_metrics["blink:ring_slots_used"] == 0  # all requests finished
    assert ring_metrics["blink:iteration_tokens_total_count"] > 0


def test_request_counters_add_up(fake_engine_metrics):
    m = fake_engine_metrics
    # per token after the first, like the inter-token latency it is (vLLM's older name)
    assert m["blink:time_per_output_token_seconds_count"] == \
        m["blink:inter_token_latency_seconds_count"] > 0
    assert m["blink:request_generation_tokens_sum"] == m["blink:generation_tokens_total"]
    assert m["blink:request_prompt_tokens_sum"] == m["blink:prompt_tokens_total"]
    assert m["blink:prompt_tokens_cached_total"] == 2 * 4
    assert m["blink:request_params_n_sum"] == 1 + 2 + 1
    assert m["blink:request_params_max_tokens_sum"] == 6 + 4 + 4 + 5


def test_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(8192)[-1] == 5000
    tok = tiny_tokenizer()
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    text = asyncio.run(asgi_request(app, "GET", "/metrics")).text
    les = [float(s.labels["le"]) for f in text_string_to_metric_families(text)
           for s in f.samples if s.name == "blink:iteration_tokens_total_bucket"]
    assert les[:-1] == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


# -- the queue time comes from the engine's admission stamp ------------------------------


def test_step_clock_interpolates_between_readings():
    clock = StepClock()
    clock.saw(0, 100.0)
    clock.saw(0, 100.5)  # unchanged: the first reading stands
    clock.saw(10, 101.0)
    assert clock.time_of(0) == 100.0
    assert clock.time_of(5) == pytest.approx(100.5)
    assert clock.time_of(10) == 101.0
    assert clock.time_of(11) is None  # not reached yet
    clock.saw(3, 200.0)  # a restarted engine counts from 0 again
    assert clock.time_of(5) is None and clock.time_of(3) == 200.0


def test_step_clock_cadence_is_the_recent_step_time():
    clock = StepClock()
    assert clock.cadence() is None
    clock.saw(0, 10.0)
    assert clock.cadence() is None  # one reading: no interval yet
    for step in range(1, 9):
        clock.saw(step, 10.0 + 0.025 * step)
    assert clock.cadence() == (pytest.approx(10.2), pytest.approx(0.025))
    clock.saw(9, 12.2)  # one 2 s step (a long prefill): the median stands
    assert clock.cadence()[1] == pytest.approx(0.025)
    clock.saw(19, 12.3)  # ten steps seen at once: 10 ms each, faster: taken at once
    assert clock.cadence() == (12.3, pytest.approx(0.01))


def _poller(clock: StepClock, *, active: bool = True, masks: bool = False, align: bool = True):
    """What RingEngineClient._poll_delay reads, with the defaults' numbers."""
    return SimpleNamespace(step_clock=clock, align_to_steps=align, align_min_step_s=ALIGN_MIN_STEP_S,
                           align_max_sleep_s=0.1, poll_min_interval_s=2e-4, doorbell=None, _line=[],
                           ring=SimpleNamespace(active=[object()] if active else [], masks_pending=masks))


def test_the_poller_sleeps_until_just_before_the_step_is_due():
    clock = StepClock()
    for step in range(5):
        clock.saw(step, 1.0 + 0.02 * step)  # 20 ms steps; the count last moved at 1.08
    delay = functools.partial(RingEngineClient._poll_delay, _poller(clock))
    assert delay(2e-4, 1.0805) == pytest.approx(0.098 - 0.0805)  # asleep until due - 2 ms
    assert delay(4e-4, 1.0985) == pytest.approx(0.02 / 40)  # fine ticks around due (1.10)
    assert delay(8e-4, 1.1015) == pytest.approx(0.02 / 40)
    assert delay(3.2e-3, 1.103) == 3.2e-3  # past due + 2 ms: a longer step, the backoff again
    for off in (_poller(clock, align=False), _poller(clock, masks=True), _poller(clock, active=False)):
        assert RingEngineClient._poll_delay(off, 2e-4, 1.0805) == 2e-4
    fast = StepClock()
    fast.saw(0, 1.0)
    fast.saw(10, 1.01)  # 1 ms steps (a GPU loop): the backoff's ticks
    assert RingEngineClient._poll_delay(_poller(fast), 2e-4, 1.0101) == 2e-4
    small = StepClock()
    small.saw(0, 1.0)
    small.saw(1, 1.005)  # 5 ms steps (a small model on a CPU shared with the frontend): the backoff's too
    assert RingEngineClient._poll_delay(_poller(small), 4e-4, 1.0051) == 4e-4
    slow = StepClock()
    slow.saw(0, 1.0)
    slow.saw(1, 3.0)  # 2 s steps: asleep 0.1 s at most at a time
    assert RingEngineClient._poll_delay(_poller(slow), 2e-4, 3.0) == 0.1


def test_admission_time_is_the_engines_step_not_the_poll():
    """The poller saw the slot admitted only at t=20, but the engine stamped step 6, which
    began when the count reached 5, which its step clock places at t=14: the queue time is
    4 s, not 10 s; bounded by the submission and the observation."""
    clock = StepClock()
    clock.saw(0, 9.0)
    clock.saw(10, 19.0)
    client = SimpleNamespace(step_clock=clock)
    handle = RingHandle(0, 1, 1, 0, None, submitted_at=10.0, claimed_at=20.0, admitted_step=6)
    assert RingEngineClient._admitted_at(client, handle) == pytest.approx(14.0)
    handle.admitted_step = 1  # before the submission by the clock: clamped to it
    assert RingEngineClient._admitted_at(client, handle) == 10.0
    handle.admitted_step = 99  # the clock has no answer yet: what the poller saw
    assert RingEngineClient._admitted_at(client, handle) == 20.0


def test_scheduler_stamps_the_admission_step():
    """Scheduler._admit writes the step's number into the slot's admitted_step; the control
    block publishes that number as C_STAT_STEPS when the step ends (the frontend's clock)."""
    from blink.engine.sched.scheduler import Scheduler
    from blink.engine.sched.state import ring_tensors

    ring = make_scheduler_ring(2, 32, 8)
    sched = Scheduler(_cfg(), ring_tensors(ring))
    model, fe = FakeModel(sched.config, 2), Frontend(ring)
    stamps = {}
    reqs = [Req(prompt=[1, 2, 3], max_tokens=6), Req(prompt=[4, 5], max_tokens=2)]
    fe.submit(reqs[0])
    for step in range(1, 7):
        if step == 4:
            fe.submit(reqs[1])
        written = [int(s) for s in (ring.state == SLOT_WRITTEN).nonzero()[0]]
        batch = sched.schedule()
        sched.update(batch, *model(sched, batch))
        assert int(ring.control[C_STAT_STEPS]) == step  # published by the step's end
        for slot in written:
            assert ring.state[slot] != SLOT_WRITTEN
            stamps[slot] = int(ring.admitted_step[slot])
        fe.poll()
    assert sorted(stamps.values()) == [1, 4]


def test_queue_time_of_a_waiting_request_through_the_ring():
    """End to end over the ring: a request the engine leaves in WRITTEN for 0.3 s reports
    that wait, and its admission lies between its submission and the poller's observation."""
    setup = Setup()
    setup.engine.admit = False
    setup.engine.start()
    try:
        async def main():
            from blink.shared.sampling_params import SamplingParams

            client = RingEngineClient(setup.client, model_name="m")
            client.start()
            t0 = time.monotonic()
            gen = client.generate("q", [1, 2], SamplingParams(max_tokens=3))
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.3)
            setup.engine.admit = True
            out = await asyncio.wait_for(first, 5)
            async for _ in gen:
                pass
            await client.close()
            return t0, out

        t0, out = asyncio.run(main())
        assert 0.25 <= out.queue_time_s < 2.0
        assert t0 <= out.admitted_at <= t0 + 2.0
    finally:
        setup.close()
