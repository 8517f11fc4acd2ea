"""The frontend's ring client against a fake engine thread (tests/test_ring_fake_engine.py).

Sync client: arena allocation (hypothesis), submit/poll/cancel, backpressure, full ring, adopting
a previous frontend's slots. Async client: streaming, abort, overload, heartbeat watchdog.
"""
from __future__ import annotations

import asyncio
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.dpu.engine_client import EngineClient, EngineDeadError, EngineOverloadedError
from blink.dpu.engine_health import EngineHealth
from blink.dpu.ring_engine_client import RingEngineClient
from blink.dpu.ring_packing import RingRequestError, ring_fields
from blink.dpu.ring_protocol import ArenaAllocator, RingClient, RingFullError
from blink.shared.sampling_params import SamplingParams
from blink.ring import (
    C_ENGINE_STATE,
    C_STAT_STEPS,
    ENGINE_DRAINING,
    ENGINE_FAILED,
    ENGINE_READY,
    ENGINE_STARTING,
    SLOT_FINISHED,
    SLOT_FREE,
    SLOT_RUNNING,
    SLOT_WRITTEN,
    RingConfig,
    RingLayout,
)
from blink.transport.loopback import LoopbackRegion, LoopbackTransport

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_ring_fake_engine import FakeEngine, make_ring, token_logprob  # noqa: E402


class Setup:
    """A loopback region with a ring, a fake engine (not started) and a frontend client."""

    def __init__(self, **cfg) -> None:
        kw = dict(n_slots=8, arena_tokens=256, stream_capacity=8, max_logprobs=4,
                  max_stop_ids=4, max_logit_bias=4, max_model_len=128)
        kw.update(cfg)
        self.region = LoopbackRegion(RingLayout(RingConfig(**kw)).total_bytes)
        self.ring = make_ring(self.region.buffer, **kw)
        self.engine = FakeEngine(self.ring)
        self.transport = LoopbackTransport(self.region.name, self.region.total_bytes)
        self.client = RingClient(self.transport)

    def close(self) -> None:
        self.engine.stop()
        self.client.close()
        self.region.close()


@pytest.fixture
def setup():
    s = Setup()
    yield s
    s.close()


def drain(client: RingClient, handle, engine: FakeEngine | None = None, limit: int = 500):
    """Poll (stepping the engine by hand when given) until the handle is done."""
    tokens, logprobs, reasons = [], [], []
    for _ in range(limit):
        if engine is not None:
            engine.step()
        delta = client.poll(handle)
        if delta is not None:
            tokens += delta.token_ids
            logprobs += delta.logprobs
            if delta.finish_reason:
                reasons.append(delta.finish_reason)
        if handle.done:
            return tokens, logprobs, reasons
        if engine is None:
            time.sleep(0.001)
    raise AssertionError(f"request did not finish: {handle}")


# -- arena allocator ----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 64), st.integers(0, 1000)), max_size=60),
)
def test_arena_never_overlaps_and_frees_everything(capacity, ops):
    arena = ArenaAllocator(capacity)
    live = []
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            n = min(n, capacity)
            free_before = arena.free
            r = arena.allocate(n)
            assert (r is None) == (n > free_before)
            if r is not None:
                live.append(r)
        else:
            arena.release(live.pop(pick % len(live)))  # any order
        # live ranges, as arena cells, never overlap
        cells = [(r.start + i) % capacity for r in live for i in range(r.length)]
        assert len(cells) == len(set(cells))
        assert 0 <= arena.used <= capacity
        assert sum(r.length for r in live) <= arena.used
        for r in live:
            assert sum(c for _, c in r.segments(capacity)) == r.length
            assert all(0 <= off < capacity for off, _ in r.segments(capacity))
    for r in live:
        arena.release(r)
    assert arena.used == 0 and arena.free == capacity
    assert arena.allocate(capacity) is not None


