"""The scheduler's stages as fused Triton kernels: one program over the slot table each.

The torch tensor code of :class:`blink.engine.sched.scheduler.Scheduler` is the reference and
the CPU path; ``Scheduler(fused=True)`` routes the stages implemented here through these
kernels instead. In a captured step every aten op of a stage is a graph node (a kernel
launch of 1-2 µs); a stage here is one launch. Each kernel is a single program (grid
``(1,)``) that holds the slot table's per-row vectors in registers, so a prefix sum, a
scatter and the gathers that follow it are ordered by ``tl.debug_barrier()`` inside the
program, not by separate launches. Fences stay where the reference has them: a ring payload
and the word that publishes it are written by two launches with the system fence between.

Stages (issue 32, part 1):

- ``build_batch``: the step's flat token batch (positions, token ids, slot mapping, query
  starts, sequence lengths, sample rows, logits indices, token count and bucket) from the
  tokens each row computes this step;
- ``release``: RELEASING rows drop their block references, deepest block first, in the
  release window's lanes; rows left without a block become EMPTY;
- ``stats``: the ring's gauges and counters;
- ``allocate``: the token budget in queue order (FCFS, or (priority, arrival) under the
  priority policy, whose bound on the other prompts' prefill and urgency register it
  applies too), preemption by recompute when the blocks do
  not fit (the reference's freed(k) scan over the block table, then the newest-first
  suffix), and the new blocks from the free pool, never-cached first then least recently
  used. FCFS order and the free list are one ``tl.sort`` each of keys packed with their
  row / block id, so the pool is sorted in one program: at most ``MAX_SORT_BLOCKS`` blocks.
  Among equally old free blocks it takes the lowest id, as the reference's stable sort does.
- ``publish``: ``update()``'s tokens table and stream payload; then (after the fence) the
  ``produced`` counters, the finish checks and finish reasons; then (after the fence) the
  FINISHED state words: three launches;
- ``register``: the prefix-cache insert (block tokens, the rows' prefix hashes, the probe
  window, the oldest request winning a contested slot and the losers' later rounds,
  eviction);
- ``lookup``: the prefix-cache lookup of the oldest waiting rows (hash per block, first live
  match, verification of tokens and the parent chain, the hits taken);
- ``admit``: admission's FCFS pick, prompt gather out of the arena, the rows' state, their
  sampling records (every field of SAMPLING_FIELDS: one gather over a table of word offsets
  into ``EngineState.sampling_words``) and feature words, the stream reset and finish
  reasons; the state words after the fence (a second launch).

- ``cancel``: cancelled live rows finish with ABORT (finish reason, rows RELEASING), the
  state words after the fence (:func:`publish_words`).

Every stage reproduces the reference bit for bit (tests/test_scheduler_fused.py compares
batch, state and ring step by step).

Shared pieces (``@triton.jit`` helpers): :func:`_search` (the segment a flat lane belongs
to), :func:`_segment_lane` (its index there), :func:`_fcfs_order` (rows by arrival, one sort)
and :func:`_queue_order` (the same, or (priority, arrival) under the priority policy: admit,
lookup and allocate order the queue with it, as the torch code's ``queue_order``).

Launch grids and block sizes depend on shapes only and the wrappers never read a tensor
value on the host, so the stages stay capturable. On CPU tensors they run under
``TRITON_INTERPRET=1`` (set before this module is imported), as the sampler's kernels do in
the tests. Every launch is counted by :mod:`blink.kernels.triton.sched_count`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.kernels.batch_buffers import BatchBuffers
from blink.kernels.triton import sched_count as triton_sched_count

_INT64_MAX = tl.constexpr(2**63 - 1)


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(int(n)))


@triton.jit
def _search(ends_ptr, w, n, wm, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """searchsorted(ends[:n], w, right=True), clamped to n - 1, for each lane: the segment
    (row, request) a flat lane belongs to, given the segments' inclusive ends."""
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + n
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        e = tl.load(ends_ptr + mid, mask=(mid < n) & wm, other=0)
        right = (e <= w) & (lo < hi)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right | (lo >= hi), hi, mid)
    return tl.minimum(lo, n - 1)


@triton.jit
def _segment_lane(ends_ptr, take_ptr, w, n, wm, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Lane w of a flat window of n segments (segment k: ``take[k]`` lanes, ending before
    ``ends[k]``): (k, the lane's index in segment k, segment k's first lane)."""
    k = _search(ends_ptr, w, n, wm, BLOCK, STEPS)
    start = tl.load(ends_ptr + k, mask=wm, other=0) - tl.load(take_ptr + k, mask=wm, other=0)
    return k, w - start, start


@triton.jit
def _fcfs_order(live, arrival, lanes, lmask, S_BITS: tl.constexpr):
    """FCFS order of the rows (``torch.topk`` of arrival over the live rows, ascending):
    lane i holds the row at position i, the live rows by arrival (unique tickets) first,
    then the others. One ``tl.sort`` of (arrival - oldest) << S_BITS | row; spans beyond
    2**(61 - S_BITS) tickets clamp."""
    lim = (1 << (61 - S_BITS)) - 1
    oldest = tl.min(tl.where(live, arrival, _INT64_MAX), 0)
    cls = tl.where(live, tl.minimum(tl.maximum(arrival - oldest, 0), lim), tl.where(lmask, lim + 1, lim + 2))
    return tl.sort((cls << S_BITS) | lanes.to(tl.int64), 0) & ((1 << S_BITS) - 1)


@triton.jit
def _queue_order(live, arrival, lanes, lmask, prio_ptr, prio_stride, S_BITS: tl.constexpr,
                 PRIORITY: tl.constexpr):
    """:func:`blink.engine.sched.budget.queue_order`: lane i holds the row at queue position
    i, the live rows first. FCFS: by arrival (:func:`_fcfs_order`). The priority policy: by
    (priority, arrival), a second sort of the FCFS order keyed by each row's priority (int32:
    its span fits 33 bits), its FCFS position and the row."""
    order = _fcfs_order(live, arrival, lanes, lmask, S_BITS)
    if PRIORITY:
        in_queue = lanes < tl.sum(live.to(tl.int32), 0)  # the live rows lead the FCFS order
        prio = tl.load(prio_ptr + order * prio_stride, mask=in_queue, other=0).to(tl.int64)
        least = tl.min(tl.where(in_queue, prio, _INT64_MAX), 0)
        cls = tl.where(in_queue, prio - least, 1 << 33)
        key = (cls << (2 * S_BITS)) | (lanes.to(tl.int64) << S_BITS) | order
        order = tl.sort(key, 0) & ((1 << S_BITS) - 1)
    return order


# --------------------------------------------------------------------------- batch build


@triton.jit
def _build_batch_kernel(
    num_new_ptr, num_computed_ptr, num_tokens_ptr, tokens_ptr, tokens_stride, block_table_ptr,
    buckets_ptr,
    input_ids_ptr, positions_ptr, seq_idx_ptr, slot_mapping_ptr, qsl_ptr, seq_lens_ptr,
    total_ptr, bucket_ptr, sample_rows_ptr, n_sample_ptr, logits_idx_ptr,
    S, T, N, B, M, n_buckets,
    S_P2: tl.constexpr, BLOCK_T: tl.constexpr, NB_P2: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """:meth:`Scheduler._build_batch` (batch.py): the step's flat token batch and the sampler's rows."""
    rows = tl.arange(0, S_P2)
    rmask = rows < S
    num_new = tl.load(num_new_ptr + rows, mask=rmask, other=0)
    nc = tl.load(num_computed_ptr + rows, mask=rmask, other=0)
    nt = tl.load(num_tokens_ptr + rows, mask=rmask, other=0)
    ends = tl.cumsum(num_new, 0)
    total = tl.sum(num_new, 0)
    tl.store(qsl_ptr + 1 + rows, ends.to(tl.int32), mask=rmask)
    tl.store(qsl_ptr + rows, tl.zeros_like(rows), mask=rows == 0)
    tl.store(seq_lens_ptr + rows, tl.where(num_new > 0, nc + num_new, 0).to(tl.int32), mask=rmask)
    sampled = (num_new > 0) & (nc + num_new == nt) & rmask
    sampled_i = sampled.to(tl.int64)
    dest = tl.cumsum(sampled_i, 0) - 1
    tl.store(total_ptr, total)
    tl.store(n_sample_ptr, tl.sum(sampled_i, 0))
    b = tl.arange(0, NB_P2)
    bounds = tl.load(buckets_ptr + b, mask=b < n_buckets, other=_INT64_MAX)
    tl.store(bucket_ptr, tl.sum((bounds < total).to(tl.int64), 0))
    # Sample rows: compacted first, -1 after (a scatter, ordered by barriers).
    tl.store(sample_rows_ptr + rows, tl.full([S_P2], -1, tl.int64), mask=rmask)
    tl.debug_barrier()
    tl.store(sample_rows_ptr + dest, rows.to(tl.int64), mask=sampled)
    tl.debug_barrier()
    sr = tl.load(sample_rows_ptr + rows, mask=rmask, other=-1)
    r = tl.maximum(sr, 0)
    last = tl.load(qsl_ptr + r + 1, mask=rmask, other=1).to(tl.int64) - 1
    tl.store(logits_idx_ptr + rows, tl.where(sr >= 0, last, 0), mask=rmask)
    # The flat token lanes: lane t belongs to the first row whose end exceeds t.
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < T
        valid = t < total
        row = tl.where(valid, _search(qsl_ptr + 1, t, S, tmask, BLOCK_T, SEARCH_STEPS), 0)
        start = tl.load(qsl_ptr + row, mask=tmask, other=0).to(tl.int64)
        row_nc = tl.load(num_computed_ptr + row, mask=tmask, other=0)
        pos = tl.where(valid, row_nc + t - start, 0)
        ids = tl.load(tokens_ptr + row * tokens_stride + pos, mask=tmask & valid, other=0).to(tl.int64)
        block = tl.load(block_table_ptr + row * M + pos // B, mask=tmask, other=0).to(tl.int64)
        slot = tl.where(valid, block * B + pos % B, N * B)
        tl.store(input_ids_ptr + t, ids, mask=tmask)
        tl.store(positions_ptr + t, pos, mask=tmask)
        tl.store(seq_idx_ptr + t, row, mask=tmask)
        tl.store(slot_mapping_ptr + t, slot, mask=tmask)


def build_batch(num_new: torch.Tensor, num_computed: torch.Tensor, num_tokens: torch.Tensor,
                tokens: torch.Tensor, block_table: torch.Tensor, buckets: torch.Tensor,
                out: BatchBuffers, num_blocks: int, block_size: int) -> None:
    """Fill ``out`` as :meth:`Scheduler._build_batch` computes its batch (one launch)."""
    S, M = block_table.shape
    T = out.input_ids.shape[0]
    with triton_sched_count.launch("build_batch"):
        _build_batch_kernel[(1,)](
            num_new, num_computed, num_tokens, tokens, tokens.stride(0), block_table, buckets,
            out.input_ids, out.positions, out.seq_idx, out.slot_mapping, out.query_start_loc, out.seq_lens,
            out.total, out.bucket, out.sample_rows, out.num_sample_rows, out.logits_indices,
            S, T, num_blocks, block_size, M, buckets.shape[0],
            S_P2=_p2(S), BLOCK_T=min(_p2(T), 1024), NB_P2=_p2(buckets.shape[0]),
            SEARCH_STEPS=int(S).bit_length() + 1,
        )


# ------------------------------------------------------------------------------ release


@triton.jit
def _release_kernel(
    status_ptr, num_blocks_ptr, num_prompt_ptr, num_tokens_ptr, num_computed_ptr,
    table_ptr, block_ref_ptr, last_used_ptr, step_ptr, ends_ptr,
    S, M, N, W, table_sink,
    ROW_RELEASING: tl.constexpr, ROW_EMPTY: tl.constexpr,
    S_P2: tl.constexpr, BLOCK_W: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """:meth:`Scheduler._release_finished` (budget.py): RELEASING rows drop their block references,
    deepest first, in the release window."""
    rows = tl.arange(0, S_P2)
    rmask = rows < S
    status = tl.load(status_ptr + rows, mask=rmask, other=0)
    nb = tl.load(num_blocks_ptr + rows, mask=rmask, other=0)
    releasing = (status == ROW_RELEASING) & rmask
    count = tl.where(releasing, nb, 0)
    ends = tl.cumsum(count, 0)
    total = tl.sum(count, 0)
    step = tl.load(step_ptr)
    tl.store(ends_ptr + rows, ends, mask=rmask)
    tl.debug_barrier()
    # Lane j of the window: the j-th block to drop, each row's deepest first.
    for w0 in range(0, W, BLOCK_W):
        lane = w0 + tl.arange(0, BLOCK_W)
        lmask = lane < W
        valid = (lane < total) & lmask
        row = _search(ends_ptr, lane, S, lmask, BLOCK_W, SEARCH_STEPS)
        row_nb = tl.load(num_blocks_ptr + row, mask=lmask, other=0)
        row_end = tl.load(ends_ptr + row, mask=lmask, other=0)
        row_st = tl.load(status_ptr + row, mask=lmask, other=0)
        row_count = tl.where(row_st == ROW_RELEASING, row_nb, 0)
        col = tl.maximum(row_nb - 1 - (lane - (row_end - row_count)), 0)
        at = tl.where(valid, row * M + col, table_sink)
        blocks = tl.where(valid, tl.load(table_ptr + at, mask=lmask, other=N).to(tl.int64), N)
        tl.atomic_add(block_ref_ptr + blocks, tl.where(valid, -1, 0).to(tl.int32), mask=lmask)
        tl.atomic_max(last_used_ptr + blocks, tl.where(valid, step * (M + 1) + (M - col), 0), mask=lmask)
        tl.store(table_ptr + at, (tl.zeros([BLOCK_W], dtype=tl.int32) + N), mask=lmask)
    tl.debug_barrier()
    released = tl.maximum(tl.minimum(ends, W) - (ends - count), 0)
    nb = nb - released
    tl.store(num_blocks_ptr + rows, nb, mask=rmask)
    emptied = releasing & (nb == 0)
    tl.store(status_ptr + rows, tl.where(emptied, ROW_EMPTY, status), mask=rmask)
    zero = tl.zeros([S_P2], dtype=tl.int64)
    tl.store(num_prompt_ptr + rows, zero, mask=emptied)
    tl.store(num_tokens_ptr + rows, zero, mask=emptied)
    tl.store(num_computed_ptr + rows, zero, mask=emptied)


def release(status: torch.Tensor, num_blocks: torch.Tensor, num_prompt: torch.Tensor,
            num_tokens: torch.Tensor, num_computed: torch.Tensor, table_flat: torch.Tensor,
            block_ref: torch.Tensor, last_used: torch.Tensor, step: torch.Tensor, scratch: torch.Tensor,
            max_blocks_per_seq: int, num_blocks_total: int, window: int,
            row_releasing: int, row_empty: int) -> None:
    """:meth:`Scheduler._release_finished` in one launch (``scratch``: int64 [S])."""
    S = status.shape[0]
    with triton_sched_count.launch("release"):
        _release_kernel[(1,)](
            status, num_blocks, num_prompt, num_tokens, num_computed, table_flat, block_ref, last_used,
            step, scratch, S, max_blocks_per_seq, num_blocks_total, window, table_flat.shape[0] - 1,
            ROW_RELEASING=row_releasing, ROW_EMPTY=row_empty,
            S_P2=_p2(S), BLOCK_W=min(_p2(window), 1024), SEARCH_STEPS=int(S).bit_length() + 1,
        )


# -------------------------------------------------------------------------------- stats


@triton.jit
def _stats_kernel(
    status_ptr, ring_state_ptr, state_stride, block_ref_ptr, counters_ptr, control_ptr, words_ptr,
    S, N,
    ROW_RUNNING: tl.constexpr, ROW_WAITING: tl.constexpr, ROW_EMPTY: tl.constexpr,
    ROW_RELEASING: tl.constexpr, SLOT_WRITTEN: tl.constexpr,
    K_QUERIES: tl.constexpr, K_HITS: tl.constexpr, K_PREEMPTIONS: tl.constexpr, K_STEPS: tl.constexpr,
    K_PROMPT: tl.constexpr, K_GENERATED: tl.constexpr,
    S_P2: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """:meth:`Scheduler._write_stats` (stats.py): the ring's gauges and counters."""
    rows = tl.arange(0, S_P2)
    rmask = rows < S
    status = tl.load(status_ptr + rows, mask=rmask, other=ROW_EMPTY)
    state = tl.load(ring_state_ptr + rows * state_stride, mask=rmask, other=0)
    unadmitted = tl.sum(((state == SLOT_WRITTEN) & ((status == ROW_EMPTY) | (status == ROW_RELEASING))
                         & rmask).to(tl.int64), 0)
    running = tl.sum((status == ROW_RUNNING).to(tl.int64), 0)
    waiting = tl.sum((status == ROW_WAITING).to(tl.int64), 0) + unadmitted
    used = tl.zeros([BLOCK_N], dtype=tl.int64)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ref = tl.load(block_ref_ptr + n, mask=n < N, other=0)
        used += (ref > 0).to(tl.int64)
    i = tl.arange(0, 16)
    words = tl.load(words_ptr + i, mask=i < 10, other=0)
    c = tl.load(counters_ptr + tl.where(i == 4, K_QUERIES, tl.where(i == 5, K_HITS, tl.where(
        i == 6, K_PREEMPTIONS, tl.where(i == 7, K_STEPS, tl.where(i == 8, K_PROMPT, K_GENERATED))))),
        mask=(i >= 4) & (i < 10), other=0)
    v = tl.where(i == 0, running, tl.where(i == 1, waiting, tl.where(i == 2, tl.sum(used, 0), tl.where(
        i == 3, N, c))))
    tl.store(control_ptr + words, v, mask=i < 10)


