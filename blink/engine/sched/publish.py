"""Publish: the engine's side of the ring protocol (blink/ring.py). Sampled tokens go to the
output streams (payload, fence, then ``produced``), finished rows publish their reason, a
fence, then the FINISHED state word, and become RELEASING. Every ring write of the
scheduler goes through the helpers here, so the order of payload, fence and word is in
one file (tests/test_publish_order.py checks it).

- Finish (in ``update``): stop/EOS (EOS unless ``ignore_eos``, both only once ``min_tokens``
  outputs exist; the sampler gets them as ``suppress_ids`` before that), ``max_tokens``
  (<= 0 means no limit), or ``max_model_len``. The finishing token is written to the stream.
  A finished row publishes FINISHED at once and becomes RELEASING; the next ``schedule()``
  drops its block references in a flat window of ``release_window_blocks`` blocks (rows past
  the window wait a step), and only then can its slot's next request be admitted.

Ring writes keep the protocol's order: stream payload before ``produced``, finish reason
before the state word, with a system-scope fence between each payload and its word
(``blink.kernels.system_fence``: consecutive kernels of a graph are ordered only for the
GPU itself, not for a CPU or NIC reading the mapped ring over PCIe). The ``state`` word is
the one word both sides write, so it is only ever written lane by lane with ``index_put_`` (lanes with nothing to publish go to the
control block's scratch word), never rewritten wholesale with a masked select.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from blink.engine.sched.batch import StepBatch
from blink.engine.sched.state import K_GENERATED_TOKENS, ROW_RELEASING
from blink.ring import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, SLOT_FINISHED


class Publish:
    """The publish stage of :class:`blink.engine.sched.scheduler.Scheduler` (a mixin over
    its state, ring views and row window)."""

    def _publish_tokens(self, batch: StepBatch, tokens: torch.Tensor, logprob: torch.Tensor,
                        top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
        """Append the sampled tokens to the rows and their streams, and finish the rows that
        stop (stop/EOS once ``min_tokens`` outputs exist, ``max_tokens``, ``max_model_len``,
        or token -1: no structured-output mask). Arguments: as :meth:`Scheduler.update`'s."""
        w, cfg = self._w, self.config
        st = w.state
        if "publish" in self.fused:  # the tokens and finishes below, in three launches
            self._triton.publish(self, batch, tokens, logprob, top_ids, top_logprobs, self._done,
                                 self._publish_consts)
            return
        if self._c is not None:  # the CPU loop: one C call (kernels/cpu/sched.c), same order
            self._c.publish(st, w.ring, self._state_words_of(w.size),
                            batch.sample_rows, tokens, logprob, top_ids, top_logprobs, self._done,
                            stream_capacity=self.stream_capacity, num_top=self.num_top)
            return

        # Lane i carries the sampler's output for sample row batch.sample_rows[i]. Padding
        # lanes repeat the last live lane (row, value and all), so every duplicate write
        # below writes the same value: no sink needed, and the work is R lanes, not S rows.
        R = min(tokens.shape[0], w.size)  # a bucket's padding rows past the window sample nothing
        rows = batch.sample_rows[:R]
        n_live = (rows >= 0).sum()
        lane = torch.minimum(w.rows[:R], (n_live - 1).clamp(min=0))
        live = rows[lane] >= 0  # all False only when no row samples
        r = rows[lane].clamp(min=0)
        tok = tokens.long()[lane]

        # Token -1: a constrained row whose mask did not arrive at the sampling gate
        # (blink.engine.token_mask): nothing is published, the row finishes with an error.
        no_mask = live & (tok < 0)
        live = live & ~no_mask
        tok = tok.clamp(min=0)
        n_published = (live & (w.rows[:R] < n_live)).sum()  # padding lanes repeat a live one

        row_tokens = st.num_tokens[r]
        n_out_before = row_tokens - st.num_prompt[r]
        sink = st.tokens.shape[1] - 1
        st.tokens.index_put_((r, torch.where(live, row_tokens, sink)), tok.to(st.tokens.dtype))
        row_tokens = row_tokens + live.long()
        st.num_tokens.index_put_((r,), row_tokens)

        # Stream: payload first, then the produced counter.
        produced = w.ring["produced"]
        at = produced[r] % self.stream_capacity
        self._stream_write("tokens", r, at, tok, live)
        self._stream_write("logprob", r, at, logprob.float()[lane], live)
        width = top_ids.shape[1]
        if width:  # a shape, not a value: 0 when no row asked for alternatives (CPU plan)
            pad = max(0, self.num_top - width)
            top_i = F.pad(top_ids.long()[:, : self.num_top], (0, pad), value=-1)[lane]
            top_l = F.pad(top_logprobs.float()[:, : self.num_top], (0, pad), value=float("-inf"))[lane]
            self._stream_write("top_ids", r, at, top_i, live)
            self._stream_write("top_logprobs", r, at, top_l, live)
        self._fence()
        produced.index_put_((r,), produced[r] + live.long())
        st.counters[K_GENERATED_TOKENS] += n_published

        sp = st.sampling
        stop_token = (sp["stop_token_ids"][r] == tok.unsqueeze(1)).any(1) | (
            (self._eos == tok.unsqueeze(1)).any(1) & (sp["ignore_eos"][r] == 0)
        )
        stop = live & stop_token & (n_out_before >= sp["min_tokens"][r])
        max_tokens = sp["max_tokens"][r].long()
        length = live & (
            ((max_tokens > 0) & (n_out_before + 1 >= max_tokens)) | (row_tokens >= cfg.max_model_len)
        )
        done_lane = stop | length | no_mask
        if self._when(lambda: done_lane.any()):
            done = torch.zeros_like(w.rows, dtype=torch.bool).index_put_((r,), done_lane)
            reason = torch.full_like(w.rows, FINISH_LENGTH).index_put_(
                (r,), torch.where(no_mask, FINISH_ERROR, torch.where(stop, FINISH_STOP, FINISH_LENGTH)))
            self._finish(done, reason)

    def _finish(self, mask: torch.Tensor, reason: torch.Tensor | int) -> None:
        """Finish the rows in ``mask``: publish the reason, then the FINISHED state word; the
        rows become RELEASING (their blocks are dropped by the next ``schedule()``, which
        then empties them)."""
        st = self._w.state
        self._ring_set(mask, "finish_reason", reason)
        self._fence()
        self._publish_state(mask, SLOT_FINISHED)
        st.status.masked_fill_(mask, ROW_RELEASING)
        st.needs_lookup &= ~mask

    def _ring_set(self, mask: torch.Tensor, name: str, value: torch.Tensor | int) -> None:
        """``ring[name][mask] = value`` for an engine-owned per-slot field (the frontend
        never writes it, so rewriting the other lanes with their own value is harmless)."""
        field = self._w.ring[name]
        field.copy_(torch.where(mask, value, field))

    def _publish_state(self, mask: torch.Tensor, value: torch.Tensor | int) -> None:
        """Write slot state words of ``mask`` lanes only. The frontend writes the state words
        of FREE/FINISHED slots concurrently, so rewriting other lanes (even with the value
        just read) could undo its write; those lanes go to a scratch word instead."""
        lanes = torch.where(mask, self._state_word0 + self._w.rows, self._scratch_word)
        values = torch.where(mask, value, 0).to(torch.int32)
        self._words.index_put_((lanes,), values)

    def _stream_write(self, name: str, rows: torch.Tensor, at: torch.Tensor, value: torch.Tensor,
                      live: torch.Tensor) -> None:
        """Write ``value`` [R, ...] at stream position ``at`` [R] of ``rows`` [R] where
        ``live``; other lanes write back what is there (the field is the engine's own)."""
        field = self._w.ring[name]
        old = field[rows, at]
        new = value.to(field.dtype).view_as(old)
        keep = live.view(-1, *([1] * (old.dim() - 1)))
        field.index_put_((rows, at), torch.where(keep, new, old))

