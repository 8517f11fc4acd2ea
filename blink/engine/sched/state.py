"""Fixed-shape engine state: what the device-resident scheduler reads and writes every step.

Every tensor here is allocated once, at startup, on the engine device; a step only mutates
them in place. Nothing is ever resized, so the same code runs on CPU tensors, on GPU tensors
and inside a captured CUDA graph.

Rows: engine row ``i`` serves ring slot ``i`` (S = the ring's ``n_slots``), so admission needs
no row allocator. A row is in one of five states (``ROW_*``): EMPTY (no request), WAITING
(admitted or preempted, holds no computed KV beyond prefix-cache hits), RUNNING (scheduled
at least once since then), RELEASING (finished and published; its block references are
being dropped, a bounded number of blocks per step, and its slot's next request waits until
the row is EMPTY) or AWAITING_KV (disaggregation, decode role: blocks reserved for a prompt
whose KV a prefill engine is writing). ``EngineState.row(i)`` shows one row readably. A
request is just "``num_computed`` of ``num_tokens`` tokens have KV in the cache" (vLLM V1's
idea): prefill, chunked prefill, decode and recompute after preemption are the same thing.

Blocks: the KV pool has ``num_blocks`` blocks; id ``num_blocks`` is the scratch block (the
executor allocates ``num_blocks + 1``). Per-block arrays have ``num_blocks + 1`` entries so
that fixed-shape scatters can send their unused lanes to the scratch entry. A block-table
entry equal to ``num_blocks`` means "no block", so the table is always a valid index.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from blink.errors import BlinkError
from blink.ring import REQUEST, Ring, RingConfig, RingLayout, c_strides
from blink.shared.sampling_fields import SAMPLING_FIELDS as TABLE

# Row status (module docstring). AWAITING_KV (decode role): blocks reserved for a prompt whose KV a prefill
# engine is writing; not scheduled, never preempted, until the ring says the KV is there.
ROW_EMPTY, ROW_WAITING, ROW_RUNNING, ROW_RELEASING, ROW_AWAITING_KV = 0, 1, 2, 3, 4

# EngineState.kv_route columns (prefill role: where a request's KV goes once computed).
KV_ROUTE_MODE, KV_ROUTE_PEER, KV_ROUTE_SLOT, KV_ROUTE_SEQ = range(4)

#: ROW_* value -> its name, for :meth:`EngineState.row`
ROW_STATUS_NAMES = {ROW_EMPTY: "EMPTY", ROW_WAITING: "WAITING", ROW_RUNNING: "RUNNING",
                    ROW_RELEASING: "RELEASING", ROW_AWAITING_KV: "AWAITING_KV"}


# Cumulative counters in ``EngineState.counters`` (mirrored into the ring control block).
(
    K_PREFIX_QUERIES,  # tokens looked up in the prefix cache
    K_PREFIX_HITS,  # tokens served from it
    K_PREFIX_REJECTS,  # hash matches that failed token/parent verification
    K_PREEMPTIONS,
    K_STEPS,
    K_PROMPT_TOKENS,  # prompt tokens of admitted requests
    K_GENERATED_TOKENS,
) = range(7)
NUM_COUNTERS = 7

INT64_MAX = 2**63 - 1

#: SchedulerConfig.scheduling_policy values (vLLM's --scheduling-policy)
SCHEDULING_POLICIES = ("fcfs", "priority")


def geometric_buckets(first: int, factor: int, last: int) -> tuple[int, ...]:
    """``first, first*factor, ...`` below ``last``, then ``last`` itself."""
    buckets, b = [], first
    while b < last:
        buckets.append(b)
        b *= factor
    buckets.append(last)
    return tuple(buckets)


def default_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of two from 8 up to the token budget, plus the budget itself."""
    return geometric_buckets(8, 2, max_num_batched_tokens)


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``num_tokens`` tokens (host side, between steps)."""
    i = bisect.bisect_left(buckets, num_tokens)
    if i == len(buckets):
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes and policy knobs of the scheduler. All fixed at startup.

    max_num_batched_tokens: the per-step token budget; also T, the flat batch size.
    max_admit_per_step: ring slots admitted (and prefix-cache lookups done) per step.
    admit_window_tokens: prompt tokens copied out of the arena per step (one flat gather);
        default and minimum ``max_model_len``, so the oldest prompt always fits.
    lookup_window_blocks: blocks hashed and probed by the prefix-cache lookup per step;
        default and minimum ``max_blocks_per_seq`` (one max-length prompt).
    release_window_blocks: block references dropped per step for finished rows; default
        the most blocks one step can allocate (``alloc_window_blocks``), minimum
        ``max_blocks_per_seq``.
    eos_token_ids: ids that end a request (unless ``ignore_eos``).
    buckets: token counts graphs are captured for (default: :func:`default_buckets`).
    prefix_probes: probe window of the open-addressing prefix-cache table.
    mask_timeout_s: how long a constrained row waits at the sampling gate for the frontend's
        token mask before it finishes with an error (blink.engine.token_mask).
    scheduling_policy: ``fcfs`` (arrival order) or ``priority`` (vLLM's: the request's
        ``priority`` field first, lower = sooner, then arrival) for admission, the token
        budget, blocks and preemption (the last in that order is preempted first).
    priority_other_prefill_tokens: under the priority policy, the prefill tokens per step of
        the rows prefilling their prompt after the first one in that order, together (the
        first asks for all it needs): one large prefill per step at most, so no step that
        an urgent request waits for, or prefills in, is long with less urgent prefills.
        Unused under fcfs.
    priority_urgent_window_steps: under the priority policy, W: for how many steps the
        most urgent priority seen among the live rows is remembered (``EngineState``'s
        ``urgent_priority`` register). While it is, a prompt less urgent than it loses the
        first prefill's privilege and only shares ``priority_other_prefill_tokens``: the step
        an urgent arrival waits for (the one in flight) is short too, not a whole less urgent
        prompt. W must span the gap between urgent arrivals (256 steps: over 2 s at a
        10 ms step; bench_priority sends one every 0.5 s); with nothing urgent for W steps the
        privilege returns, so an all-low workload prefills as before. And in a step where a
        row at the register's level prefills, the rows less urgent than it get no tokens
        (decode included): the urgent prompt's step is as short as it alone. Unused under
        fcfs.
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    max_admit_per_step: int = 16
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    buckets: tuple[int, ...] | None = None
    prefix_probes: int = 8
    admit_window_tokens: int | None = None
    lookup_window_blocks: int | None = None
    release_window_blocks: int | None = None
    mask_timeout_s: float = 5.0
    scheduling_policy: str = "fcfs"
    priority_other_prefill_tokens: int = 32
    priority_urgent_window_steps: int = 256

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise BlinkError(f"scheduler config: scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for name in ("block_size", "num_blocks", "max_model_len", "max_num_batched_tokens",
                     "max_admit_per_step", "prefix_probes", "priority_other_prefill_tokens",
                     "priority_urgent_window_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BlinkError(f"scheduler config: {name} must be a positive integer, got {value!r}")
        if self.num_blocks < self.max_blocks_per_seq:
            # Below this a lone max-length request could never finish (no progress guarantee).
            raise BlinkError(
                f"scheduler config: num_blocks ({self.num_blocks}) must hold one max_model_len "
                f"sequence ({self.max_blocks_per_seq} blocks of {self.block_size})"
            )
        if not self.mask_timeout_s > 0:
            raise BlinkError(f"scheduler config: mask_timeout_s must be positive, got {self.mask_timeout_s!r}")
        buckets = tuple(self.buckets) if self.buckets else default_buckets(self.max_num_batched_tokens)
        if list(buckets) != sorted(set(buckets)) or buckets[-1] != self.max_num_batched_tokens:
            raise BlinkError(
                f"scheduler config: buckets must be increasing and end at the token budget "
                f"({self.max_num_batched_tokens}), got {buckets}"
            )
        object.__setattr__(self, "buckets", buckets)
        windows = {
            "admit_window_tokens": self.max_model_len,
            "lookup_window_blocks": self.max_blocks_per_seq,
            "release_window_blocks": self.max_blocks_per_seq,
        }
        for name, minimum in windows.items():
            value = getattr(self, name)
            if value is None:
                value = minimum if name != "release_window_blocks" else None
            elif not isinstance(value, int) or value < minimum:
                raise BlinkError(
                    f"scheduler config: {name} must be an integer >= {minimum} (one max-length "
                    f"sequence), got {value!r}"
                )
            object.__setattr__(self, name, value)

    @property
    def max_blocks_per_seq(self) -> int:
        """M: block-table width."""
        return -(-self.max_model_len // self.block_size)

    def alloc_window_blocks(self, num_slots: int) -> int:
        """J: the most new blocks one step can allocate. A row granted g tokens needs at most
        ceil(g / B) new blocks (its held blocks cover its computed tokens exactly), so the
        sum is at most ceil(T / B) plus one per row with tokens (at most min(S, T))."""
        T, B = self.max_num_batched_tokens, self.block_size
        return min(self.num_blocks, -(-T // B) + min(num_slots, T))

    def release_window(self, num_slots: int) -> int:
        """Blocks released per step: the configured window, else as many as a step can
        allocate (so releases keep up with allocation), at least one max-length sequence."""
        if self.release_window_blocks is not None:
            return self.release_window_blocks
        return max(self.max_blocks_per_seq, self.alloc_window_blocks(num_slots))

    @property
    def hash_table_size(self) -> int:
        """H: prefix-cache table slots (a power of two, at least twice the pool)."""
        return 1 << max(4, (2 * self.num_blocks - 1).bit_length())

    def bucket_for(self, num_tokens: int) -> int:
        return bucket_for(num_tokens, self.buckets)


_TORCH_DTYPES = {"<i4": torch.int32, "<i8": torch.int64, "<f4": torch.float32}

# Sampling fields copied from the ring slot at admission: (name, state dtype), derived from
# the one table (blink.shared.sampling_fields); ring field and state tensor share the name.
SAMPLING_FIELDS: tuple[tuple[str, torch.dtype], ...] = tuple(
    (f.name, _TORCH_DTYPES[f.dtype]) for f in TABLE
)


def sampling_words(ring_cfg: RingConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The rows' sampling fields in one allocation: a flat int32 buffer (every entry is 4 or
    8 bytes) and each field's tensor, a contiguous [S, *shape] segment of it (8-byte fields
    on an even word), filled with its pad. One buffer, so that admission copies every field
    of a slot's record with one program (the fused scheduler), whatever the table holds."""
    S, spans, words = ring_cfg.n_slots, [], 0
    for f in TABLE:
        n = S * math.prod(f.shape(ring_cfg)) * int(f.dtype[-1]) // 4
        words += words % 2  # 8-byte alignment of every segment
        spans.append((f, words, n))
        words += n
    buf = torch.zeros(max(words, 1), dtype=torch.int32, device=device)
    fields = {}
    for f, at, n in spans:
        t = buf[at:at + n].view(_TORCH_DTYPES[f.dtype]).view(S, *f.shape(ring_cfg))
        fields[f.name] = t.fill_(f.pad)
    return buf, fields


