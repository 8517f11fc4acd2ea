"""The frontend side of the ring protocol (:mod:`blink.ring`), over a one-sided transport.

numpy only: this runs on the DPU image (no torch). Two layers:

- :class:`RingClient` (synchronous): slot and prompt-arena allocation, ``submit`` (payload,
  fence, then the state word), ``poll_many``/``poll`` (produced counter, then tokens; bumps
  ``consumed``; frees the slot once FINISHED and fully read), ``cancel``, engine status.
- :class:`RingEngineClient` (asyncio): the frontend's :class:`~blink.dpu.engine_client.EngineClient`
  on top of it. One poller task serves every in-flight request and watches the engine's
  heartbeat and state.

Ring field conventions the frontend writes (the engine side reads them the same way):

- ``top_k``: 0 means off (SamplingParams' -1 is written as 0; the sampler treats <= 0 as off).
- ``n_logprobs``: how many top alternatives to return, 0 = none; the chosen token's logprob is
  always written by the engine and the frontend returns it only if the request asked.
- ``seed``: always set; a request without one gets a random 63-bit seed here.
- ``max_tokens``: always concrete (``max_model_len - prompt_len`` when the request gave none).
- ``stop_ids`` / ``logit_bias_ids``: -1 padded; more than the ring holds is refused.
- ``prompt_offset``: index in [0, arena_tokens); the prompt continues at index 0 after the end.
- ``request_id``: a ring-local int64 assigned here (the API's string ids stay in the frontend).
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

import numpy as np

from blink.dpu.engine_client import (
    DEFAULT_ENGINE_DEAD_TIMEOUT_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    EngineDeadError,
    EngineOutput,
    EngineOverloadedError,
    EngineStats,
    check_engine_timeouts,
)
from blink.engine.sampling_params import SamplingParams, SamplingParamsError, draw_seed
from blink.errors import BlinkError
from blink.ring import (
    C_ENGINE_STATE,
    C_HEARTBEAT,
    C_MAGIC,
    C_STAT_KV_BLOCKS_TOTAL,
    C_STAT_KV_BLOCKS_USED,
    C_STAT_PREEMPTIONS,
    C_STAT_PREFIX_HITS,
    C_STAT_PREFIX_QUERIES,
    C_STAT_RUNNING,
    C_STAT_WAITING,
    C_TOTAL_BYTES,
    CONTROL_WORDS,
    ENGINE_FAILED,
    ENGINE_READY,
    ENGINE_STATE_NAMES,
    ENGINE_STOPPED,
    FINISH_REASON_NAMES,
    MAGIC,
    SLOT_FINISHED,
    SLOT_FREE,
    SLOT_RUNNING,
    SLOT_WRITTEN,
    RingConfig,
    RingLayout,
    RingLayoutError,
    read_header,
)
from blink.transport.base import Transport

logger = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1


class RingFullError(BlinkError):
    """No free request slot or prompt-arena space within the bounded wait."""


class RingRequestError(SamplingParamsError):
    """The request cannot be written into the ring (empty or oversized prompt, more stop ids or
    logit-bias entries than the ring holds...). A client error, not an engine failure."""


class RingProtocolError(BlinkError):
    """The engine side broke the ring protocol (stream for another request, counters that go
    backwards...). The affected request fails; others go on."""


# -- prompt arena -------------------------------------------------------------------------


@dataclass(eq=False)
class ArenaRange:
    """``length`` tokens from monotonic position ``start`` (arena index ``start % capacity``)."""

    start: int
    length: int
    released: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length

    def segments(self, capacity: int) -> list[tuple[int, int]]:
        """(arena index, count) pieces: one, or two when the range wraps past the end."""
        off = self.start % capacity
        first = min(self.length, capacity - off)
        pieces = [(off, first)]
        if first < self.length:
            pieces.append((0, self.length - first))
        return pieces


class ArenaAllocator:
    """Circular allocator over the prompt arena.

    Allocations are taken in order at the head and may be released in any order; the tail moves
    past a range only once it and everything before it are released (a FIFO arena, matching the
    engine's FCFS admission: a prompt waiting for admission holds back only newer space).
    """

    def __init__(self, capacity: int, start: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"arena capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._head = start  # monotonic: next position to hand out
        self._tail = start  # monotonic: everything before it is free
        self._live: deque[ArenaRange] = deque()

    @property
    def used(self) -> int:
        """Tokens between tail and head: live ranges plus released ones stuck behind them."""
        return self._head - self._tail

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def live(self) -> list[ArenaRange]:
        return [r for r in self._live if not r.released]

    def allocate(self, n: int) -> ArenaRange | None:
        """A range of ``n`` tokens, or None while the arena has no room for it."""
        if n <= 0 or n > self.capacity:
            raise ValueError(f"cannot allocate {n} tokens from an arena of {self.capacity}")
        if n > self.free:
            return None
        r = ArenaRange(self._head, n)
        self._head += n
        self._live.append(r)
        return r

    def release(self, r: ArenaRange) -> None:
        """Give ``r`` back (idempotent)."""
        r.released = True
        while self._live and self._live[0].released:
            self._tail = self._live.popleft().end


# -- handles and deltas ---------------------------------------------------------------------


@dataclass(eq=False)
class RingHandle:
    """One submitted request: its slot, the slot's sequence number, and read progress."""

    slot: int
    seq: int
    request_id: int
    n_logprobs: int
    arena: ArenaRange | None
    submitted_at: float = field(default_factory=time.monotonic)
    consumed: int = 0  # tokens read so far (mirrors the stream's consumed counter)
    claimed: bool = False  # the engine took the prompt (state RUNNING or later)
    done: bool = False  # finished, fully read, slot given back
    cancelled: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: BaseException | None = None  # protocol failure; the slot is leaked on purpose

    def __repr__(self) -> str:
        return f"RingHandle(slot={self.slot}, seq={self.seq}, request_id={self.request_id})"


@dataclass
class StreamDelta:
    """What one poll of one request found: new tokens and, when finished, the finish reason."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: np.ndarray | None  # int32 [len(token_ids), n_logprobs], or None if n_logprobs == 0
    top_logprobs: np.ndarray | None  # float32, same shape
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStatus:
    """The control block as last read."""

    state: int
    heartbeat: int
    control: np.ndarray

    @property
    def state_name(self) -> str:
        return ENGINE_STATE_NAMES[self.state] if 0 <= self.state < len(ENGINE_STATE_NAMES) else str(self.state)


# -- SamplingParams -> ring fields ----------------------------------------------------------


def ring_fields(params: SamplingParams, prompt_len: int, max_model_len: int,
                cfg: RingConfig) -> dict[str, Any]:
    """The slot fields for ``params`` (see the module docstring for the conventions)."""
    if params.n != 1:
        raise RingRequestError(f"the engine takes one sequence per request, got n={params.n}")
    if prompt_len >= max_model_len and params.max_tokens is None:
        raise RingRequestError(
            f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - prompt_len
    if len(params.stop_token_ids) > cfg.max_stop_ids:
        raise RingRequestError(
            f"stop_token_ids can hold at most {cfg.max_stop_ids} ids in this engine, "
            f"got {len(params.stop_token_ids)}"
        )
    if len(params.logit_bias) > cfg.max_logit_bias:
        raise RingRequestError(
            f"logit_bias can hold at most {cfg.max_logit_bias} entries in this engine, "
            f"got {len(params.logit_bias)}"
        )
    n_logprobs = params.logprobs or 0
    if n_logprobs > cfg.max_logprobs:
        raise RingRequestError(
            f"logprobs can be at most {cfg.max_logprobs} in this engine, got {n_logprobs}"
        )
    return dict(
        max_tokens=min(max_tokens, _INT32_MAX),
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        n_logprobs=n_logprobs,
        top_k=params.top_k if params.top_k > 0 else 0,
        temperature=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed if params.seed is not None else draw_seed(),
        stop_ids=list(params.stop_token_ids),
        logit_bias=dict(params.logit_bias),
    )


# -- the synchronous client -------------------------------------------------------------------


def attach_layout(transport: Transport) -> RingLayout:
    """Read and validate the ring header through ``transport``."""
    header = transport.read(0, CONTROL_WORDS * 8)
    control = header.view("<i8")
    buf = header
    total = int(control[C_TOTAL_BYTES])
    if int(control[C_MAGIC]) == MAGIC and header.size < total <= transport.total_bytes:
        # read_header checks the region size against the buffer it gets: hand it a zero-filled
        # buffer of the announced size (untouched pages of np.zeros cost no memory).
        buf = np.zeros(total, dtype=np.uint8)
        buf[: header.size] = header
    elif int(control[C_MAGIC]) == MAGIC and total > transport.total_bytes:
        raise RingLayoutError(
            f"ring size mismatch: header says {total} bytes, the transport region has "
            f"{transport.total_bytes}"
        )
    return RingLayout(read_header(buf))


class RingClient:
    """Frontend side of the ring over ``transport``; thread-safe (one lock)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.layout = attach_layout(transport)
        self.config = self.layout.config
        self._spec = self.layout.fields
        self._lock = threading.RLock()
        n = self.config.n_slots
        self._active: dict[int, RingHandle] = {}  # slot -> handle not yet done
        seqs = self._read_field("seq", 0, n)
        self._seq = [int(s) for s in seqs]
        self._next_arrival = int(self._read_field("arrival", 0, n).max(initial=0)) + 1
        self._next_request_id = int(self._read_field("request_id", 0, n).max(initial=0)) + 1
        self.arena = ArenaAllocator(self.config.arena_tokens)
        self._free: list[int] = []
        self._adopt_slots()

    # -- low-level field access ----------------------------------------------------------

    def _offset(self, name: str, slot: int) -> int:
        return self._spec[name].element_offset(slot)

    def _read_field(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of a per-slot field."""
        spec = self._spec[name]
        row = spec.nbytes // spec.shape[0]
        raw = self.transport.read(spec.offset + lo * row, (hi - lo) * row)
        return raw.view(spec.dtype).reshape((hi - lo, *spec.shape[1:]))

    def _write_field(self, name: str, slot: int, value: Any) -> None:
        spec = self._spec[name]
        arr = np.asarray(value, dtype=spec.dtype)
        if arr.shape != spec.shape[1:]:
            raise ValueError(f"ring field {name} takes shape {spec.shape[1:]}, got {arr.shape}")
        self.transport.write(self._offset(name, slot), arr)

    def _read_ring(self, name: str, slot: int, start: int, count: int) -> np.ndarray:
        """``count`` entries from the slot's circular stream field ``name`` at ``start``."""
        spec = self._spec[name]
        cap = self.config.stream_capacity
        inner = spec.shape[2:]
        entry = spec.dtype.itemsize * int(np.prod(inner, dtype=np.int64))
        base = spec.element_offset(slot)
        off = start % cap
        first = min(count, cap - off)
        parts = [self.transport.read(base + off * entry, first * entry)]
        if first < count:
            parts.append(self.transport.read(base, (count - first) * entry))
        raw = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return raw.view(spec.dtype).reshape((count, *inner))

    # -- attach: adopt what a previous frontend left in the ring ----------------------------

    def _adopt_slots(self) -> None:
        n = self.config.n_slots
        states = self._read_field("state", 0, n)
        written: list[tuple[int, int, int, int]] = []  # (arrival, slot, offset, length)
        for slot in range(n):
            st = int(states[slot])
            if st == SLOT_FREE:
                self._free.append(slot)
            elif st == SLOT_FINISHED:
                self._write_field("state", slot, SLOT_FREE)  # nobody will read it any more
                self._free.append(slot)
            elif st in (SLOT_WRITTEN, SLOT_RUNNING):
                # An orphan of a previous frontend: cancel it and drain it to FREE.
                handle = RingHandle(slot, self._seq[slot], -1, 0, None, cancelled=True)
                handle.consumed = int(self._read_field("consumed", slot, slot + 1)[0])
                self._write_field("cancel", slot, 1)
                self._active[slot] = handle
                if st == SLOT_WRITTEN:
                    written.append((
                        int(self._read_field("arrival", slot, slot + 1)[0]), slot,
                        int(self._read_field("prompt_offset", slot, slot + 1)[0]),
                        int(self._read_field("prompt_len", slot, slot + 1)[0]),
                    ))
            else:
                raise RingProtocolError(f"slot {slot} has an unknown state word {st}")
        heapq.heapify(self._free)
        if written:
            # Their prompts are still in the arena, waiting to be copied: start our allocator
            # after them and hold one range over all of them until the engine claims them.
            cap = self.config.arena_tokens
            written.sort()
            start = pos = written[0][2] % cap
            end = start
            for _, _, off, length in written:
                pos += (off - pos) % cap
                end = max(end, pos + length)
            span = min(end - start, cap)
            self.arena = ArenaAllocator(cap, start=start)
            hold = self.arena.allocate(span)
            for _, slot, _, _ in written:
                self._active[slot].arena = hold
        if self._active:
            logger.warning("ring: cancelling %d requests left by a previous frontend", len(self._active))

    # -- submission ----------------------------------------------------------------------

    def new_request_id(self) -> int:
        with self._lock:
            rid = self._next_request_id
            self._next_request_id += 1
            return rid

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def active(self) -> list[RingHandle]:
        """Handles not yet done, including cancelled ones still draining."""
        with self._lock:
            return list(self._active.values())

    def _check_prompt(self, prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise RingRequestError("the prompt must be a non-empty list of token ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise RingRequestError(f"prompt token ids must be integers, got {prompt.dtype}")
        if prompt.min() < 0 or prompt.max() > _INT32_MAX:
            raise RingRequestError("prompt token ids must be in [0, 2**31)")
        limit = min(self.config.max_model_len, self.config.arena_tokens)
        if prompt.size > limit:
            raise RingRequestError(
                f"the prompt has {prompt.size} tokens; this engine takes at most {limit}"
            )
        return prompt.astype("<i4")

    def try_submit(
        self,
        request_id: int,
        prompt_ids: Sequence[int] | np.ndarray,
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        n_logprobs: int = 0,
        top_k: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int = 0,
        stop_ids: Sequence[int] = (),
        logit_bias: Mapping[int, float] | None = None,
    ) -> RingHandle | None:
        """Write one request into a free slot; None while no slot or arena space is free.

        Order: prompt tokens and every slot field (payload), fence, then state=WRITTEN, so the
        engine never sees the state word before the payload.
        """
        prompt = self._check_prompt(prompt_ids)
        cfg = self.config
        stop = np.full(cfg.max_stop_ids, -1, dtype="<i4")
        bias_ids = np.full(cfg.max_logit_bias, -1, dtype="<i4")
        bias_vals = np.zeros(cfg.max_logit_bias, dtype="<f4")
        if len(stop_ids) > cfg.max_stop_ids:
            raise RingRequestError(f"at most {cfg.max_stop_ids} stop token ids fit in the ring, got {len(stop_ids)}")
        logit_bias = dict(logit_bias or {})
        if len(logit_bias) > cfg.max_logit_bias:
            raise RingRequestError(f"at most {cfg.max_logit_bias} logit_bias entries fit in the ring, got {len(logit_bias)}")
        if not 0 <= n_logprobs <= cfg.max_logprobs:
            raise RingRequestError(f"n_logprobs must be in [0, {cfg.max_logprobs}], got {n_logprobs}")
        if max_tokens < 1:
            raise RingRequestError(f"max_tokens must be at least 1, got {max_tokens}")
        stop[: len(stop_ids)] = list(stop_ids)
        bias_ids[: len(logit_bias)] = list(logit_bias.keys())
        bias_vals[: len(logit_bias)] = list(logit_bias.values())
        with self._lock:
            if not self._free:
                return None
            rng = self.arena.allocate(prompt.size)
            if rng is None:
                self._refresh_claims()  # claimed prompts give their arena space back
                rng = self.arena.allocate(prompt.size)
                if rng is None:
                    return None
            slot = heapq.heappop(self._free)
            seq = self._seq[slot] + 1
            self._seq[slot] = seq
            arrival = self._next_arrival
            self._next_arrival += 1
            t = self.transport
            # payload ---------------------------------------------------------------
            arena = self._spec["arena"]
            pos = 0
            for off, count in rng.segments(cfg.arena_tokens):
                t.write(arena.element_offset(off), prompt[pos : pos + count])
                pos += count
            w = self._write_field
            w("seq", slot, seq)
            w("cancel", slot, 0)
            w("request_id", slot, request_id)
            w("arrival", slot, arrival)
            w("prompt_offset", slot, rng.start % cfg.arena_tokens)
            w("prompt_len", slot, prompt.size)
            w("max_tokens", slot, max_tokens)
            w("min_tokens", slot, min_tokens)
            w("ignore_eos", slot, int(bool(ignore_eos)))
            w("n_logprobs", slot, n_logprobs)
            w("top_k", slot, top_k if top_k > 0 else 0)
            w("temperature", slot, temperature)
            w("top_p", slot, top_p)
            w("min_p", slot, min_p)
            w("repetition_penalty", slot, repetition_penalty)
            w("presence_penalty", slot, presence_penalty)
            w("frequency_penalty", slot, frequency_penalty)
            w("seed", slot, seed)
            w("stop_ids", slot, stop)
            w("logit_bias_ids", slot, bias_ids)
            w("logit_bias_values", slot, bias_vals)
            w("consumed", slot, 0)
            # publish ---------------------------------------------------------------
            t.fence()
            w("state", slot, SLOT_WRITTEN)
            handle = RingHandle(slot, seq, request_id, n_logprobs, rng)
            self._active[slot] = handle
            return handle

    def submit(self, request_id: int, prompt_ids: Sequence[int] | np.ndarray, *,
               timeout_s: float = 5.0, **fields: Any) -> RingHandle:
        """:meth:`try_submit`, waiting up to ``timeout_s`` for room, then :class:`RingFullError`.

        Slots come back only through polling: wait here only while another thread polls.
        """
        deadline = time.monotonic() + timeout_s
        delay = 1e-4
        while True:
            handle = self.try_submit(request_id, prompt_ids, **fields)
            if handle is not None:
                return handle
            if time.monotonic() >= deadline:
                raise RingFullError(self.full_message(len(prompt_ids), timeout_s))
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def full_message(self, prompt_len: int, waited_s: float) -> str:
        what = "request slots" if not self._free else f"prompt-arena space for {prompt_len} tokens"
        return (
            f"the engine's ring has no free {what} after {waited_s:g} s "
            f"({self.config.n_slots} slots, {self.config.arena_tokens} arena tokens)"
        )

    # -- polling -------------------------------------------------------------------------

    def _refresh_claims(self) -> None:
        """Release the arena ranges of prompts the engine has claimed (state past WRITTEN)."""
        pending = [h for h in self._active.values() if not h.claimed and h.arena is not None]
        if not pending:
            return
        lo, hi = min(h.slot for h in pending), max(h.slot for h in pending) + 1
        states = self._read_field("state", lo, hi)
        for h in pending:
            if int(states[h.slot - lo]) not in (SLOT_WRITTEN, SLOT_FREE):
                self._claim(h)

    def _claim(self, h: RingHandle) -> None:
        h.claimed = True
        if h.arena is not None and all(
            o.claimed for o in self._active.values() if o.arena is h.arena
        ):
            self.arena.release(h.arena)

    def poll(self, handle: RingHandle) -> StreamDelta | None:
        """New output of one request, or None if nothing new."""
        return self.poll_many([handle]).get(handle)

    def poll_many(self, handles: Iterable[RingHandle] | None = None) -> dict[RingHandle, StreamDelta]:
        """Poll ``handles`` (default: all active); return the ones with news.

        Reads the state words first, then the produced counters, then the tokens: a state of
        FINISHED read first means the produced counter read after it is final.
        Handles whose stream breaks the protocol get ``handle.error`` set and a
        :class:`RingProtocolError` is not raised (the caller checks ``error``).
        """
        with self._lock:
            todo = [h for h in (self._active.values() if handles is None else handles) if not h.done and h.error is None]
            if not todo:
                return {}
            lo, hi = min(h.slot for h in todo), max(h.slot for h in todo) + 1
            states = self._read_field("state", lo, hi)
            self.transport.fence()  # acquire: nothing below is read before the state words
            produced = self._read_field("produced", lo, hi)
            self.transport.fence()
            out: dict[RingHandle, StreamDelta] = {}
            for h in todo:
                try:
                    delta = self._poll_one(h, int(states[h.slot - lo]), int(produced[h.slot - lo]))
                except RingProtocolError as exc:
                    logger.error("ring: %s", exc)
                    h.error = exc
                    self._active.pop(h.slot, None)  # leak the slot: its state is unknown
                    if h.arena is not None:  # but not the arena: it would block every prompt
                        self.arena.release(h.arena)
                    continue
                if delta is not None:
                    out[h] = delta
            return out

    def _poll_one(self, h: RingHandle, state: int, produced: int) -> StreamDelta | None:
        slot = h.slot
        if state == SLOT_WRITTEN:
            return None
        if state not in (SLOT_RUNNING, SLOT_FINISHED):
            raise RingProtocolError(f"slot {slot} went to state {state} while request {h.request_id} was in flight")
        first_news = not h.claimed
        if not h.claimed:
            stream_seq = int(self._read_field("stream_seq", slot, slot + 1)[0])
            if stream_seq != h.seq:
                raise RingProtocolError(
                    f"slot {slot}: the engine's stream serves sequence {stream_seq}, "
                    f"the request was written as {h.seq}"
                )
            self._claim(h)
        cap = self.config.stream_capacity
        n = produced - h.consumed
        if n < 0 or n > cap:
            raise RingProtocolError(
                f"slot {slot}: produced={produced} with consumed={h.consumed} and a stream of {cap}"
            )
        finished = state == SLOT_FINISHED
        if n == 0 and not finished:
            return None
        if first_news or h.consumed == 0 or finished:
            h.num_prompt_tokens = int(self._read_field("num_prompt_tokens", slot, slot + 1)[0])
            h.num_cached_tokens = int(self._read_field("num_cached_tokens", slot, slot + 1)[0])
        tokens: list[int] = []
        logprobs: list[float] = []
        top_ids = top_lps = None
        if n > 0:
            tokens = self._read_ring("tokens", slot, h.consumed, n).tolist()
            logprobs = self._read_ring("logprob", slot, h.consumed, n).tolist()
            if h.n_logprobs > 0:
                top_ids = self._read_ring("top_ids", slot, h.consumed, n)[:, : h.n_logprobs]
                top_lps = self._read_ring("top_logprobs", slot, h.consumed, n)[:, : h.n_logprobs]
            h.consumed = produced
            self._write_field("consumed", slot, produced)  # lets the engine reuse those entries
        reason = None
        if finished:
            code = int(self._read_field("finish_reason", slot, slot + 1)[0])
            reason = FINISH_REASON_NAMES[code] if 0 < code < len(FINISH_REASON_NAMES) else None
            if reason is None:
                raise RingProtocolError(f"slot {slot} finished with an invalid finish reason {code}")
            # Everything is read: the slot is ours again.
            self.transport.fence()
            self._write_field("state", slot, SLOT_FREE)
            h.done = True
            h.finish_reason = reason
            self._active.pop(slot, None)
            heapq.heappush(self._free, slot)
        return StreamDelta(tokens, logprobs, top_ids, top_lps, reason, h.num_prompt_tokens, h.num_cached_tokens)

    def cancel(self, handle: RingHandle) -> None:
        """Ask the engine to finish the request (FINISH_ABORT within one step). Idempotent;
        keep polling the handle until done, so its slot comes back."""
        with self._lock:
            if handle.done or handle.error is not None or handle.cancelled:
                return
            handle.cancelled = True
            self._write_field("cancel", handle.slot, 1)

    # -- engine status -------------------------------------------------------------------

    def engine_status(self) -> EngineStatus:
        control = self.transport.read(0, CONTROL_WORDS * 8).view("<i8")
        return EngineStatus(int(control[C_ENGINE_STATE]), int(control[C_HEARTBEAT]), control)

    def close(self) -> None:
        self.transport.close()


# -- the asyncio EngineClient ---------------------------------------------------------------


@dataclass(eq=False)
class _Stream:
    request_id: str
    handle: RingHandle
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    abandoned: bool = False  # the consumer left: drain silently


class RingEngineClient:
    """:class:`~blink.dpu.engine_client.EngineClient` over a :class:`RingClient`.

    One poller task polls every in-flight request each tick, sleeping ``poll_min_interval_s``
    after a tick that found output and backing off to ``poll_max_interval_s`` otherwise. It also
    watches the engine, and tells a slow engine from a dead one:

    - **dead** (final): engine state FAILED/STOPPED, the engine process gone (the transport can
      tell: loopback checks the segment creator's pid and start time), or a broken poller.
      Every stream ends at once with :class:`EngineDeadError`; new requests are refused.
    - **stalled**: the heartbeat has not moved for ``heartbeat_timeout_s`` while requests are
      in flight (one long step on a loaded CPU). :meth:`is_healthy` is False (``/health``
      answers 503), but nothing is lost: in-flight streams keep waiting, and new requests are
      still accepted (:meth:`is_accepting`) and queue in the ring, bounded by its slots and
      prompt arena (a full ring answers 503 + Retry-After after ``submit_timeout_s``, as
      always). When the heartbeat moves again all of them proceed.
    - **unresponsive**: the heartbeat has not moved for ``engine_dead_timeout_s`` (the hard
      limit) while requests are in flight: every in-flight stream ends with
      :class:`EngineDeadError` and its slot is cancelled, and new requests are refused. Not
      final either: once the heartbeat moves again, requests are served again.
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
        idle_interval_s: float = 0.1,
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
        self.idle_interval_s = idle_interval_s
        self.info: Any = None  # the bootstrap EngineInfo, when made by connect()
        self._streams: dict[str, _Stream] = {}
        self._by_handle: dict[RingHandle, _Stream] = {}
        self._dead: str | None = None
        self._stalled: str | None = None  # heartbeat stale: unhealthy, requests keep waiting
        self._stalled_at = 0.0
        self._unresponsive: str | None = None  # past the hard limit: refused until it moves
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._peer_checked = 0.0
        status = ring.engine_status()
        self._last_state = status.state
        self._last_heartbeat = status.heartbeat
        self._heartbeat_changed = time.monotonic()
        self._busy_since = time.monotonic()

    @classmethod
    async def connect(cls, host: str, port: int, *, secret: bytes | None = None,
                      expect_transport: str | None = None, connect_timeout_s: float = 10.0,
                      **kwargs: Any) -> "RingEngineClient":
        """Bootstrap with the engine at ``host:port`` (authenticating with ``secret``), attach
        the ring, return a client. The client holds the engine's one frontend lease until
        :meth:`close`."""
        from blink.transport.bootstrap import connect

        info, transport = await asyncio.to_thread(
            connect, host, port, secret=secret, timeout_s=connect_timeout_s,
            expect_transport=expect_transport,
        )
        try:
            ring = RingClient(transport)
        except BaseException:
            transport.close()
            raise
        try:
            client = cls(ring, model_name=info.model_name, max_model_len=info.max_model_len, **kwargs)
        except BaseException:
            ring.close()
            raise
        client.info = info
        return client

    # -- health --------------------------------------------------------------------------

    def _observe(self, status: EngineStatus, now: float) -> None:
        if status.heartbeat != self._last_heartbeat:
            self._last_heartbeat = status.heartbeat
            self._heartbeat_changed = now
        self._last_state = status.state

    def _stale_for(self, now: float) -> float:
        return now - max(self._heartbeat_changed, self._busy_since)

    def _check_peer(self, now: float) -> None:
        """While the heartbeat is not moving, ask the transport (at most every
        ``peer_check_interval_s``) whether the engine process still exists; declare the
        engine dead at once if it does not."""
        peer_alive = getattr(self.ring.transport, "peer_alive", None)  # None: cannot tell
        if peer_alive is None or self._dead is not None:
            return
        if (now - self._heartbeat_changed < self.peer_check_interval_s
                or now - self._peer_checked < self.peer_check_interval_s):
            return
        self._peer_checked = now
        if peer_alive() is False:
            self._declare_dead("the engine process has exited")

    def _sample(self) -> bool:
        """No poller sampling for us: sample the engine now. False if it cannot be read."""
        if self._task is not None and not self._task.done():
            return True
        now = time.monotonic()
        try:
            self._observe(self.ring.engine_status(), now)
        except BlinkError:
            return False
        self._check_peer(now)
        return True

    @property
    def dead_reason(self) -> str | None:
        """Why the engine counts as dead (final for this client), or None."""
        return self._dead

    @property
    def stalled(self) -> bool:
        """The heartbeat is stale with requests in flight (not yet past the hard limit)."""
        return self._stalled is not None and self._unresponsive is None

    def is_healthy(self) -> bool:
        """Not dead, not stalled, state READY, and the heartbeat moved within
        ``heartbeat_timeout_s`` (what ``/health`` reports)."""
        if self._dead is not None or self._stalled is not None or self._closed:
            return False
        return self._ready_within(self.heartbeat_timeout_s)

    def is_accepting(self) -> bool:
        """Whether a new request is taken: also during a stall (the request queues in the
        ring), not once the engine is dead, draining, or past ``engine_dead_timeout_s``."""
        return self._refusal() is None and self._ready_within(self.engine_dead_timeout_s)

    def _ready_within(self, limit_s: float) -> bool:
        """Sampled now: not dead, state READY, and the heartbeat moved within ``limit_s``."""
        if not self._sample() or self._dead is not None:
            return False
        return (self._last_state == ENGINE_READY
                and time.monotonic() - self._heartbeat_changed <= limit_s)

    def _refusal(self) -> str | None:
        if self._dead is not None:
            return f"the engine is not available: {self._dead}"
        if self._closed:
            return "the engine client is closed"
        if self._unresponsive is not None:
            return f"the engine is not responding: {self._unresponsive}"
        return None

    def _check_alive(self) -> None:
        refusal = self._refusal()
        if refusal is not None:
            raise EngineDeadError(refusal)

    def _declare_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        logger.error("engine declared dead: %s", reason)
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineDeadError(f"the engine died mid-request: {reason}"))
        self._streams.clear()
        self._by_handle.clear()

    def _give_up(self, reason: str) -> None:
        """Past the hard limit: end the in-flight streams with an error and cancel their
        slots; keep polling so the slots drain if the engine comes back."""
        self._unresponsive = reason
        logger.error("engine not responding, ending %d requests: %s", len(self._streams), reason)
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(EngineDeadError(f"the engine stopped responding mid-request: {reason}"))
            stream.abandoned = True
            self.ring.cancel(stream.handle)
        self._streams.clear()

    # -- the poller ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the poller task (done by the first generate; call it to watch an idle engine)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="blink-ring-poller")

    async def _run(self) -> None:
        interval = self.poll_min_interval_s
        while not self._closed and self._dead is None:
            try:
                progressed = self._tick()
            except Exception as exc:  # noqa: BLE001 - a broken poller must not hang the streams
                logger.exception("ring poller failed")
                self._declare_dead(f"the ring poller failed: {exc}")
                return
            if progressed:
                interval = self.poll_min_interval_s
            elif self.ring.active:
                interval = min(interval * 2, self.poll_max_interval_s)
            else:
                interval = self.idle_interval_s
            assert self._wake is not None
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass

    def _tick(self) -> bool:
        """One poll of everything; True if any request made progress."""
        now = time.monotonic()
        self._observe(self.ring.engine_status(), now)
        if self._last_state in (ENGINE_FAILED, ENGINE_STOPPED):
            self._declare_dead(f"engine state is {ENGINE_STATE_NAMES[self._last_state]}")
            return False
        self._check_peer(now)
        if self._dead is not None:
            return False
        if self._stalled is not None and self._heartbeat_changed > self._stalled_at:
            logger.warning("engine heartbeat resumed after %.1f s; %s", now - self._stalled_at,
                           "accepting requests again" if self._unresponsive else "requests continue")
            self._stalled = self._unresponsive = None
        active = self.ring.active
        if not active:
            return False
        stale = self._stale_for(now)
        if stale > self.heartbeat_timeout_s and self._stalled is None:
            self._stalled = (f"heartbeat stale for {stale:.1f} s (timeout "
                             f"{self.heartbeat_timeout_s:g} s) with {len(active)} requests in flight")
            self._stalled_at = now
            logger.warning("engine stalled: %s; requests keep waiting up to %g s",
                           self._stalled, self.engine_dead_timeout_s)
        if stale > self.engine_dead_timeout_s and self._unresponsive is None:
            self._give_up(f"heartbeat stale for {stale:.1f} s (limit {self.engine_dead_timeout_s:g} s, "
                          f"--engine-dead-timeout) with {len(active)} requests in flight")

        deltas = self.ring.poll_many(active)
        for handle in active:
            stream = self._by_handle.get(handle)
            if handle.error is not None:
                if stream is not None and not stream.abandoned:
                    stream.queue.put_nowait(handle.error)
                self._forget(handle)
                continue
            delta = deltas.get(handle)
            if delta is None:
                continue
            if stream is not None and not stream.abandoned:
                stream.queue.put_nowait(self._to_output(delta, stream))
            if handle.done:
                self._forget(handle)
        return bool(deltas)

    def _forget(self, handle: RingHandle) -> None:
        stream = self._by_handle.pop(handle, None)
        if stream is not None and self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    @staticmethod
    def _to_output(delta: StreamDelta, stream: _Stream) -> EngineOutput:
        logprobs = top = None
        if stream.params.logprobs is not None:
            logprobs = delta.logprobs
            if delta.top_ids is None:
                top = [[] for _ in delta.token_ids]
            else:
                top = [
                    [(int(i), float(lp)) for i, lp in zip(ids, lps)]
                    for ids, lps in zip(delta.top_ids, delta.top_logprobs)
                ]
        return EngineOutput(
            new_token_ids=delta.token_ids, logprobs=logprobs, top_logprobs=top,
            finished=delta.finished, finish_reason=delta.finish_reason,  # type: ignore[arg-type]
            num_prompt_tokens=delta.num_prompt_tokens, num_cached_tokens=delta.num_cached_tokens,
        )

    # -- EngineClient ----------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        self._check_alive()
        if request_id in self._streams:
            raise RingRequestError(f"request id {request_id!r} is already running")
        fields = ring_fields(params, len(prompt_ids), self.max_model_len, self.ring.config)
        self.start()
        ring_id = self.ring.new_request_id()
        deadline = time.monotonic() + self.submit_timeout_s
        while True:
            handle = self.ring.try_submit(ring_id, prompt_ids, **fields)
            if handle is not None:
                break
            if time.monotonic() >= deadline:
                raise EngineOverloadedError(
                    self.ring.full_message(len(prompt_ids), self.submit_timeout_s),
                    retry_after_s=self.retry_after_s,
                )
            await asyncio.sleep(0.002)  # the poller frees slots meanwhile
            self._check_alive()
        stream = _Stream(request_id, handle, params)
        now = time.monotonic()
        if len(self.ring.active) == 1 and now - self._heartbeat_changed <= self.heartbeat_timeout_s:
            # Judge the heartbeat from now, not from idle (unless it was already stale then).
            self._busy_since = now
        self._streams[request_id] = stream
        self._by_handle[handle] = stream
        assert self._wake is not None
        self._wake.set()
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
                stream.abandoned = True
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
                if self._dead is None:
                    self.ring.cancel(handle)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or self._dead is not None:
            return
        self.ring.cancel(stream.handle)
        if self._wake is not None:
            self._wake.set()

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
        )

    async def close(self) -> None:
        """Stop polling, cancel what is in flight, and close the transport."""
        if self._closed:
            return
        for stream in list(self._streams.values()):
            self.ring.cancel(stream.handle)
            stream.queue.put_nowait(EngineDeadError("the engine client was closed"))
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
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
        return c if c is not None and c.dead_reason is None and not self._closed else None

    # -- EngineClient ----------------------------------------------------------------------

    def is_healthy(self) -> bool:
        c = self._live()
        return c is not None and c.is_healthy()

    def is_accepting(self) -> bool:
        c = self._live()
        return c is not None and c.is_accepting()

    def unavailable_retry_after_s(self) -> float | None:
        """Seconds a refused client should wait (``Retry-After``) while the engine is being
        reconnected; None when a refusal is not about a restart."""
        return None if self._closed or self._live() is not None else self.retry_after_s

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        c = self._live()
        if c is None:
            raise EngineDeadError(
                f"the engine is restarting ({self._down or 'it went away'}); retry shortly",
                retry_after_s=self.retry_after_s)
        async for out in c.generate(request_id, prompt_ids, params):
            yield out

    async def abort(self, request_id: str) -> None:
        c = self._client
        if c is not None:
            await c.abort(request_id)

    def stats(self) -> EngineStats:
        c = self._live()
        if c is None:
            return EngineStats(running=0, waiting=0, kv_usage=0.0, prefix_cache_queries=0,
                               prefix_cache_hits=0, preemptions=0)
        return c.stats()

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
            if c is not None and c.dead_reason is None:
                await asyncio.sleep(self.watch_interval_s)
                continue
            self._down = c.dead_reason if c is not None else "not attached"
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
