"""The ring protocol: the one byte layout shared by the engine and the frontend.

numpy only (the frontend runs without torch). The engine wraps the same arrays as torch
tensors (``torch.from_numpy``) and the device loop reads and writes them directly.

Memory is one region, mostly struct-of-arrays (a field is a contiguous array of ``n_slots``
entries, 64-byte aligned) so the device reads it coalesced, torch can view it without copies,
and a one-sided writer can address any field by (offset, length). What the frontend writes
for a new request is one record per slot instead (``request``: a numpy structured dtype, see
:func:`request_record_dtype`), so the whole payload is one write; its fields are strided
views on both sides:

    control block   int64[CONTROL_WORDS]    magic, version, sizes, engine state, heartbeat, stats
    slot words      one array per field     state word, cancel (polled by the device loop)
    request records record[n_slots]         seq, request id, arrival, prompt location, consumed,
                                            then the sampling fields (blink.shared.sampling_fields)
    prompt arena    int32[arena_tokens]     circular token buffer shared by all prompts
    mask area       int32[n_slots, mask_words]  each slot's structured-output token mask
                                            (bit t: token t allowed), written by the frontend,
                                            read by the sampler when the slot's mask_epoch
                                            matches the row's output count
    output streams  one array per field     token ring, produced counter, finish, logprobs
    prompt-logprob  one array per field     L lanes x max_model_len positions: the logprob and
    lanes           over [L, max_model_len]  rank of each prompt token, the top max_logprobs
                                            (id, logprob) at each position (prompt_logprobs)

Protocol (payload first, then the state word; readers read the state word first):
    frontend: slot FREE      -> writes the prompt into the arena and the slot's request record
                                (seq+1, consumed=0, sampling fields) -> fence -> state=WRITTEN;
                                cancel is 0 already (a FREE slot always has cancel 0)
    engine:   state WRITTEN  -> copies the prompt out of the arena, resets the stream
                                (stream_seq=seq, produced=0, finish=NONE, admitted_step=
                                its step count, the frontend's queue-time clock) -> state=RUNNING;
                                from then on the frontend may reuse that arena range
    engine:   each new token -> writes tokens[produced % capacity] (+ logprobs), then
                                produced += 1; never when produced - consumed == capacity
    engine:   finished       -> writes finish_reason, then state=FINISHED
    frontend: reads tokens up to produced, bumps consumed; after FINISHED and everything
                                read -> (cancel=0 if it was set) -> fence -> state=FREE
    frontend: cancel=1 at any time after WRITTEN; the engine finishes the request with
                                FINISH_ABORT within one step.

Prompt logprobs (``prompt_logprobs`` >= 0 in the request record; ``prompt_logprob_lanes`` =
L > 0 in the control block, 0: the engine does not compute them):
    frontend: a free lane l      -> request record prompt_logprob_lane = l (else -1); a request
                                    asking for prompt logprobs waits for a lane as for a slot
    engine:   each prefill chunk -> for every chunk position q whose next token q + 1 is a
                                    prompt token: lane l's entries at position q + 1, while the
                                    row has no output yet; all before the row's first token
                                    is published (produced 0 -> 1)
    frontend: produced >= 1      -> reads lane l's positions [1, prompt_len), frees the lane
                                    (also when the request finishes without an output)

Structured outputs (``constrained`` = 1 in the request record; docs/architecture.md,
"Structured outputs"). The frontend follows the request's tokens with a grammar matcher and
publishes, for each output count n, the mask of the token at output n:
    frontend: before WRITTEN     -> mask[slot] = the first token's mask -> fence -> mask_epoch=0
    engine:   sampling output n  -> waits (bounded) until mask_epoch[slot] == n, then masks the
                                    row's logits with mask[slot]; past the bound the request
                                    finishes with FINISH_ERROR (never sampled unconstrained)
    frontend: read token n       -> mask[slot] = the mask after it -> fence -> mask_epoch=n+1
The engine writes output n + 1 only after sampling it, and the frontend writes mask n + 1
only after reading output n, so the two never touch the same mask at once.

Disaggregated prefill/decode (docs/disaggregation.md; ``max_kv_blocks`` > 0 enables it):
    frontend -> decode ring:  a request with kv_mode=KV_RESERVE (prompt and sampling as usual)
    decode:   state WRITTEN  -> copies the prompt, allocates ceil(prompt_len / block_size)
                                blocks, publishes their ids in kv_reserved (-1 padded), resets
                                the stream -> state=RUNNING; the row waits for the KV
    frontend -> prefill ring: the same request with max_tokens=1 and kv_mode=KV_SEND,
                                kv_peer (the decode engine in the prefill engine's peer list),
                                kv_slot / kv_seq (the decode slot and its seq), kv_blocks (the
                                reserved ids)
    prefill:  after the prompt's step -> writes the prompt's KV blocks into the reserved blocks
                                of the decode engine's KV region (one-sided writes), then
                                kv_first_token[kv_slot] (the token it sampled) -> fence ->
                                kv_ready_seq[kv_slot] = kv_seq, both in the decode ring
    decode:   kv_ready_seq == stream_seq of a waiting row -> the row starts with
                                computed = prompt_len, tokens = prompt + first token (tensor code)
    Cancelling a row that waits for its KV takes effect once the KV is there (its blocks are
    still being written), unless cancel == CANCEL_FORCE (the writer is known to be gone).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np

from blink.errors import BlinkError
from blink.shared.sampling_fields import BAD_WORD_TOKENS, SAMPLING_FIELDS, numpy_fields

MAGIC = int.from_bytes(b"BLINKRNG", "little")
LAYOUT_VERSION = 11  # 2: the request record (one contiguous payload per slot); 3: grammar region
# (issue 15) or admitted_step (main); 4: both; 5: disaggregated prefill/decode (kv_* fields);
# 6: per-slot token masks with an epoch word replace the grammar region (issue 30);
# 7: allowed_token_ids, bad_words_ids and cache_salt in the request record (issue 33)
# 8: priority in the request record (issue 33, --scheduling-policy priority)
# 9: 56 control words: the speculative decoding words (C_SPEC_TOKENS, C_STAT_SPEC_*; issue 36)
# 10: prompt-logprob lanes (C_PROMPT_LOGPROB_LANES, the plp_* region, prompt_logprobs and
# prompt_logprob_lane in the request record; issue 33)
# 11: no prompt-logprob lane reserved when C_PROMPT_LOGPROB_LANES is 0 (was one)
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
    C_MASK_WORDS,  # int32 words of one slot's token mask (0: structured outputs off)
    C_MAX_KV_BLOCKS,  # width of the kv block-id fields (0: no disaggregation)
    C_STAT_KV_BYTES_SENT,  # prefill role: KV bytes written into decode engines
    C_STAT_KV_TRANSFERS,  # prefill role: requests whose KV was sent
    C_MAX_ALLOWED_TOKEN_IDS,  # width of the allowed_token_ids field
    C_MAX_BAD_WORDS_TOKENS,  # width of the bad_words_ids field
    C_SPEC_TOKENS,  # --speculative-config's num_speculative_tokens (0: speculation off)
    C_STAT_SPEC_DRAFTS,  # decode rows that verified a draft (vLLM's spec_decode_num_drafts)
    C_STAT_SPEC_DRAFT_TOKENS,  # draft tokens verified
    C_STAT_SPEC_ACCEPTED_TOKENS,  # draft tokens accepted
) = range(33)
#: accepted draft tokens per draft position: words C_STAT_SPEC_ACCEPTED_PER_POS + i, i < K
#: (vLLM's spec_decode_num_accepted_tokens_per_pos; K <= SPEC_POSITIONS)
C_STAT_SPEC_ACCEPTED_PER_POS = 33
SPEC_POSITIONS = 16
#: lanes of the prompt-logprob region (0: the engine computes no prompt logprobs)
C_PROMPT_LOGPROB_LANES = C_STAT_SPEC_ACCEPTED_PER_POS + SPEC_POSITIONS
CONTROL_WORDS = 56
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

# Request record field kv_mode.
KV_NONE, KV_RESERVE, KV_SEND = range(3)
# Cancel word values: CANCEL_FORCE also frees a row still waiting for its KV at once.
CANCEL_NONE, CANCEL_REQUEST, CANCEL_FORCE = range(3)


#: Value of a slot's mask_epoch while no mask is published for it.
MASK_EPOCH_NONE = -1


def mask_words_for(vocab_size: int) -> int:
    """int32 words of a token mask over ``vocab_size`` token ids (32 per word)."""
    return -(-int(vocab_size) // 32)


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
    #: width of allowed_token_ids (the most ids a request may allow)
    max_allowed_token_ids: int = 128
    #: width of bad_words_ids: rows of BAD_WORD_TOKENS entries, one banned sequence each
    max_bad_words_tokens: int = 256
    max_model_len: int = 8192
    #: int32 words of one slot's token mask (:func:`mask_words_for` the model's logits
    #: width); 0 = no mask area (requests with a constraint are then refused)
    mask_words: int = 0
    #: width of the kv block-id fields: the most KV blocks one prompt can have
    #: (ceil(max_model_len / block_size)); 0 = this engine takes no part in disaggregation
    max_kv_blocks: int = 0
    #: lanes of the prompt-logprob region (each max_model_len positions x max_logprobs top
    #: entries); 0 = the engine computes no prompt logprobs (requests asking are refused)
    prompt_logprob_lanes: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            low = 0 if name.startswith("max_") or name in ("mask_words", "prompt_logprob_lanes") else 1
            if not isinstance(value, int) or value < low:
                raise RingLayoutError(f"ring config: {name} must be a positive integer, got {value!r}")
        if self.max_bad_words_tokens % BAD_WORD_TOKENS:
            raise RingLayoutError(
                f"ring config: max_bad_words_tokens must be a multiple of {BAD_WORD_TOKENS}, "
                f"got {self.max_bad_words_tokens}"
            )
        if self.arena_tokens < self.max_model_len:
            raise RingLayoutError(
                f"ring config: arena_tokens ({self.arena_tokens}) must hold at least one prompt of "
                f"max_model_len ({self.max_model_len}) tokens"
            )


def _slot_fields(cfg: RingConfig) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Request-slot arrays of their own (one array per field over the slots): the words the
    device loop polls (read contiguously by tier B's gate kernel)."""
    i32 = np.dtype("<i4")
    return [
        ("state", i32, ()),
        ("cancel", i32, ()),  # 0 whenever the slot is FREE (the frontend clears it on freeing)
        # written by a prefill engine into a decode engine's ring (kv_ready_seq last)
        ("kv_first_token", i32, ()),
        ("kv_ready_seq", np.dtype("<i8"), ()),
        # written by the frontend: the output count the slot's token mask is for
        ("mask_epoch", i32, ()),
    ]


