"""The frontend's asyncio engine client over the ring: :class:`RingEngineClient` (one ring,
one engine) and :class:`ReconnectingEngineClient` (outlives its engine: re-bootstraps to a
restarted one).

numpy only (runs on the DPU image). The synchronous protocol is
:class:`blink.dpu.ring_protocol.RingClient`; the engine's health is one
:class:`blink.dpu.engine_health.EngineHealth` state, moved by
:func:`blink.dpu.engine_health.next_health` and read by ``/health`` (:meth:`is_healthy`),
request admission (:meth:`is_accepting`, :meth:`generate`) and the streams' error paths.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from blink.dpu.engine_client import (
    DEFAULT_ENGINE_DEAD_TIMEOUT_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    EngineDeadError,
    EngineOutput,
    EngineOverloadedError,
    EngineStats,
    check_engine_timeouts,
)
from blink.dpu.engine_health import EngineHealth, HeartbeatWatch, Observation, Transition
from blink.dpu.ring_packing import RingRequestError, ring_fields
from blink.dpu.structured.workers import CompiledGrammar
from blink.dpu.ring_protocol import KvRoute, RingClient, RingHandle
from blink.dpu.step_clock import StepClock
from blink.shared.sampling_params import SamplingParams
from blink.errors import BlinkError
from blink.transport.doorbell import FIELD as doorbell_field, DoorbellListener, supported as doorbell_supported
from blink.ring import (
    C_HEARTBEAT,
    C_STAT_KV_BLOCKS_TOTAL,
    C_STAT_KV_BLOCKS_USED,
    C_STAT_PREEMPTIONS,
    C_STAT_PREFIX_HITS,
    C_STAT_PREFIX_QUERIES,
    C_STAT_RUNNING,
    C_STAT_STEPS,
    C_STAT_PROMPT_TOKENS,
    C_STAT_GENERATED_TOKENS,
    C_STAT_WAITING,
    C_STAT_KV_BYTES_SENT,
    C_STAT_KV_TRANSFERS,
    C_SPEC_TOKENS,
    C_STAT_SPEC_ACCEPTED_PER_POS,
    C_STAT_SPEC_ACCEPTED_TOKENS,
    C_STAT_SPEC_DRAFT_TOKENS,
    C_STAT_SPEC_DRAFTS,
)

logger = logging.getLogger(__name__)

#: With a doorbell, the poller's tick while requests run and no bell rang: a safety net only
#: (the engine rings after every step), so it is long; the heartbeat watch needs seconds.
DOORBELL_FALLBACK_S = 0.02

#: The shortest step the poller sleeps through (``align_to_steps``). Shorter steps get the
#: backoff's ticks: a GPU loop's (~1 ms), and a small model's on a CPU whose cores the frontend
#: shares with the engine's kernels: SmolLM2-135M's 5-7 ms steps on two Zen 4 vCPUs decoded
#: 0.88-0.94x as fast aligned (three A/B runs of benchmarks/bench_frontend_cpu, 2026-12-07),
#: while a 1B's ~30 ms steps decoded as fast either way with 0.58x the frontend's CPU a token
#: (docs/performance.md#frontend-poller).
ALIGN_MIN_STEP_S = 10e-3


@dataclass(order=True)
class _Waiter:
    """A request waiting in line for room in the ring (:meth:`RingEngineClient._submit_in_line`):
    ordered by (priority, ticket), the engine's queue order. ``submit`` writes it into the
    ring (None while there is no room); ``future`` gets its handle; past ``deadline`` without
    room it gets the 503 of a full ring."""

    priority: int
    ticket: int
    submit: Callable[[], RingHandle | None] = field(compare=False)
    needs_lane: bool = field(compare=False)  # prompt logprobs: also a lane
    prompt_len: int = field(compare=False)
    deadline: float = field(compare=False)
    future: asyncio.Future = field(compare=False)


@dataclass(eq=False)
class _Stream:
    """A request whose consumer is reading: its ring handle and the queue its deltas go to."""

    request_id: str
    handle: RingHandle
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    queue_time_reported: bool = False


def _doorbell_listener() -> DoorbellListener | None:
    """A doorbell to offer the engine, where this OS has one (Linux) and it can be bound."""
    if not doorbell_supported():
        return None
    try:
        return DoorbellListener()
    except OSError as exc:
        logger.warning("no doorbell for the engine to ring (%s): the ring poller keeps its timers", exc)
        return None


def _wake_up(sleeper: asyncio.Future[None] | None) -> None:
    """End the poller's sleep (its timer or a nudge, whichever comes first)."""
    if sleeper is not None and not sleeper.done():
        sleeper.set_result(None)