def test_arena_out_of_order_release_waits_for_the_oldest():
    arena = ArenaAllocator(10)
    a, b, c = arena.allocate(4), arena.allocate(4), arena.allocate(2)
    assert arena.allocate(1) is None
    arena.release(b)
    assert arena.free == 0  # b is behind a: FIFO arena
    arena.release(a)
    assert arena.free == 8
    d = arena.allocate(8)  # wraps around the end
    assert d.segments(10) == [(0, 8)]
    arena.release(c)
    e = arena.allocate(2)
    assert e.segments(10) == [(8, 2)]
    with pytest.raises(ValueError):
        arena.allocate(11)


def test_arena_range_wraps_into_two_segments():
    arena = ArenaAllocator(10)
    arena.release(arena.allocate(7))
    r = arena.allocate(6)
    assert r.segments(10) == [(7, 3), (0, 3)]


# -- SamplingParams -> ring fields ------------------------------------------------------------


def test_ring_fields_conventions():
    cfg = RingConfig(n_slots=4, arena_tokens=256, max_model_len=128, max_stop_ids=2, max_logit_bias=2,
                     max_logprobs=3)
    f = ring_fields(SamplingParams(max_tokens=None, top_k=-1), 10, 128, cfg)
    assert f["max_tokens"] == 118 and f["top_k"] == 0 and f["logprobs"] == 0
    assert 0 <= f["seed"] < 2**63
    assert ring_fields(SamplingParams(seed=7, top_k=5, logprobs=2), 10, 128, cfg)["seed"] == 7
    assert ring_fields(SamplingParams(top_k=5), 10, 128, cfg)["top_k"] == 5
    with pytest.raises(RingRequestError, match="stop_token_ids can hold at most 2"):
        ring_fields(SamplingParams(stop_token_ids=[1, 2, 3]), 10, 128, cfg)
    with pytest.raises(RingRequestError, match="logit_bias can hold at most 2"):
        ring_fields(SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}), 10, 128, cfg)
    with pytest.raises(RingRequestError, match="logprobs can be at most 3"):
        ring_fields(SamplingParams(logprobs=4), 10, 128, cfg)
    with pytest.raises(RingRequestError, match="no room"):
        ring_fields(SamplingParams(max_tokens=None), 128, 128, cfg)
    with pytest.raises(RingRequestError, match="n=2"):
        ring_fields(SamplingParams(n=2), 10, 128, cfg)


# -- the sync client against the fake engine --------------------------------------------------


def test_submit_poll_roundtrip_with_all_fields(setup):
    c, e = setup.client, setup.engine
    h = c.submit(42, [3, 4, 5], max_tokens=5, min_tokens=1, top_k=7, seed=99, logprobs=2,
                 temperature=0.5, stop_token_ids=[100], logit_bias={11: -2.0})
    assert setup.ring.state[h.slot] == SLOT_WRITTEN
    tokens, logprobs, reasons = drain(c, h, e)
    assert tokens == [3, 4, 5, 3, 4] and reasons == ["length"]
    assert logprobs == pytest.approx([token_logprob(t) for t in tokens])
    got = e.claimed[-1]
    assert got["request_id"] == 42 and got["prompt"] == [3, 4, 5] and got["seq"] == h.seq
    assert (got["max_tokens"], got["min_tokens"], got["top_k"], got["seed"], got["logprobs"]) == (5, 1, 7, 99, 2)
    assert got["temperature"] == 0.5 and got["stop_token_ids"] == [100] and got["logit_bias"] == {11: -2.0}
    assert setup.ring.state[h.slot] == SLOT_FREE and h.done
    assert c.free_slots == 8 and c.arena.used == 0


def test_top_logprobs_and_prompt_counts(setup):
    c, e = setup.client, setup.engine
    e.cached_tokens = 2
    h = c.submit(1, [10, 20, 30], max_tokens=3, logprobs=3)
    seen = []
    for _ in range(50):
        e.step()
        d = c.poll(h)
        if d:
            seen.append(d)
        if h.done:
            break
    first = next(d for d in seen if d.token_ids)
    assert first.num_prompt_tokens == 3 and first.num_cached_tokens == 2
    assert [len(top) for top in first.top_logprobs] == [3] * len(first.token_ids)
    assert [tid for tid, _ in first.top_logprobs[0]] == [10, 11, 12]
    assert seen[-1].finish_reason == "length"


