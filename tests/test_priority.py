"""Priority scheduling (issue 33 item 3; vLLM's ``--scheduling-policy priority`` and the
request field ``priority``, lower = served first, ties by arrival).

- The flag: declared once (blink.engine_options), reaches the scheduler's config, the
  ``blink engine`` children of ``blink serve`` and its frontend.
- The tensor-code scheduler (its agreement with the reference, step by step, is in
  tests/test_scheduler_reference.py; the fused one's in tests/test_scheduler_fused.py): a
  later, more urgent request is admitted and served before queued less urgent ones and
  preempts the least urgent running row when blocks run out; one large prefill per step;
  while urgent work was seen in the last W steps a less urgent first prompt is capped too
  (the urgency register), whole again after W steps; low prefills keep progressing.
- The frontend: ``priority`` other than 0 is a 400 under fcfs, passed through the ring under
  priority (also a 400 when it does not fit 32 bits).
- End to end through the app, the ring and the engine (tiny random model): with the engine
  saturated by low-priority streams, a high-priority request's first token comes before the
  first token of every low-priority request still queued when it was sent, and every
  low-priority request still finishes.
- Capture-clean: the captured step (tier A simulated on CPU) under the priority policy with a
  preempting priority workload holds only capturable ops.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
import test_scheduler as ts  # noqa: E402
from dpu_helpers import ring_frontend  # noqa: E402
from test_scheduler_reference import drive  # noqa: E402

tsr_drive = drive

from blink.cli import parse_args  # noqa: E402
from blink.launcher import engine_child_argv, engine_config_from_args, frontend_args  # noqa: E402
from blink.shared.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402


# ----------------------------------------------------------------------------- the flag


def test_the_flag_reaches_the_scheduler_the_engine_children_and_the_frontend():
    args = parse_args(["serve", "--scheduling-policy", "priority"])
    config = engine_config_from_args(args)
    assert config.scheduling_policy == "priority"
    sched = config.scheduler_config(num_blocks=64, max_model_len=256, eos_token_ids=[])
    assert sched.scheduling_policy == "priority"
    argv = engine_child_argv(args)
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    child = engine_config_from_args(parse_args(["engine", *argv]))
    assert child.scheduling_policy == "priority"
    front = frontend_args(args, "127.0.0.1:1")
    assert front[front.index("--scheduling-policy") + 1] == "priority"
    from blink.dpu.app import app_options

    assert app_options(parse_args(front))["scheduling_policy"] == "priority"  # the frontend's
    default = engine_config_from_args(parse_args(["serve"]))
    assert default.scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--scheduling-policy", "lottery"])


def test_priority_must_fit_32_bits():
    SamplingParams(priority=-5)
    with pytest.raises(SamplingParamsError, match="priority"):
        SamplingParams(priority=2**31)


# ----------------------------------------------------------------------------- the scheduler


def _first_steps(reqs, cfg, **env) -> dict[int, int]:
    """Drive ``reqs`` (checked against the reference at every step) and return, per request
    index, the step of its first sampled token."""
    first: dict[int, int] = {}
    orig = ts.Frontend.poll

    def poll(self):
        orig(self)
        for i, r in enumerate(reqs):
            if r.out and i not in first:
                first[i] = self.polls
    ts.Frontend.poll = poll
    try:
        _, ref = drive(reqs, cfg, **env)
    finally:
        ts.Frontend.poll = orig
    return first, ref


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_urgent_request_jumps_the_queue_and_preempts(policy):
    """Four slots, a pool of 10 blocks of 4 (one max-length sequence is 8): three long
    low-priority requests saturate it, then an urgent one arrives. Under priority it gets
    its first token before the queued low ones and preempts a running one; under fcfs it
    waits its turn. Every request finishes either way."""
    import dataclasses

    cfg = ts._cfg(num_blocks=10, enable_prefix_caching=False, max_num_batched_tokens=8,
                  scheduling_policy=policy)
    rng = np.random.default_rng(1)
    reqs = [ts.Req(prompt=rng.integers(1, ts.VOCAB, 14).tolist(), max_tokens=12, ignore_eos=True)
            for _ in range(3)]
    urgent = ts.Req(prompt=rng.integers(1, ts.VOCAB, 6).tolist(), max_tokens=3, ignore_eos=True,
                    submit_step=6)
    reqs.append(urgent)
    for r in reqs[:3]:
        r.priority = 5
    urgent.priority = -1
    first, ref = _first_steps(reqs, dataclasses.replace(cfg), n_slots=4)
    assert all(r.finish is not None for r in reqs)
    queued = [i for i in range(3) if first[i] > urgent.submit_step]  # no token yet when it came
    assert queued, "the low-priority requests must still be queued when the urgent one arrives"
    if policy == "priority":
        assert all(first[3] < first[i] for i in queued), first
        assert ref.preemptions > 0
    else:
        assert all(first[3] > first[i] for i in queued), first


def _grant_steps(reqs, cfg, **env) -> list[list[tuple[int, int, int, bool]]]:
    """Drive ``reqs`` (checked against the reference at every step) and return, per step,
    the tokens each row got: (priority, arrival, tokens, prefilling its prompt), in queue
    order."""
    from blink.engine.sched import reference

    steps: list[list[tuple[int, int, int, bool]]] = []
    orig = reference.ReferenceScheduler.schedule

    def schedule(self):
        num_new = orig(self)
        steps.append(sorted((r.priority, r.arrival, num_new[r.slot], r.num_computed < len(r.prompt))
                            for r in self.rows if r is not None and num_new.get(r.slot)))
        return num_new
    reference.ReferenceScheduler.schedule = schedule
    try:
        drive(reqs, cfg, **env)
    finally:
        reference.ReferenceScheduler.schedule = orig
    return steps


def _prefill_steps(reqs, cfg, **env) -> list[list[tuple[int, int, int]]]:
    """:func:`_grant_steps`' prefilling rows only: (priority, arrival, prompt tokens)."""
    return [[(p, arr, n) for p, arr, n, pre in step if pre] for step in _grant_steps(reqs, cfg, **env)]