#: The slot's request record: everything the frontend writes for a new request, in one
#: contiguous record per slot so that one transport write carries the whole payload.
REQUEST = "request"


def _request_header_fields(cfg: RingConfig) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The request record's fields before the sampling fields."""
    i32, i64 = np.dtype("<i4"), np.dtype("<i8")
    kv_width = max(cfg.max_kv_blocks, 1)
    return [
        ("seq", i64, ()),
        ("request_id", i64, ()),
        ("arrival", i64, ()),  # global ticket: FCFS order of admission
        ("prompt_offset", i64, ()),  # in arena tokens; the prompt wraps around the arena end
        ("consumed", i64, ()),  # stream entries the frontend has read (it alone writes this)
        ("prompt_len", i32, ()),
        ("kv_mode", i32, ()),  # KV_NONE / KV_RESERVE (decode) / KV_SEND (prefill)
        ("kv_peer", i32, ()),  # KV_SEND: index of the decode engine in the prefill's peers
        ("kv_slot", i32, ()),  # KV_SEND: the decode engine's slot holding the reservation
        ("kv_seq", i64, ()),  # KV_SEND: that slot's seq
        ("kv_blocks", i32, (kv_width,)),  # KV_SEND: the reserved block ids (-1 padded)
    ]


def request_record_dtype(cfg: RingConfig) -> np.dtype:
    """The numpy structured dtype of one slot's request record: the header fields, then the
    sampling fields of :data:`blink.shared.sampling_fields.SAMPLING_FIELDS` (the one table),
    each aligned to its item size, the record size a multiple of 8."""
    names, formats, offsets, offset = [], [], [], 0
    for name, dtype, shape in _request_header_fields(cfg) + numpy_fields(cfg):
        offset = -(-offset // dtype.itemsize) * dtype.itemsize
        names.append(name)
        formats.append((dtype, shape) if shape else dtype)
        offsets.append(offset)
        offset += dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    itemsize = -(-offset // 8) * 8
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})


