"""Admission: cancellation, and WRITTEN ring slots taken into their engine rows (FCFS, up
to ``max_admit_per_step`` per step, as many prompts as fit the copy window), with the
prompt copied out of the arena and the sampling fields out of the slot.

- Cancellation: a slot whose ``cancel`` word is set finishes with FINISH_ABORT this step.
- Admission: up to ``max_admit_per_step`` WRITTEN slots, lowest arrival ticket first (under
  the priority policy: lowest ``priority``, then arrival), as
  long as their prompts fit the step's copy window (``admit_window_tokens``, at least one
  max-length prompt, so the oldest always fits). The prompt is copied out of the circular
  arena by one flat gather over the window, the sampling fields out of the slot, the stream
  is reset, then the slot state becomes RUNNING. Empty prompts and prompts that leave no
  room for one output token finish with FINISH_ERROR instead.
"""
from __future__ import annotations

import torch

from blink.engine.sampler import row_features
from blink.engine.sched.budget import queue_order
from blink.engine.sched.state import (
    INT64_MAX,
    K_PROMPT_TOKENS,
    K_STEPS,
    ROW_AWAITING_KV,
    ROW_EMPTY,
    ROW_WAITING,
    SAMPLING_FIELDS,
)
from blink.ring import CANCEL_FORCE, FINISH_ABORT, FINISH_ERROR, FINISH_NONE, SLOT_FINISHED, SLOT_RUNNING, SLOT_WRITTEN