def test_stop_token_and_seq_increments_on_reuse(setup):
    c, e = setup.client, setup.engine
    h1 = c.submit(1, [1, 2, 3], max_tokens=10, stop_token_ids=[3])
    assert drain(c, h1, e)[0:3:2] == ([1, 2, 3], ["stop"])
    h2 = c.submit(2, [1, 2, 3], max_tokens=2)
    assert h2.slot == h1.slot and h2.seq == h1.seq + 1  # lowest free slot reused, no ABA
    drain(c, h2, e)


def test_backpressure_long_output_through_small_stream(setup):
    c, e = setup.client, setup.engine
    e.tokens_per_step = 20  # more than the 8-entry stream holds
    h = c.submit(1, list(range(1, 40)), max_tokens=100)
    tokens, _, reasons = drain(c, h, e)
    assert tokens == [(i % 39) + 1 for i in range(100)] and reasons == ["length"]
    assert e.backpressure_waits > 0  # the 8-entry stream filled up; nothing was lost


def test_cancel_finishes_with_abort_and_frees_the_slot(setup):
    c, e = setup.client, setup.engine
    h = c.submit(1, [1], max_tokens=100)
    e.step()
    c.poll(h)
    c.cancel(h)
    c.cancel(h)  # idempotent
    _, _, reasons = drain(c, h, e)
    assert reasons == ["abort"] and c.free_slots == 8
    # Submit does not write cancel: freeing a cancelled slot cleared it, so the slot's next
    # request runs normally.
    assert setup.ring.cancel[h.slot] == 0
    h2 = c.submit(2, [1], max_tokens=2)
    assert h2.slot == h.slot
    _, _, reasons = drain(c, h2, e)
    assert reasons == ["length"]


def test_cancel_before_admission(setup):
    c, e = setup.client, setup.engine
    h = c.submit(1, [1, 2], max_tokens=100)
    c.cancel(h)
    tokens, _, reasons = drain(c, h, e)
    assert tokens == [] and reasons == ["abort"]


def test_request_not_visible_to_the_engine_before_the_state_word(setup):
    """Payload writes land first; the engine, scanning after every single write, never sees a
    WRITTEN slot whose payload is incomplete."""
    c, ring = setup.client, setup.ring
    real_write = setup.transport.write
    snapshots = []

    def spying_write(offset, data):
        real_write(offset, data)
        written = np.flatnonzero(ring.state == SLOT_WRITTEN)
        snapshots.append([(int(s), int(ring.prompt_len[s]), int(ring.max_tokens[s]),
                           int(ring.seed[s]), ring.arena[:3].tolist()) for s in written])

    setup.transport.write = spying_write
    c.submit(5, [7, 8, 9], max_tokens=4, seed=1234)
    assert all(s == [] for s in snapshots[:-1])  # nothing visible until the last write...
    assert snapshots[-1] == [(0, 3, 4, 1234, [7, 8, 9])]  # ...which publishes a complete request


def test_tokens_not_consumed_before_produced_counter(setup):
    c, ring = setup.client, setup.ring
    h = c.submit(1, [1], max_tokens=5)
    setup.engine._claim(h.slot)  # RUNNING, nothing produced yet
    ring.tokens[h.slot, 0] = 77  # a token written, not yet published
    assert c.poll(h) is None
    ring.produced[h.slot] = 1
    d = c.poll(h)
    assert d.token_ids == [77] and ring.consumed[h.slot] == 1


def test_full_ring_raises_after_bounded_wait(setup):
    c = setup.client
    setup.engine.admit = False
    handles = [c.submit(i, [1], max_tokens=1) for i in range(8)]
    assert c.try_submit(9, [1], max_tokens=1) is None
    t0 = time.monotonic()
    with pytest.raises(RingFullError, match="no free request slots"):
        c.submit(9, [1], max_tokens=1, timeout_s=0.05)
    assert time.monotonic() - t0 < 1.0
    setup.engine.admit = True
    drain(c, handles[0], setup.engine)
    assert c.try_submit(9, [1], max_tokens=1) is not None


