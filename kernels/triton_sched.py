"""The scheduler's stages as fused Triton kernels: one program over the slot table each.

The torch tensor code of :class:`blink.engine.scheduler.Scheduler` is the reference and
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
- ``allocate``: the token budget in FCFS order, preemption by recompute when the blocks do
  not fit (the reference's freed(k) scan over the block table, then the newest-first
  suffix), and the new blocks from the free pool, never-cached first then least recently
  used. FCFS order and the free list are one ``tl.sort`` each of keys packed with their
  row / block id, so the pool is sorted in one program: at most ``MAX_SORT_BLOCKS`` blocks.
  Among equally old free blocks it takes the lowest id, where ``torch.topk`` leaves the
  order unspecified: block ids may differ from the reference's, tokens never do.

Launch grids and block sizes depend on shapes only and the wrappers never read a tensor
value on the host, so the stages stay capturable. On CPU tensors they run under
``TRITON_INTERPRET=1`` (set before this module is imported), as the sampler's kernels do in
the tests. Every launch is counted by :mod:`blink.kernels.triton_sched_count`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.kernels import triton_sched_count

_INT64_MAX = tl.constexpr(2**63 - 1)


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(int(n)))


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
        lo = tl.zeros([BLOCK_T], dtype=tl.int64)
        hi = tl.zeros([BLOCK_T], dtype=tl.int64) + S
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            e = tl.load(qsl_ptr + 1 + mid, mask=(mid < S) & tmask, other=0).to(tl.int64)
            right = (e <= t) & (lo < hi)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right | (lo >= hi), hi, mid)
        row = tl.where(valid, tl.minimum(lo, S - 1), 0)
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


class BatchBuffers:
    """The step batch's tensors, allocated once (a captured graph's outputs live at fixed
    addresses anyway; the CPU loop consumes a batch before the next step)."""

    def __init__(self, S: int, T: int, device: torch.device) -> None:
        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids, self.positions, self.seq_idx, self.slot_mapping = z(T), z(T), z(T), z(T)
        self.query_start_loc, self.seq_lens = z(S + 1, dtype=torch.int32), z(S, dtype=torch.int32)
        self.total, self.bucket, self.num_sample_rows = z(), z(), z()
        self.sample_rows, self.logits_indices = z(S), z(S)


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
        lo = tl.zeros([BLOCK_W], dtype=tl.int64)
        hi = tl.zeros([BLOCK_W], dtype=tl.int64) + S
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            e = tl.load(ends_ptr + mid, mask=(mid < S) & lmask, other=0)
            right = (e <= lane) & (lo < hi)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right | (lo >= hi), hi, mid)
        row = tl.minimum(lo, S - 1)
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
    S, N, M, B, budget, capacity, J, table_sink,
    PREFIX_CACHING: tl.constexpr, K_PREEMPTIONS: tl.constexpr,
    ROW_WAITING: tl.constexpr, ROW_RUNNING: tl.constexpr, ROW_RELEASING: tl.constexpr,
    ROW_AWAITING_KV: tl.constexpr,
    S_P2: tl.constexpr, N_P2: tl.constexpr, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    S_BITS: tl.constexpr, N_BITS: tl.constexpr,
):
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

    # FCFS order: active rows by arrival (unique tickets), then the idle rows (their order
    # among themselves changes nothing: they hold, ask and free nothing here). A sort of
    # (arrival - oldest) << S_BITS | row; spans beyond 2**(62 - S_BITS) tickets clamp.
    lim = (1 << (61 - S_BITS)) - 1
    oldest = tl.min(tl.where(active, arrival, _INT64_MAX), 0)
    rel = tl.minimum(tl.maximum(arrival - oldest, 0), lim)
    cls = tl.where(active, rel, tl.where(rmask, lim + 1, lim + 2))
    order = tl.sort((cls << S_BITS) | rows.to(tl.int64), 0) & ((1 << S_BITS) - 1)  # position -> row
    tl.store(rank_ptr + order, rows.to(tl.int64), mask=rmask)  # row -> position
    tl.store(need_ptr + rows, want, mask=rmask)
    tl.debug_barrier()
    rank = tl.load(rank_ptr + rows, mask=rmask, other=0)
    st_p = tl.load(status_ptr + order, mask=rmask, other=0)
    act_p = ((st_p == ROW_WAITING) | (st_p == ROW_RUNNING)) & rmask
    nc_p = tl.where(act_p, tl.load(num_computed_ptr + order, mask=rmask, other=0), 0)
    held_p = tl.where(act_p, tl.load(num_blocks_ptr + order, mask=rmask, other=0), 0)
    asked = tl.load(need_ptr + order, mask=rmask, other=0)

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
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = tl.zeros([BLOCK], dtype=tl.int64) + S
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            e = tl.load(ends_ptr + mid, mask=(mid < S) & jmask, other=0)
            right = (e <= j) & (lo < hi)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right | (lo >= hi), hi, mid)
        row = tl.minimum(lo, S - 1)
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
            scratch.free_list, scratch.num_new,
            S, N, M, block_size, budget, capacity, window, st.block_table_flat.shape[0] - 1,
            PREFIX_CACHING=prefix_caching, **consts,
            S_P2=_p2(S), N_P2=_p2(N), BLOCK=256, SEARCH_STEPS=int(S).bit_length() + 1,
            S_BITS=int(_p2(S)).bit_length(), N_BITS=int(_p2(N)).bit_length(),
        )
    return scratch.num_new
