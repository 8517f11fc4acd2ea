"""The ring protocol: the one byte layout shared by the engine and the frontend.

numpy only (the frontend runs without torch). The engine wraps the same arrays as torch
tensors (``torch.from_numpy``) and the device loop reads and writes them directly.

Memory is one region, laid out as struct-of-arrays (every field a contiguous array of
``n_slots`` entries, 64-byte aligned) so the device reads it coalesced, torch can view it
without copies, and a one-sided writer can address any field by (offset, length):

    control block  int64[CONTROL_WORDS]     magic, version, sizes, engine state, heartbeat, stats
    request slots  one array per field      state word, seq, request id, prompt location, sampling
    prompt arena   int32[arena_tokens]      circular token buffer shared by all prompts
    output streams one array per field      token ring, produced/consumed counters, finish, logprobs

Protocol (payload first, then the state word; readers read the state word first):
    frontend: slot FREE      -> writes payload (prompt in the arena, sampling fields, seq+1,
                                cancel=0, consumed=0) -> writes state=WRITTEN
    engine:   state WRITTEN  -> copies the prompt out of the arena, resets the stream
                                (stream_seq=seq, produced=0, finish=NONE) -> state=RUNNING;
                                from then on the frontend may reuse that arena range
    engine:   each new token -> writes tokens[produced % capacity] (+ logprobs), then
                                produced += 1; never when produced - consumed == capacity
    engine:   finished       -> writes finish_reason, then state=FINISHED
    frontend: reads tokens up to produced, bumps consumed; after FINISHED and everything
                                read -> state=FREE
    frontend: cancel=1 at any time after WRITTEN; the engine finishes the request with
                                FINISH_ABORT within one step.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np

from blink.errors import BlinkError

MAGIC = int.from_bytes(b"BLINKRNG", "little")
LAYOUT_VERSION = 1
ALIGN = 64

# Control block word indices (all int64).
(
    C_MAGIC,
    C_VERSION,
    C_TOTAL_BYTES,
    C_N_SLOTS,
    C_ARENA_TOKENS,
    C_STREAM_CAPACITY,
    C_MAX_LOGPROBS,
    C_MAX_STOP_IDS,
    C_MAX_LOGIT_BIAS,
    C_MAX_MODEL_LEN,
    C_ENGINE_STATE,
    C_HEARTBEAT,
    C_SHUTDOWN,
    C_STAT_RUNNING,
    C_STAT_WAITING,
    C_STAT_KV_BLOCKS_USED,
    C_STAT_KV_BLOCKS_TOTAL,
    C_STAT_PREFIX_QUERIES,
    C_STAT_PREFIX_HITS,
    C_STAT_PREEMPTIONS,
    C_STAT_STEPS,
    C_STAT_PROMPT_TOKENS,
    C_STAT_GENERATED_TOKENS,
) = range(23)
CONTROL_WORDS = 32
#: Reserved for the engine: a write sink for its fixed-shape scatters into the slot state
#: words (lanes with nothing to publish write here). The frontend never reads or writes it.
C_ENGINE_SCRATCH = CONTROL_WORDS - 1

# Engine states (control word C_ENGINE_STATE).
ENGINE_STARTING, ENGINE_READY, ENGINE_DRAINING, ENGINE_STOPPED, ENGINE_FAILED = range(5)
ENGINE_STATE_NAMES = ("starting", "ready", "draining", "stopped", "failed")

# Slot state words.
SLOT_FREE, SLOT_WRITTEN, SLOT_RUNNING, SLOT_FINISHED = range(4)

# Finish reasons (stream field finish_reason).
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = range(5)
FINISH_REASON_NAMES = (None, "stop", "length", "abort", "error")


class RingLayoutError(BlinkError):
    """The ring memory does not hold the layout this side expects."""


@dataclass(frozen=True)
class RingConfig:
    """Sizes that fix the layout. Both sides must agree on every field."""

    n_slots: int = 256
    arena_tokens: int = 1 << 20
    stream_capacity: int = 64
    max_logprobs: int = 20
    max_stop_ids: int = 16
    max_logit_bias: int = 32
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < (0 if name.startswith("max_") else 1):
                raise RingLayoutError(f"ring config: {name} must be a positive integer, got {value!r}")
        if self.arena_tokens < self.max_model_len:
            raise RingLayoutError(
                f"ring config: arena_tokens ({self.arena_tokens}) must hold at least one prompt of "
                f"max_model_len ({self.max_model_len}) tokens"
            )


def _slot_fields(cfg: RingConfig) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Request-slot fields: (name, dtype, per-slot shape)."""
    i32, i64, f32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")
    return [
        ("state", i32, ()),
        ("cancel", i32, ()),
        ("seq", i64, ()),
        ("request_id", i64, ()),
        ("arrival", i64, ()),  # global ticket: FCFS order of admission
        ("prompt_offset", i64, ()),  # in arena tokens; the prompt wraps around the arena end
        ("prompt_len", i32, ()),
        ("max_tokens", i32, ()),
        ("min_tokens", i32, ()),
        ("ignore_eos", i32, ()),
        ("n_logprobs", i32, ()),
        ("top_k", i32, ()),
        ("temperature", f32, ()),
        ("top_p", f32, ()),
        ("min_p", f32, ()),
        ("repetition_penalty", f32, ()),
        ("presence_penalty", f32, ()),
        ("frequency_penalty", f32, ()),
        ("seed", i64, ()),
        ("stop_ids", i32, (cfg.max_stop_ids,)),  # -1 padded
        ("logit_bias_ids", i32, (cfg.max_logit_bias,)),  # -1 padded
        ("logit_bias_values", f32, (cfg.max_logit_bias,)),
    ]


