"""Budget, blocks and preemption: which rows run this step, how many tokens each gets, the
KV blocks they need, preemption by recompute when the pool is short, and the release of
finished rows' blocks. Also the blocks' LRU stamps (the prefix cache evicts by them).

- Order: FCFS (arrival), or under ``scheduling_policy="priority"`` (priority, arrival):
  "FCFS order" below means that order, so a more urgent row gets the budget and blocks
  first and the least urgent (newest among equals) is preempted first.
- Budget: rows in FCFS order each ask for all their uncomputed tokens; a cumulative sum over
  the token budget gives each its share, the last one a partial chunk (chunked prefill mixed
  with decode). Rows whose output stream is full are skipped (backpressure, nothing lost).
  Under the priority policy the rows prefilling their prompt after the first one (in that
  order) ask, together, for at most ``priority_other_prefill_tokens`` per step: no step
  carries more than one large prefill, so an urgent arrival never waits behind a long
  step of less urgent prefills, and its own step stays short. And while a more urgent
  priority was seen in the last ``priority_urgent_window_steps`` steps (the state's
  ``urgent_priority`` register), a less urgent first prompt shares that bound too: the
  step in flight when the next urgent request arrives is short as well. In a step where
  a row at the register's level prefills, the rows less urgent than it ask for nothing
  (decode and prefill): the urgent prompt's step is as short as it alone (16 decode rows
  beside a 256-token prompt cost a third more on a CPU); they lose only those steps.
- Blocks: let freed(k) = blocks referenced only by rows at FCFS positions >= k. The longest
  prefix of rows whose new blocks fit in free + freed(k) is served (the next row gets what
  is left); then the shortest newest-first suffix of rows whose blocks cover the deficit is
  preempted by recompute: blocks released, ``num_computed = 0``, back to WAITING, tokens
  kept. The oldest request can always progress (``num_blocks`` holds one max-length one).
- Release: a finished (RELEASING) row's block references are dropped in a flat window of
  ``release_window_blocks`` blocks per step, deepest first (rows past the window wait a
  step); the row is EMPTY once it holds none, and only then can its slot's next request
  be admitted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from blink.engine.sched.state import (
    INT64_MAX,
    K_PREEMPTIONS,
    ROW_AWAITING_KV,
    ROW_EMPTY,
    ROW_RELEASING,
    ROW_RUNNING,
    ROW_WAITING,
)


def ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return (x + d - 1) // d


def queue_order(live: torch.Tensor, arrival: torch.Tensor, priority: torch.Tensor | None) -> torch.Tensor:
    """The rows (or slots) sorted into the scheduling order: ascending arrival (fcfs,
    ``priority`` None), or ascending (priority, arrival) (the priority policy: a stable sort
    by arrival, then a stable sort by priority); rows not ``live`` last. Fixed shapes, no
    branch on values."""
    order = torch.argsort(torch.where(live, arrival, INT64_MAX), stable=True)
    if priority is not None:
        key = torch.where(live, priority.long(), INT64_MAX)[order]
        order = order[torch.argsort(key, stable=True)]
    return order


class Budget:
    """The budget / allocation / preemption / release stage of
    :class:`blink.engine.sched.scheduler.Scheduler` (a mixin over its state and row window)."""

    def _allocate(self) -> torch.Tensor:
        """Token budget, block allocation and preemption. Returns the tokens per row this step."""
        w, cfg = self._w, self.config
        st = w.state
        N, B = cfg.num_blocks, cfg.block_size
        if "allocate" in self.fused:
            return self._triton.allocate(
                st, w.ring["produced"], w.ring["consumed"], self._alloc_scratch,
                budget=cfg.max_num_batched_tokens, capacity=self.stream_capacity,
                window=self._alloc_cols.shape[0], num_blocks=N, block_size=B,
                prefix_caching=cfg.enable_prefix_caching, consts=self._alloc_consts)
        if self._c is not None and cfg.scheduling_policy == "fcfs":  # the CPU loop: one C call
            num_new = self._c.allocate(st, w.ring, budget=cfg.max_num_batched_tokens,
                                       stream_capacity=self.stream_capacity)
            if num_new is not None:  # (None: the blocks do not fit; the code below preempts)
                return num_new
        active = self._active()
        room = (w.ring["produced"] - w.ring["consumed"]) < self.stream_capacity
        schedulable = active & ~st.needs_lookup & room
        want = torch.where(schedulable, st.num_tokens - st.num_computed, 0)

        # Position p in FCFS order (0 = oldest request; under the priority policy, the most
        # urgent, then oldest: preemption takes the last positions); idle rows sort last.
        order = queue_order(active, st.arrival, self._priority(st.sampling))
        # Releasing rows count as holding nothing here: they get no blocks, are never
        # preempted, and their blocks come back through _release_finished alone.
        nc = torch.where(active, st.num_computed, 0)[order]
        held = torch.where(active, st.num_blocks, 0)[order]
        asked = want[order]

        if cfg.scheduling_policy == "priority":  # a static choice: no branch on values
            priority = st.sampling["priority"].long()
            urgent = self._track_urgent(active, priority)
            prefilling = ((st.num_computed < st.num_prompt) & (want > 0))[order]
            asked = self._cap_other_prefill(asked, prefilling, priority[order] > urgent)
        # Token budget: each position gets what is left after the older ones.
        grant = torch.minimum((cfg.max_num_batched_tokens - (asked.cumsum(0) - asked)).clamp(min=0), asked)
        need = (ceil_div(nc + grant, B) - held).clamp(min=0)
        free_now = (st.block_ref[:N] == 0).sum()
        rank = torch.empty_like(order).scatter_(0, order, w.rows)  # row -> its position
        if self._when(lambda: need.sum() > free_now):  # the blocks do not fit: cut, then preempt
            grant, need = self._preempt(rank, grant, need, nc, held, free_now)
        num_new, need = grant[rank], need[rank]
        if self._when(lambda: need.sum() > 0):
            self._assign_blocks(need)
        st.status.masked_fill_(num_new > 0, ROW_RUNNING)
        return num_new

    def _track_urgent(self, active: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
        """The priority policy's urgency register: ``urgent_priority``, the most urgent
        (lowest) priority seen among the live rows within the last W
        (``priority_urgent_window_steps``) steps, and ``urgent_age``, the steps since then.
        A live row as urgent or more (re)sets it (age 0); otherwise it ages by one, and
        after W steps it takes the live rows' most urgent priority now (INT64_MAX: none).
        Afterwards the register is <= every live row's priority: a row is either at the
        urgent level or less urgent. Branch-free: two 0-d writes. Returns the register."""
        st = self._w.state
        seen = torch.where(active, priority, INT64_MAX).min()
        keep = (st.urgent_priority < seen) & (st.urgent_age < self.config.priority_urgent_window_steps)
        st.urgent_priority.copy_(torch.where(keep, st.urgent_priority, seen))
        st.urgent_age.copy_(torch.where(keep, st.urgent_age + 1, 0))
        return st.urgent_priority

    def _cap_other_prefill(self, asked: torch.Tensor, prefilling: torch.Tensor,
                           less_urgent: torch.Tensor) -> torch.Tensor:
        """The priority policy's prefill bound (``priority_other_prefill_tokens``, P): of the
        rows still prefilling their prompt, the first in queue order asks for all it needs
        unless it is ``less_urgent`` than the urgency register (:meth:`_track_urgent`); the
        others, in queue order, share at most P tokens per step. A step's length is the
        wait of any request arriving during it, so a step never carries more than one large
        prefill, none of a less urgent prompt while urgent work was seen recently (the step
        in flight when the next urgent request arrives is short), and the step in which an
        urgent request prefills carries no less urgent row at all: in a step where a row at
        the urgent level (not ``less_urgent``) prefills, the ``less_urgent`` rows ask for
        nothing, decode included. Every prefilling row still progresses: the first capped
        one gets tokens every step the budget reaches it (P >= 1) and no urgent prompt
        prefills, until its prompt is done. ``asked``, ``prefilling``, ``less_urgent``: in
        queue order."""
        other = prefilling & ((prefilling.cumsum(0) > 1) | less_urgent)
        x = torch.where(other, asked, 0)
        share = torch.minimum(x, (self.config.priority_other_prefill_tokens - (x.cumsum(0) - x)).clamp(min=0))
        asked = torch.where(other, share, asked)
        # A step in which a row at the urgent level prefills carries no less urgent row (decode
        # or prefill): that step is the urgent request's TTFT, and less urgent rows beside its
        # prompt lengthen it. They lose only these steps (one per urgent prompt that fits the
        # budget). The less urgent rows sort after it, so the shares above are unchanged.
        urgent_prefill = (prefilling & ~less_urgent).any()
        return torch.where(less_urgent & urgent_prefill, 0, asked)

    def _priority(self, fields: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The ``priority`` field (of the rows or of the ring's slots) when the priority
        policy orders the queue, else None (fcfs)."""
        return fields["priority"] if self.config.scheduling_policy == "priority" else None

    def _preempt(
        self,
        rank: torch.Tensor,
        grant: torch.Tensor,
        need: torch.Tensor,
        nc: torch.Tensor,
        held: torch.Tensor,
        free_now: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's blocks do not fit the free pool: serve the longest FCFS prefix that
        fits if everything newer were preempted, and preempt the shortest newest-first
        suffix that covers the deficit. ``rank``: each row's FCFS position; the other
        arguments and the results are in FCFS order. The one pass over the whole block
        table; it runs only when the pool is short."""
        w, cfg = self._w, self.config
        st = w.state
        S, N, B = w.size, cfg.num_blocks, cfg.block_size

        # freed[k]: blocks referenced only by positions >= k (what preempting them frees).
        table = st.block_table.long()
        # A releasing row's blocks are freed by no preemption: position 0, which only
        # freed[0] counts, and no decision reads freed[0].
        # Rows waiting for their KV likewise (their blocks are being written remotely).
        owner = torch.where((st.status == ROW_RELEASING) | (st.status == ROW_AWAITING_KV), 0, rank)
        owner_pos = owner.unsqueeze(1).expand_as(table)
        first_user = torch.full((N + 1,), S, dtype=torch.int64, device=table.device)
        first_user.scatter_reduce_(0, table.flatten(), owner_pos.flatten(), "amin")
        per_pos = torch.zeros(S + 1, dtype=torch.int64, device=table.device)
        per_pos.scatter_add_(0, first_user[:N], torch.ones_like(first_user[:N]))
        freed = F.pad(per_pos[:S].flip(0).cumsum(0).flip(0), (0, 1))  # [S+1], freed[S] = 0

        # Serve the longest prefix of positions whose new blocks fit if everything newer
        # were preempted; the position at the cut gets a chunk of what is left, if any.
        need_before = F.pad(need.cumsum(0), (1, 0))  # [S+1]
        cut = (need_before <= free_now + freed)[1:].sum().view(1)  # 1-d: indexing stays on device
        left = free_now + freed[(cut + 1).clamp(max=S)] - need_before[cut]
        fits = ((held + left.clamp(min=0)) * B - nc).clamp(min=0)
        cut_grant = torch.where(left >= 0, torch.minimum(grant, fits), 0)
        p = w.rows
        grant = torch.where(p < cut, grant, torch.where(p == cut, cut_grant, 0))
        need = (ceil_div(nc + grant, B) - held).clamp(min=0)

        # Preempt, newest first, the shortest suffix whose blocks cover the deficit.
        deficit = need.sum() - free_now
        first_preempted = (freed[1:] >= deficit).sum()
        preempt = ((p >= first_preempted) & (held > 0))[rank]

        self._release_rows(preempt)
        st.status.masked_fill_(preempt, ROW_WAITING)
        st.num_computed.masked_fill_(preempt, 0)
        st.row_hash.masked_fill_(preempt.unsqueeze(1), 0)
        if cfg.enable_prefix_caching:
            st.needs_lookup |= preempt
        st.counters[K_PREEMPTIONS] += preempt.sum()
        return grant, need

    def _assign_blocks(self, need: torch.Tensor, lanes: torch.Tensor | None = None) -> None:
        """Give each row ``need`` [S] new blocks at the end of its table: free ones,
        never-cached first, then cached ones least recently used. One flat window of
        ``alloc_window_blocks`` lanes (lane j: the j-th new block of the step), or ``lanes``
        (a KV reservation's window)."""
        w, cfg = self._w, self.config
        st = w.state
        N, M = cfg.num_blocks, cfg.max_blocks_per_seq
        free = st.block_ref[:N] == 0
        cached = st.block_slot[:N] >= 0
        order_key = torch.where(free, torch.where(cached, st.block_last_used[:N], -1), INT64_MAX)
        j = self._alloc_cols if lanes is None else lanes
        J = j.shape[0]
        # Ascending: the LRU order, the lowest id first among equals (a stable sort, where
        # topk would leave ties unordered), so that every implementation picks the same blocks.
        free_list = torch.sort(order_key, stable=True).indices[:J]

        ends = need.cumsum(0)
        row = torch.searchsorted(ends, j, right=True).clamp(max=w.size - 1)
        col = st.num_blocks[row] + j - (ends - need)[row]
        valid = j < ends[-1]
        blocks = torch.where(valid, free_list, N)
        st.block_table_flat.index_put_((torch.where(valid, row * M + col, self._table_sink),),
                                       blocks.to(st.block_table_flat.dtype))
        st.block_ref.index_add_(0, blocks, valid.to(st.block_ref.dtype))
        st.block_slot.index_put_((blocks,), torch.full_like(blocks, -1))  # evict from the cache
        st.block_gen.index_add_(0, blocks, valid.long())  # new content: children stale
        st.block_last_used.scatter_reduce_(0, blocks, torch.where(valid, self._stamp(col), 0), "amax")
        st.num_blocks += need

    def _stamp(self, j: torch.Tensor | int) -> torch.Tensor:
        """LRU stamp for block index ``j`` of a sequence at this step: later steps are newer;
        within a step deeper blocks are older, so a released sequence is evicted tail first
        (its shared beginning survives longest)."""
        M = self.config.max_blocks_per_seq
        return self.state.step * (M + 1) + (M - j)

    def _release_rows(self, mask: torch.Tensor) -> None:
        """Drop every block reference of the rows in ``mask`` at once (preemption: the blocks
        are reused this step); freed blocks stay cached. A pass over the whole table."""
        st, N = self._w.state, self.config.num_blocks
        table = st.block_table.long()
        drop = mask.unsqueeze(1) & (table < N)
        lanes = torch.where(drop, table, N).flatten()
        st.block_ref.index_add_(0, lanes, -drop.flatten().to(st.block_ref.dtype))
        stamp = torch.where(drop, self._stamp(self._cols).unsqueeze(0), 0).flatten()
        st.block_last_used.scatter_reduce_(0, lanes, stamp, "amax")
        st.block_table.masked_fill_(mask.unsqueeze(1), N)
        st.num_blocks.masked_fill_(mask, 0)

    def _release_finished(self) -> None:
        """Drop the block references of RELEASING rows, deepest block first, in one flat
        window of ``release_window_blocks`` lanes; rows left with no block become EMPTY.
        Freed blocks stay cached."""
        w, cfg = self._w, self.config
        st = w.state
        N, M = cfg.num_blocks, cfg.max_blocks_per_seq
        if "release" in self.fused:
            self._triton.release(st.status, st.num_blocks, st.num_prompt, st.num_tokens, st.num_computed,
                                 st.block_table_flat, st.block_ref, st.block_last_used, st.step, self._scratch,
                                 M, N, self._release_cols.shape[0], ROW_RELEASING, ROW_EMPTY)
            return
        releasing = st.status == ROW_RELEASING
        count = torch.where(releasing, st.num_blocks, 0)
        ends = count.cumsum(0)
        lane = self._release_cols
        row = torch.searchsorted(ends, lane, right=True).clamp(max=w.size - 1)
        col = (st.num_blocks[row] - 1 - (lane - (ends - count)[row])).clamp(min=0)
        valid = lane < ends[-1]
        at = torch.where(valid, row * M + col, self._table_sink)
        blocks = torch.where(valid, st.block_table_flat[at].long(), N)
        st.block_ref.index_add_(0, blocks, -valid.to(st.block_ref.dtype))
        st.block_last_used.scatter_reduce_(0, blocks, torch.where(valid, self._stamp(col), 0), "amax")
        st.block_table_flat.index_put_((at,), torch.full_like(at, N, dtype=st.block_table_flat.dtype))
        released = (ends.clamp(max=lane.shape[0]) - (ends - count)).clamp(min=0)
        st.num_blocks -= released
        emptied = releasing & (st.num_blocks == 0)
        st.status.masked_fill_(emptied, ROW_EMPTY)
        for counter in (st.num_prompt, st.num_tokens, st.num_computed):
            counter.masked_fill_(emptied, 0)