def _stream_fields(cfg: RingConfig) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Output-stream fields: (name, dtype, per-slot shape)."""
    i32, i64, f32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")
    cap, n = cfg.stream_capacity, max(cfg.max_logprobs, 1)
    return [
        ("stream_seq", i64, ()),  # the slot seq this stream currently serves
        ("produced", i64, ()),  # written by the engine (``consumed`` is in the request record)
        ("finish_reason", i32, ()),
        ("num_prompt_tokens", i32, ()),
        ("num_cached_tokens", i32, ()),  # prompt tokens served from the prefix cache
        ("admitted_step", i64, ()),  # the engine's step count when it admitted the request
        ("kv_reserved", i32, (max(cfg.max_kv_blocks, 1),)),  # KV_RESERVE: the block ids (-1 pad)
        ("tokens", i32, (cap,)),
        ("logprob", f32, (cap,)),
        ("top_ids", i32, (cap, n)),
        ("top_logprobs", f32, (cap, n)),
    ]


def _prompt_logprob_fields(cfg: RingConfig) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The prompt-logprob lanes (leading dimension: the lanes, not the slots); position p of
    a lane describes prompt token p (p >= 1) given the tokens before it."""
    i32, f32 = np.dtype("<i4"), np.dtype("<f4")
    # 0 lanes (--prompt-logprobs-lanes 0, or an engine whose step computes none): 0 bytes
    lanes, m, n = cfg.prompt_logprob_lanes, cfg.max_model_len, max(cfg.max_logprobs, 1)
    return [
        ("plp_logprob", f32, (lanes, m)),  # the prompt token's logprob
        ("plp_rank", i32, (lanes, m)),  # its rank: the ids at least as likely, itself included (vLLM's)
        ("plp_top_ids", i32, (lanes, m, n)),
        ("plp_top_logprobs", f32, (lanes, m, n)),
    ]


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]  # full shape, leading n_slots (or arena/control size)
    offset: int  # byte offset in the region (of entry 0)
    #: bytes from one slot's entry to the next: the row size for a region of its own, the
    #: record size for a field of the request record (None: the row size)
    stride: int | None = None
    #: the record this field lives in (:data:`REQUEST`), None for a region of its own
    record: str | None = None

    # (computed once per field: the frontend's poller asks for them on every read)
    @functools.cached_property
    def row_nbytes(self) -> int:
        """Bytes of one entry of the leading dimension."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @functools.cached_property
    def row_stride(self) -> int:
        return self.row_nbytes if self.stride is None else self.stride

    @functools.cached_property
    def item_nbytes(self) -> int:
        """Bytes of one entry of the second dimension (a stream field's token, a prompt
        logprob lane's position): what the frontend reads per token."""
        return int(np.prod(self.shape[2:], dtype=np.int64)) * self.dtype.itemsize

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes the field spans, from entry 0 to the end of the last entry."""
        return (self.shape[0] - 1) * self.row_stride + self.row_nbytes

    @functools.cached_property
    def _strides(self) -> tuple[int, ...]:
        return (self.row_stride, *c_strides(self.shape[1:], self.dtype.itemsize))

    def element_offset(self, index: tuple[int, ...] | int) -> int:
        """Byte offset of one element (or one row, given a shorter index) in the region."""
        if isinstance(index, int):  # a slot's row: the poller's every read
            return self.offset + index * self.row_stride
        return self.offset + sum(i * s for i, s in zip(index, self._strides))


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RingLayout:
    """Byte offsets of every field for a given :class:`RingConfig`.

    ``regions``: the region's top-level parts in address order, each 64-byte aligned (control,
    the slot arrays, the request records, the arena, the stream arrays). ``fields``: every
    named field, the request record's sub-fields included (strided: ``stride`` is the record
    size). Iterating a layout gives ``fields``.
    """

    def __init__(self, cfg: RingConfig) -> None:
        self.config = cfg
        self.fields: dict[str, FieldSpec] = {}
        self.regions: dict[str, FieldSpec] = {}
        offset = 0

        def add(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> FieldSpec:
            nonlocal offset
            spec = FieldSpec(name, np.dtype(dtype), shape, offset)
            self.fields[name] = self.regions[name] = spec
            offset = _align(offset + spec.nbytes)
            return spec

        add("control", np.dtype("<i8"), (CONTROL_WORDS,))
        for name, dtype, shape in _slot_fields(cfg):
            add(name, dtype, (cfg.n_slots, *shape))
        self.request_dtype = record = request_record_dtype(cfg)
        base = add(REQUEST, record, (cfg.n_slots,))
        for name in record.names:
            sub, sub_offset = record.fields[name][:2]
            dtype, shape = (sub.base, sub.shape) if sub.subdtype else (sub, ())
            self.fields[name] = FieldSpec(name, dtype, (cfg.n_slots, *shape),
                                          base.offset + sub_offset, record.itemsize, REQUEST)
        add("arena", np.dtype("<i4"), (cfg.arena_tokens,))
        add("mask", np.dtype("<i4"), (cfg.n_slots, max(cfg.mask_words, 1)))
        for name, dtype, shape in _stream_fields(cfg):
            add(name, dtype, (cfg.n_slots, *shape))
        lane_fields = _prompt_logprob_fields(cfg)
        for name, dtype, shape in lane_fields:
            add(name, dtype, shape)
        self.total_bytes = offset
        #: the fields indexed by slot first (all but the control block, the arena and the
        #: prompt-logprob lanes), the request record included
        not_slots = {"control", "arena", *(name for name, _, _ in lane_fields)}
        self.slot_fields: tuple[str, ...] = tuple(
            name for name in self.fields if name not in not_slots)

    def __iter__(self) -> Iterator[FieldSpec]:
        return iter(self.fields.values())


class Ring:
    """Named numpy views of the ring fields over a writable buffer (shared memory, pinned
    host memory, a registered RDMA region...). Attribute access gives the array:
    ``ring.state[slot]``, ``ring.tokens[slot, i]``, ``ring.control[C_HEARTBEAT]``; the
    request record's sub-fields are strided views (``ring.seed[slot]``), ``ring.request`` the
    records themselves."""

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
            if spec.record is not None:
                view = self.arrays[spec.record][spec.name]
            else:
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
        c[C_MAX_ALLOWED_TOKEN_IDS] = cfg.max_allowed_token_ids
        c[C_MAX_BAD_WORDS_TOKENS] = cfg.max_bad_words_tokens
        c[C_MAX_MODEL_LEN] = cfg.max_model_len
        c[C_MASK_WORDS] = cfg.mask_words
        c[C_MAX_KV_BLOCKS] = cfg.max_kv_blocks
        c[C_PROMPT_LOGPROB_LANES] = cfg.prompt_logprob_lanes
        c[C_ENGINE_STATE] = ENGINE_STARTING
        for f in SAMPLING_FIELDS:  # neutral values (-1 padding for id vectors)
            if f.pad != 0:
                ring.arrays[f.name][...] = f.pad
        ring.kv_blocks[...] = -1
        ring.kv_reserved[...] = -1
        ring.kv_ready_seq[...] = -1
        ring.mask_epoch[...] = MASK_EPOCH_NONE
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
        max_allowed_token_ids=int(control[C_MAX_ALLOWED_TOKEN_IDS]),
        max_bad_words_tokens=int(control[C_MAX_BAD_WORDS_TOKENS]),
        max_model_len=int(control[C_MAX_MODEL_LEN]),
        mask_words=int(control[C_MASK_WORDS]),
        max_kv_blocks=int(control[C_MAX_KV_BLOCKS]),
        prompt_logprob_lanes=int(control[C_PROMPT_LOGPROB_LANES]),
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
