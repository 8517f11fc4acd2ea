"""The engine's health as the frontend sees it: one state, one transition function.

Pure (no I/O, no asyncio, no torch): :class:`HeartbeatWatch` turns what the frontend reads
from the ring's control block (engine state word, heartbeat counter), the clock and the number
of requests in flight into one :class:`Observation`, and :func:`next_health` maps
(state, observation) to the next :class:`EngineHealth`. The ring engine client
(:mod:`blink.dpu.ring_engine_client`) feeds it and acts on the transitions (ending streams,
logging); ``/health``, request admission and the streams' error paths read the state.

The rules (docs/architecture.md, "Engine health"):

- the heartbeat counts as stale after ``heartbeat_timeout_s`` without a move (STALLED:
  ``/health`` 503, in-flight streams keep waiting, new requests are taken and queue in the
  ring), and past ``engine_dead_timeout_s``, the hard limit (UNRESPONSIVE: in-flight streams
  end with ``engine_unavailable``, new requests are refused). With requests in flight the time
  is counted from the later of the last move and the moment the first of them was submitted,
  so an idle stretch the frontend did not watch closely is not held against a new request.
  Neither is final: a heartbeat move makes the engine HEALTHY again.
- an engine state word FAILED/STOPPED, an engine process the transport reports gone, or a
  broken poller: DEAD, final for that ring client.
- a beating engine whose state word is STARTING or DRAINING is STARTING/DRAINING (not
  healthy, not accepting); READY is HEALTHY.
- CLOSED: the client was closed; final, from every state.
- RESTARTING is not reached through :func:`next_health`: it is what
  :class:`~blink.dpu.ring_engine_client.ReconnectingEngineClient` reports while it has no live
  ring client (the last one is DEAD and a new engine has not answered yet).
"""
from __future__ import annotations

import enum
from typing import NamedTuple

from blink.ring import (
    ENGINE_DRAINING,
    ENGINE_FAILED,
    ENGINE_READY,
    ENGINE_STARTING,
    ENGINE_STATE_NAMES,
    ENGINE_STOPPED,
)