#: EngineState's fields with one entry per row (leading dimension S), ``sampling``'s aside
_ROW_FIELDS = ("status", "arrival", "num_prompt", "num_tokens", "num_computed", "num_blocks",
               "needs_lookup", "row_hash", "tokens", "block_table", "sampler_features",
               "kv_route", "kv_dest_blocks")


@dataclass
class RequestRow:
    """One engine row, read back to the host and named (:meth:`EngineState.row`): for tests,
    debugging and logs, never for the step itself (it reads tensor values)."""

    row: int
    status: str  # a ROW_STATUS_NAMES value
    arrival: int
    num_prompt: int
    num_tokens: int  # prompt + generated
    num_computed: int  # tokens with KV in the cache
    num_blocks: int
    needs_lookup: bool
    tokens: list[int]  # the first num_tokens tokens
    blocks: list[int]  # the first num_blocks block-table entries
    row_hash: tuple[int, int]
    sampling: dict[str, object]  # scalar fields as numbers, vector fields as lists
    sampler_features: int
    kv_route: tuple[int, ...]  # (mode, peer, slot, seq): KV_ROUTE_*
    kv_dest_blocks: list[int]

    def __str__(self) -> str:
        head = (f"row {self.row}: {self.status} arrival={self.arrival} prompt={self.num_prompt} "
                f"computed={self.num_computed}/{self.num_tokens} blocks={self.blocks}"
                f"{' needs_lookup' if self.needs_lookup else ''}")
        return "\n".join([head, f"  tokens={self.tokens}",
                          "  " + " ".join(f"{k}={v}" for k, v in self.sampling.items())])