def write_stats(status: torch.Tensor, ring_state: torch.Tensor, block_ref: torch.Tensor,
                counters: torch.Tensor, control: torch.Tensor, stat_words: torch.Tensor,
                num_blocks: int, consts: dict[str, int]) -> None:
    """:meth:`Scheduler._write_stats` in one launch (``stat_words``: the 10 control words,
    in the reference's order)."""
    with triton_sched_count.launch("stats"):
        _stats_kernel[(1,)](
            status, ring_state, ring_state.stride(0), block_ref, counters, control, stat_words, status.shape[0],
            num_blocks,
            **consts, S_P2=_p2(status.shape[0]), BLOCK_N=min(_p2(num_blocks), 4096),
        )


# ---------------------------------------------------------------- allocation / preemption


@triton.jit
def _allocate_kernel(
    status_ptr, arrival_ptr, num_tokens_ptr, num_computed_ptr, num_blocks_ptr, needs_lookup_ptr,
    row_hash_ptr, produced_ptr, produced_stride, consumed_ptr, consumed_stride,
    block_ref_ptr, block_slot_ptr, last_used_ptr, block_gen_ptr, table_ptr, step_ptr, counters_ptr,
    rank_ptr, flag_ptr, need_ptr, first_user_ptr, per_pos_ptr, ends_ptr, free_list_ptr, num_new_ptr,
    priority_ptr, num_prompt_ptr, urgent_priority_ptr, urgent_age_ptr,
    S, N, M, B, budget, capacity, J, table_sink,
    PREFIX_CACHING: tl.constexpr, K_PREEMPTIONS: tl.constexpr, PRIORITY: tl.constexpr, OTHER_PREFILL: tl.constexpr,
    URGENT_WINDOW: tl.constexpr,
    ROW_WAITING: tl.constexpr, ROW_RUNNING: tl.constexpr, ROW_RELEASING: tl.constexpr,
    ROW_AWAITING_KV: tl.constexpr,
    S_P2: tl.constexpr, N_P2: tl.constexpr, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    S_BITS: tl.constexpr, N_BITS: tl.constexpr,
):
    """:meth:`Scheduler._allocate` (budget.py): token budget, preemption by recompute, new blocks."""
    rows = tl.arange(0, S_P2)
    rmask = rows < S
    status = tl.load(status_ptr + rows, mask=rmask, other=0)
    active = ((status == ROW_WAITING) | (status == ROW_RUNNING)) & rmask
    produced = tl.load(produced_ptr + rows * produced_stride, mask=rmask, other=0).to(tl.int64)
    consumed = tl.load(consumed_ptr + rows * consumed_stride, mask=rmask, other=0).to(tl.int64)
    lookup = tl.load(needs_lookup_ptr + rows, mask=rmask, other=0) != 0
    nt = tl.load(num_tokens_ptr + rows, mask=rmask, other=0)
    nc_row = tl.load(num_computed_ptr + rows, mask=rmask, other=0)
    nb_row = tl.load(num_blocks_ptr + rows, mask=rmask, other=0)
    want = tl.where(active & ~lookup & (produced - consumed < capacity), nt - nc_row, 0)
    arrival = tl.load(arrival_ptr + rows, mask=rmask, other=0)

    # Queue order: active rows by arrival (unique tickets; the priority policy: by priority
    # first), then the idle rows (their order among themselves changes nothing: they hold,
    # ask and free nothing here).
    order = _queue_order(active, arrival, rows, rmask, priority_ptr, 1, S_BITS, PRIORITY)  # position -> row
    tl.store(rank_ptr + order, rows.to(tl.int64), mask=rmask)  # row -> position
    tl.store(need_ptr + rows, want, mask=rmask)
    tl.debug_barrier()
    rank = tl.load(rank_ptr + rows, mask=rmask, other=0)
    st_p = tl.load(status_ptr + order, mask=rmask, other=0)
    act_p = ((st_p == ROW_WAITING) | (st_p == ROW_RUNNING)) & rmask
    nc_p = tl.where(act_p, tl.load(num_computed_ptr + order, mask=rmask, other=0), 0)
    held_p = tl.where(act_p, tl.load(num_blocks_ptr + order, mask=rmask, other=0), 0)
    asked = tl.load(need_ptr + order, mask=rmask, other=0)
    if PRIORITY:
        # Budget._track_urgent: the urgency register (the most urgent priority seen among the
        # live rows within the last URGENT_WINDOW steps, and its age).
        seen = tl.min(tl.where(active, tl.load(priority_ptr + rows, mask=rmask, other=0).to(tl.int64),
                               _INT64_MAX), 0)
        urgent = tl.load(urgent_priority_ptr)
        age = tl.load(urgent_age_ptr)
        keep = (urgent < seen) & (age < URGENT_WINDOW)
        urgent = tl.where(keep, urgent, seen)
        tl.store(urgent_priority_ptr, urgent)
        tl.store(urgent_age_ptr, tl.where(keep, age + 1, 0))
        # Budget._cap_other_prefill: the prompts after the first share OTHER_PREFILL, and so
        # does the first when it is less urgent than the register; a step in which a row at
        # the register's level prefills carries no less urgent row.
        prefilling = act_p & (nc_p < tl.load(num_prompt_ptr + order, mask=rmask, other=0)) & (asked > 0)
        less_urgent = tl.load(priority_ptr + order, mask=rmask, other=0).to(tl.int64) > urgent
        other = prefilling & ((tl.cumsum(prefilling.to(tl.int64), 0) > 1) | less_urgent)
        x = tl.where(other, asked, 0)
        asked = tl.where(other, tl.minimum(x, tl.maximum(OTHER_PREFILL - (tl.cumsum(x, 0) - x), 0)), asked)
        # A step in which a row at the urgent level prefills carries no less urgent row.
        urgent_prefill = tl.sum((prefilling & ~less_urgent).to(tl.int64), 0) > 0
        asked = tl.where(less_urgent & urgent_prefill, 0, asked)

    # Token budget in FCFS order; the blocks each position needs.
    grant = tl.minimum(tl.maximum(budget - (tl.cumsum(asked, 0) - asked), 0), asked)
    need = tl.maximum((nc_p + grant + B - 1) // B - held_p, 0)
    free_now = tl.zeros([BLOCK], dtype=tl.int64)
    for n0 in range(0, N, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        free_now += ((tl.load(block_ref_ptr + n, mask=n < N, other=1) == 0) & (n < N)).to(tl.int64)
    free_now = tl.sum(free_now, 0)

    # Preemption (an identity when the blocks fit): freed(k) = blocks referenced only by
    # positions >= k; a releasing or KV-awaiting row's blocks count for position 0.
    for n0 in range(0, N + 1, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        tl.store(first_user_ptr + n, tl.zeros([BLOCK], dtype=tl.int64) + S, mask=n < N + 1)
    tl.store(per_pos_ptr + rows, tl.zeros([S_P2], dtype=tl.int64), mask=rows < S + 1)
    tl.store(per_pos_ptr + S, 0)
    tl.debug_barrier()
    for e0 in range(0, S * M, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        emask = e < S * M
        r = e // M
        st_r = tl.load(status_ptr + r, mask=emask, other=0)
        owner = tl.where((st_r == ROW_RELEASING) | (st_r == ROW_AWAITING_KV), 0,
                         tl.load(rank_ptr + r, mask=emask, other=0))
        b = tl.load(table_ptr + e, mask=emask, other=N).to(tl.int64)
        tl.atomic_min(first_user_ptr + b, owner, mask=emask)
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        fu = tl.load(first_user_ptr + n, mask=n < N, other=S)
        tl.atomic_add(per_pos_ptr + fu, tl.zeros([BLOCK], dtype=tl.int64) + 1, mask=n < N)
    tl.debug_barrier()
    pp = tl.load(per_pos_ptr + rows, mask=rmask, other=0)
    freed_at = tl.sum(pp, 0) - (tl.cumsum(pp, 0) - pp)  # freed[p]
    freed_next = freed_at - pp  # freed[p + 1]
    need_incl = tl.cumsum(need, 0)  # need_before[p + 1]
    cut = tl.sum(((need_incl <= free_now + freed_next) & rmask).to(tl.int64), 0)
    c1 = tl.minimum(cut + 1, S)
    left = free_now + tl.sum(tl.where(rows >= c1, pp, 0), 0) - tl.sum(tl.where(rows < cut, need, 0), 0)
    fits = tl.maximum((held_p + tl.maximum(left, 0)) * B - nc_p, 0)
    cut_grant = tl.where(left >= 0, tl.minimum(grant, fits), 0)
    grant = tl.where(rows < cut, grant, tl.where(rows == cut, cut_grant, 0))
    need = tl.where(rmask, tl.maximum((nc_p + grant + B - 1) // B - held_p, 0), 0)
    deficit = tl.sum(need, 0) - free_now
    first_preempted = tl.sum(((freed_next >= deficit) & rmask).to(tl.int64), 0)
    preempt_p = (rows >= first_preempted) & (held_p > 0) & rmask
    tl.store(flag_ptr + order, preempt_p.to(tl.int64), mask=rmask)
    tl.store(num_new_ptr + order, grant, mask=rmask)
    tl.store(need_ptr + order, need, mask=rmask)
    tl.debug_barrier()
    preempt = tl.load(flag_ptr + rows, mask=rmask, other=0) != 0
    num_new = tl.load(num_new_ptr + rows, mask=rmask, other=0)
    need_r = tl.load(need_ptr + rows, mask=rmask, other=0)
    step = tl.load(step_ptr)

    # The preempted rows drop every block reference (blocks stay cached), back to WAITING.
    for e0 in range(0, S * M, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        emask = e < S * M
        r = e // M
        m = e % M
        b = tl.load(table_ptr + e, mask=emask, other=N).to(tl.int64)
        gone = tl.load(flag_ptr + r, mask=emask, other=0) != 0
        drop = gone & (b < N)
        lane = tl.where(drop, b, N)
        tl.atomic_add(block_ref_ptr + lane, tl.where(drop, -1, 0).to(tl.int32), mask=emask)
        tl.atomic_max(last_used_ptr + lane, tl.where(drop, step * (M + 1) + (M - m), 0), mask=emask)
        tl.store(table_ptr + e, tl.where(gone, N, b).to(tl.int32), mask=emask)
    nb_row = tl.where(preempt, 0, nb_row)
    status = tl.where(preempt, ROW_WAITING, status)
    tl.store(num_computed_ptr + rows, tl.where(preempt, 0, nc_row), mask=rmask)
    zero = tl.zeros([S_P2], dtype=tl.int64)
    tl.store(row_hash_ptr + 2 * rows, zero, mask=preempt)
    tl.store(row_hash_ptr + 2 * rows + 1, zero, mask=preempt)
    if PREFIX_CACHING:
        tl.store(needs_lookup_ptr + rows, (lookup | preempt).to(tl.int1), mask=rmask)
    n_pre = tl.sum(preempt.to(tl.int64), 0)
    tl.store(counters_ptr + K_PREEMPTIONS, tl.load(counters_ptr + K_PREEMPTIONS) + n_pre)
    tl.debug_barrier()

    # New blocks: free ones, never-cached first, then cached ones least recently used
    # (ties: the lowest block id). A sort of class << N_BITS | block.
    blk = tl.arange(0, N_P2)
    bmask = blk < N
    ref = tl.load(block_ref_ptr + blk, mask=bmask, other=1)
    cached = tl.load(block_slot_ptr + blk, mask=bmask, other=-1) >= 0
    used_at = tl.load(last_used_ptr + blk, mask=bmask, other=0)
    free = (ref == 0) & bmask
    base = tl.min(tl.where(free & cached, used_at, _INT64_MAX), 0)
    blim = (1 << (61 - N_BITS)) - 1
    bcls = tl.where(free, tl.where(cached, 1 + tl.minimum(used_at - base, blim - 2), 0),
                    tl.where(bmask, blim, blim + 1))
    free_list = tl.sort((bcls << N_BITS) | blk.to(tl.int64), 0) & ((1 << N_BITS) - 1)
    tl.store(free_list_ptr + blk, free_list)
    ends = tl.cumsum(need_r, 0)
    total = tl.sum(need_r, 0)
    tl.store(ends_ptr + rows, ends, mask=rmask)
    tl.store(num_blocks_ptr + rows, nb_row, mask=rmask)
    tl.debug_barrier()
    for j0 in range(0, J, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        jmask = j < J
        valid = (j < total) & jmask
        row = _search(ends_ptr, j, S, jmask, BLOCK, SEARCH_STEPS)
        row_need = tl.load(need_ptr + row, mask=jmask, other=0)
        col = tl.load(num_blocks_ptr + row, mask=jmask, other=0) + j - (tl.load(ends_ptr + row, mask=jmask, other=0)
                                                                        - row_need)
        blocks = tl.where(valid, tl.load(free_list_ptr + j, mask=jmask, other=N), N)
        at = tl.where(valid, row * M + col, table_sink)
        tl.store(table_ptr + at, blocks.to(tl.int32), mask=jmask)
        tl.atomic_add(block_ref_ptr + blocks, valid.to(tl.int32), mask=jmask)
        tl.store(block_slot_ptr + blocks, tl.zeros([BLOCK], dtype=tl.int64) - 1, mask=jmask)
        tl.atomic_add(block_gen_ptr + blocks, valid.to(tl.int64), mask=jmask)
        tl.atomic_max(last_used_ptr + blocks, tl.where(valid, step * (M + 1) + (M - col), 0), mask=jmask)
    tl.debug_barrier()
    tl.store(num_blocks_ptr + rows, nb_row + need_r, mask=rmask)
    tl.store(status_ptr + rows, tl.where(num_new > 0, ROW_RUNNING, status), mask=rmask)


#: the allocation kernel sorts the whole pool in one program (registers of one block)
MAX_SORT_BLOCKS = 16384


class AllocScratch:
    """The allocation kernel's scratch words (allocated once: S rows, N blocks)."""

    def __init__(self, S: int, N: int, device: torch.device) -> None:
        if _p2(N) > MAX_SORT_BLOCKS:
            raise ValueError(f"the fused allocator sorts the pool in one program: at most "
                             f"{MAX_SORT_BLOCKS} blocks, not {N}")
        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.rank, self.flag, self.need, self.ends, self.num_new = z(S), z(S), z(S), z(S), z(S)
        self.first_user, self.per_pos, self.free_list = z(N + 1), z(S + 1), z(_p2(N))


def allocate(st, produced: torch.Tensor, consumed: torch.Tensor, scratch: AllocScratch, *, budget: int,
             capacity: int, window: int, num_blocks: int, block_size: int, prefix_caching: bool,
             consts: dict[str, int]) -> torch.Tensor:
    """:meth:`Scheduler._allocate` (token budget, preemption by recompute, new blocks) in one
    launch; returns the tokens per row (``scratch.num_new``). ``st``: the engine state."""
    S, M = st.block_table.shape
    N = num_blocks
    if window > N:
        raise ValueError(f"the allocation window ({window}) exceeds the pool ({N} blocks)")
    with triton_sched_count.launch("allocate"):
        _allocate_kernel[(1,)](
            st.status, st.arrival, st.num_tokens, st.num_computed, st.num_blocks, st.needs_lookup,
            st.row_hash, produced, produced.stride(0), consumed, consumed.stride(0),
            st.block_ref, st.block_slot, st.block_last_used, st.block_gen, st.block_table_flat, st.step,
            st.counters,
            scratch.rank, scratch.flag, scratch.need, scratch.first_user, scratch.per_pos, scratch.ends,
            scratch.free_list, scratch.num_new, st.sampling["priority"], st.num_prompt,
            st.urgent_priority, st.urgent_age,
            S, N, M, block_size, budget, capacity, window, st.block_table_flat.shape[0] - 1,
            PREFIX_CACHING=prefix_caching, **consts,
            S_P2=_p2(S), N_P2=_p2(N), BLOCK=256, SEARCH_STEPS=int(S).bit_length() + 1,
            S_BITS=int(_p2(S)).bit_length(), N_BITS=int(_p2(N)).bit_length(),
            num_warps=_pool_warps(N),
        )
    return scratch.num_new


def _pool_warps(num_blocks: int) -> int:
    """The allocator's warps: it sorts the whole pool in one program, 32 blocks a thread at most
    (sm_90, 16,384 blocks: 4 warps took 32 registers and 152 KB of spill stores and ~6 minutes
    to compile, 16 warps 128 registers, 1.7 KB and 23 s). The warps change no result."""
    return min(32, max(4, _p2(num_blocks) // (32 * 32)))


# ---------------------------------------------------------------------- update / publish


@triton.jit
def _lanes(sample_rows_ptr, tok_ptr, R, BLOCK_R: tl.constexpr):
    """The live sample lanes: (lane, row, token, live, no_mask, valid). Sample rows are
    compacted first, so the lanes past the first -1 carry nothing (the reference's padding
    lanes repeat the last live one: the same writes)."""
    i = tl.arange(0, BLOCK_R)
    imask = i < R
    rows = tl.load(sample_rows_ptr + i, mask=imask, other=-1)
    valid = (rows >= 0) & imask
    r = tl.maximum(rows, 0)
    tok = tl.load(tok_ptr + i, mask=valid, other=0).to(tl.int64)
    no_mask = valid & (tok < 0)
    live = valid & ~no_mask
    return i, r, tl.maximum(tok, 0), live, no_mask, valid


@triton.jit
def _publish_payload_kernel(
    sample_rows_ptr, tok_ptr, logprob_ptr, top_ids_ptr, top_lp_ptr, top_stride, width,
    num_tokens_ptr, table_ptr, table_stride, produced_ptr, produced_stride,
    s_tok_ptr, s_tok_s0, s_tok_s1, s_lp_ptr, s_lp_s0, s_lp_s1,
    s_tid_ptr, s_tid_s0, s_tid_s1, s_tlp_ptr, s_tlp_s0, s_tlp_s1,
    R, capacity, num_top,
    HAS_TOP: tl.constexpr, BLOCK_R: tl.constexpr, TOP_P2: tl.constexpr,
):
    """:meth:`Scheduler._publish_tokens` (publish.py), before the first fence: the tokens table and
    the stream payload."""
    i, r, tok, live, no_mask, valid = _lanes(sample_rows_ptr, tok_ptr, R, BLOCK_R)
    row_tokens = tl.load(num_tokens_ptr + r, mask=valid, other=0)
    tl.store(table_ptr + r * table_stride + row_tokens, tok.to(tl.int32), mask=live)
    tl.store(num_tokens_ptr + r, row_tokens + live.to(tl.int64), mask=valid)
    at = tl.load(produced_ptr + r * produced_stride, mask=valid, other=0).to(tl.int64) % capacity
    tl.store(s_tok_ptr + r * s_tok_s0 + at * s_tok_s1, tok.to(tl.int32), mask=live)
    lp = tl.load(logprob_ptr + i, mask=live, other=0.0).to(tl.float32)
    tl.store(s_lp_ptr + r * s_lp_s0 + at * s_lp_s1, lp, mask=live)
    if HAS_TOP:
        k = tl.arange(0, TOP_P2)
        have = (k[None, :] < width) & (k[None, :] < num_top)
        lane2 = live[:, None] & (k[None, :] < num_top)
        ids = tl.load(top_ids_ptr + i[:, None] * top_stride + k[None, :], mask=lane2 & have, other=-1)
        lps = tl.load(top_lp_ptr + i[:, None] * top_stride + k[None, :], mask=lane2 & have,
                      other=float("-inf"))
        dst = r[:, None] * s_tid_s0 + at[:, None] * s_tid_s1 + k[None, :]
        tl.store(s_tid_ptr + dst, ids.to(tl.int32), mask=lane2)
        tl.store(s_tlp_ptr + r[:, None] * s_tlp_s0 + at[:, None] * s_tlp_s1 + k[None, :], lps.to(tl.float32),
                 mask=lane2)


@triton.jit
def _publish_finish_kernel(
    sample_rows_ptr, tok_ptr, num_tokens_ptr, num_prompt_ptr, produced_ptr, produced_stride,
    stop_ids_ptr, stop_stride, n_stop, ignore_eos_ptr, min_tokens_ptr, max_tokens_ptr, eos_ptr, n_eos,
    counters_ptr, finish_ptr, finish_stride, done_ptr, S, R, max_model_len,
    K_GENERATED: tl.constexpr, FINISH_STOP: tl.constexpr, FINISH_LENGTH: tl.constexpr,
    FINISH_ERROR: tl.constexpr, BLOCK_R: tl.constexpr, STOP_P2: tl.constexpr, S_P2: tl.constexpr,
):
    """:meth:`Scheduler._publish_tokens` (publish.py), between the fences: ``produced``, the finish
    checks and reasons."""
    i, r, tok, live, no_mask, valid = _lanes(sample_rows_ptr, tok_ptr, R, BLOCK_R)
    produced = tl.load(produced_ptr + r * produced_stride, mask=valid, other=0)
    tl.store(produced_ptr + r * produced_stride, produced + live.to(produced.dtype), mask=valid)
    n_pub = tl.sum(live.to(tl.int64), 0)
    tl.store(counters_ptr + K_GENERATED, tl.load(counters_ptr + K_GENERATED) + n_pub)
    row_tokens = tl.load(num_tokens_ptr + r, mask=valid, other=0)  # after the token
    n_out_before = row_tokens - live.to(tl.int64) - tl.load(num_prompt_ptr + r, mask=valid, other=0)
    k = tl.arange(0, STOP_P2)
    stop_ids = tl.load(stop_ids_ptr + r[:, None] * stop_stride + k[None, :], mask=valid[:, None] & (k[None, :] < n_stop),
                       other=-1).to(tl.int64)
    is_stop = tl.sum(((stop_ids == tok[:, None]) & (k[None, :] < n_stop)).to(tl.int32), 1) > 0
    eos = tl.load(eos_ptr + k, mask=k < n_eos, other=-1)
    is_eos = tl.sum(((eos[None, :] == tok[:, None]) & (k[None, :] < n_eos)).to(tl.int32), 1) > 0
    ignore = tl.load(ignore_eos_ptr + r, mask=valid, other=0) != 0
    min_t = tl.load(min_tokens_ptr + r, mask=valid, other=0).to(tl.int64)
    max_t = tl.load(max_tokens_ptr + r, mask=valid, other=0).to(tl.int64)
    stop = live & (is_stop | (is_eos & ~ignore)) & (n_out_before >= min_t)
    length = live & (((max_t > 0) & (n_out_before + 1 >= max_t)) | (row_tokens >= max_model_len))
    done = stop | length | no_mask
    reason = tl.where(no_mask, FINISH_ERROR, tl.where(stop, FINISH_STOP, FINISH_LENGTH))
    rows = tl.arange(0, S_P2)
    tl.store(done_ptr + rows, tl.zeros([S_P2], dtype=tl.int64), mask=rows < S)
    tl.debug_barrier()
    tl.store(finish_ptr + r * finish_stride, reason.to(tl.int32), mask=done)
    tl.store(done_ptr + r, done.to(tl.int64), mask=done)


@triton.jit
def _publish_state_kernel(done_ptr, words_ptr, word0, status_ptr, needs_lookup_ptr, S,
                          SLOT_FINISHED: tl.constexpr, ROW_RELEASING: tl.constexpr, S_P2: tl.constexpr):
    """:meth:`Scheduler._publish_tokens` (publish.py), after the second fence: the FINISHED state
    words, the rows RELEASING."""
    rows = tl.arange(0, S_P2)
    done = (tl.load(done_ptr + rows, mask=rows < S, other=0) != 0) & (rows < S)
    tl.store(words_ptr + word0 + rows, tl.zeros([S_P2], dtype=tl.int32) + SLOT_FINISHED, mask=done)
    tl.store(status_ptr + rows, tl.zeros([S_P2], dtype=tl.int32) + ROW_RELEASING, mask=done)
    tl.store(needs_lookup_ptr + rows, tl.zeros([S_P2], dtype=tl.int1), mask=done)


def publish(sched, batch, tokens: torch.Tensor, logprob: torch.Tensor, top_ids: torch.Tensor,
            top_logprobs: torch.Tensor, done: torch.Tensor, consts: dict[str, int]) -> None:
    """:meth:`Scheduler.update`'s publishing part in three launches with the reference's two
    fences between them: the tokens table and the stream payload; then the ``produced``
    counters, the finish checks and the finish reasons; then the FINISHED state words."""
    st, ring, S = sched.state, sched.ring, sched.num_slots
    R = min(tokens.shape[0], S)
    width = top_ids.shape[1]
    top_i = top_ids if width else tokens.view(-1, 1)
    top_l = top_logprobs if width else logprob.view(-1, 1)
    if width:
        top_i, top_l = top_i.contiguous(), top_l.contiguous()
    lp = logprob.contiguous()
    tok = tokens.contiguous()
    sp = st.sampling
    produced = ring["produced"]
    block_r = _p2(R)
    with triton_sched_count.launch("publish_payload"):
        _publish_payload_kernel[(1,)](
            batch.sample_rows, tok, lp, top_i, top_l, top_i.stride(0), width,
            st.num_tokens, st.tokens, st.tokens.stride(0), produced, produced.stride(0),
            ring["tokens"], ring["tokens"].stride(0), ring["tokens"].stride(1),
            ring["logprob"], ring["logprob"].stride(0), ring["logprob"].stride(1),
            ring["top_ids"], ring["top_ids"].stride(0), ring["top_ids"].stride(1),
            ring["top_logprobs"], ring["top_logprobs"].stride(0), ring["top_logprobs"].stride(1),
            R, sched.stream_capacity, sched.num_top,
            HAS_TOP=bool(width), BLOCK_R=block_r, TOP_P2=_p2(sched.num_top),
        )
    sched._fence()
    stop_ids = sp["stop_token_ids"]
    with triton_sched_count.launch("publish_finish"):
        _publish_finish_kernel[(1,)](
            batch.sample_rows, tok, st.num_tokens, st.num_prompt, produced, produced.stride(0),
            stop_ids, stop_ids.stride(0), stop_ids.shape[1], sp["ignore_eos"], sp["min_tokens"],
            sp["max_tokens"], sched._eos, sched._eos.shape[0],
            st.counters, ring["finish_reason"], ring["finish_reason"].stride(0), done, S, R,
            sched.config.max_model_len, **consts["finish"],
            BLOCK_R=block_r, STOP_P2=_p2(max(stop_ids.shape[1], sched._eos.shape[0])), S_P2=_p2(S),
        )
    sched._fence()
    with triton_sched_count.launch("publish_state"):
        _publish_state_kernel[(1,)](
            done, sched._words, sched._state_word0, st.status, st.needs_lookup, S,
            **consts["state"], S_P2=_p2(S),
        )


# ------------------------------------------------------------------- prefix-cache insert


@triton.jit
def _register_kernel(
    ids_ptr, pos_ptr, rows_ptr, slot_ptr, qsl_ptr, total_ptr, n,
    block_tokens_ptr, row_hash_ptr, pows_ptr, pows_stride, p0, p1,
    table_ptr, hash_table_ptr, block_slot_ptr, block_key_ptr, block_parent_ptr, block_parent_gen_ptr,
    block_gen_ptr, block_ref_ptr, last_used_ptr, insert_best_ptr, arrival_ptr, step_ptr,
    excl_ptr, key_ptr, target_ptr, prio_ptr, parent_ptr, salt_ptr,
    S, N, B, M, H, P,
    BLOCK_T: tl.constexpr, P_P2: tl.constexpr, S_P2: tl.constexpr, COLLIDE: tl.constexpr,
    INSERT_ROUNDS: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """:func:`blink.engine.prefix_cache.register` (``Scheduler._register``, prefix.py): the prefix-
    cache insert of the step's filled blocks."""
    INT64_MIN: tl.constexpr = -(2**63)
    total = tl.load(total_ptr)
    # Pass 1: block tokens; per-token hash terms, their running sums (carried over chunks).
    carry0 = tl.zeros([], dtype=tl.int64)
    carry1 = tl.zeros([], dtype=tl.int64)
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < n
        ids = tl.load(ids_ptr + t, mask=tm, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + t, mask=tm, other=0)
        slot = tl.load(slot_ptr + t, mask=tm, other=0)
        tl.store(block_tokens_ptr + slot, ids.to(tl.int32), mask=tm)
        valid = (t < total) & tm
        w0 = tl.load(pows_ptr + pos, mask=tm, other=0)
        w1 = tl.load(pows_ptr + pows_stride + pos, mask=tm, other=0)
        term0 = tl.where(valid, (ids + 1) * w0 % p0, 0)
        term1 = tl.where(valid, (ids + 1) * w1 % p1, 0)
        incl0 = carry0 + tl.cumsum(term0, 0)
        incl1 = carry1 + tl.cumsum(term1, 0)
        tl.store(excl_ptr + t, incl0 - term0, mask=tm)
        tl.store(excl_ptr + n + t, incl1 - term1, mask=tm)
        tl.store(key_ptr + t, incl0, mask=tm)  # incl, for pass 2
        tl.store(prio_ptr + t, incl1, mask=tm)
        carry0 += tl.sum(term0, 0)
        carry1 += tl.sum(term1, 0)
    tl.debug_barrier()
    # Pass 2: each token's prefix hash (the row's hash before the step + this step's terms).
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < n
        row = tl.load(rows_ptr + t, mask=tm, other=0)
        start = tl.load(qsl_ptr + row, mask=tm, other=0).to(tl.int64)
        h0 = tl.load(row_hash_ptr + 2 * row, mask=tm, other=0)
        h1 = tl.load(row_hash_ptr + 2 * row + 1, mask=tm, other=0)
        pre0 = (h0 + tl.load(key_ptr + t, mask=tm, other=0) - tl.load(excl_ptr + start, mask=tm, other=0)) % p0
        pre1 = (h1 + tl.load(prio_ptr + t, mask=tm, other=0) - tl.load(excl_ptr + n + start, mask=tm, other=0)) % p1
        key = (pre0 << 31) | pre1
        if COLLIDE:  # tests: every key collides (the reference's tests patch prefix_cache.table_key)
            key = key * 0
        key = key ^ tl.load(salt_ptr + row, mask=tm, other=0)  # the row's cache_salt (prefix_cache.salted)
        tl.store(parent_ptr + t, key, mask=tm)  # the key, staged
    tl.debug_barrier()
    # The rows' hashes advance by their tokens' terms.
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < n
        row = tl.load(rows_ptr + t, mask=tm, other=0)
        e0 = tl.load(excl_ptr + t, mask=tm, other=0)
        e1 = tl.load(excl_ptr + n + t, mask=tm, other=0)
        term0 = tl.load(key_ptr + t, mask=tm, other=0) - e0
        term1 = tl.load(prio_ptr + t, mask=tm, other=0) - e1
        tl.atomic_add(row_hash_ptr + 2 * row, term0, mask=tm)
        tl.atomic_add(row_hash_ptr + 2 * row + 1, term1, mask=tm)
    tl.debug_barrier()
    r = tl.arange(0, S_P2)
    rm = r < S
    tl.store(row_hash_ptr + 2 * r, tl.load(row_hash_ptr + 2 * r, mask=rm, other=0) % p0, mask=rm)
    tl.store(row_hash_ptr + 2 * r + 1, tl.load(row_hash_ptr + 2 * r + 1, mask=rm, other=0) % p1, mask=rm)
    # Pass 3: the blocks this step filled, staged: parent, bid (prio), pending (1/0), the slot
    # taken (H: none yet).
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < n
        row = tl.load(rows_ptr + t, mask=tm, other=0)
        pos = tl.load(pos_ptr + t, mask=tm, other=0)
        fills = (t < total) & tm & ((pos + 1) % B == 0)
        j = pos // B
        parent = tl.where(j > 0, tl.load(table_ptr + row * M + tl.maximum(j - 1, 0), mask=tm, other=N).to(tl.int64), N)
        arrival = tl.load(arrival_ptr + row, mask=tm, other=0)
        tl.store(excl_ptr + t, parent, mask=tm)  # the parent, staged
        tl.store(prio_ptr + t, tl.where(fills, -(arrival * (M + 1) + j), INT64_MIN), mask=tm)
        tl.store(key_ptr + t, fills.to(tl.int64), mask=tm)  # pending
        tl.store(target_ptr + t, tl.zeros([BLOCK_T], dtype=tl.int64) + H, mask=tm)
    tl.debug_barrier()
    # The insert's rounds (prefix_cache.INSERT_ROUNDS): this round's slot of each block is
    # staged in excl[n + t]; insert_best is INT64_MAX at the slots taken this step.
    k = tl.arange(0, P_P2)
    step = tl.load(step_ptr)
    for r in range(INSERT_ROUNDS):  # a loop, not unrolled: one copy of the passes' code
        # Pass 4: each pending block picks its slot in the probe window and bids (in chunks of
        # BLOCK_F tokens: its [tokens, probes] tiles stay in registers).
        for t0 in range(0, n, BLOCK_F):
            t = t0 + tl.arange(0, BLOCK_F)
            tm = t < n
            key = tl.load(parent_ptr + t, mask=tm, other=0)
            pending = (tl.load(key_ptr + t, mask=tm, other=0) != 0) & tm
            # a retry (round r > 0) scans its window from a point its key picks
            rotate = tl.where(r > 0, ((key // H) >> (3 * r)) % P, 0)
            probe = ((key % H)[:, None] + (k[None, :] + rotate[:, None]) % P) % H
            pm = tm[:, None] & (k[None, :] < P)
            occ = tl.load(hash_table_ptr + probe, mask=pm, other=N)
            live = (tl.load(block_slot_ptr + occ, mask=pm, other=-1) == probe) & pm
            same = live & (tl.load(block_key_ptr + occ, mask=pm, other=-1) == key[:, None])
            up = tl.load(block_parent_ptr + occ, mask=pm, other=N)
            anchored = (up == N) | ((tl.load(block_slot_ptr + up, mask=pm, other=-1) >= 0)
                                    & (tl.load(block_parent_gen_ptr + occ, mask=pm, other=0)
                                       == tl.load(block_gen_ptr + up, mask=pm, other=0)))
            in_use = (tl.load(block_ref_ptr + occ, mask=pm, other=0) > 0).to(tl.int64) << 62
            score = tl.where(same, -2, tl.where(live, tl.load(last_used_ptr + occ, mask=pm, other=0) + in_use, -1))
            claimed = tl.load(insert_best_ptr + probe, mask=pm, other=INT64_MIN) == _INT64_MAX
            score = tl.where(pm & ~claimed, score, _INT64_MAX)
            best_score = tl.min(score, 1)
            choice = tl.min(tl.where(score == best_score[:, None], k[None, :], P_P2), 1)  # the first minimum
            pick = k[None, :] == choice[:, None]
            target = tl.sum(tl.where(pick, probe, 0), 1)
            taken = tl.sum((pick & same & anchored).to(tl.int32), 1) > 0
            pending = pending & ~taken & (best_score != _INT64_MAX)
            prio = tl.load(prio_ptr + t, mask=tm, other=INT64_MIN)
            lanes = tl.where(pending, target, H)
            tl.atomic_max(insert_best_ptr + lanes, tl.where(pending, prio, INT64_MIN), mask=tm)
            tl.store(excl_ptr + n + t, lanes, mask=tm)
            tl.store(key_ptr + t, pending.to(tl.int64), mask=tm)
        tl.debug_barrier()
        # Pass 5: the winners (the oldest request per slot) evict what their slot held.
        for t0 in range(0, n, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < n
            lanes = tl.load(excl_ptr + n + t, mask=tm, other=H)
            prio = tl.load(prio_ptr + t, mask=tm, other=INT64_MIN)
            win = (lanes < H) & (tl.load(insert_best_ptr + lanes, mask=tm, other=INT64_MIN) == prio) & tm
            tl.store(target_ptr + t, tl.where(win, lanes, tl.load(target_ptr + t, mask=tm, other=H)), mask=tm)
            victim = tl.load(hash_table_ptr + tl.where(win, lanes, H), mask=tm, other=N)
            evicted = win & (tl.load(block_slot_ptr + victim, mask=tm, other=-1) == lanes)
            tl.store(block_slot_ptr + tl.where(evicted, victim, N), tl.zeros([BLOCK_T], dtype=tl.int64) - 1, mask=tm)
        tl.debug_barrier()
        # Pass 6: the winners' table entries and their blocks' records.
        for t0 in range(0, n, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < n
            lanes = tl.load(excl_ptr + n + t, mask=tm, other=H)
            win = (lanes < H) & (tl.load(target_ptr + t, mask=tm, other=H) == lanes) & tm
            blk = tl.where(win, tl.load(slot_ptr + t, mask=tm, other=0) // B, N)
            key = tl.load(parent_ptr + t, mask=tm, other=0)
            parent = tl.load(excl_ptr + t, mask=tm, other=N)
            tl.store(hash_table_ptr + lanes, blk, mask=win)
            tl.store(block_slot_ptr + blk, lanes, mask=win)
            tl.store(block_key_ptr + blk, key, mask=win)
            tl.store(block_parent_ptr + blk, parent, mask=win)
            tl.store(block_parent_gen_ptr + blk, tl.load(block_gen_ptr + parent, mask=win, other=0), mask=win)
            tl.atomic_max(last_used_ptr + blk, tl.where(win, step * (M + 1), 0), mask=win)
        tl.store(block_slot_ptr + N, -1)
        tl.store(hash_table_ptr + H, N)
        tl.debug_barrier()
        # Pass 7: the slots bid on are taken; a loser tries again next round unless the winner
        # holds its own key (a key has at most one live entry).
        for t0 in range(0, n, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < n
            lanes = tl.load(excl_ptr + n + t, mask=tm, other=H)
            pending = (tl.load(key_ptr + t, mask=tm, other=0) != 0) & tm
            win = pending & (tl.load(target_ptr + t, mask=tm, other=H) == lanes)
            key = tl.load(parent_ptr + t, mask=tm, other=0)
            holder = tl.load(hash_table_ptr + lanes, mask=tm, other=N)
            pending = pending & ~win & (tl.load(block_key_ptr + holder, mask=tm, other=0) != key)
            tl.store(insert_best_ptr + lanes, tl.zeros([BLOCK_T], dtype=tl.int64) + _INT64_MAX, mask=tm & (lanes < H))
            tl.store(key_ptr + t, pending.to(tl.int64), mask=tm)
        tl.store(insert_best_ptr + H, INT64_MIN)
        tl.debug_barrier()
    for t0 in range(0, n, BLOCK_T):  # bids reset (all INT64_MIN between steps)
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < n
        tl.store(insert_best_ptr + tl.load(target_ptr + t, mask=tm, other=H),
                 tl.zeros([BLOCK_T], dtype=tl.int64) + INT64_MIN, mask=tm)
    # The sinks again (each round's end restored them already; without these three stores
    # sm_90's build of this kernel spilled 20 bytes: test_kernels_compile checks none)
    tl.store(insert_best_ptr + H, INT64_MIN)
    tl.store(block_slot_ptr + N, -1)
    tl.store(hash_table_ptr + H, N)


class RegisterScratch:
    """The prefix-insert kernel's per-token scratch (T tokens), allocated once."""

    def __init__(self, T: int, device: torch.device) -> None:
        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.excl, self.key, self.target, self.prio, self.parent = z(2 * T), z(T), z(T), z(T), z(T)


def register(st, batch, n: int, hc, scratch: RegisterScratch, *, num_blocks: int, block_size: int,
             hash_table_size: int, probes: int) -> None:
    """:func:`blink.engine.prefix_cache.register` in one launch: block tokens, the rows'
    prefix hashes, and the insert of every block the step filled (probe window, the oldest
    request winning a contested slot and the losers choosing again in later rounds, eviction
    of the slot's previous entry)."""
    md = batch.attn
    S, M = st.block_table.shape
    pows = hc.pows
    with triton_sched_count.launch("register"):
        _register_kernel[(1,)](
            batch.input_ids, md.positions, md.token_seq_idx, md.slot_mapping, md.query_start_loc,
            batch.num_scheduled_tokens, n,
            st.block_tokens, st.row_hash, pows, pows.stride(0), int(PRIMES[0]), int(PRIMES[1]),
            st.block_table_flat, st.hash_table, st.block_slot, st.block_key, st.block_parent, st.block_parent_gen,
            st.block_gen, st.block_ref, st.block_last_used, st.insert_best, st.arrival, st.step,
            scratch.excl, scratch.key, scratch.target, scratch.prio, scratch.parent,
            st.sampling["cache_salt"],
            S, num_blocks, block_size, M, hash_table_size, probes,
            BLOCK_T=min(_p2(n), 512), P_P2=_p2(probes), S_P2=_p2(S), COLLIDE=COLLIDE_KEYS,
            INSERT_ROUNDS=INSERT_ROUNDS, BLOCK_F=min(_p2(n), 64),
        )


# the prefix hash's moduli and the insert's rounds (blink.engine.prefix_cache.PRIMES and
# INSERT_ROUNDS; repeated here: kernels import no engine)
PRIMES = (2_147_483_647, 2_147_483_629)
INSERT_ROUNDS = 3
#: tests only: every prefix key 0, so every lookup collides and verification alone decides
#: (what the reference's tests force by replacing ``prefix_cache.table_key``)
COLLIDE_KEYS = False


# ------------------------------------------------------------------- prefix-cache lookup


@triton.jit
def _lookup_kernel(
    needs_ptr, arrival_ptr, num_tokens_ptr, num_prompt_ptr, num_blocks_ptr, num_computed_ptr, row_hash_ptr,
    tokens_ptr, tokens_stride, block_tokens_ptr, hash_table_ptr, block_slot_ptr, block_key_ptr,
    block_parent_ptr, block_parent_gen_ptr, block_gen_ptr, block_ref_ptr, last_used_ptr, table_ptr,
    step_ptr, counters_ptr, pows_ptr, pows_stride, p0, p1, cached_ptr, cached_stride,
    rows_ptr, ends_ptr, take_ptr, nhit_ptr, incl_ptr, excl_ptr, blk_ptr, flag_ptr, salt_ptr, priority_ptr,
    S, K, W, N, B, M, H, P, table_sink,
    K_QUERIES: tl.constexpr, K_HITS: tl.constexpr, K_REJECTS: tl.constexpr, PRIORITY: tl.constexpr,
    S_P2: tl.constexpr, BLOCK_W: tl.constexpr, B_P2: tl.constexpr, P_P2: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, S_BITS: tl.constexpr, COLLIDE: tl.constexpr,
):
    """:meth:`Scheduler._lookup` with :func:`blink.engine.prefix_cache.lookup` (prefix.py): the
    oldest waiting rows take their longest verified cached prefix."""
    # The oldest K rows waiting for a lookup (FCFS: a sort of packed arrival keys; the rows
    # not waiting that fill the K lanes change nothing).
    p = tl.arange(0, S_P2)
    pm = p < S
    needs = (tl.load(needs_ptr + p, mask=pm, other=0) != 0) & pm
    arrival = tl.load(arrival_ptr + p, mask=pm, other=0)
    row_k = _queue_order(needs, arrival, p, pm, priority_ptr, 1, S_BITS, PRIORITY)
    km = p < K
    waiting = (tl.load(needs_ptr + row_k, mask=km, other=0) != 0) & km
    nt_k = tl.load(num_tokens_ptr + row_k, mask=km, other=0)
    eligible = tl.where(waiting, (nt_k - 1) // B, 0)
    ok = waiting & (tl.cumsum(eligible, 0) <= W)
    take = tl.where(ok, eligible, 0)
    ends = tl.cumsum(take, 0)
    total = tl.sum(take, 0)
    tl.store(rows_ptr + p, row_k, mask=km)
    tl.store(ends_ptr + p, ends, mask=km)
    tl.store(take_ptr + p, take, mask=km)
    tl.store(nhit_ptr + p, take, mask=km)
    tl.debug_barrier()
    c = tl.arange(0, B_P2)
    cm = c < B
    carry0 = tl.zeros([], dtype=tl.int64)
    carry1 = tl.zeros([], dtype=tl.int64)
    # Lane w: block j of the k-th row; its tokens' hash terms, summed along the window.
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < W
        k, j, start = _segment_lane(ends_ptr, take_ptr, w, K, wm, BLOCK_W, SEARCH_STEPS)
        valid = (w < total) & wm
        row = tl.load(rows_ptr + k, mask=wm, other=0)
        cols = tl.minimum(j[:, None] * B + c[None, :], M * B - 1)
        m2 = wm[:, None] & cm[None, :]
        t64 = tl.load(tokens_ptr + row[:, None] * tokens_stride + cols, mask=m2, other=0).to(tl.int64) + 1
        q0 = tl.load(pows_ptr + cols, mask=m2, other=0)
        q1 = tl.load(pows_ptr + pows_stride + cols, mask=m2, other=0)
        term0 = tl.where(valid, tl.sum(tl.where(cm[None, :], t64 * q0 % p0, 0), 1) % p0, 0)
        term1 = tl.where(valid, tl.sum(tl.where(cm[None, :], t64 * q1 % p1, 0), 1) % p1, 0)
        incl0 = carry0 + tl.cumsum(term0, 0)
        incl1 = carry1 + tl.cumsum(term1, 0)
        tl.store(incl_ptr + w, incl0, mask=wm)
        tl.store(incl_ptr + W + w, incl1, mask=wm)
        tl.store(excl_ptr + w, incl0 - term0, mask=wm)
        tl.store(excl_ptr + W + w, incl1 - term1, mask=wm)
        carry0 += tl.sum(term0, 0)
        carry1 += tl.sum(term1, 0)
    tl.debug_barrier()
    kk = tl.arange(0, P_P2)
    for w0 in range(0, W, BLOCK_W):  # the prefix hash at each block's end; its first live match
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < W
        k, j, start = _segment_lane(ends_ptr, take_ptr, w, K, wm, BLOCK_W, SEARCH_STEPS)
        valid = (w < total) & wm
        h0 = (tl.load(incl_ptr + w, mask=wm, other=0) - tl.load(excl_ptr + start, mask=wm, other=0)) % p0
        h1 = (tl.load(incl_ptr + W + w, mask=wm, other=0) - tl.load(excl_ptr + W + start, mask=wm, other=0)) % p1
        tl.store(flag_ptr + w, h0, mask=wm)  # kept for the rows' hit hash
        tl.store(flag_ptr + W + w, h1, mask=wm)
        key = (h0 << 31) | h1
        if COLLIDE:
            key = key * 0
        salt_row = tl.load(rows_ptr + k, mask=wm, other=0)
        key = key ^ tl.load(salt_ptr + salt_row, mask=wm, other=0)  # prefix_cache.salted
        probe = ((key % H)[:, None] + kk[None, :]) % H
        qm = wm[:, None] & (kk[None, :] < P)
        cand = tl.load(hash_table_ptr + probe, mask=qm, other=N)
        live = qm & (tl.load(block_slot_ptr + cand, mask=qm, other=-1) == probe) & (
            tl.load(block_key_ptr + cand, mask=qm, other=-1) == key[:, None])
        first = tl.min(tl.where(live, kk[None, :], P_P2), 1)
        blk = tl.sum(tl.where(kk[None, :] == first[:, None], cand, 0), 1)
        tl.store(blk_ptr + w, tl.where((first < P_P2) & valid, blk, N), mask=wm)
    tl.debug_barrier()
    for w0 in range(0, W, BLOCK_W):  # verification: the tokens, the parent chain; first miss per row
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < W
        k, j, start = _segment_lane(ends_ptr, take_ptr, w, K, wm, BLOCK_W, SEARCH_STEPS)
        valid = (w < total) & wm
        row = tl.load(rows_ptr + k, mask=wm, other=0)
        blk = tl.load(blk_ptr + w, mask=wm, other=N)
        cols = tl.minimum(j[:, None] * B + c[None, :], M * B - 1)
        m2 = wm[:, None] & cm[None, :]
        toks = tl.load(tokens_ptr + row[:, None] * tokens_stride + cols, mask=m2, other=0)
        stored = tl.load(block_tokens_ptr + blk[:, None] * B + c[None, :], mask=m2, other=0)
        same_tokens = tl.sum(((stored != toks) & cm[None, :]).to(tl.int32), 1) == 0
        previous = tl.load(blk_ptr + tl.maximum(w - 1, 0), mask=wm & (w > 0), other=N)
        parent = tl.where(j > 0, previous, N)
        same_parent = (tl.load(block_parent_ptr + blk, mask=wm, other=-1) == parent) & (
            (parent == N) | (tl.load(block_parent_gen_ptr + blk, mask=wm, other=0)
                             == tl.load(block_gen_ptr + parent, mask=wm, other=0)))
        found = blk < N
        verified = found & same_tokens & same_parent
        tl.atomic_min(nhit_ptr + k, j, mask=valid & ~verified)
        tl.store(excl_ptr + w, (found & ~verified).to(tl.int64), mask=wm)  # a rejected match
    tl.debug_barrier()
    step = tl.load(step_ptr)
    rejects = tl.zeros([BLOCK_W], dtype=tl.int64)
    for w0 in range(0, W, BLOCK_W):  # the hits: into the block table, a reference each
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < W
        k, j, start = _segment_lane(ends_ptr, take_ptr, w, K, wm, BLOCK_W, SEARCH_STEPS)
        valid = (w < total) & wm
        row = tl.load(rows_ptr + k, mask=wm, other=0)
        n_hit = tl.load(nhit_ptr + k, mask=wm, other=0)
        rejects += (valid & (j == n_hit) & (tl.load(excl_ptr + w, mask=wm, other=0) != 0)).to(tl.int64)
        hit = valid & (j < n_hit)
        blk = tl.where(hit, tl.load(blk_ptr + w, mask=wm, other=N), N)
        tl.store(table_ptr + tl.where(hit, row * M + j, table_sink), blk.to(tl.int32), mask=wm)
        tl.atomic_add(block_ref_ptr + blk, hit.to(tl.int32), mask=wm)
        tl.atomic_max(last_used_ptr + blk, tl.where(hit, step * (M + 1) + (M - j), 0), mask=wm)
    # The rows: blocks and computed tokens of the hit, its hash, lookup done; the counters.
    n_hit = tl.load(nhit_ptr + p, mask=km, other=0)
    hit_tokens = n_hit * B
    last = tl.maximum(ends - take + n_hit - 1, 0)
    hh0 = tl.where(n_hit > 0, tl.load(flag_ptr + last, mask=km, other=0), 0)
    hh1 = tl.where(n_hit > 0, tl.load(flag_ptr + W + last, mask=km, other=0), 0)
    tl.store(num_blocks_ptr + row_k, n_hit, mask=ok)
    tl.store(num_computed_ptr + row_k, hit_tokens, mask=ok)
    tl.store(row_hash_ptr + 2 * row_k, hh0, mask=ok)
    tl.store(row_hash_ptr + 2 * row_k + 1, hh1, mask=ok)
    tl.store(needs_ptr + row_k, tl.zeros([S_P2], dtype=tl.int1), mask=ok)
    tl.store(counters_ptr + K_QUERIES, tl.load(counters_ptr + K_QUERIES) + tl.sum(tl.where(ok, nt_k, 0), 0))
    tl.store(counters_ptr + K_HITS, tl.load(counters_ptr + K_HITS) + tl.sum(tl.where(km, hit_tokens, 0), 0))
    tl.store(counters_ptr + K_REJECTS, tl.load(counters_ptr + K_REJECTS) + tl.sum(rejects, 0))
    first_time = ok & (nt_k == tl.load(num_prompt_ptr + row_k, mask=km, other=-1))
    tl.store(cached_ptr + row_k * cached_stride, hit_tokens.to(tl.int32), mask=first_time)


class LookupScratch:
    """The lookup kernel's scratch (S rows, a window of W blocks), allocated once."""

    def __init__(self, S: int, W: int, device: torch.device) -> None:
        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.rows, self.ends, self.take, self.nhit = z(S), z(S), z(S), z(S)
        self.incl, self.excl, self.blk, self.flag = z(2 * W), z(2 * W), z(W), z(2 * W)


def lookup(st, ring_cached: torch.Tensor, hc, scratch: LookupScratch, *, K: int, window: int,
           num_blocks: int, block_size: int, hash_table_size: int, probes: int, consts: dict[str, int]) -> None:
    """:meth:`Scheduler._lookup` with :func:`blink.engine.prefix_cache.lookup` in one launch:
    the oldest rows waiting for a lookup take their longest verified cached prefix."""
    S, M = st.block_table.shape
    pows = hc.pows
    with triton_sched_count.launch("lookup"):
        _lookup_kernel[(1,)](
            st.needs_lookup, st.arrival, st.num_tokens, st.num_prompt, st.num_blocks, st.num_computed, st.row_hash,
            st.tokens, st.tokens.stride(0), st.block_tokens, st.hash_table, st.block_slot, st.block_key,
            st.block_parent, st.block_parent_gen, st.block_gen, st.block_ref, st.block_last_used,
            st.block_table_flat, st.step, st.counters, pows, pows.stride(0), int(PRIMES[0]), int(PRIMES[1]),
            ring_cached, ring_cached.stride(0),
            scratch.rows, scratch.ends, scratch.take, scratch.nhit, scratch.incl, scratch.excl, scratch.blk,
            scratch.flag, st.sampling["cache_salt"], st.sampling["priority"],
            S, K, window, num_blocks, block_size, M, hash_table_size, probes, st.block_table_flat.shape[0] - 1,
            **consts, S_P2=_p2(S), BLOCK_W=min(_p2(window), 256), B_P2=triton.next_power_of_2(block_size),
            P_P2=_p2(probes), SEARCH_STEPS=int(K).bit_length() + 1, S_BITS=int(_p2(S)).bit_length(),
            COLLIDE=COLLIDE_KEYS,
        )


# ----------------------------------------------------------------------------- admission


#: the sampler's feature bits, in order (blink.engine.sampler._FEATURES, which the scheduler
#: checks against this before it uses the admit kernel; kernels import no engine)
FEATURES = ("any_random", "any_filter", "any_penalty", "any_top_logprobs", "any_logit_bias",
            "any_constrained", "any_allowed", "any_bad_words")


@triton.jit
def _any_set(ptr, rows, m, width, V_P2: tl.constexpr):
    """Per row: whether any of its ``width`` entries (an int32 [S, width] field) is >= 0."""
    v = tl.arange(0, V_P2)
    x = tl.load(ptr + rows[:, None] * width + v[None, :], mask=m[:, None] & (v[None, :] < width), other=-1)
    return tl.max((x >= 0).to(tl.int32), 1) > 0


@triton.jit
def _admit_sampling(
    idx_ptr, admit_ptr, K, words_ptr, record_ptr, copy_ptr, RW, features_ptr,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, rep_ptr, pres_ptr, freq_ptr, logprobs_ptr, constrained_ptr,
    bias_ptr, n_bias, allowed_ptr, n_allowed, bad_ptr, n_bad,
    K_P2: tl.constexpr, BLOCK_C: tl.constexpr, V_P2: tl.constexpr,
):
    """Admission's copy of the sampling fields (``torch.where(admit, ring[name], ...)`` for
    each field of SAMPLING_FIELDS) and the rows' feature words
    (:func:`blink.engine.sampler.row_features`), for the admitted rows among the K picked.
    The copy is one gather over the record's words: ``copy_ptr`` [4, RW] holds, per word of a
    row's record, its word in the flat sampling buffer (row 0: base, row 1: words per row)
    and in the ring region (row 2: slot 0's word, row 3: words per slot)."""
    kk = tl.arange(0, K_P2)
    km = kk < K
    row = tl.load(idx_ptr + kk, mask=km, other=0)
    m = km & (tl.load(admit_ptr + row, mask=km, other=0) != 0)
    for c0 in range(0, RW, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < RW
        dst0 = tl.load(copy_ptr + c, mask=cm, other=0)
        dst_n = tl.load(copy_ptr + RW + c, mask=cm, other=0)
        src0 = tl.load(copy_ptr + 2 * RW + c, mask=cm, other=0)
        src_n = tl.load(copy_ptr + 3 * RW + c, mask=cm, other=0)
        m2 = m[:, None] & cm[None, :]
        v = tl.load(words_ptr + src0[None, :] + row[:, None] * src_n[None, :], mask=m2, other=0)
        tl.store(record_ptr + dst0[None, :] + row[:, None] * dst_n[None, :], v, mask=m2)
    tl.debug_barrier()
    # The feature word, bit i = FEATURES[i] (row_features' rules).
    temp = tl.load(temp_ptr + row, mask=m, other=0.0)
    random = temp > 0
    filtered = random & ((tl.load(top_k_ptr + row, mask=m, other=0) > 0) | (tl.load(top_p_ptr + row, mask=m, other=1.0) < 1)
                         | (tl.load(min_p_ptr + row, mask=m, other=0.0) > 0))
    penalty = ((tl.load(rep_ptr + row, mask=m, other=1.0) != 1) | (tl.load(pres_ptr + row, mask=m, other=0.0) != 0)
               | (tl.load(freq_ptr + row, mask=m, other=0.0) != 0))
    word = (random.to(tl.int32) | (filtered.to(tl.int32) << 1) | (penalty.to(tl.int32) << 2)
            | ((tl.load(logprobs_ptr + row, mask=m, other=0) > 0).to(tl.int32) << 3)
            | (_any_set(bias_ptr, row, m, n_bias, V_P2).to(tl.int32) << 4)
            | ((tl.load(constrained_ptr + row, mask=m, other=0) != 0).to(tl.int32) << 5)
            | (_any_set(allowed_ptr, row, m, n_allowed, V_P2).to(tl.int32) << 6)
            | (_any_set(bad_ptr, row, m, n_bad, V_P2).to(tl.int32) << 7))
    tl.store(features_ptr + row, word, mask=m)


@triton.jit
def _admit_kernel(
    slot_state_ptr, cancel_ptr, cancel_s, status_ptr, ring_arrival_ptr, arr_s, plen_ptr, plen_s,
    poff_ptr, poff_s, seq_ptr, seq_s, arena_ptr, A, tokens_ptr, tokens_stride,
    arrival_ptr, num_prompt_ptr, num_tokens_ptr, num_computed_ptr, row_hash_ptr, needs_lookup_ptr, counters_ptr,
    stream_seq_ptr, ss_s, produced_ptr, pr_s, finish_ptr, fr_s, nprompt_ptr, np_s, ncached_ptr, nc_s,
    admitted_ptr, ad_s,
    admit_ptr, publish_ptr, idx_ptr, ends_ptr, take_ptr,
    words_ptr, record_ptr, copy_ptr, RW, features_ptr,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, rep_ptr, pres_ptr, freq_ptr, logprobs_ptr, constrained_ptr,
    bias_ptr, n_bias, allowed_ptr, n_allowed, bad_ptr, n_bad, ring_prio_ptr, prio_s,
    S, K, L, Wt,
    PREFIX_CACHING: tl.constexpr, K_PROMPT: tl.constexpr, K_STEPS: tl.constexpr, SLOT_WRITTEN: tl.constexpr,
    SLOT_RUNNING: tl.constexpr, SLOT_FINISHED: tl.constexpr, ROW_EMPTY: tl.constexpr, ROW_WAITING: tl.constexpr,
    FINISH_ABORT: tl.constexpr, FINISH_ERROR: tl.constexpr, FINISH_NONE: tl.constexpr, PRIORITY: tl.constexpr,
    S_P2: tl.constexpr, BLOCK_T: tl.constexpr, SEARCH_STEPS: tl.constexpr, S_BITS: tl.constexpr,
    K_P2: tl.constexpr, BLOCK_C: tl.constexpr, V_P2: tl.constexpr,
):
    """:meth:`Scheduler._admit` (admission.py): the FCFS pick, the prompts out of the arena,
    the rows' state and sampling record (every field, :func:`_admit_sampling`), the stream
    reset and finish reasons; the state words' values into ``publish_ptr`` for
    :func:`publish_words` after the fence."""
    p = tl.arange(0, S_P2)
    pm = p < S
    sstate = tl.load(slot_state_ptr + p, mask=pm, other=0)
    status = tl.load(status_ptr + p, mask=pm, other=-1)
    cancel = tl.load(cancel_ptr + p * cancel_s, mask=pm, other=0) != 0
    written = (sstate == SLOT_WRITTEN) & (status == ROW_EMPTY) & pm
    aborted = written & cancel
    candidate = written & ~cancel
    arr = tl.load(ring_arrival_ptr + p * arr_s, mask=pm, other=0)
    idx = _queue_order(candidate, arr, p, pm, ring_prio_ptr, prio_s, S_BITS, PRIORITY)  # the candidates first
    km = p < K
    ok_k = km & (tl.load(slot_state_ptr + idx, mask=km, other=0) == SLOT_WRITTEN) & (
        tl.load(status_ptr + idx, mask=km, other=-1) == ROW_EMPTY) & (
        tl.load(cancel_ptr + idx * cancel_s, mask=km, other=1) == 0)
    plen_k = tl.load(plen_ptr + idx * plen_s, mask=km, other=0).to(tl.int64)
    valid_k = ok_k & (plen_k >= 1) & (plen_k < L)
    take_k = tl.where(valid_k, plen_k, 0)
    picked_k = ok_k & (tl.cumsum(take_k, 0) <= Wt)
    admit_k = picked_k & valid_k
    take_k = tl.where(picked_k, take_k, 0)
    ends_k = tl.cumsum(take_k, 0)
    total = tl.sum(take_k, 0)
    tl.store(publish_ptr + p, tl.zeros([S_P2], dtype=tl.int64), mask=pm)
    tl.debug_barrier()
    tl.store(publish_ptr + idx, tl.where(admit_k, 1, 2).to(tl.int64), mask=picked_k)  # 1 admit, 2 rejected
    tl.store(idx_ptr + p, idx, mask=km)
    tl.store(ends_ptr + p, ends_k, mask=km)
    tl.store(take_ptr + p, take_k, mask=km)
    tl.debug_barrier()
    # The prompts, out of the circular arena, one flat window of lanes.
    for t0 in range(0, Wt, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < Wt
        k, col, start = _segment_lane(ends_ptr, take_ptr, t, K, tm, BLOCK_T, SEARCH_STEPS)
        valid = (t < total) & tm
        row = tl.load(idx_ptr + k, mask=tm, other=0)
        src = tl.load(poff_ptr + row * poff_s, mask=valid, other=0) % A + col
        src = tl.where(src >= A, src - A, src)
        tl.store(tokens_ptr + row * tokens_stride + col, tl.load(arena_ptr + src, mask=valid, other=0), mask=valid)
    chosen = tl.load(publish_ptr + p, mask=pm, other=0)
    admit = chosen == 1
    rejected = chosen == 2
    plen = tl.load(plen_ptr + p * plen_s, mask=pm, other=0).to(tl.int64)
    zero = tl.zeros([S_P2], dtype=tl.int64)
    tl.store(arrival_ptr + p, arr, mask=admit)
    tl.store(num_prompt_ptr + p, plen, mask=admit)
    tl.store(num_tokens_ptr + p, plen, mask=admit)
    tl.store(num_computed_ptr + p, zero, mask=admit)
    tl.store(row_hash_ptr + 2 * p, zero, mask=admit)
    tl.store(row_hash_ptr + 2 * p + 1, zero, mask=admit)
    tl.store(status_ptr + p, tl.zeros([S_P2], dtype=tl.int32) + ROW_WAITING, mask=admit)
    if PREFIX_CACHING:
        tl.store(needs_lookup_ptr + p, tl.zeros([S_P2], dtype=tl.int1) + 1, mask=admit)
    tl.store(counters_ptr + K_PROMPT, tl.load(counters_ptr + K_PROMPT) + tl.sum(tl.where(admit, plen, 0), 0))
    tl.store(admit_ptr + p, admit, mask=pm)
    tl.debug_barrier()
    _admit_sampling(idx_ptr, admit_ptr, K, words_ptr, record_ptr, copy_ptr, RW, features_ptr,
                    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, rep_ptr, pres_ptr, freq_ptr, logprobs_ptr,
                    constrained_ptr, bias_ptr, n_bias, allowed_ptr, n_allowed, bad_ptr, n_bad,
                    K_P2, BLOCK_C, V_P2)
    # Every slot leaving WRITTEN: the stream reset and finish reason (the state word after a fence).
    opened = admit | aborted | rejected
    reason = tl.where(aborted, FINISH_ABORT, tl.where(rejected, FINISH_ERROR, FINISH_NONE))
    tl.store(stream_seq_ptr + p * ss_s, tl.load(seq_ptr + p * seq_s, mask=opened, other=0), mask=opened)
    tl.store(produced_ptr + p * pr_s, zero, mask=opened)
    tl.store(finish_ptr + p * fr_s, reason.to(tl.int32), mask=opened)
    tl.store(nprompt_ptr + p * np_s, plen.to(tl.int32), mask=opened)
    tl.store(ncached_ptr + p * nc_s, zero.to(tl.int32), mask=opened)
    tl.store(admitted_ptr + p * ad_s, zero + tl.load(counters_ptr + K_STEPS), mask=opened)
    tl.debug_barrier()
    tl.store(publish_ptr + p, tl.where(opened, tl.where(admit, SLOT_RUNNING, SLOT_FINISHED), -1).to(tl.int64),
             mask=pm)


@triton.jit
def _publish_words_kernel(value_ptr, words_ptr, word0, S, S_P2: tl.constexpr):
    """Slot state words of the lanes with a value (>= 0), others untouched."""
    p = tl.arange(0, S_P2)
    v = tl.load(value_ptr + p, mask=p < S, other=-1)
    tl.store(words_ptr + word0 + p, v.to(tl.int32), mask=(p < S) & (v >= 0))


class AdmitScratch:
    """The admit kernel's scratch (S rows) and its record-copy table, made once.

    ``words``: the ring region as int32 words; ``copy`` [4, RW] int64: per word of a row's
    sampling record, its word in ``sampling_words`` for row 0 (base) and the words per row,
    its word in the region for slot 0 and the words per slot. Built from the tensors
    themselves (any field the table holds, on any device)."""

    def __init__(self, S: int, words: torch.Tensor, sampling_words: torch.Tensor,
                 sampling: dict[str, torch.Tensor], ring: dict[str, torch.Tensor]) -> None:
        device = sampling_words.device

        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.publish, self.idx, self.ends, self.take = z(S), z(S), z(S), z(S)
        self.admit = torch.zeros(S, dtype=torch.bool, device=device)
        self.words = words
        self.copy = self.record_copy(words, sampling_words, sampling, ring).to(device)

    @staticmethod
    def record_copy(words: torch.Tensor, sampling_words: torch.Tensor, sampling: dict[str, torch.Tensor],
                    ring: dict[str, torch.Tensor]) -> torch.Tensor:
        """The copy table (class docstring). Raises ValueError naming a field whose ring and
        engine entries differ or that is not word-aligned in the ring."""
        cols = []
        for name, dst in sampling.items():
            src = ring[name]
            item = dst.element_size()
            per_row = dst[0].numel() * item // 4
            d0 = dst.data_ptr() - sampling_words.data_ptr()
            s0 = src.data_ptr() - words.data_ptr()
            s_n = src.stride(0) * item
            if (src.dtype != dst.dtype or src.shape != dst.shape or d0 % 4 or s0 % 4 or s_n % 4
                    or (src.dim() > 1 and src.stride(1) != 1)):
                raise ValueError(f"sampling field {name}: the ring's entries ({src.dtype}, {tuple(src.shape)}) "
                                 f"are not a word-aligned copy of the engine's ({dst.dtype}, {tuple(dst.shape)})")
            for j in range(per_row):
                cols.append((d0 // 4 + j, per_row, s0 // 4 + j, s_n // 4))
        return torch.tensor(cols, dtype=torch.int64).reshape(-1, 4).T.contiguous()


def admit(st, ring: dict, slot_state: torch.Tensor, scratch: AdmitScratch, *, K: int, max_model_len: int,
          window: int, prefix_caching: bool, consts: dict[str, int]) -> torch.Tensor:
    """:meth:`Scheduler._admit`'s payload in one launch: FCFS pick, prompt copy, the rows'
    state, sampling fields (``scratch.copy``: :meth:`AdmitScratch.record_copy`) and feature
    words, the stream reset and finish reasons. :func:`publish_words` then writes the state
    words (after the fence). Returns the admitted rows' mask."""
    S = st.status.shape[0]
    sp, copy = st.sampling, scratch.copy
    widths = [sp[name].shape[1] for name in ("logit_bias_ids", "allowed_token_ids", "bad_words_ids")]
    f = {name: ring[name] for name in ("cancel", "arrival", "prompt_len", "prompt_offset", "seq", "stream_seq",
                                      "produced", "finish_reason", "num_prompt_tokens", "num_cached_tokens",
                                      "admitted_step")}
    with triton_sched_count.launch("admit"):
        _admit_kernel[(1,)](
            slot_state, f["cancel"], f["cancel"].stride(0), st.status, f["arrival"], f["arrival"].stride(0),
            f["prompt_len"], f["prompt_len"].stride(0), f["prompt_offset"], f["prompt_offset"].stride(0),
            f["seq"], f["seq"].stride(0), ring["arena"], ring["arena"].shape[0], st.tokens, st.tokens.stride(0),
            st.arrival, st.num_prompt, st.num_tokens, st.num_computed, st.row_hash, st.needs_lookup, st.counters,
            f["stream_seq"], f["stream_seq"].stride(0), f["produced"], f["produced"].stride(0),
            f["finish_reason"], f["finish_reason"].stride(0), f["num_prompt_tokens"], f["num_prompt_tokens"].stride(0),
            f["num_cached_tokens"], f["num_cached_tokens"].stride(0), f["admitted_step"], f["admitted_step"].stride(0),
            scratch.admit, scratch.publish, scratch.idx, scratch.ends, scratch.take,
            scratch.words, st.sampling_words, copy, copy.shape[1], st.sampler_features,
            sp["temperature"], sp["top_k"], sp["top_p"], sp["min_p"], sp["repetition_penalty"],
            sp["presence_penalty"], sp["frequency_penalty"], sp["logprobs"], sp["constrained"],
            sp["logit_bias_ids"], widths[0], sp["allowed_token_ids"], widths[1], sp["bad_words_ids"], widths[2],
            ring["priority"], ring["priority"].stride(0),
            S, K, max_model_len, window, PREFIX_CACHING=prefix_caching, **consts,
            S_P2=_p2(S), BLOCK_T=min(_p2(window), 1024), SEARCH_STEPS=int(K).bit_length() + 1,
            S_BITS=int(_p2(S)).bit_length(), K_P2=_p2(K), BLOCK_C=min(_p2(copy.shape[1]), 128),
            V_P2=_p2(max(widths)),
        )
    return scratch.admit


def publish_words(values: torch.Tensor, words: torch.Tensor, word0: int) -> None:
    """The slot state words of the lanes whose value is >= 0 (one launch)."""
    with triton_sched_count.launch("publish_words"):
        _publish_words_kernel[(1,)](values, words, word0, values.shape[0], S_P2=_p2(values.shape[0]))


# -------------------------------------------------------------------------------- cancel


@triton.jit
def _cancel_kernel(cancel_ptr, cancel_s, status_ptr, needs_ptr, finish_ptr, finish_s, values_ptr, S,
                   ROW_WAITING: tl.constexpr, ROW_RUNNING: tl.constexpr, ROW_RELEASING: tl.constexpr,
                   FINISH_ABORT: tl.constexpr, SLOT_FINISHED: tl.constexpr, S_P2: tl.constexpr):
    """:meth:`Scheduler._cancel` (admission.py): cancelled live rows finish with ABORT; the state
    words' values for :func:`publish_words`."""
    p = tl.arange(0, S_P2)
    pm = p < S
    status = tl.load(status_ptr + p, mask=pm, other=-1)
    gone = pm & (tl.load(cancel_ptr + p * cancel_s, mask=pm, other=0) != 0) & (
        (status == ROW_WAITING) | (status == ROW_RUNNING))
    tl.store(finish_ptr + p * finish_s, tl.zeros([S_P2], dtype=tl.int32) + FINISH_ABORT, mask=gone)
    tl.store(values_ptr + p, tl.where(gone, SLOT_FINISHED, -1).to(tl.int64), mask=pm)
    tl.store(status_ptr + p, tl.zeros([S_P2], dtype=tl.int32) + ROW_RELEASING, mask=gone)
    tl.store(needs_ptr + p, tl.zeros([S_P2], dtype=tl.int1), mask=gone)


def cancel(st, ring: dict, values: torch.Tensor, consts: dict[str, int]) -> None:
    """The cancelled live rows finish with ABORT (``Scheduler._finish``'s payload, one launch):
    their finish reason, their rows RELEASING; ``values`` gets the state word of each lane
    (FINISHED, or -1: untouched) for :func:`publish_words` after the fence."""
    S = st.status.shape[0]
    with triton_sched_count.launch("cancel"):
        _cancel_kernel[(1,)](ring["cancel"], ring["cancel"].stride(0), st.status, st.needs_lookup,
                             ring["finish_reason"], ring["finish_reason"].stride(0), values, S,
                             **consts, S_P2=_p2(S))
