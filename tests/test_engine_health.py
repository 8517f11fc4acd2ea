"""The engine-health state machine (blink.dpu.engine_health) on its own: the transition table,
what each state means for /health and admission, and how a read of the control block at a
given time is classified (stale heartbeat, hard limit, state words, gone). The same machine
through the ring client and the app: tests/test_ring_client.py, tests/test_engine_reconnect.py."""
from __future__ import annotations

import pytest

from blink.dpu.engine_health import EngineHealth, HeartbeatWatch, Observation, next_health
from blink.ring import ENGINE_DRAINING, ENGINE_FAILED, ENGINE_READY, ENGINE_STARTING, ENGINE_STOPPED

H, O = EngineHealth, Observation

# (state, observation) -> next state, for every pair. Columns: what one look at the engine found.
COLUMNS = (O.BEATING_READY, O.BEATING_STARTING, O.BEATING_DRAINING, O.STALE, O.STALE_PAST_LIMIT,
           O.GONE, O.CLOSED)
TABLE = {
    H.STARTING: (H.HEALTHY, H.STARTING, H.DRAINING, H.STALLED, H.UNRESPONSIVE, H.DEAD, H.CLOSED),
    H.HEALTHY: (H.HEALTHY, H.STARTING, H.DRAINING, H.STALLED, H.UNRESPONSIVE, H.DEAD, H.CLOSED),
    H.STALLED: (H.HEALTHY, H.STARTING, H.DRAINING, H.STALLED, H.UNRESPONSIVE, H.DEAD, H.CLOSED),
    # past the hard limit, only a heartbeat move brings it back (stale again stays unresponsive)
    H.UNRESPONSIVE: (H.HEALTHY, H.STARTING, H.DRAINING, H.UNRESPONSIVE, H.UNRESPONSIVE, H.DEAD, H.CLOSED),
    H.DRAINING: (H.HEALTHY, H.STARTING, H.DRAINING, H.STALLED, H.UNRESPONSIVE, H.DEAD, H.CLOSED),
    # dead is final for a ring client (only closing it changes it)
    H.DEAD: (H.DEAD, H.DEAD, H.DEAD, H.DEAD, H.DEAD, H.DEAD, H.CLOSED),
    # the reconnecting client's state between engines; a ring client is never in it
    H.RESTARTING: (H.HEALTHY, H.STARTING, H.DRAINING, H.STALLED, H.UNRESPONSIVE, H.DEAD, H.CLOSED),
    H.CLOSED: (H.CLOSED,) * 7,
}
CASES = [(state, obs, nxt) for state, row in TABLE.items() for obs, nxt in zip(COLUMNS, row)]


def test_the_table_covers_every_state_and_observation():
    assert set(TABLE) == set(EngineHealth) and set(COLUMNS) == set(Observation)
    assert len(CASES) == len(EngineHealth) * len(Observation)


@pytest.mark.parametrize("state,obs,expected", CASES, ids=lambda x: getattr(x, "name", x))
def test_transition(state, obs, expected):
    assert next_health(state, obs) is expected


def test_what_each_state_means():
    assert {s for s in H if s.healthy} == {H.HEALTHY}  # /health 200
    assert {s for s in H if s.accepting} == {H.HEALTHY, H.STALLED}  # a stall queues requests
    assert {s for s in H if s.final} == {H.DEAD, H.CLOSED}


def watch(hb: float = 1.0, dead: float = 10.0, state: int = ENGINE_READY) -> HeartbeatWatch:
    return HeartbeatWatch(hb, dead, engine_state=state, heartbeat=0, now=100.0)


def test_classify_a_moving_and_a_still_heartbeat():
    w = watch()
    assert w.classify(100.5, in_flight=0)[0] is O.BEATING_READY
    obs, reason = w.classify(101.5, in_flight=0)
    assert obs is O.STALE and "stale for 1.5 s (timeout 1 s) with no request in flight" in reason
    obs, reason = w.classify(101.5, in_flight=3)
    assert obs is O.STALE and "with 3 requests in flight" in reason
    obs, reason = w.classify(110.5, in_flight=3)
    assert obs is O.STALE_PAST_LIMIT and "limit 10 s, --engine-dead-timeout" in reason
    w.saw(ENGINE_READY, 1, 110.6)  # the counter moved
    assert w.classify(110.7, in_flight=3)[0] is O.BEATING_READY
    w.saw(ENGINE_READY, 1, 111.0)  # read again, not moved: still judged from 110.6
    assert w.still_for(111.0) == pytest.approx(0.4)


def test_requests_are_judged_from_when_they_came():
    w = watch(hb=1.0, dead=10.0)
    w.became_busy(100.9)  # the heartbeat was seen 0.9 s ago: not stale yet
    assert w.classify(101.5, in_flight=1)[0] is O.BEATING_READY  # 0.6 s since the request
    assert w.classify(101.5, in_flight=0)[0] is O.STALE  # idle: 1.5 s since the move
    assert w.classify(102.0, in_flight=1)[0] is O.STALE
    w2 = watch()
    w2.became_busy(102.0)  # already stale then: no fresh start
    assert w2.classify(102.0, in_flight=1)[0] is O.STALE


@pytest.mark.parametrize("word,obs", [(ENGINE_READY, O.BEATING_READY),
                                      (ENGINE_STARTING, O.BEATING_STARTING),
                                      (ENGINE_DRAINING, O.BEATING_DRAINING),
                                      (ENGINE_FAILED, O.GONE), (ENGINE_STOPPED, O.GONE)])
def test_classify_state_words(word, obs):
    assert watch(state=word).classify(100.1, in_flight=0)[0] is obs


def test_gone_wins_over_staleness_and_the_state_word_over_gone():
    w = watch()
    assert w.classify(150.0, 1, gone="the engine process has exited") == (
        O.GONE, "the engine process has exited")
    w.saw(ENGINE_FAILED, 0, 150.0)
    assert w.classify(150.0, 1, gone="the engine process has exited") == (O.GONE, "engine state is failed")


def test_observe_applies_and_reports_transitions_once():
    w = watch(hb=1.0, dead=10.0)
    assert w.state is H.STARTING
    t = w.observe(100.1, in_flight=0)
    assert (t.old, t.new, t.reason) == (H.STARTING, H.HEALTHY, None) and w.state is H.HEALTHY
    assert w.observe(100.2, in_flight=0) is None  # no change, nothing to act on
    t = w.observe(101.5, in_flight=2)
    assert t.new is H.STALLED and "2 requests in flight" in t.reason
    assert w.observe(105.0, in_flight=2) is None and "1.5 s" in w.reason  # the reason of the entry
    t = w.observe(111.0, in_flight=2)
    assert (t.old, t.new) == (H.STALLED, H.UNRESPONSIVE) and t.lasted_s == pytest.approx(9.5)
    w.saw(ENGINE_READY, 5, 112.0)
    t = w.observe(112.0, in_flight=2)
    assert (t.old, t.new, t.lasted_s) == (H.UNRESPONSIVE, H.HEALTHY, pytest.approx(1.0))
    t = w.apply(O.GONE, "the ring poller failed: boom", 113.0)
    assert t.new is H.DEAD and w.reason == "the ring poller failed: boom"
    w.saw(ENGINE_READY, 6, 114.0)
    assert w.observe(114.0, in_flight=0) is None and w.state is H.DEAD  # final
    assert w.apply(O.CLOSED, "closed", 115.0).new is H.CLOSED
