"""The frontend side of the ring protocol (:mod:`blink.ring`), synchronous, over a one-sided
transport.

numpy only: this runs on the DPU image (no torch). Both the HTTP frontend (through
:class:`blink.dpu.ring_engine_client.RingEngineClient`) and the offline
:class:`blink.llm.LLM` use it. :class:`RingClient`: slot and prompt-arena allocation,
``submit`` (payload, fence, then the state word), ``poll_many``/``poll`` (produced counter,
then tokens; bumps ``consumed``; frees the slot once FINISHED and fully read), ``cancel``,
engine status, and adopting what a previous frontend left in the ring. What goes into a slot's
sampling fields is :mod:`blink.dpu.ring_packing`'s.

Conventions of the fields this module writes itself (the engine side reads them the same way):

- ``prompt_offset``: index in [0, arena_tokens); the prompt continues at index 0 after the end.
- ``request_id``: a ring-local int64 assigned here (the API's string ids stay in the frontend).
- ``seq``: bumped each time the slot is reused; the engine's ``stream_seq`` must echo it.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from blink.dpu.engine_client import EngineOutput
from blink.dpu.ring_packing import INT32_MAX, RingRequestError, pack_sampling
from blink.dpu.structured.masker import MaskError, TokenMasker
from blink.dpu.structured.workers import CompiledGrammar
from blink.errors import BlinkError
from blink.ring import (
    CANCEL_FORCE,
    CANCEL_REQUEST,
    KV_NONE,
    KV_RESERVE,
    KV_SEND,
    C_ENGINE_STATE,
    C_HEARTBEAT,
    C_MAGIC,
    C_TOTAL_BYTES,
    CONTROL_WORDS,
    FINISH_REASON_NAMES,
    MAGIC,
    SLOT_FINISHED,
    SLOT_FREE,
    SLOT_RUNNING,
    SLOT_WRITTEN,
    REQUEST,
    RingLayout,
    RingLayoutError,
    read_header,
)
from blink.transport.base import Transport

logger = logging.getLogger(__name__)

__all__ = [
    "ArenaAllocator", "ArenaRange", "EngineStatus", "KvRoute", "RingClient", "RingFullError",
    "RingHandle", "RingProtocolError", "attach_layout",
]


class RingFullError(BlinkError):
    """No free request slot or prompt-arena space within the bounded wait."""


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


@dataclass(frozen=True)
class KvRoute:
    """A request's part in a disaggregated prefill/decode (docs/disaggregation.md).

    ``KV_RESERVE`` (to a decode engine): reserve blocks for the prompt and wait for its KV.
    ``KV_SEND`` (to a prefill engine): after the prompt, write its KV into ``blocks`` of decode
    engine ``peer`` (its index in the prefill engine's ``kv_peers``) and publish it ready in
    that engine's slot ``slot`` of sequence ``seq``."""

    mode: int
    peer: int = -1
    slot: int = -1
    seq: int = -1
    blocks: tuple[int, ...] = ()


@dataclass(eq=False)
class RingHandle:
    """One submitted request: its slot, the slot's sequence number, and read progress."""

    slot: int
    seq: int
    request_id: int
    n_logprobs: int
    arena: ArenaRange | None
    submitted_at: float = field(default_factory=time.monotonic)  # when the state became WRITTEN
    consumed: int = 0  # tokens read so far (mirrors the stream's consumed counter)
    claimed: bool = False  # the engine took the prompt (state RUNNING or later)
    claimed_at: float | None = None  # when this client first saw the slot past WRITTEN
    admitted_step: int | None = None  # the engine's step count at admission (engine-written)
    done: bool = False  # finished, fully read, slot given back
    cancelled: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: BaseException | None = None  # protocol failure; the slot is leaked on purpose
    masker: TokenMasker | None = None  # structured outputs: follows the tokens, writes masks
    mask_error: str | None = None  # why its masks stopped (the request is being cancelled)
    kv_mode: int = KV_NONE  # KV_RESERVE: the first delta carries the reserved blocks
    #: prompt logprobs: the ring lane the engine writes them into (-1: none asked) and the
    #: top alternatives wanted; the lane is read and given back with the first token
    plp_lane: int = -1
    plp_top: int = 0
    plp_prompt: list[int] = field(default_factory=list)  # (the arena is reused once claimed)

    @property
    def queue_time_s(self) -> float | None:
        """Seconds from the request being written (state WRITTEN) to the engine admitting it
        (the slot left WRITTEN), as this client saw it: None until then. The resolution is the
        poll interval of whoever polls the handle."""
        return None if self.claimed_at is None else self.claimed_at - self.submitted_at

    def __repr__(self) -> str:
        return f"RingHandle(slot={self.slot}, seq={self.seq}, request_id={self.request_id})"


@dataclass(frozen=True)
class EngineStatus:
    """The control block as last read."""

    state: int
    heartbeat: int
    control: np.ndarray


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
        #: free prompt-logprob lanes (lowest first)
        self._free_lanes: list[int] = list(range(self.config.prompt_logprob_lanes))
        self._adopt_slots()

    # -- low-level field access ----------------------------------------------------------

    def _offset(self, name: str, slot: int) -> int:
        return self._spec[name].element_offset(slot)

    def _read_field(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of a per-slot field (of a request record's field: the records read)."""
        spec = self._spec[name]
        if spec.record is not None:
            return self._read_field(spec.record, lo, hi)[name]
        row = spec.row_nbytes
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
        entry = spec.item_nbytes
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
                self._write_field("cancel", slot, 0)  # FREE slots have cancel 0 (submit relies on it)
                self.transport.fence()
                self._write_field("state", slot, SLOT_FREE)  # nobody will read it any more
                self._free.append(slot)
            elif st in (SLOT_WRITTEN, SLOT_RUNNING):
                # An orphan of a previous frontend: cancel it and drain it to FREE.
                handle = RingHandle(slot, self._seq[slot], -1, 0, None, cancelled=True)
                handle.consumed = int(self._read_field("consumed", slot, slot + 1)[0])
                # A KV reservation's prefill request was the old frontend's too: nobody may
                # ever send its KV, so it is freed at once (force).
                reserved = int(self._read_field("kv_mode", slot, slot + 1)[0]) == KV_RESERVE
                self._write_field("cancel", slot, CANCEL_FORCE if reserved else CANCEL_REQUEST)
                lane = int(self._read_field("prompt_logprob_lane", slot, slot + 1)[0])
                if lane in self._free_lanes:  # the engine may write it until the slot finishes
                    self._free_lanes.remove(lane)
                    handle.plp_lane = lane
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
        heapq.heapify(self._free_lanes)
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

    @property
    def masks_pending(self) -> bool:
        """Some constrained request in flight: the engine's sampling gate waits for the mask
        this side writes after each of its tokens (so the poller should not back off far)."""
        with self._lock:
            return any(h.masker is not None and h.mask_error is None
                       for h in self._active.values())

    def _check_prompt(self, prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise RingRequestError("the prompt must be a non-empty list of token ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise RingRequestError(f"prompt token ids must be integers, got {prompt.dtype}")
        if prompt.min() < 0 or prompt.max() > INT32_MAX:
            raise RingRequestError("prompt token ids must be in [0, 2**31)")
        limit = min(self.config.max_model_len, self.config.arena_tokens)
        if prompt.size > limit:
            raise RingRequestError(
                f"the prompt has {prompt.size} tokens; this engine takes at most {limit}"
            )
        return prompt.astype("<i4")

    def try_submit(self, request_id: int, prompt_ids: Sequence[int] | np.ndarray,
                   sampling: np.ndarray | None = None, *, grammar: CompiledGrammar | None = None,
                   kv: KvRoute | None = None, **fields: Any) -> RingHandle | None:
        """Write one request into a free slot; None while no slot or arena space is free.

        ``kv``: the request's part in a disaggregated prefill/decode (:class:`KvRoute`); the
        ring must have kv fields (an engine with ``--role prefill|decode``).

        ``grammar``: the request's compiled structured-output constraint; the request gets
        its own matcher, whose first mask is written into the slot's mask row (epoch 0)
        before the record, and whose next masks follow the tokens as they are polled.

        ``sampling``: the packed record :func:`~blink.dpu.ring_packing.ring_fields` returns;
        else ``fields`` are :func:`~blink.dpu.ring_packing.pack_sampling`'s keywords. Order:
        the prompt tokens, the slot's whole request record (one write), fence, then
        state=WRITTEN, so the engine never sees the state word before the payload. ``cancel``
        is not written: it is 0 whenever a slot is FREE (cleared when a cancelled slot is
        freed).
        """
        prompt = self._check_prompt(prompt_ids)
        cfg = self.config
        if sampling is None:
            sampling = pack_sampling(cfg, **fields)
        elif fields:
            raise TypeError("try_submit takes a packed record or keyword fields, not both")
        elif sampling.dtype != self.layout.request_dtype:
            raise TypeError("try_submit: the record was packed for another ring layout")
        masker = None
        if grammar is not None:
            if cfg.mask_words == 0:
                raise RingRequestError("this engine runs with structured outputs off "
                                       "(--no-structured-outputs)")
            masker = grammar.new_masker()
            first_mask = masker.mask()  # a MaskError is a client error (400)
        if kv is not None:
            width = cfg.max_kv_blocks
            if width == 0:
                raise RingRequestError("this engine takes no part in disaggregation (--role both)")
            if kv.mode not in (KV_RESERVE, KV_SEND) or len(kv.blocks) > width:
                raise RingRequestError(f"bad KV route {kv}")
        wants_lane = int(sampling["prompt_logprobs"]) >= 0
        if wants_lane and cfg.prompt_logprob_lanes == 0:
            raise RingRequestError("this engine computes no prompt logprobs (no prompt-logprob "
                                   "lanes in its ring)")
        with self._lock:
            if not self._free or (wants_lane and not self._free_lanes):
                return None  # a request with prompt logprobs waits for a lane as for a slot
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
            record = sampling.reshape(1).copy()  # the caller's record stays as it was
            record["seq"] = seq
            record["request_id"] = request_id
            record["arrival"] = arrival
            record["prompt_offset"] = rng.start % cfg.arena_tokens
            record["prompt_len"] = prompt.size
            record["consumed"] = 0
            record["constrained"] = int(masker is not None)
            lane = heapq.heappop(self._free_lanes) if wants_lane else -1
            record["prompt_logprob_lane"] = lane
            if masker is not None:  # the first token's mask, then its epoch (0 outputs)
                self._write_mask(slot, first_mask, 0)
            if kv is not None:
                record["kv_mode"], record["kv_peer"] = kv.mode, kv.peer
                record["kv_slot"], record["kv_seq"] = kv.slot, kv.seq
                blocks = np.full(max(cfg.max_kv_blocks, 1), -1, dtype="<i4")
                blocks[: len(kv.blocks)] = kv.blocks
                record["kv_blocks"] = blocks
            else:
                record["kv_mode"] = KV_NONE
            t.write(self._offset(REQUEST, slot), record.view(np.uint8))
            # publish ---------------------------------------------------------------
            t.fence()
            self._write_field("state", slot, SLOT_WRITTEN)
            handle = RingHandle(slot, seq, request_id, int(record["logprobs"][0]), rng,
                                masker=masker, kv_mode=KV_NONE if kv is None else kv.mode,
                                plp_lane=lane, plp_top=max(int(record["prompt_logprobs"][0]), 0),
                                plp_prompt=prompt.tolist() if wants_lane else [])
            self._active[slot] = handle
            return handle

    def submit(self, request_id: int, prompt_ids: Sequence[int] | np.ndarray,
               sampling: np.ndarray | None = None, *, timeout_s: float = 5.0,
               grammar: CompiledGrammar | None = None, **fields: Any) -> RingHandle:
        """:meth:`try_submit`, waiting up to ``timeout_s`` for room, then :class:`RingFullError`.

        Slots come back only through polling: wait here only while another thread polls.
        """
        if sampling is None:  # packed (and checked) once, not once per retry
            sampling, fields = pack_sampling(self.config, **fields), {}
        deadline = time.monotonic() + timeout_s
        delay = 1e-4
        while True:
            handle = self.try_submit(request_id, prompt_ids, sampling, grammar=grammar, **fields)
            if handle is not None:
                return handle
            if time.monotonic() >= deadline:
                raise RingFullError(self.full_message(len(prompt_ids), timeout_s))
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _write_mask(self, slot: int, words: np.ndarray, epoch: int) -> None:
        """The slot's next-token mask, then (fenced) its epoch: the engine reads the mask
        only once it sees the epoch. Words past the ring's mask width (tokens the model's
        head does not produce) are dropped; missing ones are 0 (forbidden)."""
        width = self.config.mask_words
        row = words[:width]
        if row.size < width:
            row = np.concatenate([row, np.zeros(width - row.size, dtype="<i4")])
        self.transport.write(self._offset("mask", slot), np.ascontiguousarray(row, dtype="<i4"))
        self.transport.fence()
        self._write_field("mask_epoch", slot, epoch)

    def _follow_mask(self, h: RingHandle, tokens: list[int], produced: int) -> None:
        """A constrained request's new tokens: advance its matcher and publish the mask of
        output ``produced``. On a matcher error the request is cancelled and the error kept
        for its last delta (never sampled unconstrained: the engine's gate waits, then
        the cancel ends it)."""
        if h.masker is None or h.mask_error is not None:
            return
        try:
            h.masker.advance(tokens)
            self._write_mask(h.slot, h.masker.mask(), produced)
        except MaskError as exc:
            h.mask_error = str(exc)
            logger.warning("ring: request %d: %s", h.request_id, exc)
            self.cancel(h)

    def free_lanes(self) -> int:
        """Prompt-logprob lanes no request holds."""
        with self._lock:
            return len(self._free_lanes)

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
        h.claimed_at = time.monotonic()
        if h.arena is not None and all(
            o.claimed for o in self._active.values() if o.arena is h.arena
        ):
            self.arena.release(h.arena)

    def poll(self, handle: RingHandle) -> EngineOutput | None:
        """New output of one request, or None if nothing new."""
        return self.poll_many([handle]).get(handle)

    def poll_many(self, handles: Iterable[RingHandle] | None = None) -> dict[RingHandle, EngineOutput]:
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
            out: dict[RingHandle, EngineOutput] = {}
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

    def _poll_one(self, h: RingHandle, state: int, produced: int) -> EngineOutput | None:
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
            h.admitted_step = int(self._read_field("admitted_step", slot, slot + 1)[0])
            self._claim(h)
        cap = self.config.stream_capacity
        n = produced - h.consumed
        if n < 0 or n > cap:
            raise RingProtocolError(
                f"slot {slot}: produced={produced} with consumed={h.consumed} and a stream of {cap}"
            )
        finished = state == SLOT_FINISHED
        reservation = None
        if first_news and h.kv_mode == KV_RESERVE:  # the blocks were published before RUNNING
            blocks = self._read_field("kv_reserved", slot, slot + 1)[0]
            reservation = (slot, h.seq, [int(b) for b in blocks if b >= 0])
        if n == 0 and not finished and reservation is None:
            return None
        if first_news or h.consumed == 0 or finished:
            h.num_prompt_tokens = int(self._read_field("num_prompt_tokens", slot, slot + 1)[0])
            h.num_cached_tokens = int(self._read_field("num_cached_tokens", slot, slot + 1)[0])
        tokens: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        prompt_logprobs = None
        if h.plp_lane >= 0 and (n > 0 or finished):
            # the first token publishes the whole lane (payload first); a request that ends
            # without one has none to return, but its lane comes back too
            if n > 0 and h.consumed == 0:
                prompt_logprobs = self._read_prompt_logprobs(h)
            heapq.heappush(self._free_lanes, h.plp_lane)
            h.plp_lane = -1
        if n > 0:
            tokens = self._read_ring("tokens", slot, h.consumed, n).tolist()
            logprobs = self._read_ring("logprob", slot, h.consumed, n).tolist()
            if h.n_logprobs > 0:
                ids = self._read_ring("top_ids", slot, h.consumed, n)[:, : h.n_logprobs].tolist()
                lps = self._read_ring("top_logprobs", slot, h.consumed, n)[:, : h.n_logprobs].tolist()
                top = [list(zip(i, lp)) for i, lp in zip(ids, lps)]
            else:
                top = [[] for _ in tokens]
            h.consumed = produced
            self._write_field("consumed", slot, produced)  # lets the engine reuse those entries
            if h.masker is not None and not finished:
                self._follow_mask(h, tokens, produced)
        reason = None
        if finished:
            code = int(self._read_field("finish_reason", slot, slot + 1)[0])
            reason = FINISH_REASON_NAMES[code] if 0 < code < len(FINISH_REASON_NAMES) else None
            if reason is None:
                raise RingProtocolError(f"slot {slot} finished with an invalid finish reason {code}")
            # Everything is read: the slot is ours again.
            if h.cancelled:  # FREE slots have cancel 0: submit does not write it
                self._write_field("cancel", slot, 0)
            self.transport.fence()
            self._write_field("state", slot, SLOT_FREE)
            h.done = True
            h.finish_reason = reason
            if h.mask_error is not None:  # cancelled because the matcher failed
                reason = "error"
            elif reason == "error" and h.masker is not None:
                h.mask_error = ("structured outputs: the next-token mask did not reach the "
                                "engine within its --structured-mask-timeout")
            h.masker = None  # the engine no longer reads this slot's mask
            self._active.pop(slot, None)
            heapq.heappush(self._free, slot)
        return EngineOutput(
            token_ids=tokens, logprobs=logprobs, top_logprobs=top, finished=reason is not None,
            finish_reason=reason,  # type: ignore[arg-type]
            num_prompt_tokens=h.num_prompt_tokens, num_cached_tokens=h.num_cached_tokens,
            kv_reservation=reservation, error=h.mask_error if reason == "error" else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _read_prompt_logprobs(self, h: RingHandle) -> list[dict[int, tuple[float, int]] | None]:
        """The request's prompt logprobs from its lane: None for the first prompt token, then
        per position {token id: (logprob, rank)}, the prompt token first, then the top
        ``plp_top`` (vLLM's ``prompt_logprobs``)."""
        prompt = h.plp_prompt
        prompt_len = len(prompt)
        lane, top = h.plp_lane, h.plp_top

        def rows(name: str) -> np.ndarray:
            spec = self._spec[name]
            per_pos = spec.item_nbytes
            raw = self.transport.read(spec.element_offset((lane, 1)), (prompt_len - 1) * per_pos)
            return raw.view(spec.dtype).reshape((prompt_len - 1, *spec.shape[2:]))

        out: list[dict[int, tuple[float, int]] | None] = [None]
        if prompt_len < 2:
            return out
        chosen, ranks = rows("plp_logprob").tolist(), rows("plp_rank").tolist()
        ids = rows("plp_top_ids")[:, :top].tolist() if top else None
        lps = rows("plp_top_logprobs")[:, :top].tolist() if top else None
        for i in range(prompt_len - 1):
            entry = {prompt[i + 1]: (chosen[i], ranks[i])}
            for k in range(top):
                entry.setdefault(ids[i][k], (lps[i][k], k + 1))  # type: ignore[index]
            out.append(entry)
        return out

    def cancel(self, handle: RingHandle, force: bool = False) -> None:
        """Ask the engine to finish the request (FINISH_ABORT within one step). Idempotent;
        keep polling the handle until done, so its slot comes back. A KV reservation is freed
        only once its KV is there, unless ``force`` (the prefill engine writing it is known to
        be gone or to have given up)."""
        with self._lock:
            if handle.done or handle.error is not None or (handle.cancelled and not force):
                return
            handle.cancelled = True
            self._write_field("cancel", handle.slot, CANCEL_FORCE if force else CANCEL_REQUEST)

    # -- engine status -------------------------------------------------------------------

    def engine_status(self) -> EngineStatus:
        control = self.transport.read(0, CONTROL_WORDS * 8).view("<i8")
        return EngineStatus(int(control[C_ENGINE_STATE]), int(control[C_HEARTBEAT]), control)

    def close(self) -> None:
        self.transport.close()