def _stream_fields(cfg: RingConfig) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Output-stream fields: (name, dtype, per-slot shape)."""
    i32, i64, f32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")
    cap, n = cfg.stream_capacity, max(cfg.max_logprobs, 1)
    return [
        ("stream_seq", i64, ()),  # the slot seq this stream currently serves
        ("produced", i64, ()),  # written by the engine
        ("consumed", i64, ()),  # written by the frontend
        ("finish_reason", i32, ()),
        ("num_prompt_tokens", i32, ()),
        ("num_cached_tokens", i32, ()),  # prompt tokens served from the prefix cache
        ("tokens", i32, (cap,)),
        ("logprob", f32, (cap,)),
        ("top_ids", i32, (cap, n)),
        ("top_logprobs", f32, (cap, n)),
    ]


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]  # full shape, leading n_slots (or arena/control size)
    offset: int  # byte offset in the region

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def element_offset(self, index: tuple[int, ...] | int) -> int:
        """Byte offset of one element (or one row, given a shorter index) in the region."""
        index = (index,) if isinstance(index, int) else index
        strides = _c_strides(self.shape, self.dtype.itemsize)
        return self.offset + sum(i * s for i, s in zip(index, strides))


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RingLayout:
    """Byte offsets of every field for a given :class:`RingConfig`."""

    def __init__(self, cfg: RingConfig) -> None:
        self.config = cfg
        self.fields: dict[str, FieldSpec] = {}
        offset = 0

        def add(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
            nonlocal offset
            spec = FieldSpec(name, np.dtype(dtype), shape, offset)
            self.fields[name] = spec
            offset = _align(offset + spec.nbytes)

        add("control", np.dtype("<i8"), (CONTROL_WORDS,))
        for name, dtype, shape in _slot_fields(cfg):
            add(name, dtype, (cfg.n_slots, *shape))
        add("arena", np.dtype("<i4"), (cfg.arena_tokens,))
        for name, dtype, shape in _stream_fields(cfg):
            add(name, dtype, (cfg.n_slots, *shape))
        self.total_bytes = offset

    def __iter__(self) -> Iterator[FieldSpec]:
        return iter(self.fields.values())


class Ring:
    """Named numpy views of the ring fields over a writable buffer (shared memory, pinned
    host memory, a registered RDMA region...). Attribute access gives the array:
    ``ring.state[slot]``, ``ring.tokens[slot, i]``, ``ring.control[C_HEARTBEAT]``."""

    def __init__(self, buffer, layout: RingLayout) -> None:
        raw = np.frombuffer(buffer, dtype=np.uint8)
        if raw.size < layout.total_bytes:
            raise RingLayoutError(
                f"ring region is {raw.size} bytes, the layout needs {layout.total_bytes}"
            )
        self.buffer = buffer
        self.layout = layout
        self.config = layout.config
        self.arrays: dict[str, np.ndarray] = {}
        for spec in layout:
            view = raw[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)
            self.arrays[spec.name] = view
            setattr(self, spec.name, view)

    # -- creation / attachment -------------------------------------------------------------

    @classmethod
    def create(cls, buffer, cfg: RingConfig) -> "Ring":
        """Engine side: lay out a zeroed region and write the header (state STARTING)."""
        layout = RingLayout(cfg)
        ring = cls(buffer, layout)
        np.frombuffer(buffer, dtype=np.uint8)[: layout.total_bytes] = 0
        c = ring.control
        c[C_VERSION] = LAYOUT_VERSION
        c[C_TOTAL_BYTES] = layout.total_bytes
        c[C_N_SLOTS] = cfg.n_slots
        c[C_ARENA_TOKENS] = cfg.arena_tokens
        c[C_STREAM_CAPACITY] = cfg.stream_capacity
        c[C_MAX_LOGPROBS] = cfg.max_logprobs
        c[C_MAX_STOP_IDS] = cfg.max_stop_ids
        c[C_MAX_LOGIT_BIAS] = cfg.max_logit_bias
        c[C_MAX_MODEL_LEN] = cfg.max_model_len
        c[C_ENGINE_STATE] = ENGINE_STARTING
        ring.stop_ids[:] = -1
        ring.logit_bias_ids[:] = -1
        c[C_MAGIC] = MAGIC  # last: a reader that sees the magic sees a complete header
        return ring

    @classmethod
    def attach(cls, buffer) -> "Ring":
        """Either side: read the header from an existing region and refuse a mismatch."""
        return cls(buffer, RingLayout(read_header(buffer)))

    # -- small helpers both sides use -------------------------------------------------------

    @property
    def engine_state(self) -> int:
        return int(self.control[C_ENGINE_STATE])

    @property
    def heartbeat(self) -> int:
        return int(self.control[C_HEARTBEAT])


def config_of_control(control: Any) -> RingConfig:
    """The sizes a control block records (int64 words, any indexable: numpy or a host tensor)."""
    return RingConfig(
        n_slots=int(control[C_N_SLOTS]),
        arena_tokens=int(control[C_ARENA_TOKENS]),
        stream_capacity=int(control[C_STREAM_CAPACITY]),
        max_logprobs=int(control[C_MAX_LOGPROBS]),
        max_stop_ids=int(control[C_MAX_STOP_IDS]),
        max_logit_bias=int(control[C_MAX_LOGIT_BIAS]),
        max_model_len=int(control[C_MAX_MODEL_LEN]),
    )


def read_header(buffer) -> RingConfig:
    """Validate the control block of ``buffer`` and return the config it describes."""
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if raw.size < CONTROL_WORDS * 8:
        raise RingLayoutError(f"ring region is only {raw.size} bytes: no control block")
    control = raw[: CONTROL_WORDS * 8].view("<i8")
    if int(control[C_MAGIC]) != MAGIC:
        raise RingLayoutError("ring region has no Blink ring header (bad magic): is the engine running and initialised?")
    version = int(control[C_VERSION])
    if version != LAYOUT_VERSION:
        raise RingLayoutError(
            f"ring layout version mismatch: engine has version {version}, this side speaks version {LAYOUT_VERSION}"
        )
    cfg = config_of_control(control)
    expected = RingLayout(cfg).total_bytes
    if int(control[C_TOTAL_BYTES]) != expected or raw.size < expected:
        raise RingLayoutError(
            f"ring size mismatch: header says {int(control[C_TOTAL_BYTES])} bytes, layout needs "
            f"{expected}, region has {raw.size}"
        )
    return cfg