@pytest.mark.parametrize("bound", [4, 64])
def test_one_large_prefill_per_step_under_the_priority_policy(bound):
    """The bench_priority pattern scaled down: 16 low-priority requests arrive together (the
    closed-loop streams re-arriving after finishing in the same step), then an urgent one
    while they prefill. With ``priority_other_prefill_tokens`` P (4; 64 is past the 64-token
    budget: the bound never binds, the behaviour before it), every step carries the first
    prefilling row's tokens plus at most P other prompt tokens, the urgent request prefills
    whole in a step with no low-priority row at all, and every request finishes."""
    cfg = ts._cfg(num_blocks=400, max_model_len=64, max_num_batched_tokens=64, max_admit_per_step=17,
                  enable_prefix_caching=False, scheduling_policy="priority",
                  priority_other_prefill_tokens=bound)
    rng = np.random.default_rng(2)
    reqs = [ts.Req(prompt=rng.integers(1, ts.VOCAB, 12).tolist(), max_tokens=6, ignore_eos=True)
            for _ in range(16)]
    for r in reqs:
        r.priority = 10
    urgent = ts.Req(prompt=rng.integers(1, ts.VOCAB, 12).tolist(), max_tokens=2, ignore_eos=True,
                    submit_step=2)
    urgent.priority = 0
    steps = _prefill_steps([*reqs, urgent], cfg, n_slots=17, stream_capacity=8)
    assert all(r.finish is not None for r in [*reqs, urgent])
    others = [sum(n for _, _, n in step[1:]) for step in steps]
    urgent_steps = [step for step in steps if any(p == 0 for p, _, _ in step)]
    assert urgent_steps == [[(0, urgent.arrival, 12)]], urgent_steps  # whole, alone
    if bound < cfg.max_num_batched_tokens:
        assert max(others) <= bound, others
    else:  # unbounded: a step fills the budget with low-priority prompts (the old tail)
        assert max(others) > 4, others


def _urgency_cfg(**kw):
    return ts._cfg(**{"num_blocks": 400, "max_model_len": 64, "max_num_batched_tokens": 64,
                      "max_admit_per_step": 4, "enable_prefix_caching": False,
                      "scheduling_policy": "priority", "priority_other_prefill_tokens": 4,
                      "priority_urgent_window_steps": 6, **kw})


