"""KV reservation for disaggregation (docs/disaggregation.md), decode role: admission
reserves a KV_RESERVE request's prompt blocks and publishes their ids; the row then waits
(ROW_AWAITING_KV: never scheduled, never preempted) until the prefill engine's
``kv_ready_seq`` says its KV is there, and starts decoding with the prefill engine's first
token. Prefill role: every admitted row's KV route is copied out of its request record."""
from __future__ import annotations

import torch

from blink.engine.sched.budget import ceil_div as _ceil_div
from blink.engine.sched.state import ROW_AWAITING_KV, ROW_WAITING
from blink.ring import FINISH_ABORT, KV_RESERVE


class KvReservation:
    """The disaggregation stages of :class:`blink.engine.sched.scheduler.Scheduler` (a mixin
    over its state, ring views and row window)."""

    def _reservations_fit(self, idx: torch.Tensor, plen_k: torch.Tensor, valid_k: torch.Tensor,
                          ok_k: torch.Tensor) -> torch.Tensor:
        """Admission's candidates ``idx`` (FCFS) that may be admitted: a reservation takes its
        blocks now, so the oldest ones that fit the free pool (and the reservation window)
        are picked, the others stay WRITTEN until blocks free up."""
        st, ring, cfg = self._w.state, self._w.ring, self.config
        reserve_k = ring["kv_mode"][idx] == KV_RESERVE
        blocks_k = torch.where(reserve_k & valid_k, _ceil_div(plen_k, cfg.block_size), 0)
        free_now = (st.block_ref[: cfg.num_blocks] == 0).sum()
        room = torch.clamp(free_now, max=self._reserve_cols.shape[0])
        return ok_k & (~reserve_k | (blocks_k.cumsum(0) <= room))

    def _admit_kv_fields(self, admit: torch.Tensor, plen: torch.Tensor) -> None:
        """Admission's disaggregation part: KV_RESERVE rows get their prompt's blocks now and
        publish the ids (before the state word that follows); every admitted row's KV route
        (KV_SEND: where its prompt's KV goes) is copied out of its request record."""
        st, ring, B = self._w.state, self._w.ring, self.config.block_size
        mode = ring["kv_mode"].long()
        reserve = admit & (mode == KV_RESERVE)
        need = torch.where(reserve, _ceil_div(plen, B), 0)
        if self._when(lambda: need.sum() > 0):
            self._assign_blocks(need, self._reserve_cols)
        st.status.masked_fill_(reserve, ROW_AWAITING_KV)
        st.needs_lookup &= ~reserve
        ids = torch.where(self._cols.unsqueeze(0) < need.unsqueeze(1), st.block_table, -1)
        self._ring_set(reserve.unsqueeze(1), "kv_reserved", ids)
        route = torch.stack([mode, ring["kv_peer"].long(), ring["kv_slot"].long(),
                             ring["kv_seq"]], 1)
        st.kv_route.copy_(torch.where(admit.unsqueeze(1), route, st.kv_route))
        st.kv_dest_blocks.copy_(torch.where(admit.unsqueeze(1), ring["kv_blocks"], st.kv_dest_blocks))

    def _kv_ready(self) -> torch.Tensor:
        """Rows waiting for their KV whose prefill engine has published it (its seq)."""
        st, ring = self._w.state, self._w.ring
        return (st.status == ROW_AWAITING_KV) & (ring["kv_ready_seq"] == ring["stream_seq"])

    def _admit_kv_ready(self, cancel: torch.Tensor) -> None:
        """KV ready: the row starts with computed = prompt_len and the prefill engine's first
        token appended, so its next step decodes. A row
        cancelled while it waited finishes with ABORT now."""
        w = self._w
        st = w.state
        ready = self._kv_ready()
        go = ready & ~cancel
        first = w.ring["kv_first_token"]
        sink = st.tokens.shape[1] - 1
        col = torch.where(go, st.num_prompt, sink)
        st.tokens.index_put_((w.rows, col), torch.where(go, first, st.tokens[w.rows, col]))
        st.num_tokens.copy_(torch.where(go, st.num_prompt + 1, st.num_tokens))
        st.num_computed.copy_(torch.where(go, st.num_prompt, st.num_computed))
        st.status.masked_fill_(go, ROW_WAITING)
        if self._when(lambda: (ready & cancel).any()):
            self._finish(ready & cancel, FINISH_ABORT)