class RingEngineClient:
    """:class:`~blink.dpu.engine_client.EngineClient` over a :class:`RingClient`.

    One poller task polls every in-flight request each tick, sleeping ``poll_min_interval_s``
    after a tick that found output and backing off to ``poll_max_interval_s`` otherwise (to
    ``mask_poll_max_interval_s`` while a constrained request is in flight: the engine's
    sampling gate waits for the next token mask, which this side writes only once it has read
    the previous token, so every ms of poll delay is a ms of step time). With
    ``align_to_steps`` (the default) and steps of at least ``align_min_step_s``, it sleeps
    through the running step instead: until just before the engine's step count is due to
    move (the step clock's cadence, :meth:`_poll_delay`), then ticks finely around that time,
    so a 25 ms decode step costs ~3 ticks instead of ~9, and the token is seen within a fine
    tick of being written (on a host whose cores all run the engine's kernels, every tick
    takes CPU from them). With a ``doorbell`` (a frontend on the engine's host whose engine
    rings it after each step: :mod:`blink.transport.doorbell`) it ticks when the bell rings,
    and otherwise only every ``doorbell_fallback_s`` while requests run, in place of both
    (not while a constrained request waits for its mask, or a request waits for room). It also
    watches the engine and keeps its :attr:`health` (see :mod:`blink.dpu.engine_health`), which
    tells a slow engine from a dead one:

    - **DEAD** (final): engine state FAILED/STOPPED, the engine process gone (the transport can
      tell: loopback checks the segment creator's pid and start time), or a broken poller.
      Every stream ends at once with :class:`EngineDeadError`; new requests are refused.
    - **STALLED**: the heartbeat has not moved for ``heartbeat_timeout_s`` (one long step on a
      loaded CPU). :meth:`is_healthy` is False (``/health`` answers 503), but nothing is lost:
      in-flight streams keep waiting, and new requests are still accepted
      (:meth:`is_accepting`) and queue in the ring, bounded by its slots and prompt arena (a
      full ring answers 503 + Retry-After after ``submit_timeout_s``, as always). When the
      heartbeat moves again all of them proceed.
    - **UNRESPONSIVE**: the heartbeat has not moved for ``engine_dead_timeout_s`` (the hard
      limit): every in-flight stream ends with :class:`EngineDeadError` and its slot is
      cancelled, and new requests are refused. Not final either: once the heartbeat moves
      again, requests are served again.
    - **STARTING** / **DRAINING**: the engine's state word says so; not healthy, not accepting.

    Requests in flight are one map, request id → :class:`_Stream`, holding every request whose
    consumer still reads; a request whose consumer left, or that was given up, is only the
    ring client's to drain (:attr:`RingClient.active` holds every slot not yet given back).
    """

    #: how often (at most) to ask the transport whether the engine process is alive, while
    #: the heartbeat is not moving
    peer_check_interval_s = 0.25

    def __init__(
        self,
        ring: RingClient,
        *,
        model_name: str,
        max_model_len: int | None = None,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        engine_dead_timeout_s: float = DEFAULT_ENGINE_DEAD_TIMEOUT_S,
        submit_timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        poll_min_interval_s: float = 2e-4,
        poll_max_interval_s: float = 5e-3,
        mask_poll_max_interval_s: float = 5e-4,
        idle_interval_s: float = 0.1,
        align_to_steps: bool = True,
        align_min_step_s: float = ALIGN_MIN_STEP_S,
        align_max_sleep_s: float = 0.1,
        doorbell: DoorbellListener | None = None,
        doorbell_fallback_s: float = DOORBELL_FALLBACK_S,
    ) -> None:
        check_engine_timeouts(heartbeat_timeout_s, engine_dead_timeout_s)
        self.ring = ring
        self.model_name = model_name
        self.max_model_len = max_model_len or ring.config.max_model_len
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engine_dead_timeout_s = engine_dead_timeout_s
        self.submit_timeout_s = submit_timeout_s
        self.retry_after_s = retry_after_s
        self.poll_min_interval_s = poll_min_interval_s
        self.poll_max_interval_s = poll_max_interval_s
        self.mask_poll_max_interval_s = mask_poll_max_interval_s
        self.idle_interval_s = idle_interval_s
        self.align_to_steps = align_to_steps
        self.align_min_step_s = align_min_step_s
        self.align_max_sleep_s = align_max_sleep_s
        #: the engine rings this after each step (None: no bell, the timers alone); the client
        #: owns it and closes it with itself
        self.doorbell = doorbell
        self.doorbell_fallback_s = doorbell_fallback_s
        self.info: Any = None  # the bootstrap EngineInfo, when made by connect()
        self._inflight: dict[str, _Stream] = {}
        #: requests waiting for room in the ring (served in (priority, ticket) order)
        self._line: list[_Waiter] = []
        self._tickets = itertools.count()
        self._task: asyncio.Task[None] | None = None
        #: the poller's sleep, while it sleeps (:meth:`_nudge` ends it)
        self._sleeper: asyncio.Future[None] | None = None
        self._peer_checked = 0.0
        #: the engine's step count in time, for the queue time (blink.dpu.step_clock)
        self.step_clock = StepClock()
        self._last_step_count: tuple[int, int] | None = None
        self._step_samples: list[tuple[int, int]] = []
        status = ring.engine_status()
        now = time.monotonic()
        self._watch = HeartbeatWatch(heartbeat_timeout_s, engine_dead_timeout_s,
                                     engine_state=status.state, heartbeat=status.heartbeat, now=now)
        self._update(now, in_flight=len(ring.active), check_peer=False)

    @classmethod
    async def connect(cls, host: str, port: int, *, secret: bytes | None = None,
                      expect_transport: str | None = None, connect_timeout_s: float = 10.0,
                      doorbell: bool = True, **kwargs: Any) -> "RingEngineClient":
        """Bootstrap with the engine at ``host:port`` (authenticating with ``secret``), attach
        the ring, return a client. The client holds the engine's one frontend lease until
        :meth:`close`. ``doorbell``: ask the engine to ring a doorbell after each step (kept
        where the engine will: its host's loopback transport, a loop with host steps)."""
        from blink.transport.bootstrap import connect

        listener = _doorbell_listener() if doorbell else None
        try:
            info, transport = await asyncio.to_thread(
                connect, host, port, secret=secret, timeout_s=connect_timeout_s,
                expect_transport=expect_transport, doorbell=listener.name if listener is not None else None,
            )
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        if listener is not None and info.connection.get(doorbell_field) is not True:
            listener.close()  # an engine on another host, or one with no host step
            listener = None
        logger.info("engine %s:%d: %s", host, port,
                    "the ring poller wakes at its doorbell, rung after each engine step" if listener is not None
                    else "the ring poller ticks on its timers (no doorbell: %s)" % (
                        "$BLINK_FRONTEND_DOORBELL=0" if not doorbell else "not on Linux" if not doorbell_supported()
                        else "the engine rings none (another host, or a loop with no host step)"))
        try:
            ring = RingClient(transport)
        except BaseException:
            transport.close()
            if listener is not None:
                listener.close()
            raise
        try:
            client = cls(ring, model_name=info.model_name, max_model_len=info.max_model_len,
                         doorbell=listener, **kwargs)
        except BaseException:
            ring.close()
            if listener is not None:
                listener.close()
            raise
        client.info = info
        return client

    # -- health --------------------------------------------------------------------------

    @property
    def health(self) -> EngineHealth:
        """The engine's health now. Without a running poller the control block is read here;
        with one, the clock runs on the poller's last read."""
        if not self._watch.state.final:
            now = time.monotonic()
            if self._task is not None and not self._task.done():
                self._update(now, in_flight=len(self.ring.active), check_peer=False)
            else:
                try:
                    status = self.ring.engine_status()
                except BlinkError as exc:
                    self._set(Observation.GONE, f"the ring cannot be read: {exc}")
                else:
                    self._watch.saw(status.state, status.heartbeat, now)
                    self._update(now, in_flight=len(self.ring.active), check_peer=True)
        return self._watch.state

    @property
    def health_reason(self) -> str | None:
        """Why the engine is in its state (stale heartbeat, dead...), or None."""
        return self._watch.reason

    @property
    def dead_reason(self) -> str | None:
        """Why the engine counts as dead (final for this client), or None."""
        return self._watch.reason if self._watch.state is EngineHealth.DEAD else None

    @property
    def stalled(self) -> bool:
        """The heartbeat is stale (not yet past the hard limit)."""
        return self.health is EngineHealth.STALLED

    def is_healthy(self) -> bool:
        """HEALTHY: state READY and the heartbeat moved within ``heartbeat_timeout_s`` (what
        ``/health`` reports)."""
        return self.health.healthy

    def is_accepting(self) -> bool:
        """Whether a new request is taken: also during a stall (the request queues in the
        ring), not once the engine is dead, starting, draining, or past
        ``engine_dead_timeout_s``."""
        return self.health.accepting

    def _peer_gone(self, now: float) -> str | None:
        """While the heartbeat is not moving, ask the transport (at most every
        ``peer_check_interval_s``) whether the engine process still exists."""
        peer_alive = getattr(self.ring.transport, "peer_alive", None)  # None: cannot tell
        if peer_alive is None:
            return None
        if (self._watch.still_for(now) < self.peer_check_interval_s
                or now - self._peer_checked < self.peer_check_interval_s):
            return None
        self._peer_checked = now
        return "the engine process has exited" if peer_alive() is False else None

    def _update(self, now: float, *, in_flight: int, check_peer: bool) -> None:
        """Judge the last read of the control block at ``now``; act on a change of state."""
        gone = self._peer_gone(now) if check_peer else None
        self._transitioned(self._watch.observe(now, in_flight, gone=gone))

    def _set(self, obs: Observation, reason: str) -> None:
        """An event that is not a read of the control block (broken poller, close)."""
        self._transitioned(self._watch.apply(obs, reason, time.monotonic()))

    def _transitioned(self, t: Transition | None) -> None:
        """What a change of health does to the streams (and the log)."""
        if t is None:
            return
        if t.new is EngineHealth.DEAD:
            logger.error("engine declared dead: %s", t.reason)
            self._end_streams(f"the engine died mid-request: {t.reason}", cancel=False)
        elif t.new is EngineHealth.UNRESPONSIVE:
            logger.error("engine not responding, ending %d requests: %s", len(self._inflight), t.reason)
            # keep polling so the cancelled slots drain if the engine comes back
            self._end_streams(f"the engine stopped responding mid-request: {t.reason}", cancel=True)
        elif t.new is EngineHealth.STALLED:
            if self.ring.active:
                logger.warning("engine stalled: %s; requests keep waiting up to %g s",
                               t.reason, self.engine_dead_timeout_s)
            else:
                logger.warning("engine stalled while idle: %s; /health answers 503", t.reason)
        elif t.old in (EngineHealth.STALLED, EngineHealth.UNRESPONSIVE) and not t.new.final:
            logger.warning("engine heartbeat resumed after %.1f s; %s", t.lasted_s,
                           "accepting requests again" if t.old is EngineHealth.UNRESPONSIVE
                           else "requests continue")
        elif t.new in (EngineHealth.STARTING, EngineHealth.DRAINING):
            logger.info("engine is %s", t.new.value)

    def _end_streams(self, message: str, *, cancel: bool) -> None:
        streams = list(self._inflight.values())
        self._inflight.clear()
        for stream in streams:
            stream.queue.put_nowait(EngineDeadError(message))
            if cancel:
                self.ring.cancel(stream.handle)

    def _refusal(self, state: EngineHealth) -> str:
        reason = self._watch.reason
        if state is EngineHealth.DEAD:
            return f"the engine is not available: {reason}"
        if state is EngineHealth.CLOSED:
            return "the engine client is closed"
        if state is EngineHealth.UNRESPONSIVE:
            return f"the engine is not responding: {reason}"
        return f"the engine is not ready: {reason or state.value}"

    def _check_accepting(self) -> None:
        state = self.health
        if not state.accepting:
            raise EngineDeadError(self._refusal(state))

    # -- the poller ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the poller task (done by the first generate; call it to watch an idle engine)."""
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            if self.doorbell is not None:
                loop.add_reader(self.doorbell.fileno(), self._on_doorbell)
            self._task = loop.create_task(self._run(), name="blink-ring-poller")

    def _on_doorbell(self) -> None:
        """The engine ended a step: read its bells, tick now."""
        if self.doorbell is not None:
            self.doorbell.drain()
        self._nudge()

    async def _run(self) -> None:
        try:
            await self._poll()
        finally:  # the engine is gone or the client closed: nobody serves the line now
            reason = self._refusal(self.health) if self._watch.state.final else "the ring poller stopped"
            self._fail_line(reason)

    async def _poll(self) -> None:
        backoff = self.poll_min_interval_s
        while not self._watch.state.final:
            try:
                progressed = self._tick()
                self._serve_line()
            except Exception as exc:  # noqa: BLE001 - a broken poller must not hang the streams
                logger.exception("ring poller failed")
                self._set(Observation.GONE, f"the ring poller failed: {exc}")
                return
            if progressed:
                backoff = self.poll_min_interval_s
            elif self.ring.active or self._line:
                cap = self.mask_poll_max_interval_s if self.ring.masks_pending \
                    else self.poll_max_interval_s
                backoff = min(backoff * 2, cap)
            else:
                backoff = self.idle_interval_s
            await self._sleep(self._poll_delay(backoff, time.monotonic()))

    def _poll_delay(self, backoff: float, now: float) -> float:
        """How long to sleep after a tick: ``backoff`` (the tick's backoff), unless the step
        clock's cadence says when the running step should end (``due``: the count's last move
        plus the recent step time). Then: asleep until a tenth of a step before ``due`` (at
        most ``align_max_sleep_s`` at a time: the bound on a late token when the estimate is
        stale), fine ticks (a fortieth of a step) until as long after it, and past that the
        backoff again (a longer step: a prefill, a larger batch). Not while a constrained
        request waits for its mask (the engine's step waits for this side then) nor for steps
        shorter than ``align_min_step_s`` (:data:`ALIGN_MIN_STEP_S`)."""
        if self.doorbell is not None and self.ring.active and not self.ring.masks_pending and not self._line:
            return self.doorbell_fallback_s  # the bell says when a step ended
        if not self.align_to_steps or not self.ring.active or self.ring.masks_pending:
            return backoff
        cadence = self.step_clock.cadence()
        if cadence is None or cadence[1] < self.align_min_step_s:
            return backoff
        moved, period = cadence
        due, margin = moved + period, 0.1 * period
        if now < due - margin:
            return min(due - margin - now, self.align_max_sleep_s)
        fine = max(self.poll_min_interval_s, period / 40)
        return fine if now < due + margin else max(backoff, fine)

    async def _sleep(self, delay: float) -> None:
        """Sleep ``delay`` seconds or until :meth:`_nudge`: one future and one timer (cheaper
        per tick than ``wait_for`` on an event, which runs the wait as a task of its own)."""
        loop = asyncio.get_running_loop()
        sleeper = self._sleeper = loop.create_future()
        timer = loop.call_later(delay, _wake_up, sleeper)
        try:
            await sleeper
        finally:
            timer.cancel()
            self._sleeper = None

    def _nudge(self) -> None:
        """Wake the poller now (a new request, a cancel, a waiter in line, a close): its next
        tick runs at once."""
        _wake_up(self._sleeper)

    def _tick(self) -> bool:
        """One poll of everything; True if any request made progress."""
        now = time.monotonic()
        status = self.ring.engine_status()
        self._watch.saw(status.state, status.heartbeat, now)
        self.step_clock.saw(int(status.control[C_STAT_STEPS]), now)
        self._note_step_tokens(status.control)
        active = self.ring.active
        self._update(now, in_flight=len(active), check_peer=True)
        if self._watch.state.final or not active:
            return False
        deltas = self.ring.poll_many(active)
        for stream in list(self._inflight.values()):
            handle = stream.handle
            if handle.error is not None:  # the engine broke the protocol for this request
                del self._inflight[stream.request_id]
                stream.queue.put_nowait(handle.error)
                continue
            delta = deltas.get(handle)
            if delta is None:
                continue
            stream.queue.put_nowait(self._to_output(delta, stream))
            if handle.done:
                del self._inflight[stream.request_id]
        return bool(deltas)

    def _note_step_tokens(self, control: Any) -> None:
        """(steps, tokens) the engine ran since the last tick, for ``iteration_tokens_total``."""
        steps = int(control[C_STAT_STEPS])
        tokens = int(control[C_STAT_PROMPT_TOKENS]) + int(control[C_STAT_GENERATED_TOKENS])
        last = self._last_step_count
        self._last_step_count = (steps, tokens)
        if last is not None and steps > last[0] and tokens >= last[1]:
            if len(self._step_samples) < 100_000:  # unscraped: keep memory bounded
                self._step_samples.append((steps - last[0], tokens - last[1]))

    def step_token_samples(self) -> list[tuple[int, int]]:
        """(steps, tokens) pairs since the last call: the engine ran ``steps`` steps that
        processed ``tokens`` tokens (admitted prompt tokens + generated ones) between two
        polls. ``/metrics`` turns them into ``blink:iteration_tokens_total``."""
        out, self._step_samples = self._step_samples, []
        return out

    def _admitted_at(self, handle: RingHandle) -> float | None:
        """When the engine admitted ``handle``: the start of its ``admitted_step`` (the end of
        the step before) on the step clock, never before the submission nor after this client
        saw the slot leave WRITTEN (the bounds the clock's interpolation must respect); the
        latter when the clock has no answer."""
        if handle.claimed_at is None:
            return None
        step = handle.admitted_step
        at = None if step is None or step < 1 else self.step_clock.time_of(step - 1)
        if at is None:
            return handle.claimed_at
        return min(max(at, handle.submitted_at), handle.claimed_at)

    def _to_output(self, delta: EngineOutput, stream: _Stream) -> EngineOutput:
        """The protocol's delta as this request asked for it: logprobs only when asked (the
        engine always computes the chosen token's); the admission time and queue time on the
        first delta."""
        extra: dict[str, Any] = {}
        if not stream.queue_time_reported:  # the first delta: the engine has admitted it
            admitted_at = self._admitted_at(stream.handle)
            if admitted_at is not None:
                stream.queue_time_reported = True
                extra = {"admitted_at": admitted_at,
                         "queue_time_s": admitted_at - stream.handle.submitted_at}
        if stream.params.logprobs is None:
            return dataclasses.replace(delta, logprobs=None, top_logprobs=None, **extra)
        return dataclasses.replace(delta, **extra)

    # -- EngineClient ----------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       grammar: CompiledGrammar | None = None,
                       kv: KvRoute | None = None) -> AsyncIterator[EngineOutput]:
        """:meth:`EngineClient.generate`; ``grammar``: the compiled form of
        ``params.structured_outputs`` (required when that is set: never run unconstrained);
        ``kv``: the request's part in a disaggregated prefill/decode (blink.dpu.disaggregated)."""
        self._check_accepting()
        if request_id in self._inflight:
            raise RingRequestError(f"request id {request_id!r} is already running")
        if (params.structured_outputs is None) != (grammar is None):
            raise RingRequestError("structured_outputs and its compiled grammar go together")
        fields = ring_fields(params, len(prompt_ids), self.max_model_len, self.ring.config)
        self.start()
        ring_id = self.ring.new_request_id()
        handle = await self._submit_in_line(
            params, len(prompt_ids),
            lambda: self.ring.try_submit(ring_id, prompt_ids, fields, grammar=grammar, kv=kv))
        stream = _Stream(request_id, handle, params)
        if len(self.ring.active) == 1:
            self._watch.became_busy(time.monotonic())
        self._inflight[request_id] = stream
        self._nudge()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                # The consumer left early: cancel, and let the poller drain the slot silently.
                if self._inflight.get(request_id) is stream:
                    del self._inflight[request_id]
                if not self._watch.state.final:
                    self.ring.cancel(handle)

    async def _submit_in_line(self, params: SamplingParams, prompt_len: int,
                              submit: Callable[[], RingHandle | None]) -> RingHandle:
        """Write a request into the ring (``submit``), waiting in line while there is no room
        (every slot or the prompt arena taken; for prompt logprobs, every lane).

        The line is in (priority, arrival) order, the engine's queue order (a request's
        priority is 0 under fcfs, where the frontend refuses others: arrival order), and the
        poller serves it after each tick (:meth:`_serve_line`): a more urgent request goes
        before less urgent ones that came earlier, and nobody passes the head while it waits
        for room (a long prompt waiting for arena space is not starved), except past a
        request waiting for a prompt-logprob lane (the first one in line takes the next
        free lane; that wait is not bounded: each holder gives its lane back with its first
        token). A waiter whose caller is cancelled (the client left) leaves the line and
        takes no slot; one left without room for ``submit_timeout_s`` gets the 503 a full
        ring answers."""
        needs_lane = params.prompt_logprobs is not None
        if needs_lane and self.ring.config.prompt_logprob_lanes == 0:  # (else it would wait forever)
            raise RingRequestError("this engine computes no prompt logprobs (no prompt-logprob "
                                   "lanes in its ring)")
        if not self._line:  # nobody waits: no line to keep
            handle = submit()
            if handle is not None:
                return handle
        waiter = _Waiter(params.priority, next(self._tickets), submit, needs_lane, prompt_len,
                         time.monotonic() + self.submit_timeout_s,
                         asyncio.get_running_loop().create_future())
        self._line.append(waiter)
        self._nudge()  # served at the next tick
        try:
            return await waiter.future
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.ring.cancel(future.result())  # room came as it left: the poller drains it
            raise
        finally:
            if waiter in self._line:
                self._line.remove(waiter)
                self._nudge()  # it may have held up the line

    def _serve_line(self) -> None:
        """Give room in the ring to the line (:meth:`_submit_in_line`), in its order, until
        the first waiter it does not fit; time out the waiters past their deadline; fail
        every waiter as a new request would while the engine does not accept any."""
        if not self._line:
            return
        state = self.health
        if not state.accepting:
            self._fail_line(self._refusal(state))
            return
        now = time.monotonic()
        self._line.sort()
        lane_turn, room = True, True
        for waiter in list(self._line):
            future = waiter.future
            if future.done():  # its caller left
                self._line.remove(waiter)
                continue
            if waiter.needs_lane:
                first, lane_turn = lane_turn, False
                if not first or not self.ring.free_lanes():
                    waiter.deadline = now + self.submit_timeout_s  # the lane wait is unbounded
                    continue
            try:
                handle = waiter.submit() if room else None
            except Exception as exc:  # noqa: BLE001 - its generate raises it (a bad request)
                self._line.remove(waiter)
                future.set_exception(exc)
                continue
            if handle is not None:
                self._line.remove(waiter)
                future.set_result(handle)
                continue
            room = False  # nobody behind it passes it
            if now >= waiter.deadline:
                self._line.remove(waiter)
                future.set_exception(EngineOverloadedError(
                    self.ring.full_message(waiter.prompt_len, self.submit_timeout_s),
                    retry_after_s=self.retry_after_s))

    def _fail_line(self, reason: str) -> None:
        """Every waiter in line ends with :class:`EngineDeadError` (``reason``)."""
        for waiter in self._line:
            if not waiter.future.done():
                waiter.future.set_exception(EngineDeadError(reason))
        self._line.clear()

    async def abort(self, request_id: str, force: bool = False) -> None:
        """Cancel a request; ``force``: also a KV reservation whose KV has not landed (the
        prefill engine writing it is gone)."""
        stream = self._inflight.get(request_id)
        if stream is None or self._watch.state.final:
            return
        self.ring.cancel(stream.handle, force=force)
        self._nudge()

    def stats(self) -> EngineStats:
        c = self.ring.engine_status().control
        total = int(c[C_STAT_KV_BLOCKS_TOTAL])
        return EngineStats(
            running=int(c[C_STAT_RUNNING]),
            waiting=int(c[C_STAT_WAITING]),
            kv_usage=(int(c[C_STAT_KV_BLOCKS_USED]) / total) if total > 0 else 0.0,
            prefix_cache_queries=int(c[C_STAT_PREFIX_QUERIES]),
            prefix_cache_hits=int(c[C_STAT_PREFIX_HITS]),
            preemptions=int(c[C_STAT_PREEMPTIONS]),
            steps=int(c[C_STAT_STEPS]),
            step_tokens=int(c[C_STAT_PROMPT_TOKENS]) + int(c[C_STAT_GENERATED_TOKENS]),
            kv_blocks_total=total,
            heartbeat_age_s=self._heartbeat_age(int(c[C_HEARTBEAT])),
            slots_used=len(self.ring.active),
            slots_total=self.ring.config.n_slots,
            arena_used=self.ring.arena.used,
            arena_total=self.ring.arena.capacity,
            **({"kv_transfer_bytes": int(c[C_STAT_KV_BYTES_SENT]),
                "kv_transfers": int(c[C_STAT_KV_TRANSFERS])} if self.ring.config.max_kv_blocks else {}),
            **({"spec_decode_num_drafts": int(c[C_STAT_SPEC_DRAFTS]),
                "spec_decode_num_draft_tokens": int(c[C_STAT_SPEC_DRAFT_TOKENS]),
                "spec_decode_num_accepted_tokens": int(c[C_STAT_SPEC_ACCEPTED_TOKENS]),
                "spec_decode_num_accepted_tokens_per_pos": [
                    int(v) for v in c[C_STAT_SPEC_ACCEPTED_PER_POS: C_STAT_SPEC_ACCEPTED_PER_POS + int(c[C_SPEC_TOKENS])]]}
               if c[C_SPEC_TOKENS] > 0 else {}),
        )

    def _heartbeat_age(self, heartbeat: int) -> float:
        """Seconds since the heartbeat last moved, as of ``heartbeat`` (read just now)."""
        if heartbeat != self._watch.heartbeat:
            return 0.0
        return max(0.0, time.monotonic() - self._watch.heartbeat_changed)

    async def close(self) -> None:
        """Stop polling, cancel what is in flight, and close the transport."""
        if self._watch.state is EngineHealth.CLOSED:
            return
        streams = list(self._inflight.values())
        self._inflight.clear()
        for stream in streams:
            self.ring.cancel(stream.handle)
            stream.queue.put_nowait(EngineDeadError("the engine client was closed"))
        self._set(Observation.CLOSED, "the engine client was closed")
        self._nudge()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.doorbell is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.doorbell.fileno())
            except (RuntimeError, ValueError):  # no running loop; or already closed
                pass
            self.doorbell.close()
        self.ring.close()