class EngineHealth(enum.Enum):
    """The engine's state as the frontend sees it; see the module docstring."""

    STARTING = "starting"  # heartbeat moving, engine state word STARTING
    HEALTHY = "healthy"  # heartbeat moving, engine state word READY
    STALLED = "stalled"  # no heartbeat move for the heartbeat timeout
    UNRESPONSIVE = "unresponsive"  # no heartbeat move for the hard limit
    DRAINING = "draining"  # heartbeat moving, engine state word DRAINING (stopping)
    DEAD = "dead"  # FAILED/STOPPED, process gone, or poller broken: final
    RESTARTING = "restarting"  # (ReconnectingEngineClient only) no live engine attached
    CLOSED = "closed"  # the client was closed: final

    @property
    def healthy(self) -> bool:
        """What ``/health`` answers 200 for."""
        return self is EngineHealth.HEALTHY

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken (a stalled engine's queue in the ring)."""
        return self in (EngineHealth.HEALTHY, EngineHealth.STALLED)

    @property
    def final(self) -> bool:
        return self in (EngineHealth.DEAD, EngineHealth.CLOSED)


class Observation(enum.Enum):
    """What one look at the engine found (:meth:`HeartbeatWatch.observe`), or an event."""

    BEATING_READY = "heartbeat moving, state READY"
    BEATING_STARTING = "heartbeat moving, state STARTING"
    BEATING_DRAINING = "heartbeat moving, state DRAINING"
    STALE = "no heartbeat move for the heartbeat timeout"
    STALE_PAST_LIMIT = "no heartbeat move for the engine-dead timeout"
    GONE = "state FAILED/STOPPED, process gone, or poller broken"
    CLOSED = "the client was closed"


_BEATING = {
    Observation.BEATING_READY: EngineHealth.HEALTHY,
    Observation.BEATING_STARTING: EngineHealth.STARTING,
    Observation.BEATING_DRAINING: EngineHealth.DRAINING,
}


def next_health(state: EngineHealth, obs: Observation) -> EngineHealth:
    """The one transition function: the state after ``obs`` in ``state``."""
    if state is EngineHealth.CLOSED or obs is Observation.CLOSED:
        return EngineHealth.CLOSED  # final, and closing wins over everything
    if state is EngineHealth.DEAD or obs is Observation.GONE:
        return EngineHealth.DEAD  # final for this client
    if obs is Observation.STALE_PAST_LIMIT:
        return EngineHealth.UNRESPONSIVE
    if obs is Observation.STALE:
        # Past the hard limit only a heartbeat move brings the engine back.
        return EngineHealth.UNRESPONSIVE if state is EngineHealth.UNRESPONSIVE else EngineHealth.STALLED
    return _BEATING[obs]


class Transition(NamedTuple):
    """A change of state: from, to, why, and how long the old state lasted."""

    old: EngineHealth
    new: EngineHealth
    reason: str | None
    lasted_s: float


class HeartbeatWatch:
    """Holds the health state and what it is judged from; :meth:`observe` classifies a look
    at the engine and applies :func:`next_health`.

    Times are ``time.monotonic()`` seconds passed in by the caller (tests pass their own).
    """

    def __init__(self, heartbeat_timeout_s: float, engine_dead_timeout_s: float, *,
                 engine_state: int, heartbeat: int, now: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engine_dead_timeout_s = engine_dead_timeout_s
        self.engine_state = engine_state  # the state word as last read
        self.heartbeat = heartbeat  # the counter as last read
        self.heartbeat_changed = now  # when a move of the counter was last seen
        self.busy_since = now  # when the first of the requests in flight was submitted
        self.state = EngineHealth.STARTING
        self.reason: str | None = None  # why the engine is in ``state`` (stale, dead...)
        self.since = now  # when ``state`` was entered

    # -- inputs ----------------------------------------------------------------------------

    def saw(self, engine_state: int, heartbeat: int, now: float) -> None:
        """Record one read of the control block."""
        if heartbeat != self.heartbeat:
            self.heartbeat = heartbeat
            self.heartbeat_changed = now
        self.engine_state = engine_state

    def became_busy(self, now: float) -> None:
        """The first request of a busy period was submitted: judge the heartbeat from now, not
        from the idle stretch before (unless it was already stale then)."""
        if now - self.heartbeat_changed <= self.heartbeat_timeout_s:
            self.busy_since = now

    def stale_for(self, now: float, in_flight: int) -> float:
        """Seconds the heartbeat has not moved, as held against the requests in flight."""
        since = max(self.heartbeat_changed, self.busy_since) if in_flight else self.heartbeat_changed
        return now - since

    def still_for(self, now: float) -> float:
        """Seconds since a heartbeat move was last seen."""
        return now - self.heartbeat_changed

    # -- classification and transition -----------------------------------------------------

    def classify(self, now: float, in_flight: int, *,
                 gone: str | None = None) -> tuple[Observation, str | None]:
        """The observation the last read amounts to at ``now`` (and why). ``gone``: the
        reason the engine is known to be gone (process exited, poller broken), if it is."""
        if self.engine_state in (ENGINE_FAILED, ENGINE_STOPPED):
            return Observation.GONE, f"engine state is {ENGINE_STATE_NAMES[self.engine_state]}"
        if gone is not None:
            return Observation.GONE, gone
        stale = self.stale_for(now, in_flight)
        what = f"with {in_flight} requests in flight" if in_flight else "with no request in flight"
        if stale > self.engine_dead_timeout_s:
            return Observation.STALE_PAST_LIMIT, (
                f"heartbeat stale for {stale:.1f} s (limit {self.engine_dead_timeout_s:g} s, "
                f"--engine-dead-timeout) {what}")
        if stale > self.heartbeat_timeout_s:
            return Observation.STALE, (
                f"heartbeat stale for {stale:.1f} s (timeout {self.heartbeat_timeout_s:g} s) {what}")
        if self.engine_state == ENGINE_READY:
            return Observation.BEATING_READY, None
        if self.engine_state == ENGINE_DRAINING:
            return Observation.BEATING_DRAINING, "the engine is draining (stopping)"
        if self.engine_state == ENGINE_STARTING:
            return Observation.BEATING_STARTING, "the engine is starting"
        return Observation.BEATING_STARTING, f"unknown engine state word {self.engine_state}"

    def apply(self, obs: Observation, reason: str | None, now: float) -> Transition | None:
        """Move to ``next_health(state, obs)``; the transition if the state changed (the
        caller acts on it), else None. The reason is the one of the transition into the state
        (kept while the state lasts)."""
        new = next_health(self.state, obs)
        if new is self.state:
            return None
        t = Transition(self.state, new, reason, now - self.since)
        self.state, self.reason, self.since = new, reason, now
        return t

    def observe(self, now: float, in_flight: int, *, gone: str | None = None) -> Transition | None:
        """:meth:`classify`, then :meth:`apply`."""
        obs, reason = self.classify(now, in_flight, gone=gone)
        return self.apply(obs, reason, now)