@dataclass
class EngineState:
    """All scheduler state, fixed shapes, on one device. S rows, N blocks, M = blocks per
    sequence, B = block size, H = prefix table size, W = M*B + 1 token columns.

    Rows [S]:
      status (int32 ROW_*), arrival (int64 FCFS ticket), num_prompt, num_tokens,
      num_computed, num_blocks (int64), needs_lookup (bool: prefix lookup pending),
      row_hash [S, 2] (int64 polynomial hash of tokens[:num_computed], two moduli),
      tokens [S, W] int32 (prompt + generated; column W-1 is a write sink),
      block_table [S, M] int32 (``num_blocks`` = no block), a view of block_table_flat
      [S*M + 1] whose last entry is a write sink for flat scatters, sampling fields (segments
      of one int32 buffer, ``sampling_words``),
      sampler_features (int32 feature word per row: the sampler stages it needs, written at
      admission, :func:`blink.engine.sampler.row_features`).
    Blocks [N+1] (entry N = scratch / write sink):
      block_ref (int32 references from block tables), block_last_used (int64 LRU stamp),
      block_key (int64 chained-prefix key), block_slot (int64 prefix-table slot holding it,
      -1 = not cached), block_parent (previous block of its chain, N = first block),
      block_gen (bumped whenever the block is allocated, i.e. gets new content) and
      block_parent_gen (the parent's generation when this block was registered: a reused
      parent never validates a stale child), block_tokens [N+1, B] int32 (the tokens, to
      verify hits).
    Prefix table [H+1] int64: block id per slot, N = empty; slot H is a write sink.
    insert_best [H+1] int64: the table insert's per-slot scratch (all INT64_MIN between steps).
    counters [NUM_COUNTERS] int64 (K_*), step (0-d int64).
    The priority policy's urgency register (0-d int64; inert under fcfs): urgent_priority,
    the most urgent priority seen among the live rows within the last
    ``priority_urgent_window_steps`` steps (INT64_MAX: none), and urgent_age, the steps
    since it was last seen (``Budget._track_urgent``).
    Disaggregation (ring ``max_kv_blocks`` > 0, else width 1): kv_route [S, 4] int64 (mode,
    peer, slot, seq: KV_ROUTE_*) and kv_dest_blocks [S, max(max_kv_blocks, 1)] int32, copied
    from the request record at admission, so the KV sender never reads a slot the frontend may
    already be reusing.
    """

    status: torch.Tensor
    arrival: torch.Tensor
    num_prompt: torch.Tensor
    num_tokens: torch.Tensor
    num_computed: torch.Tensor
    num_blocks: torch.Tensor
    needs_lookup: torch.Tensor
    row_hash: torch.Tensor
    tokens: torch.Tensor
    block_table: torch.Tensor
    block_table_flat: torch.Tensor
    sampling: dict[str, torch.Tensor]
    sampler_features: torch.Tensor
    block_ref: torch.Tensor
    block_last_used: torch.Tensor
    block_key: torch.Tensor
    block_slot: torch.Tensor
    block_parent: torch.Tensor
    block_gen: torch.Tensor
    block_parent_gen: torch.Tensor
    block_tokens: torch.Tensor
    hash_table: torch.Tensor
    insert_best: torch.Tensor
    counters: torch.Tensor
    kv_route: torch.Tensor
    kv_dest_blocks: torch.Tensor
    urgent_priority: torch.Tensor
    urgent_age: torch.Tensor
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    #: the flat buffer every ``sampling`` tensor is a segment of (:func:`sampling_words`)
    sampling_words: torch.Tensor | None = None

    def window(self, rows: int) -> "EngineState":
        """The same state with its per-row fields viewed for rows [0, rows) (the scheduler's
        row window); block, prefix-table and counter fields, and ``block_table_flat`` (whose
        sink is its last entry), are shared whole. Views: writes land in this state."""
        return dataclasses.replace(
            self, **{name: getattr(self, name)[:rows] for name in _ROW_FIELDS},
            sampling={name: values[:rows] for name, values in self.sampling.items()})

    def row(self, i: int) -> RequestRow:
        """Row ``i``'s fields, named and read back to the host (``print(state.row(i))``)."""

        def value(t: torch.Tensor) -> object:
            return t.item() if t.dim() == 0 else t.tolist()

        n_tok, n_blk = int(self.num_tokens[i]), int(self.num_blocks[i])
        return RequestRow(
            row=i,
            status=ROW_STATUS_NAMES.get(int(self.status[i]), str(int(self.status[i]))),
            arrival=int(self.arrival[i]),
            num_prompt=int(self.num_prompt[i]),
            num_tokens=n_tok,
            num_computed=int(self.num_computed[i]),
            num_blocks=n_blk,
            needs_lookup=bool(self.needs_lookup[i]),
            tokens=self.tokens[i, :n_tok].tolist(),
            blocks=self.block_table[i, :n_blk].tolist(),
            row_hash=tuple(self.row_hash[i].tolist()),
            sampling={name: value(values[i]) for name, values in self.sampling.items()},
            sampler_features=int(self.sampler_features[i]),
            kv_route=tuple(self.kv_route[i].tolist()),
            kv_dest_blocks=self.kv_dest_blocks[i].tolist(),
        )

    @classmethod
    def allocate(
        cls, cfg: SchedulerConfig, ring_cfg: RingConfig, device: torch.device | str = "cpu"
    ) -> "EngineState":
        S, N, M, B = ring_cfg.n_slots, cfg.num_blocks, cfg.max_blocks_per_seq, cfg.block_size
        H = cfg.hash_table_size

        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        words, sampling = sampling_words(ring_cfg, device)
        block_table_flat = full((S * M + 1,), N, torch.int32)
        return cls(
            status=full((S,), ROW_EMPTY, torch.int32),
            arrival=full((S,), 0, torch.int64),
            num_prompt=full((S,), 0, torch.int64),
            num_tokens=full((S,), 0, torch.int64),
            num_computed=full((S,), 0, torch.int64),
            num_blocks=full((S,), 0, torch.int64),
            needs_lookup=full((S,), False, torch.bool),
            row_hash=full((S, 2), 0, torch.int64),
            tokens=full((S, M * B + 1), 0, torch.int32),
            block_table=block_table_flat[: S * M].view(S, M),
            block_table_flat=block_table_flat,
            sampling=sampling,
            sampler_features=full((S,), 0, torch.int32),
            block_ref=full((N + 1,), 0, torch.int32),
            block_last_used=full((N + 1,), 0, torch.int64),
            block_key=full((N + 1,), -1, torch.int64),
            block_slot=full((N + 1,), -1, torch.int64),
            block_parent=full((N + 1,), N, torch.int64),
            block_gen=full((N + 1,), 0, torch.int64),
            block_parent_gen=full((N + 1,), 0, torch.int64),
            block_tokens=full((N + 1, B), -1, torch.int32),
            hash_table=full((H + 1,), N, torch.int64),
            insert_best=full((H + 1,), -(2**63), torch.int64),
            counters=full((NUM_COUNTERS,), 0, torch.int64),
            kv_route=full((S, 4), 0, torch.int64),
            kv_dest_blocks=full((S, max(ring_cfg.max_kv_blocks, 1)), -1, torch.int32),
            urgent_priority=full((), INT64_MAX, torch.int64),
            urgent_age=full((), 0, torch.int64),
            step=full((), 0, torch.int64),
            sampling_words=words,
        )