class Admission:
    """The cancel and admit stages of :class:`blink.engine.sched.scheduler.Scheduler` (a
    mixin over its state, ring views and row window)."""

    def _cancel(self) -> torch.Tensor | None:
        """Slots whose ``cancel`` word is set: live rows finish with FINISH_ABORT now (a row
        waiting for its KV only on a forced cancel). Returns the cancel mask for admission
        (None when the fused kernels did it all)."""
        w = self._w
        st, ring = w.state, w.ring
        if {"cancel", "admit"} <= self.fused and not self.kv_enabled:  # (admit reads the words itself)
            if self._when(lambda: ((ring["cancel"] != 0) & self._active()).any()):
                self._triton.cancel(st, ring, self._cancel_values, self._cancel_consts)
                self._fence()
                self._triton.publish_words(self._cancel_values, self._words, self._state_word0)
            return None
        cancel = ring["cancel"] != 0
        cancelled = cancel & self._active()
        if self.kv_enabled:  # a row waiting for its KV is freed only by a forced cancel
            cancelled |= (ring["cancel"] == CANCEL_FORCE) & (st.status == ROW_AWAITING_KV)
        if self._when(lambda: cancelled.any()):
            self._finish(cancelled, FINISH_ABORT)
        return cancel

    def _admit(self, slot_state: torch.Tensor, cancel: torch.Tensor | None) -> None:
        """Take up to ``max_admit_per_step`` WRITTEN slots into their rows, FCFS, as long as
        their prompts fit the copy window; abort cancelled WRITTEN slots and reject invalid
        prompts."""
        w, cfg = self._w, self.config
        st, ring = w.state, w.ring
        S, L, Wt = w.size, cfg.max_model_len, cfg.admit_window_tokens
        if "admit" in self.fused and not self.kv_enabled:  # (KV reservations: the torch code)
            # One launch: the pick, the prompts, the rows, their sampling records and feature words.
            self._triton.admit(st, ring, slot_state, self._admit_scratch, K=min(cfg.max_admit_per_step, S),
                               max_model_len=L, window=Wt, prefix_caching=cfg.enable_prefix_caching,
                               consts=self._admit_consts)
            self._fence()
            self._triton.publish_words(self._admit_scratch.publish, self._words, self._state_word0)
            return
        written = (slot_state == SLOT_WRITTEN) & (st.status == ROW_EMPTY)
        aborted = written & cancel
        candidate = written & ~cancel
        K = min(cfg.max_admit_per_step, S)
        if cfg.scheduling_policy == "priority":  # (priority, arrival): the most urgent first
            idx = queue_order(candidate, ring["arrival"], self._priority(ring))[:K]
        else:  # ascending arrival: the FCFS order of the candidates
            _, idx = torch.topk(torch.where(candidate, ring["arrival"], INT64_MAX), K, largest=False)
        plen_k = ring["prompt_len"][idx].long()
        ok_k = candidate[idx]
        valid_k = ok_k & (plen_k >= 1) & (plen_k < L)
        if self.kv_enabled:  # a KV reservation must fit the free pool now (kv_reserve.py)
            ok_k = self._reservations_fit(idx, plen_k, valid_k, ok_k)
        # The oldest prompts whose tokens fit the window (a prefix: the sum only grows).
        take_k = torch.where(valid_k, plen_k, 0)
        ends_k = take_k.cumsum(0)
        picked_k = ok_k & (ends_k <= Wt)
        picked = torch.zeros_like(candidate).index_put_((idx,), picked_k)
        admit = torch.zeros_like(candidate).index_put_((idx,), picked_k & valid_k)
        rejected = picked & ~admit
        plen = ring["prompt_len"].long()

        # The prompts, out of the circular arena (a prompt may wrap around its end), in one
        # flat window: token t belongs to the k-th picked candidate.
        take_k = torch.where(picked_k, take_k, 0)
        ends_k = take_k.cumsum(0)
        t = self._admit_cols
        k = torch.searchsorted(ends_k, t, right=True).clamp(max=K - 1)
        col = t - (ends_k - take_k)[k]
        valid = t < ends_k[-1]
        arena = ring["arena"]
        A = arena.shape[0]
        row = idx[k]
        src = ring["prompt_offset"][row] % A + col
        src = torch.where(src >= A, src - A, src)  # L <= A: one wrap at most
        sink = st.tokens.shape[1] - 1
        st.tokens.index_put_((torch.where(valid, row, 0), torch.where(valid, col, sink)),
                             arena[src].to(st.tokens.dtype))

        for name, dtype in SAMPLING_FIELDS:
            dst = st.sampling[name]
            mask = admit.view(S, *([1] * (dst.dim() - 1)))
            dst.copy_(torch.where(mask, ring[name].to(dtype), dst))
        st.sampler_features.copy_(torch.where(admit, row_features(st.sampling), st.sampler_features))
        st.arrival.copy_(torch.where(admit, ring["arrival"], st.arrival))
        st.num_prompt.copy_(torch.where(admit, plen, st.num_prompt))
        st.num_tokens.copy_(torch.where(admit, plen, st.num_tokens))
        st.num_computed.masked_fill_(admit, 0)
        st.row_hash.masked_fill_(admit.unsqueeze(1), 0)
        st.status.masked_fill_(admit, ROW_WAITING)
        if cfg.enable_prefix_caching:
            st.needs_lookup |= admit
        st.counters[K_PROMPT_TOKENS] += (plen * admit).sum()
        if self.kv_enabled:
            self._admit_kv_fields(admit, plen)

        # Every slot leaving WRITTEN: stream reset and finish reason, then the state word.
        opened = admit | aborted | rejected
        reason = torch.where(aborted, FINISH_ABORT, torch.where(rejected, FINISH_ERROR, FINISH_NONE))
        self._ring_set(opened, "stream_seq", ring["seq"])
        self._ring_set(opened, "produced", 0)
        self._ring_set(opened, "finish_reason", reason)
        self._ring_set(opened, "num_prompt_tokens", plen)
        self._ring_set(opened, "num_cached_tokens", 0)
        self._ring_set(opened, "admitted_step", st.counters[K_STEPS])  # queue time (frontend)
        self._fence()
        self._publish_state(opened, torch.where(admit, SLOT_RUNNING, SLOT_FINISHED))