def test_full_arena_waits_for_claims():
    s = Setup(arena_tokens=128, max_model_len=128)
    try:
        c, e = s.client, s.engine
        e.admit = False
        h1 = c.submit(1, [1] * 100, max_tokens=1)
        assert c.try_submit(2, [2] * 50, max_tokens=1) is None  # only 28 tokens left
        with pytest.raises(RingFullError, match="prompt-arena space for 50 tokens"):
            c.submit(2, [2] * 50, max_tokens=1, timeout_s=0.02)
        e.admit = True
        e.step()  # the engine copies prompt 1 out: its arena range is free again
        h2 = c.try_submit(2, [2] * 50, max_tokens=1)
        assert h2 is not None and h2.arena.segments(128) == [(100, 28), (0, 22)]
        e.step()
        assert e.claimed[-1]["prompt"] == [2] * 50  # read back across the arena's end
        drain(c, h1, e), drain(c, h2, e)
    finally:
        s.close()


def test_bad_prompts_are_refused(setup):
    c = setup.client
    with pytest.raises(RingRequestError, match="non-empty"):
        c.try_submit(1, [], max_tokens=1)
    with pytest.raises(RingRequestError, match="at most 128"):
        c.try_submit(1, [1] * 129, max_tokens=1)
    with pytest.raises(RingRequestError, match=r"\[0, 2\*\*31\)"):
        c.try_submit(1, [-1], max_tokens=1)
    with pytest.raises(RingRequestError, match="stop_token_ids can hold at most 4 ids"):
        c.try_submit(1, [1], max_tokens=1, stop_token_ids=[1, 2, 3, 4, 5])
    assert c.free_slots == 8 and c.arena.used == 0  # nothing was half-written


def test_stream_for_another_sequence_is_a_protocol_error(setup):
    c, ring = setup.client, setup.ring
    h = c.submit(1, [1], max_tokens=3)
    ring.stream_seq[h.slot] = h.seq + 5  # a confused engine
    ring.state[h.slot] = SLOT_RUNNING
    assert c.poll_many([h]) == {}
    assert h.error is not None and "sequence" in str(h.error)
    assert c.arena.used == 0  # the arena is not held hostage


def test_new_frontend_adopts_slots_left_by_a_crashed_one(setup):
    c, e, ring = setup.client, setup.engine, setup.ring
    e.admit = False
    c.submit(1, [1, 2, 3], max_tokens=50)  # stays WRITTEN
    c.submit(2, [4, 5], max_tokens=50)  # stays WRITTEN
    e.admit = True
    e.step()
    running = c.submit(3, [6], max_tokens=50)
    e.step()
    assert ring.state[running.slot] == SLOT_RUNNING
    e.admit = False
    waiting = c.submit(4, [7, 8, 9, 10], max_tokens=50)
    waiting2 = c.submit(6, [11, 12], max_tokens=50)
    finished_slot = c.submit(5, [1], max_tokens=1).slot
    ring.state[finished_slot] = SLOT_FINISHED  # finished, never read
    # The frontend "crashes" (no cleanup) and a new one attaches.
    c2 = RingClient(LoopbackTransport(setup.region.name))
    assert ring.state[finished_slot] == SLOT_FREE
    orphans = {0, 1, running.slot, waiting.slot, waiting2.slot}
    assert {h.slot for h in c2.active} == orphans
    assert all(ring.cancel[s] == 1 for s in orphans)
    # The still-WRITTEN prompt must not be overwritten before the engine copies it.
    assert c2.arena.free == 256 - 6
    e.admit = True
    for _ in range(20):
        e.step()
        c2.poll_many()
    assert c2.active == [] and c2.free_slots == 8 and c2.arena.used == 0
    assert [x["prompt"] for x in e.claimed[-2:]] == [[7, 8, 9, 10], [11, 12]]
    h = c2.submit(9, [1], max_tokens=1)
    assert h.slot == 0 and h.seq == 2  # sequence numbers continue
    assert c2.new_request_id() == 7
    c2.close()


# -- the asyncio EngineClient -------------------------------------------------------------------


