"""The tensor-code scheduler against its oracle, the per-request Python scheduler
(blink/engine/sched/reference.py): both driven by the same arrivals, cancels, stream reads
and sampled tokens, and compared step by step: which rows run and how many tokens each gets,
which rows sample, every row's status and token / computed / block counts, the free pool,
preemptions, and every finish reason. Both policies: fcfs (the default) and priority
(``--scheduling-policy priority``: random request priorities)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
import test_scheduler as ts  # noqa: E402

from blink.engine.sched import reference  # noqa: E402
from blink.engine.sched.scheduler import Scheduler  # noqa: E402
from blink.engine.sched.state import (  # noqa: E402
    INT64_MAX,
    K_PREEMPTIONS,
    K_PREFIX_HITS,
    ROW_EMPTY,
    ROW_RELEASING,
    ROW_RUNNING,
    ROW_WAITING,
    ring_tensors,
)

_STATUS = {ROW_WAITING: reference.WAITING, ROW_RUNNING: reference.RUNNING, ROW_RELEASING: reference.RELEASING}


def _rows(sched: Scheduler) -> list[tuple]:
    st = sched.state
    return [None if int(st.status[i]) == ROW_EMPTY else
            (_STATUS[int(st.status[i])], int(st.num_tokens[i]), int(st.num_computed[i]), int(st.num_blocks[i]))
            for i in range(sched.num_slots)]


def _ref_rows(ref: reference.ReferenceScheduler) -> list[tuple]:
    return [None if r is None else (r.status, r.num_tokens, r.num_computed, len(r.blocks)) for r in ref.rows]


def _same_state(sched: Scheduler, ref: reference.ReferenceScheduler, what: str) -> None:
    st, N = sched.state, sched.config.num_blocks
    assert _rows(sched) == _ref_rows(ref), f"{what}: rows differ\n{_rows(sched)}\n{_ref_rows(ref)}"
    assert int((st.block_ref[:N] == 0).sum()) == ref.num_free_blocks(), f"{what}: free blocks differ"
    assert int(st.counters[K_PREEMPTIONS]) == ref.preemptions, f"{what}: preemptions differ"
    # The priority policy's urgency register (inert under fcfs: never written).
    urgent = INT64_MAX if ref.urgent_priority is None else ref.urgent_priority
    assert (int(st.urgent_priority), int(st.urgent_age)) == (urgent, ref.urgent_age), f"{what}: urgency register"


def drive(reqs: list[ts.Req], cfg, n_slots: int = 4, stream_capacity: int = 4, rate: int = 1 << 30,
          stall_every: int = 0, arena_tokens: int | None = None, host_guards: bool = True,
          max_steps: int = 1500) -> tuple[Scheduler, reference.ReferenceScheduler]:
    """Run ``reqs`` through ring + scheduler + fake model and through the reference, side by
    side, comparing every step."""
    ring = ts.make_ring(n_slots, cfg.max_model_len, stream_capacity, arena_tokens)
    sched = Scheduler(cfg, ring_tensors(ring), host_guards=host_guards)
    ref = reference.ReferenceScheduler(cfg, n_slots, stream_capacity)
    model = ts.FakeModel(cfg, n_slots)
    fe = ts.Frontend(ring, rate, stall_every)
    pending = sorted(reqs, key=lambda r: r.submit_step)
    queue: list[ts.Req] = []
    by_req: dict[int, reference.Request] = {}
    step = 0
    while len(fe.done) < len(reqs) or any(r is not None for r in ref.rows):
        assert step < max_steps, f"no progress after {step} steps"
        while pending and pending[0].submit_step <= step:
            queue.append(pending.pop(0))
        while queue and fe.submit(queue[0]):
            req = queue.pop(0)
            priority = getattr(req, "priority", 0)  # set on a ts.Req by the priority tests
            ring.priority[req.slot] = priority  # (before the scheduler's next step reads the slot)
            by_req[id(req)] = r = reference.Request(
                slot=req.slot, arrival=req.arrival, prompt=list(req.prompt), max_tokens=req.max_tokens,
                min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop_ids=tuple(req.stop_ids),
                priority=priority)
            ref.add(r)
        for req in reqs:
            if req.cancel_step == step and req.slot >= 0 and req.finish is None:
                fe.cancel(req)
                ref.cancel(req.slot)
        for r in ref.rows:  # what the frontend has read of each stream
            if r is not None:
                r.consumed = int(ring.consumed[r.slot])

        batch = sched.schedule()
        num_new = ref.schedule()
        got = batch.num_new_tokens.tolist()
        got += [0] * (n_slots - len(got))
        assert {i: n for i, n in enumerate(got) if n} == num_new, f"step {step}: tokens per row differ"
        _same_state(sched, ref, f"step {step} after schedule")
        n_sample = int(batch.num_sample_rows)
        rows = batch.sample_rows[:n_sample].tolist()
        assert rows == ref.sample_rows(num_new), f"step {step}: sample rows differ"

        if n_sample or int(batch.num_scheduled_tokens):
            out = model(sched, batch)
            sched.update(batch, *out)
            ref.update(num_new, {row: int(tok) for row, tok in zip(rows, out[0][:n_sample].tolist())})
            _same_state(sched, ref, f"step {step} after update")
        fe.poll()
        step += 1
    for req in reqs:  # the same finishes (the frontend saw the ring's)
        if id(req) in by_req:
            assert req.finish == by_req[id(req)].finish, f"finish of {req.prompt}"
    assert len(ref.finished) == len(by_req)
    return sched, ref


def test_tiny_pool_agrees_step_by_step():
    rng = np.random.default_rng(0)
    cfg = ts._cfg(num_blocks=10, enable_prefix_caching=False)
    _, ref = drive(ts._random_reqs(rng, 12, cfg.max_model_len), cfg)
    assert ref.preemptions > 0  # the pool is small enough to preempt


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts.scenarios())
def test_random_workloads_agree_with_the_reference(scenario):
    """The property test's workloads (tiny pools: preemption; tiny streams and slow
    clients: backpressure; cancels; invalid prompts; the smallest windows) without prefix
    caching: the two schedulers agree at every step."""
    cfg, reqs, env, _ = scenario
    drive(reqs, dataclasses.replace(cfg, enable_prefix_caching=False), **env)


@pytest.mark.parametrize("seed", range(6))
def test_prefix_caching_agrees_while_nothing_is_evicted(seed):
    """Prefix caching, in a pool large enough that no cached block is evicted (which of two
    equally old cached blocks goes first is the tensor code's choice) and a probe window
    wide enough that the table always has room: the same hits, step by step."""
    rng = np.random.default_rng(seed)
    base = ts._cfg(max_admit_per_step=int(rng.integers(1, 4)))
    cfg = dataclasses.replace(base, num_blocks=12 * base.max_blocks_per_seq, prefix_probes=64)
    reqs = ts._random_reqs(rng, 10, cfg.max_model_len, shared=16)
    sched, _ = drive(reqs, cfg, n_slots=int(rng.integers(1, 6)))
    assert int(sched.state.counters[K_PREFIX_HITS]) > 0 or seed  # seed 0 shares prefixes


# ----------------------------------------------------------------------------- priority policy


def _with_priorities(reqs: list[ts.Req], priorities) -> list[ts.Req]:
    for req, p in zip(reqs, priorities):
        req.priority = int(p)  # read by drive()
    return reqs


def test_priority_tiny_pool_agrees_step_by_step():
    rng = np.random.default_rng(0)
    cfg = ts._cfg(num_blocks=10, enable_prefix_caching=False, scheduling_policy="priority",
                  priority_other_prefill_tokens=3)
    reqs = _with_priorities(ts._random_reqs(rng, 12, cfg.max_model_len), rng.integers(-3, 3, 12))
    _, ref = drive(reqs, cfg)
    assert ref.preemptions > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts.scenarios(), hst.lists(hst.integers(-3, 3), min_size=10, max_size=10), hst.integers(1, 24),
       hst.integers(1, 12))
def test_priority_random_workloads_agree_with_the_reference(scenario, priorities, other_prefill, window):
    """The property test's workloads under the priority policy with random priorities
    (few values: many ties, so arrival breaks them), prefill bounds (from 1 token to past
    the budget) and urgency windows (short: the register expires within the workloads): the
    two schedulers agree at every step, the urgency register included."""
    cfg, reqs, env, _ = scenario
    cfg = dataclasses.replace(cfg, enable_prefix_caching=False, scheduling_policy="priority",
                              priority_other_prefill_tokens=other_prefill,
                              priority_urgent_window_steps=window)
    drive(_with_priorities(reqs, priorities), cfg, **env)


def urgent_waves(window: int = 5) -> tuple[list[ts.Req], object]:
    """Low-priority (10) requests with long prompts arriving throughout, and urgent (0) ones
    in two waves far enough apart that the urgency register (window ``window``) expires
    between them, then a priority-5 request once it has: the register is set, ages, expires
    to the live rows' most urgent priority, is set again, and holds a middle level."""
    rng = np.random.default_rng(7)
    cfg = ts._cfg(num_blocks=40, max_model_len=32, max_num_batched_tokens=24, max_admit_per_step=3,
                  enable_prefix_caching=False, scheduling_policy="priority",
                  priority_other_prefill_tokens=3, priority_urgent_window_steps=window)
    reqs = []
    for submit, priority, length, max_tokens in [
            (0, 10, 20, 10), (0, 10, 18, 10), (1, 0, 6, 2), (4, 10, 22, 6), (9, 10, 20, 4),
            (24, 0, 5, 2), (26, 10, 21, 5), (40, 5, 19, 3), (41, 10, 20, 3)]:
        req = ts.Req(prompt=rng.integers(1, ts.VOCAB, length).tolist(), max_tokens=max_tokens,
                     ignore_eos=True, submit_step=submit)
        req.priority = priority
        reqs.append(req)
    return reqs, cfg


def test_priority_urgency_register_agrees_step_by_step(monkeypatch):
    """The urgency register through urgent arrivals, ageing, expiry after W steps and a
    new urgent wave (urgent_waves): the tensor code's register, tokens and blocks equal the
    reference's at every step (drive compares the register too)."""
    reqs, cfg = urgent_waves()
    seen: list[tuple[int | None, int]] = []
    orig = reference.ReferenceScheduler._track_urgent

    def track(self, queue):
        orig(self, queue)
        seen.append((self.urgent_priority, self.urgent_age))
    monkeypatch.setattr(reference.ReferenceScheduler, "_track_urgent", track)
    drive(reqs, cfg, n_slots=5, stream_capacity=8)
    levels = [p for p, _ in seen]
    assert (0, cfg.priority_urgent_window_steps) in seen  # aged the whole window
    first_expiry = levels.index(10, levels.index(0))
    assert 0 in levels[first_expiry:] and 5 in levels  # set again, and a middle level


@pytest.mark.parametrize("seed", range(8))
def test_priority_prefix_caching_agrees_while_nothing_is_evicted(seed):
    """Prefix caching under the priority policy (lookups in the queue order too)."""
    rng = np.random.default_rng(100 + seed)
    base = ts._cfg(max_admit_per_step=int(rng.integers(1, 4)), scheduling_policy="priority",
                   priority_other_prefill_tokens=int(rng.integers(1, 8)))
    cfg = dataclasses.replace(base, num_blocks=12 * base.max_blocks_per_seq, prefix_probes=64)
    reqs = _with_priorities(ts._random_reqs(rng, 10, cfg.max_model_len, shared=16), rng.integers(-2, 3, 10))
    drive(reqs, cfg, n_slots=int(rng.integers(1, 6)))


def test_priority_policy_with_zero_priorities_is_fcfs():
    """Every priority 0 and the prefill bound at the token budget (so it never binds): the
    priority policy schedules exactly as fcfs (same steps, same preemptions)."""
    rng = np.random.default_rng(3)
    cfg = ts._cfg(num_blocks=10, enable_prefix_caching=False)
    cfg = dataclasses.replace(cfg, priority_other_prefill_tokens=cfg.max_num_batched_tokens)
    runs = []
    for policy in ("fcfs", "priority"):
        reqs = ts._random_reqs(np.random.default_rng(3), 12, cfg.max_model_len)
        _, ref = drive(reqs, dataclasses.replace(cfg, scheduling_policy=policy))
        runs.append((ref.preemptions, [(r.slot, r.arrival, r.finish, r.tokens) for r in ref.finished]))
    assert runs[0] == runs[1]
    del rng