def _req(priority: int, length: int, max_tokens: int, submit: int, rng) -> ts.Req:
    req = ts.Req(prompt=rng.integers(1, ts.VOCAB, length).tolist(), max_tokens=max_tokens, ignore_eos=True,
                 submit_step=submit)
    req.priority = priority
    return req


@pytest.mark.parametrize("urgent", [True, False])
def test_a_low_first_prompt_is_capped_while_urgent_was_seen_and_whole_after(urgent):
    """The urgency register (window W = 6 steps, bound P = 4), step by step (drive checks
    the tensor code against the reference): a low prompt A arrives with an urgent request U
    at step 0; U prefills whole and alone, and A, the first prefilling row once U is done, gets
    only P tokens per step while U was seen in the last W steps (the step in flight when the
    next urgent request comes stays short). A low prompt C arriving once the register has
    expired prefills whole in one step, as does A when no urgent request came at all (the
    rule before the register: an all-low workload is unchanged)."""
    rng = np.random.default_rng(4)
    u = _req(0, 8, 2, 0, rng)
    a = _req(10, 20, 30, 0, rng)
    c = _req(10, 20, 2, 14, rng)
    reqs = [u, a, c] if urgent else [a, c]
    steps = _prefill_steps(reqs, _urgency_cfg(), n_slots=4, stream_capacity=64)
    assert all(r.finish is not None for r in reqs)

    def grants(req: ts.Req) -> list[tuple[int, int]]:  # (step, prompt tokens) of its prefill
        return [(i, n) for i, step in enumerate(steps) for p, arr, n in step if arr == req.arrival]

    if urgent:
        assert grants(u) == [(0, 8)]  # whole, in the step that admits it
        # none in U's prefill step, then capped at P while U was seen (steps 0-7)
        assert grants(a) == [(i, 4) for i in range(1, 6)]
    else:
        assert grants(a) == [(0, 20)]
    assert grants(c) == [(14, 20)]  # no urgent work in the last W steps: whole


@pytest.mark.parametrize("prompt", [8, 100])
def test_an_urgent_prompt_prefills_without_less_urgent_rows(prompt):
    """Three low-priority requests decode (and a fourth prefills) when an urgent one arrives:
    every step in which the urgent prompt prefills (one step; three chunks of the 40-token
    budget for a 100-token prompt) carries it alone, no low decode or prefill row; every
    other step serves the low rows, while the urgent one decodes too; all finish. A second
    urgent request prefilling beside the first's decode shares its step with it (the rule
    leaves out only less urgent rows), and with no priority difference (all 10) a prompt
    prefills beside the decode rows as before."""
    rng = np.random.default_rng(7)
    for lows_priority in (10, 0):
        check_the_urgent_prompt_prefills_alone(prompt, lows_priority, rng)