def make_async(setup, **kw) -> RingEngineClient:
    return RingEngineClient(setup.client, model_name="fake", heartbeat_timeout_s=kw.pop("hb", 1.0),
                            poll_min_interval_s=1e-4, poll_max_interval_s=1e-3, **kw)


async def collect(agen):
    out = []
    async for o in agen:
        out.append(o)
    return out


def test_async_generate_many_concurrent_requests(setup):
    setup.engine.start()

    async def main():
        client = make_async(setup)
        assert isinstance(client, EngineClient)
        assert client.max_model_len == 128 and client.is_healthy()
        params = SamplingParams(max_tokens=12, logprobs=1, seed=1)
        outs = await asyncio.gather(*(
            collect(client.generate(f"r{i}", [i + 1, i + 2], params)) for i in range(20)
        ))  # 20 requests through 8 slots: the overflow waits for slots
        for i, out in enumerate(outs):
            assert [t for o in out for t in o.token_ids] == [i + 1, i + 2] * 6
            assert out[-1].finished and out[-1].finish_reason == "length"
            assert all(not o.finished for o in out[:-1])
            assert out[0].num_prompt_tokens == 2
            lp = [x for o in out for x in o.logprobs]
            assert lp == pytest.approx([token_logprob(t) for t in [i + 1, i + 2] * 6])
            assert all(len(row) == 1 for o in out for row in o.top_logprobs)
        # The scheduler's running count, exactly: none once an engine step has seen them all
        # finish, two while two requests run (the engine is stepped by hand from here on).
        setup.engine.paused = True
        await asyncio.sleep(0.02)  # a step in progress ends
        setup.engine.step()
        assert client.stats()["running"] == 0
        two = [asyncio.ensure_future(collect(client.generate(f"s{i}", [7], SamplingParams(max_tokens=3))))
               for i in range(2)]
        await wait_for(lambda: (setup.ring.state == SLOT_WRITTEN).sum() == 2, 5, "two requests written")
        setup.engine.step()  # admits both, one token each
        assert client.stats()["running"] == 2
        setup.engine.paused = False
        for out in await asyncio.gather(*two):
            assert [t for o in out for t in o.token_ids] == [7, 7, 7]
        await client.close()

    asyncio.run(main())
    assert setup.ring.state.tolist() == [SLOT_FREE] * 8


async def ticks_and_steps(setup, client: RingEngineClient, max_tokens: int) -> tuple[int, list, int]:
    """One request of ``max_tokens`` through ``client`` (closed after): the poller's ticks,
    the outputs and the engine's steps meanwhile."""
    ticks = 0
    tick = client._tick

    def counted() -> bool:
        nonlocal ticks
        ticks += 1
        return tick()

    client._tick = counted
    steps0 = int(setup.ring.control[C_STAT_STEPS])
    out = await collect(client.generate("r", [5], SamplingParams(max_tokens=max_tokens)))
    steps = int(setup.ring.control[C_STAT_STEPS]) - steps0
    await client.close()
    return ticks, out, steps


def test_the_poller_sleeps_through_each_step_and_still_sees_every_token(setup):
    """With steps of ~20 ms the poller aligned to the step clock ticks a few times per step
    (asleep through the step, fine ticks around its end), far fewer than the backoff alone
    (ticks every 0.1-1 ms here), and each token still arrives on its own, not in bursts."""
    setup.engine.step_sleep_s = 0.02
    setup.engine.start()

    async def run(align: bool) -> tuple[float, int, int]:
        ring = RingClient(LoopbackTransport(setup.region.name, setup.region.total_bytes))
        client = RingEngineClient(ring, model_name="fake", poll_min_interval_s=1e-4,
                                  poll_max_interval_s=1e-3, align_to_steps=align)
        ticks, out, steps = await ticks_and_steps(setup, client, 24)
        return ticks / steps, len(out), sum(len(o.token_ids) for o in out)

    async def main():
        aligned, deltas, tokens = await run(True)
        assert tokens == 24 and deltas >= 20  # (a late tick may see two steps' tokens at once)
        backoff, _, _ = await run(False)
        assert aligned < backoff / 2 and aligned <= 6, (aligned, backoff)

    asyncio.run(main())


