"""Prefix cache hookup: the scheduler's side of :mod:`blink.engine.prefix_cache`. Lookup
(in ``schedule``) gives newly admitted and preempted rows their longest verified cached
prefix; register (in ``update``) enters the blocks a step filled.

- Prefix cache: newly admitted (and preempted) rows take the longest verified cached prefix
  of full blocks, never their last token (its logits are needed). Rows are looked up oldest
  first, as many as fit one flat window of ``lookup_window_blocks`` blocks per step.
"""
from __future__ import annotations

import torch

from blink.engine import prefix_cache
from blink.engine.sched.batch import StepBatch
from blink.engine.sched.budget import queue_order
from blink.engine.sched.state import INT64_MAX, K_PREFIX_HITS, K_PREFIX_QUERIES, K_PREFIX_REJECTS


class PrefixHookup:
    """Prefix-cache lookup and registration for :class:`blink.engine.sched.scheduler.Scheduler`
    (a mixin over its state and row window)."""

    def _lookup(self) -> None:
        """Prefix-cache lookup for the oldest rows waiting for one (under the priority policy
        the most urgent first), up to ``max_admit_per_step`` rows and
        ``lookup_window_blocks`` blocks."""
        w, cfg = self._w, self.config
        st = w.state
        K = min(cfg.max_admit_per_step, w.size)
        if "lookup" in self.fused:
            self._triton.lookup(st, w.ring["num_cached_tokens"], self._hash, self._lookup_scratch, K=K,
                                window=cfg.lookup_window_blocks, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                                hash_table_size=cfg.hash_table_size, probes=cfg.prefix_probes,
                                consts=self._lookup_consts)
            return
        if cfg.scheduling_policy == "priority":  # the queue order: the most urgent first
            rows = queue_order(st.needs_lookup, st.arrival, self._priority(st.sampling))[:K]
        else:
            _, rows = torch.topk(torch.where(st.needs_lookup, st.arrival, INT64_MAX), K, largest=False)
        waiting = st.needs_lookup[rows]
        # Blocks a row may hit: all its full blocks but never its last token.
        eligible = torch.where(waiting, (st.num_tokens[rows] - 1) // cfg.block_size, 0)
        ok = waiting & (eligible.cumsum(0) <= cfg.lookup_window_blocks)  # oldest first, a prefix
        n_hit, hit_hash, rejects = prefix_cache.lookup(
            st, cfg, rows, ok, eligible, self._lookup_cols, self._hash, self._stamp,
        )
        hit_tokens = n_hit * cfg.block_size
        st.num_blocks[rows] = torch.where(ok, n_hit, st.num_blocks[rows])
        st.num_computed[rows] = torch.where(ok, hit_tokens, st.num_computed[rows])
        st.row_hash[rows] = torch.where(ok.unsqueeze(1), hit_hash, st.row_hash[rows])
        st.needs_lookup[rows] = st.needs_lookup[rows] & ~ok

        num_tokens = st.num_tokens[rows]
        st.counters[K_PREFIX_QUERIES] += (num_tokens * ok).sum()
        st.counters[K_PREFIX_HITS] += hit_tokens.sum()
        st.counters[K_PREFIX_REJECTS] += rejects
        first_time = ok & (num_tokens == st.num_prompt[rows])  # not a recompute
        cached = w.ring["num_cached_tokens"]
        cached[rows] = torch.where(first_time, hit_tokens, cached[rows].long()).to(cached.dtype)

    def _register(self, batch: StepBatch, num_tokens: int | None) -> None:
        """Enter the blocks this step filled into the prefix table (before ``num_computed``
        moves past them). ``num_tokens``: as :meth:`Scheduler.update`'s."""
        w, cfg = self._w, self.config
        st = w.state
        if "register" in self.fused:
            self._triton.register(st, batch, self._tok.shape[0] if num_tokens is None else num_tokens, self._hash,
                                  self._register_scratch, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                                  hash_table_size=cfg.hash_table_size, probes=cfg.prefix_probes)
        elif self._c is not None:  # the CPU loop: one C call (kernels/cpu/sched.c)
            n = batch.input_ids.shape[0] if num_tokens is None else min(num_tokens, batch.input_ids.shape[0])
            self._c.register(st, batch, n, self._hash, hash_table_size=cfg.hash_table_size, probes=cfg.prefix_probes)
        else:
            md, n = batch.attn, num_tokens
            prefix_cache.register(
                st, cfg, batch.input_ids[:n], md.positions[:n], md.token_seq_idx[:n],
                md.slot_mapping[:n], md.query_start_loc,
                (self._tok[: batch.input_ids.shape[0]] < batch.num_scheduled_tokens)[:n],
                self._hash, self._stamp(self.config.max_blocks_per_seq), self._when,
            )