# -- healing: re-bootstrap to a restarted engine ---------------------------------------------


class ReconnectingEngineClient:
    """An :class:`~blink.dpu.engine_client.EngineClient` that outlives its engine.

    It delegates to one :class:`RingEngineClient` at a time. When that one declares the engine
    dead (process gone, state FAILED/STOPPED, broken poller: its in-flight streams have already
    ended with ``engine_unavailable``), a watcher task closes it (unmapping the old region and
    releasing the lease) and bootstraps again with ``reconnect()`` under a bounded exponential
    back-off, until an engine answers: ``blink serve`` restarts its engine on the same bootstrap
    port, and a standalone ``blink engine`` restarted with the same ``--listen`` and secret file
    is found the same way. Meanwhile ``/health`` answers 503 and new requests 503 with
    ``Retry-After`` (:meth:`unavailable_retry_after_s`). An engine that now serves another model,
    context length or tokenizer is not attached (this frontend's tokenizer would be wrong): it
    keeps refusing and says so in the log.
    """

    def __init__(self, first: RingEngineClient,
                 reconnect: Callable[[], Awaitable[RingEngineClient]],
                 *, where: str = "the engine", retry_after_s: float = 2.0,
                 min_interval_s: float = 0.2, max_interval_s: float = 2.0,
                 watch_interval_s: float = 0.05) -> None:
        self._client: RingEngineClient | None = first
        self._reconnect = reconnect
        self.where = where
        self.info = first.info
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.retry_after_s = retry_after_s
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.watch_interval_s = watch_interval_s
        self._down: str | None = None  # why no engine is attached right now
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False
        #: engines attached after the first one (diagnostics and tests)
        self.reconnects = 0

    @property
    def client(self) -> RingEngineClient | None:
        """The ring client of the engine attached now (None while reconnecting)."""
        return self._client

    @property
    def ring(self) -> RingClient | None:
        """The attached engine's :class:`RingClient` (its ``config`` says how many slots the
        ring has); None while reconnecting."""
        c = self._client
        return c.ring if c is not None else None

    def _live(self) -> RingEngineClient | None:
        c = self._client
        return c if c is not None and not self._closed and not c.health.final else None

    @property
    def health(self) -> EngineHealth:
        """The attached engine's health; RESTARTING while none is (the last one is dead and
        no new engine has answered yet); CLOSED once closed."""
        if self._closed:
            return EngineHealth.CLOSED
        state = self._client.health if self._client is not None else EngineHealth.RESTARTING
        return EngineHealth.RESTARTING if state.final else state

    # -- EngineClient ----------------------------------------------------------------------

    def is_healthy(self) -> bool:
        return self.health.healthy

    def is_accepting(self) -> bool:
        return self.health.accepting

    def unavailable_retry_after_s(self) -> float | None:
        """Seconds a refused client should wait (``Retry-After``) while the engine is being
        reconnected; None when a refusal is not about a restart."""
        return self.retry_after_s if self.health is EngineHealth.RESTARTING else None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       grammar: CompiledGrammar | None = None,
                       kv: KvRoute | None = None) -> AsyncIterator[EngineOutput]:
        c = self._live()
        if c is None:
            raise EngineDeadError(
                f"the engine is restarting ({self._down or 'it went away'}); retry shortly",
                retry_after_s=self.retry_after_s)
        async for out in c.generate(request_id, prompt_ids, params, grammar, kv=kv):
            yield out

    async def abort(self, request_id: str, force: bool = False) -> None:
        c = self._client
        if c is not None:
            await c.abort(request_id, force=force)

    def stats(self) -> EngineStats:
        c = self._live()
        if c is None:
            return EngineStats(running=0, waiting=0, kv_usage=0.0, prefix_cache_queries=0,
                               prefix_cache_hits=0, preemptions=0)
        return c.stats()

    def step_token_samples(self) -> list[tuple[int, int]]:
        c = self._live()
        return [] if c is None else c.step_token_samples()

    def start(self) -> None:
        """Start the current client's poller and the watcher that reconnects."""
        if self._client is not None:
            self._client.start()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch(), name="blink-engine-watcher")

    async def close(self) -> None:
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        c, self._client = self._client, None
        if c is not None:
            await c.close()

    # -- the watcher -----------------------------------------------------------------------

    async def _watch(self) -> None:
        while not self._closed:
            try:
                await self._watch_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watcher must outlive any one failure
                logger.exception("engine watcher failed; retrying")
                await asyncio.sleep(self.max_interval_s)

    async def _watch_once(self) -> None:
        while not self._closed:
            c = self._client
            if c is not None and not c.health.final:
                await asyncio.sleep(self.watch_interval_s)
                continue
            self._down = (c.health_reason or c.health.value) if c is not None else "not attached"
            self._client = None
            if c is not None:
                logger.error("the engine at %s is gone (%s); reconnecting (new requests get 503 "
                             "+ Retry-After meanwhile)", self.where, self._down)
                try:
                    await c.close()  # unmaps the old region and gives its lease back
                except Exception:  # noqa: BLE001 - a dead engine's client may fail to close cleanly
                    logger.warning("closing the dead engine's client failed", exc_info=True)
            new = await self._attach_again()
            if new is None:
                return
            self._client = new
            self._down = None
            self.reconnects += 1
            new.start()
            logger.warning("reconnected to the engine at %s (region %s); accepting requests again",
                           self.where, getattr(new.ring.transport, "name", new.info and new.info.transport))

    async def _attach_again(self) -> RingEngineClient | None:
        interval = self.min_interval_s
        last_error = ""
        while not self._closed:
            try:
                new = await self._reconnect()
            except Exception as exc:  # noqa: BLE001 - keep trying whatever a half-started engine does
                if str(exc) != last_error:
                    logger.warning("reconnecting to the engine at %s: %s", self.where, exc,
                                   exc_info=not isinstance(exc, BlinkError))
                    last_error = str(exc)
            else:
                mismatch = self._mismatch(new)
                if mismatch is None:
                    return new
                await new.close()
                if mismatch != last_error:
                    logger.error("the engine at %s now serves %s; not attaching it (restart this "
                                 "frontend to serve it)", self.where, mismatch)
                    last_error = mismatch
                interval = self.max_interval_s
            await asyncio.sleep(interval)
            interval = min(interval * 2, self.max_interval_s)
        return None

    def _mismatch(self, new: RingEngineClient) -> str | None:
        old, info = self.info, new.info
        if new.model_name != self.model_name:
            return f"model {new.model_name!r} instead of {self.model_name!r}"
        if new.max_model_len != self.max_model_len:
            return f"max_model_len {new.max_model_len} instead of {self.max_model_len}"
        if old is not None and info is not None and info.tokenizer != old.tokenizer:
            return f"the tokenizer of {info.tokenizer!r} instead of {old.tokenizer!r}"
        return None