def test_async_abort_and_early_exit_free_the_slot(setup):
    setup.engine.step_sleep_s = 1e-3
    setup.engine.start()

    async def main():
        client = make_async(setup)
        params = SamplingParams(max_tokens=1000)
        agen = client.generate("a", [1], params)
        first = await agen.__anext__()
        await client.abort("a")
        await client.abort("a")  # idempotent
        await client.abort("unknown")
        rest = [o async for o in agen]
        assert (rest or [first])[-1].finish_reason == "abort"
        # a consumer that walks away mid-stream: the slot is cancelled and drained
        agen2 = client.generate("b", [2], params)
        await agen2.__anext__()
        await agen2.aclose()
        for _ in range(200):
            if not setup.client.active:
                break
            await asyncio.sleep(0.005)
        assert setup.client.active == [] and setup.client.free_slots == 8
        await client.close()

    asyncio.run(main())


def test_async_overloaded_when_no_slot_frees(setup):
    setup.engine.admit = False
    setup.engine.start()

    async def main():
        client = make_async(setup, submit_timeout_s=0.05, retry_after_s=3.0)
        agens = [client.generate(f"r{i}", [1], SamplingParams(max_tokens=1)) for i in range(8)]
        tasks = [asyncio.ensure_future(a.__anext__()) for a in agens]
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError) as info:
            await client.generate("late", [1], SamplingParams(max_tokens=1)).__anext__()
        assert info.value.retry_after_s == 3.0 and "slots" in str(info.value)
        setup.engine.admit = True
        await asyncio.gather(*tasks)
        await client.close()

    asyncio.run(main())


async def wait_for(cond, timeout_s: float, what: str) -> float:
    """Poll ``cond`` until true; the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


_APPS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


async def health_status(client) -> int:
    """GET /health of the real frontend app over this client (no tokenizer needed), the app
    made once per client (7-24 ms a time, during which the client's poller does not tick)."""
    import httpx

    from blink.dpu.app import create_app

    class NoTokenizer:  # /health never tokenizes; the app only asks for its prompt bound
        def max_prompt_chars(self, max_model_len: int) -> None:
            return None

    app = _APPS.get(client)
    if app is None:
        app = _APPS[client] = create_app(client, NoTokenizer(), model_name="fake")  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return (await c.get("/health")).status_code


async def healthy_again(client, timeout_s: float = 5.0) -> None:
    """/health turns 200 within ``timeout_s``. Where a test's engine is a thread with a 0.2 s
    heartbeat timeout, a loaded host can hold that thread past the timeout once more after it
    resumed, which /health rightly reports (a CI run failed so: 503, "stalled while idle:
    heartbeat stale for 0.6 s", right after the client had seen the heartbeat resume). What
    these tests check is that the health is not final, and that it is 503 during the stall."""
    t0 = time.monotonic()
    while (status := await health_status(client)) != 200:
        assert time.monotonic() - t0 < timeout_s, f"/health still {status} after {timeout_s} s"
        await asyncio.sleep(0.05)


def test_async_stall_under_the_hard_limit_loses_no_stream(setup):
    """One slow engine step (heartbeat stale past heartbeat_timeout_s, under the hard limit):
    /health is 503 meanwhile, but the in-flight stream completes once the engine moves again,
    and a request that arrives during the stall queues and completes too."""
    setup.engine.step_sleep_s = 2e-3
    setup.engine.start()

    async def main():
        client = make_async(setup, hb=0.2, engine_dead_timeout_s=30.0)
        await healthy_again(client)
        agen = client.generate("a", [1, 2], SamplingParams(max_tokens=200))
        first = await agen.__anext__()
        setup.engine.paused = True  # a long step: no heartbeat, no tokens
        stall_s = await wait_for(lambda: client.stalled, 5, "the stall to be noticed")
        assert stall_s < 2.0
        assert not client.is_healthy() and client.is_accepting()
        assert await health_status(client) == 503
        # A request during the stall is taken (it waits in the ring), not refused.
        late = asyncio.ensure_future(collect(client.generate("b", [3], SamplingParams(max_tokens=5))))
        await asyncio.sleep(0.6)  # stay stalled for several heartbeat timeouts
        assert not late.done()
        assert client.stalled and await health_status(client) == 503
        setup.engine.paused = False  # the step ends
        rest = [o async for o in agen]
        outs = [first, *rest]
        assert [t for o in outs for t in o.token_ids] == [1, 2] * 100  # nothing lost
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        late_out = await asyncio.wait_for(late, 5)
        assert [t for o in late_out for t in o.token_ids] == [3] * 5
        assert not client.stalled
        await healthy_again(client)
        await client.close()

    asyncio.run(main())
    assert setup.ring.state.tolist() == [SLOT_FREE] * 8


def test_async_stall_past_the_hard_limit_ends_streams(setup):
    setup.engine.start()

    async def main():
        client = make_async(setup, hb=0.2, engine_dead_timeout_s=0.8)
        agen = client.generate("a", [1], SamplingParams(max_tokens=10_000))
        await agen.__anext__()
        setup.engine.paused = True  # hung engine: heartbeat stops
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="stopped responding.*heartbeat stale.*limit 0.8 s"):
            async for _ in agen:
                pass
        elapsed = time.monotonic() - t0
        assert 0.7 < elapsed < 4.0, elapsed  # the hard limit, not the heartbeat timeout
        assert not client.is_healthy() and not client.is_accepting()
        assert await health_status(client) == 503
        with pytest.raises(EngineDeadError, match="not responding"):
            await client.generate("b", [1], SamplingParams(max_tokens=1)).__anext__()
        # Not final: once the heartbeat moves again, requests are served again.
        setup.engine.paused = False
        await wait_for(client.is_healthy, 5, "the client to recover")
        assert client.is_accepting()
        await healthy_again(client)
        outs = [o async for o in client.generate("c", [1], SamplingParams(max_tokens=2))]
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 2
        await client.close()

    asyncio.run(main())


