"""The step's batch: the scheduled tokens flattened into fixed-shape tensors (``StepBatch``),
and the sampler's per-row inputs gathered for the rows that sample."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from blink.engine.sampler import SamplerPlan, SamplingTensors
from blink.engine.token_mask import MaskBatch, mask_batch
from blink.kernels.attention_metadata import AttentionMetadata
from blink.shared.sampling_fields import SAMPLER_FIELDS

_SAMPLER_NAMES = tuple(f.name for f in SAMPLER_FIELDS)


@dataclass
class StepBatch:
    """One step's work, all fixed-shape tensors. T = the token budget, S = rows.

    input_ids            int64 [T]  token of each scheduled position; 0 for padding
    attn                 AttentionMetadata over the S rows (padding tokens: row 0,
                         position 0, slot in the scratch block; seq_lens 0 = row idle)
    num_scheduled_tokens int64 0-d  real tokens (<= T); the host slices to its bucket
    bucket_index         int64 0-d  index in ``config.buckets`` of the smallest bucket
                                    holding the step (for a device-side graph switch)
    num_new_tokens       int64 [S]  tokens each row computes this step
    sample_rows          int64 [S]  rows that produce a token, compacted first, -1 padded
    num_sample_rows      int64 0-d  (<= num_scheduled_tokens, so a bucket's rows suffice)
    logits_indices       int64 [S]  flat index of each sample row's last token; 0 padded

    The sampler's per-row inputs are gathered for the rows a bucket samples only
    (:meth:`Scheduler.sampler_inputs`), not for all S.
    """

    input_ids: torch.Tensor
    attn: AttentionMetadata
    num_scheduled_tokens: torch.Tensor
    bucket_index: torch.Tensor
    num_new_tokens: torch.Tensor
    sample_rows: torch.Tensor
    num_sample_rows: torch.Tensor
    logits_indices: torch.Tensor


class SamplerInputs(NamedTuple):
    """The sampler's inputs for the first R sample rows of a batch (padding lanes: row 0's).

    sampling      SamplingTensors [R]
    prompt_lens   int64 [R]
    total_lens    int64 [R]  tokens so far per sample row; also the RNG counter
    suppress_ids  int32 [R, max_stop_ids + n_eos]  ids banned while the row has fewer than
                  min_tokens outputs (-1 padded)
    features      int32 [R]  the rows' sampler feature words (``SamplerPlan.from_features``)
    plan          the R rows' SamplerPlan where the gather read it on the way (the C
                  stages), else None (``SamplerPlan.from_features`` reads it)
    """

    sampling: SamplingTensors
    prompt_lens: torch.Tensor
    total_lens: torch.Tensor
    suppress_ids: torch.Tensor
    features: torch.Tensor
    plan: SamplerPlan | None = None



class Batching:
    """The batch-building stage and the sampler's view of the batch, for
    :class:`blink.engine.sched.scheduler.Scheduler` (a mixin over its state and row window)."""

    def _build_batch(self, num_new: torch.Tensor) -> StepBatch:
        """Flatten the scheduled tokens (rows in index order) and gather the sampler inputs."""
        w, cfg = self._w, self.config
        st = w.state
        S, N, B = w.size, cfg.num_blocks, cfg.block_size
        if "build_batch" in self.fused:
            o = self._batch_out
            self._triton.build_batch(num_new, st.num_computed, st.num_tokens, st.tokens, st.block_table,
                                     self._buckets, o, N, B)
            attn = AttentionMetadata(slot_mapping=o.slot_mapping, positions=o.positions, token_seq_idx=o.seq_idx,
                                     query_start_loc=o.query_start_loc, seq_lens=o.seq_lens,
                                     block_tables=st.block_table)
            return StepBatch(input_ids=o.input_ids, attn=attn, num_scheduled_tokens=o.total,
                             bucket_index=o.bucket, num_new_tokens=num_new, sample_rows=o.sample_rows,
                             num_sample_rows=o.num_sample_rows, logits_indices=o.logits_indices)
        if self._c is not None:  # the CPU loop: one C call (kernels/cpu/sched.c)
            o = self._batch_out
            n = self._c.build_batch(st, num_new, self._buckets, o, self.host_guards)
            # The batch is views of the buffers the call wrote: the same ones for every step of
            # n lanes in this window, made once (each slice is a torch call, and the host's
            # torch calls are what a small model's decode step waits for).
            batch = self._c_batches.get((n, S))
            if batch is None or batch.num_new_tokens is not num_new or batch.attn.block_tables is not st.block_table:
                attn = AttentionMetadata(slot_mapping=o.slot_mapping[:n], positions=o.positions[:n],
                                         token_seq_idx=o.seq_idx[:n], query_start_loc=o.query_start_loc[: S + 1],
                                         seq_lens=o.seq_lens[:S], block_tables=st.block_table)
                batch = self._c_batches[(n, S)] = StepBatch(
                    input_ids=o.input_ids[:n], attn=attn, num_scheduled_tokens=o.total, bucket_index=o.bucket,
                    num_new_tokens=num_new, sample_rows=o.sample_rows[:S], num_sample_rows=o.num_sample_rows,
                    logits_indices=o.logits_indices[:S])
            return batch
        ends = num_new.cumsum(0)
        query_start_loc = F.pad(ends, (1, 0))
        total = ends[-1]
        t = self._tok
        if self.host_guards:
            # CPU loop: the flat tensors only as long as the smallest bucket that holds the
            # step (a decode step of one row: 8 lanes, not the budget's 2,048). Exact: the
            # lanes cut off are padding, and every consumer slices the step's tokens or its
            # bucket, never more. Graphs keep the fixed length T.
            t = t[: cfg.bucket_for(int(total))]
        valid = t < total
        row = torch.where(valid, torch.searchsorted(ends, t, right=True).clamp(max=S - 1), 0)
        pos = torch.where(valid, st.num_computed[row] + t - query_start_loc[row], 0)
        input_ids = torch.where(valid, st.tokens[row, pos].long(), 0)
        block = st.block_table[row, pos // B].long()
        slot_mapping = torch.where(valid, block * B + pos % B, N * B)
        seq_lens = torch.where(num_new > 0, st.num_computed + num_new, 0)

        # Rows whose last known token is computed this step produce the next one.
        sampled = (num_new > 0) & (st.num_computed + num_new == st.num_tokens)
        dest = torch.where(sampled, sampled.long().cumsum(0) - 1, S)
        sample_rows = torch.full((S + 1,), -1, dtype=torch.int64, device=t.device)
        sample_rows = sample_rows.scatter(0, dest, w.rows)[:S]
        r = sample_rows.clamp(min=0)
        logits_indices = torch.where(sample_rows >= 0, query_start_loc[r + 1] - 1, 0)

        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            positions=pos,
            token_seq_idx=row,
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=st.block_table,
        )
        return StepBatch(
            input_ids=input_ids,
            attn=attn,
            num_scheduled_tokens=total,
            bucket_index=torch.bucketize(total, self._buckets),
            num_new_tokens=num_new,
            sample_rows=sample_rows,
            num_sample_rows=sampled.sum(),
            logits_indices=logits_indices,
        )

    # ---------------------------------------------------------------------------- helpers
    def sampler_inputs(self, batch: StepBatch, rows: int) -> SamplerInputs:
        """The sampler's inputs for the batch's first ``rows`` sample rows (a bucket's rows
        in a graph, the real count on the host)."""
        st = self.state
        if self._c is not None:  # the CPU loop: one C call into buffers (kernels/cpu/sched.c)
            summary = self._c.sampler_inputs(st, _SAMPLER_NAMES, batch.sample_rows, rows)
            if summary is not None:
                inputs = self._c_sampler_inputs.get((rows, summary))
                if inputs is None:  # the views with the plan: made once per row count and plan
                    views = self._c_sampler_views.get(rows)
                    if views is None:  # views of the buffers: made once per row count
                        gathered = self._c.sampler_views(rows)
                        views = self._c_sampler_views[rows] = SamplerInputs(
                            SamplingTensors(**{name: gathered[name] for name in _SAMPLER_NAMES}),
                            gathered["num_prompt"], gathered["num_tokens"], gathered["suppress_ids"],
                            gathered["sampler_features"])
                    inputs = self._c_sampler_inputs[(rows, summary)] = views._replace(
                        plan=SamplerPlan.from_word(summary & 0xFFFFFFFF, summary >> 32 != 0))
                return inputs
        r = self.sample_rows(batch, rows).clamp(min=0)
        sp = st.sampling
        sampling = SamplingTensors(**{f.name: sp[f.name][r] for f in SAMPLER_FIELDS})
        prompt_lens, total_lens = st.num_prompt[r], st.num_tokens[r]
        eos = torch.where(sp["ignore_eos"][r].unsqueeze(1) != 0, -1, self._eos.unsqueeze(0))
        suppress = torch.cat([sp["stop_token_ids"][r].long(), eos], 1)
        too_early = (total_lens - prompt_lens) < sp["min_tokens"][r]
        suppress_ids = torch.where(too_early.unsqueeze(1), suppress, -1).to(torch.int32)
        return SamplerInputs(sampling, prompt_lens, total_lens, suppress_ids, st.sampler_features[r])

    def compact_metadata(self, batch: StepBatch, n: int) -> AttentionMetadata | None:
        """``blink.engine.step.compact_rows(batch, n)`` from one C call (the CPU loop's C
        stages), or None: the caller compacts with torch."""
        return None if self._c is None else self._c.compact(batch, n)

    def token_masks(self, batch: StepBatch, rows: int, host_rows: bool = False) -> MaskBatch:
        """The structured-output masks of the first ``rows`` sample rows
        (:mod:`blink.engine.token_mask`); ``host_rows``: CPU loop only."""
        st = self.state
        return mask_batch(self.ring, st.sampling["constrained"], st.num_tokens, st.num_prompt,
                          self.sample_rows(batch, rows), self.config.mask_timeout_s, host_rows)

    def token_history(self, batch: StepBatch, rows: int | None = None) -> torch.Tensor:
        """int32 [rows, max_model_len]: prompt + output tokens of the first ``rows`` sample
        rows (all S when None), for the sampler's penalties; valid up to ``batch.total_lens``.
        Only a batch with a penalty needs it (the CPU loop skips it otherwise)."""
        r = batch.sample_rows if rows is None else self.sample_rows(batch, rows)
        return self.state.tokens[r.clamp(min=0), : self.config.max_model_len]

    def sample_rows(self, batch: StepBatch, rows: int) -> torch.Tensor:
        """``batch.sample_rows``' first ``rows`` lanes, -1 padded where a bucket of rows is
        wider than the step's row window."""
        lanes = batch.sample_rows[:rows]
        if lanes.shape[0] < rows:  # shapes only: no value is read
            lanes = F.pad(lanes, (0, rows - lanes.shape[0]), value=-1)
        return lanes