def ring_tensors(ring: Ring) -> dict[str, torch.Tensor]:
    """CPU torch views of every ring field, all over one storage, plus ``"region"`` (the
    whole region as uint8), which the scheduler needs to publish slot state words safely.

    On a GPU the device loop builds the same dict over the mapped region instead."""
    region = torch.frombuffer(ring.buffer, dtype=torch.uint8, count=ring.layout.total_bytes)
    return ring_views(ring.layout, region)


def ring_views(layout: RingLayout, base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Torch views of every ring field over ``base`` (the region as uint8, on any device),
    plus ``"region"`` itself. A field of the request record is a strided view (its slot
    stride is the record size); the record itself is a uint8 ``[n_slots, record size]`` view."""
    views = {"region": base}
    for spec in layout:
        if spec.name == REQUEST:
            views[spec.name] = base[spec.offset : spec.offset + spec.nbytes].view(spec.shape[0], -1)
            continue
        dtype = _TORCH_DTYPES[spec.dtype.str]
        flat = base[spec.offset : spec.offset + spec.nbytes].view(dtype)
        if spec.record is None:
            views[spec.name] = flat.view(spec.shape)
            continue
        item = spec.dtype.itemsize
        if spec.offset % item or spec.row_stride % item:
            raise BlinkError(f"ring field {spec.name} is not aligned to its item size {item}")
        strides = (spec.row_stride // item, *(s // item for s in c_strides(spec.shape[1:], item)))
        views[spec.name] = flat.as_strided(spec.shape, strides, flat.storage_offset())
    return views