def test_async_engine_failed_state(setup):
    setup.engine.start()

    async def main():
        client = make_async(setup, hb=5.0, engine_dead_timeout_s=60.0)
        agen = client.generate("a", [1], SamplingParams(max_tokens=10_000))
        await agen.__anext__()
        t0 = time.monotonic()
        setup.engine.fail()
        with pytest.raises(EngineDeadError, match="engine state is failed"):
            async for _ in agen:
                pass
        assert time.monotonic() - t0 < 1.0  # at once, not after a timeout
        assert not client.is_healthy() and not client.is_accepting()
        with pytest.raises(EngineDeadError, match="not available"):
            await client.generate("b", [1], SamplingParams(max_tokens=1)).__anext__()
        await client.close()

    asyncio.run(main())


def test_async_failed_state_during_a_stall_ends_streams_at_once(setup):
    setup.engine.start()

    async def main():
        client = make_async(setup, hb=0.2, engine_dead_timeout_s=60.0)
        agen = client.generate("a", [1], SamplingParams(max_tokens=10_000))
        await agen.__anext__()
        setup.engine.paused = True
        await wait_for(lambda: client.stalled, 5, "the stall to be noticed")
        t0 = time.monotonic()
        setup.engine.fail()  # the engine gives up: final, whatever the timeouts
        with pytest.raises(EngineDeadError, match="engine state is failed"):
            async for _ in agen:
                pass
        assert time.monotonic() - t0 < 1.0
        assert not client.is_healthy() and not client.is_accepting()
        await client.close()

    asyncio.run(main())


def test_async_exited_engine_process_ends_streams_at_once(setup):
    """The transport can tell the engine process is gone (loopback: creator pid and start
    time): dead at once, without waiting for either heartbeat limit."""
    setup.engine.start()

    async def main():
        client = make_async(setup, hb=5.0, engine_dead_timeout_s=10.0)
        agen = client.generate("a", [1], SamplingParams(max_tokens=10_000))
        await agen.__anext__()
        assert setup.transport.peer_alive() is True  # this process created the region
        setup.engine.paused = True
        setup.transport.peer_alive = lambda: False  # as after the engine process exits
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine process has exited"):
            async for _ in agen:
                pass
        assert time.monotonic() - t0 < 2.0
        assert not client.is_healthy() and not client.is_accepting()
        await client.close()

    asyncio.run(main())