def check_the_urgent_prompt_prefills_alone(prompt: int, lows_priority: int, rng: np.random.Generator) -> None:
    """test_an_urgent_prompt_prefills_without_less_urgent_rows's workload with the low rows at
    ``lows_priority`` (10: less urgent than the prompt; 0: the same priority)."""
    lows = [_req(lows_priority, 6, 40, 0, rng) for _ in range(3)] + [_req(lows_priority, 30, 20, 5, rng)]
    u1, u2 = _req(0, prompt, 12, 8, rng), _req(0, 6, 4, 9, rng)
    reqs = [*lows, u1, u2]
    cfg = _urgency_cfg(max_num_batched_tokens=40, max_model_len=128, max_admit_per_step=1)
    steps = _grant_steps(reqs, cfg, n_slots=6, stream_capacity=64)
    assert all(r.finish is not None for r in reqs)
    arrivals = {r.arrival for r in lows}
    prefill_u1 = [i for i, step in enumerate(steps) for _, arr, _, pre in step if arr == u1.arrival and pre]
    if lows_priority == 10:
        assert len(prefill_u1) == -(-prompt // 40), steps
        for i in prefill_u1:
            assert all(arr not in arrivals for _, arr, _, _ in steps[i]), steps[i]
        decoding_u1 = [i for i, step in enumerate(steps) for _, arr, _, pre in step
                       if arr == u1.arrival and not pre]
        # once u1 decodes (and u2 has prefilled), the low rows are served beside it
        assert any(arr in arrivals for i in decoding_u1[2:] for _, arr, _, _ in steps[i]), steps
        assert any(arr == u2.arrival and pre for i in decoding_u1 for _, arr, _, pre in steps[i])
    else:  # one priority: prompts prefill beside decode rows, as under fcfs
        assert any(any(pre for *_, pre in step) and any(not pre for *_, pre in step) for step in steps)


def test_low_prefills_keep_progressing_while_urgent_work_keeps_arriving():
    """No starvation: six low-priority prompts prefill while urgent requests arrive every
    third step for 60 steps (the register never expires: W = 50). Every step in which a low
    prompt is being prefilled and no urgent one is grants low prefill tokens (the first
    capped row gets its share every such step), at most P of them; a step in which an urgent
    prompt prefills grants the low rows nothing; and every request finishes."""
    rng = np.random.default_rng(5)
    lows = [_req(10, int(rng.integers(24, 31)), 3, 0, rng) for _ in range(6)]
    urgents = [_req(0, 4, 1, step, rng) for step in range(0, 60, 3)]
    cfg = _urgency_cfg(priority_other_prefill_tokens=2, priority_urgent_window_steps=50)
    from blink.engine.sched import reference

    low_prefill: list[tuple[int, int, bool]] = []  # per step: (low rows prefilling, their tokens,
    # an urgent prompt prefilling)
    orig = reference.ReferenceScheduler.schedule

    def schedule(self):
        num_new = orig(self)
        rows = [r for r in self.running if r.priority == 10 and r.num_computed < len(r.prompt)]
        urgent = any(r.priority == 0 and num_new.get(r.slot) and r.num_computed < len(r.prompt)
                     for r in self.running)
        low_prefill.append((len(rows), sum(num_new.get(r.slot, 0) for r in rows), urgent))
        return num_new
    reference.ReferenceScheduler.schedule = schedule
    try:
        tsr_drive([*lows, *urgents], cfg, n_slots=8, stream_capacity=8)
    finally:
        reference.ReferenceScheduler.schedule = orig
    assert all(r.finish is not None for r in [*lows, *urgents])
    busy = [n for rows, n, urgent in low_prefill if rows and not urgent]
    assert len(busy) > 30 and all(1 <= n <= 2 for n in busy), low_prefill
    assert all(n == 0 for rows, n, urgent in low_prefill if urgent), low_prefill


def test_compiled_steps_under_the_priority_policy_are_one_graph_each(monkeypatch):
    """schedule() and update() under the priority policy (the queue order, the prefill
    bound and the urgency register, which expires within the run: W = 3) trace as single
    graphs (torch.compile fullgraph: no host sync, no branch on a tensor value) and give
    every request its expected stream."""
    import torch

    orig = ts.Frontend.submit

    def submit(self, req):
        ok = orig(self, req)
        if ok:
            self.ring.priority[req.slot] = req.priority
        return ok
    monkeypatch.setattr(ts.Frontend, "submit", submit)
    torch._dynamo.reset()
    reqs = ts._random_reqs(np.random.default_rng(6), 6, 32, shared=12)
    for i, req in enumerate(reqs):
        req.priority, req.submit_step = (0, 4 * i) if i % 3 == 0 else (5, i)
    cfg = ts._cfg(num_blocks=10, scheduling_policy="priority", priority_other_prefill_tokens=2,
                  priority_urgent_window_steps=3)
    out = ts.run(reqs, cfg, n_slots=3, stream_capacity=2, compile_steps=True, checks=False)
    ts.check_outcome(out)


def test_step_model_bound_cuts_the_tail_and_keeps_lows_flowing():
    """benchmarks/priority_steps.py (bench_priority's workload on the reference policy with a
    linear step cost): unbounded (the budget), an urgent request's worst wait is a step of
    ~2048 re-arriving low-priority prompt tokens; with the bound but no urgency register, a
    step of one low prompt plus the bound (then its own step: ~2x idle); with the register
    (urgent work every 0.5 s, within the default window), a step of decode rows plus the
    bound; and the low streams produce as many tokens."""
    from benchmarks.priority_steps import simulate

    bound = ts._cfg().priority_other_prefill_tokens
    unbounded = simulate("priority", 2048, seconds=20, urgent_window=0)
    no_register = simulate("priority", bound, seconds=20, urgent_window=0)
    bounded = simulate("priority", bound, seconds=20)  # the default urgency window
    idle = simulate("priority", 32, seconds=20, low_streams=0)
    assert unbounded["max"] > 4 * idle["p99"]  # the old tail: one 2048-token step
    # Without the register the step in flight can still be a whole low prompt (~2x idle);
    # with it, only decode rows and P prompt tokens.
    assert no_register["max"] > 1.8 * idle["p99"], (no_register, idle)
    assert bounded["max"] < 1.7 * idle["p99"], (bounded, idle)
    assert bounded["low_tok_s"] >= 0.95 * unbounded["low_tok_s"] > 0 and bounded["low_done"] > 0


# ----------------------------------------------------------------------------- the frontend


def test_frontend_fcfs_refuses_and_priority_accepts_the_field():
    from dpu_helpers import make_engine, tiny_tokenizer

    from blink.dpu.app import create_app

    tok = tiny_tokenizer()

    async def post(policy: str, body: dict[str, Any]) -> tuple[httpx.Response, Any]:
        engine = make_engine(tok)
        app = create_app(engine, tok, scheduling_policy=policy)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as http:
            return await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                              **body}), engine

    r, _ = asyncio.run(post("fcfs", {"priority": 1}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r, engine = asyncio.run(post("fcfs", {"priority": 0}))
    assert r.status_code == 200
    assert [params.priority for _, params in engine.submitted.values()] == [0]
    r, engine = asyncio.run(post("priority", {"priority": -3}))
    assert r.status_code == 200, r.text
    assert [params.priority for _, params in engine.submitted.values()] == [-3]
    r, _ = asyncio.run(post("priority", {"priority": 2**40}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_responses_api_takes_the_priority_under_the_priority_policy():
    from dpu_helpers import make_engine, tiny_tokenizer

    from blink.dpu.app import create_app

    tok = tiny_tokenizer()

    async def post(policy: str, priority: int) -> httpx.Response:
        app = create_app(make_engine(tok), tok, scheduling_policy=policy)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as http:
            return await http.post("/v1/responses", json={
                "input": "hi", "max_output_tokens": 3, "store": False, "priority": priority})

    r = asyncio.run(post("fcfs", 2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert asyncio.run(post("priority", 2)).status_code == 200
    r = asyncio.run(post("priority", -2**40))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_ring_packing_carries_the_priority():
    from blink.dpu.ring_packing import ring_fields
    from blink.ring import RingConfig

    cfg = RingConfig(n_slots=2, arena_tokens=64, max_model_len=32)
    assert int(ring_fields(SamplingParams(max_tokens=2, priority=-7), 4, 32, cfg)["priority"]) == -7
    assert int(ring_fields(SamplingParams(max_tokens=2), 4, 32, cfg)["priority"]) == 0


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from test_engine import make_llm, tiny_model_dir

    # A KV pool of 12 blocks of 16 for 16 slots: a few 60-token requests fill it.
    with make_llm(tiny_model_dir(tmp_path_factory.mktemp("priority_models")),
                  max_model_len=128, kv_cache_tokens=192, max_num_batched_tokens=64,
                  scheduling_policy="priority") as engine:
        yield engine


def test_end_to_end_a_high_priority_request_goes_before_queued_low_ones(llm):
    from dpu_helpers import ring_frontend

    async def main() -> tuple[dict[str, float], float, set[str], dict[str, str]]:
        first: dict[str, float] = {}
        finish: dict[str, str] = {}
        async with ring_frontend(llm, scheduling_policy="priority") as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=300) as http:
                async def stream(name: str, priority: int, max_tokens: int) -> None:
                    body = {"prompt": f"{name} " + "x" * 40, "max_tokens": max_tokens,
                            "ignore_eos": True, "stream": True, "temperature": 0,
                            "priority": priority}
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200, await r.aread()
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            if name not in first:
                                first[name] = time.monotonic()
                            if '"finish_reason":"' in line.replace(" ", ""):
                                finish[name] = line

                lows = [asyncio.create_task(stream(f"low{i}", 10, 40)) for i in range(8)]
                deadline = time.monotonic() + 120
                # The engine saturated: the first two low-priority streams (what the KV
                # cache holds) are decoding, the others queue for blocks.
                while len(first) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
                sent = time.monotonic()
                queued = {f"low{i}" for i in range(8)} - set(first)
                await stream("high", 0, 4)
                await asyncio.gather(*lows)
        return first, sent, queued, finish

    first, _, queued, finish = asyncio.run(main())
    assert queued, "every low-priority request had started: the engine was not saturated"
    order = sorted(first, key=first.get)  # fcfs gives e.g. low0..low5, high, low6, low7
    assert all(first["high"] < first[name] for name in queued), (order, sorted(queued))
    assert len(finish) == 9, finish  # no starvation: every low-priority request finished


# ----------------------------------------------------------------------------- capture-clean


def test_captured_step_under_the_priority_policy_holds_only_capturable_ops(tmp_path_factory, monkeypatch):
    from test_capture_audit import SMALL
    from test_engine import random_prompts, tiny_model_dir

    from blink import llm as llm_module
    from blink.engine.capture_audit import CaptureAudit, audit
    from blink.engine.factory import create_engine
    from blink.engine.gpu import host_sim
    from blink.ring import C_STAT_PREEMPTIONS

    model = tiny_model_dir(tmp_path_factory.mktemp("priority_audit"), eos_token_id=0)
    mode = CaptureAudit()
    orig_capture = host_sim.EagerRunner.capture
    monkeypatch.setattr(host_sim.EagerRunner, "capture",
                        lambda self, name, fn: orig_capture(self, name, audit(fn, mode)))
    monkeypatch.setattr(llm_module, "create_engine",
                        lambda cfg, loop_=None, **_kw: create_engine(cfg, "host",
                                                                     simulation=host_sim.HostSimulation()))
    prompts = random_prompts(12, 30, 60, seed=4)
    rng = np.random.default_rng(0)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0,
                             priority=int(rng.integers(-2, 3))) for _ in prompts]
    with llm_module.LLM(str(model), **SMALL, scheduling_policy="priority") as llm:
        outs = llm.generate(prompts, params, timeout_s=240)
        preemptions = int(llm._ring.engine_status().control[C_STAT_PREEMPTIONS])
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert preemptions > 0, "the workload must exercise preemption"
    assert "aten.sort.stable" in set(mode.ops) or any("sort" in op for op in mode.ops)
    mode.check("tier A's captured step under the priority policy")


def test_benchmark_smoke(llm):
    """benchmarks/bench_priority.py runs its three phases (tiny sizes: correctness only, no
    timing is asserted)."""
    from benchmarks.bench_priority import run

    async def main():
        async with ring_frontend(llm, scheduling_policy="priority") as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=300) as http:
                return await run(http, model="tiny", low_streams=4, high_requests=3,
                                 high_interval_s=0.02, prompt_words=4, low_max_tokens=6,
                                 high_max_tokens=2, warmup_s=0.1)

    report = asyncio.run(main())
    assert report.high_failed == 0 and report.low_failed == 0
    assert report.idle_ttft_p99_s > 0 and report.saturated_ttft_p99_s > 0
    assert report.low_completed >= 0 and "P99 ratio" in report.text()
    assert report.idle_samples == report.saturated_samples == 3
    assert report.p99_ratio_ci[1] == float("inf") and "not conclusive" in report.text()


def test_benchmark_p99_interval():
    """bench_priority's P99 bounds (order statistics): with too few samples the upper end is
    open (inf); with enough they bracket a known distribution's P99 in about 95% of draws
    (exponential: P99 = ln 100); the ratio's interval brackets the true ratio."""
    import math

    from benchmarks.bench_priority import p99_ratio_ci, quantile_bounds

    rng = np.random.default_rng(0)
    assert quantile_bounds(list(rng.exponential(1, 200)))[1] == math.inf  # 1 - 0.99**200 < 0.975
    true = math.log(100)
    misses = 0
    for _ in range(200):
        lo, hi = quantile_bounds(list(rng.exponential(1, 400)))
        misses += not lo <= true <= hi
    assert misses <= 200 * 0.08, misses  # at most 5% expected
    lo, hi = p99_ratio_ci(list(rng.exponential(1, 2000)), list(3 * rng.exponential(1, 2000)))
    assert lo <= 3 <= hi and hi / lo < 1.5, (lo, hi)