def test_engine_timeouts_are_checked(setup):
    with pytest.raises(ValueError, match="at least the heartbeat timeout"):
        make_async(setup, hb=5.0, engine_dead_timeout_s=1.0)
    with pytest.raises(ValueError, match="positive"):
        make_async(setup, hb=0.0)


def test_is_healthy_follows_an_idle_heartbeat(setup):
    async def main():
        client = make_async(setup, hb=0.1)
        assert client.is_healthy()  # state READY, heartbeat just sampled
        time.sleep(0.15)  # no engine steps: heartbeat does not move
        assert not client.is_healthy()
        setup.engine.step()
        assert client.is_healthy()  # idle staleness is not terminal
        setup.ring.control[10] = ENGINE_FAILED
        assert not client.is_healthy()
        await client.close()

    asyncio.run(main())


def test_health_follows_the_engine_state_word(setup):
    """STARTING and DRAINING (heartbeat moving) are neither healthy nor accepting; generate
    refuses with the same state /health reads; READY again is HEALTHY."""
    async def main():
        client = make_async(setup, hb=1.0)
        assert client.health is EngineHealth.HEALTHY
        for word, state in ((ENGINE_DRAINING, EngineHealth.DRAINING),
                            (ENGINE_STARTING, EngineHealth.STARTING)):
            setup.ring.control[C_ENGINE_STATE] = word
            setup.engine.step()
            assert client.health is state and not client.is_healthy() and not client.is_accepting()
            assert await health_status(client) == 503
            with pytest.raises(EngineDeadError, match=f"not ready: the engine is {state.value}"):
                await client.generate("x", [1], SamplingParams(max_tokens=1)).__anext__()
        setup.ring.control[C_ENGINE_STATE] = ENGINE_READY
        setup.engine.step()
        assert client.health is EngineHealth.HEALTHY and client.is_accepting()
        await client.close()
        assert client.health is EngineHealth.CLOSED and not client.is_healthy()
        with pytest.raises(EngineDeadError, match="closed"):
            await client.generate("y", [1], SamplingParams(max_tokens=1)).__anext__()

    asyncio.run(main())


def test_an_idle_heartbeat_past_the_hard_limit_refuses_until_it_moves(setup):
    async def main():
        client = make_async(setup, hb=0.2, engine_dead_timeout_s=0.6)
        time.sleep(0.3)  # no engine steps: the heartbeat does not move
        assert client.health is EngineHealth.STALLED and client.is_accepting()
        time.sleep(0.4)
        assert client.health is EngineHealth.UNRESPONSIVE and not client.is_accepting()
        with pytest.raises(EngineDeadError, match="not responding.*with no request in flight"):
            await client.generate("a", [1], SamplingParams(max_tokens=1)).__anext__()
        setup.engine.step()
        assert client.health is EngineHealth.HEALTHY
        await client.close()

    asyncio.run(main())


def test_queue_time_is_measured_until_the_engine_admits(setup):
    """blink:request_queue_time_seconds from the real client: written → the slot leaves
    WRITTEN (admitted), reported on the first delta only."""
    setup.engine.admit = False  # a busy engine: the request waits in the ring
    setup.engine.start()

    async def main():
        client = make_async(setup)
        task = asyncio.ensure_future(collect(client.generate("q", [1, 2], SamplingParams(max_tokens=4))))
        await wait_for(lambda: (setup.ring.state == SLOT_WRITTEN).sum() == 1, 5, "the request written")
        await asyncio.sleep(0.3)
        setup.engine.admit = True
        out = await asyncio.wait_for(task, 5)
        assert 0.3 <= out[0].queue_time_s < 2.0
        assert all(o.queue_time_s is None for o in out[1:])
        fast = await collect(client.generate("f", [3], SamplingParams(max_tokens=2)))
        assert 0 <= fast[0].queue_time_s < 0.3
        await client.close()

    asyncio.run(main())
