"""Speculative decoding with n-gram (prompt lookup) drafts, verified in the same step
(issue 36; ``--speculative-config '{"method": "ngram", ...}'``). Eager CPU loop only.

Per step:

1. **Draft** (:meth:`SpecScheduler._draft`, before the token budget): every decode row
   (RUNNING, only its last token uncomputed, no structured-output mask, no prefix lookup
   pending) gets up to K tokens from :func:`blink.kernels.reference.ngram.ngram_propose`
   over its own history in the tokens table. The draft is written after the row's tokens
   and ``num_tokens`` grows by its length, so the unchanged budget, block and batch stages
   treat the row as a short chunk of 1 + k positions writing KV into its own blocks (a
   partial grant verifies a shorter draft). Right after the batch is built ``num_tokens``
   is put back. The draft is capped so that it never passes ``max_model_len``, the row's
   room in its output stream, or its ``max_tokens``.
2. **Verify** (:func:`run_spec_step`): the forward returns logits at every position of a
   drafting row (one sampler lane per position, ``j`` = 0..g-1) and at the last position of
   the other sampling rows. Lane j is sampled exactly as the step that would produce that
   token without speculation: its history includes the draft tokens before it, its
   ``total_lens`` (penalties, min_tokens, the RNG counter) is n + j. The row publishes lane
   tokens t_0..t_a, a the first lane whose token differs from the draft token it checks.
   Greedy rows: a is the longest prefix where the draft equals the argmax, plus the bonus
   token. Sampled rows: the draw at each position is the one the non-speculative step would
   make (same seed and counter), so a seeded request gives the same tokens with and without
   speculation; as a rule this is "accept draft x with probability p(x), else draw from p
   without x, renormalised" — the rejection rule of the speculative sampling papers for a
   point-mass (n-gram) draft (tests/test_spec_decode.py checks it with a chi-square test).
3. **Publish**: the accepted tokens go through the ordinary publish stage one position at a
   time (at most K + 1 passes), so stop ids, EOS, ``min_tokens``, ``max_tokens`` and
   ``max_model_len`` finish the row exactly where they would without speculation, and
   tokens after the finishing one are dropped. ``num_computed`` advances by the positions
   whose KV is right (1 + accepted drafts); the rejected positions' KV is left behind the
   row's length and overwritten later. The blocks allocated for them stay with the row
   (used by its next steps, released with it), so block accounting stays exact.

Rows that do not speculate in a step run exactly the normal step; a step with no drafting
row *is* the normal step (:func:`blink.engine.step.run_step`'s path).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import numpy as np
import torch

from blink.engine.sampler import SamplerPlan, SamplingTensors
from blink.engine.sched.scheduler import Scheduler, StepBatch
from blink.engine.sched.state import ROW_RELEASING, ROW_RUNNING
from blink.engine.step import StepParts, compact_rows, eager_model_phase, schedule_on_host
from blink.ring import (
    C_SPEC_TOKENS,
    C_STAT_SPEC_ACCEPTED_PER_POS,
    C_STAT_SPEC_ACCEPTED_TOKENS,
    C_STAT_SPEC_DRAFT_TOKENS,
    C_STAT_SPEC_DRAFTS,
)
from blink.kernels.reference.ngram import ngram_propose
from blink.shared.sampling_fields import SAMPLER_FIELDS
from blink.shared.speculative_config import SpeculativeConfig

log = logging.getLogger("blink.engine")

#: after a row's n-th wholly rejected draft in a row it skips 2**(n-1) steps, at most 2**5,
#: and drafts again only from an n-gram of at least prompt_lookup_min + n (at most _max)
MAX_COOLDOWN_LOG2 = 5
#: SpecScheduler.spec_counters' words (vLLM's spec_decode_* counters)
SPEC_NUM_DRAFTS, SPEC_NUM_DRAFT_TOKENS, SPEC_NUM_ACCEPTED_TOKENS = 0, 1, 2


class Drafter(Protocol):
    """Where a step's drafts come from (:class:`SpecScheduler`'s ``drafter``):
    :class:`NgramDrafter` (prompt lookup) or :class:`blink.engine.draft_model.DraftModel`."""

    #: drafts exist only where the row's last token occurred earlier (the CPU loop's host
    #: eligibility then skips the other rows)
    repeats_only: bool

    def propose(self, tokens: torch.Tensor, lengths: torch.Tensor, k: int, lookup_min: int,
                lookup_max: int, row_min_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft stage: up to ``k`` tokens [S, k] and their count [S] per row (rows of
        ``lengths`` 0 draft nothing); the n-gram arguments as :func:`ngram_propose`'s."""
        ...

    def before_forward(self, parts: StepParts, batch: Any, tokens: int) -> None:
        """Every step, between the schedule and the target's forward of ``tokens`` positions."""
        ...


class NgramDrafter:
    """Prompt lookup over the row's own history (:func:`ngram_propose`)."""

    repeats_only = True
    propose = staticmethod(ngram_propose)

    def before_forward(self, parts: StepParts, batch: Any, tokens: int) -> None:
        pass


class SpecScheduler(Scheduler):
    """The scheduler with the draft stage (module docstring). Same state and policy; rows
    that do not draft are scheduled exactly as by :class:`Scheduler`."""

    def __init__(self, config, ring_tensors, device="cpu", *, spec: SpeculativeConfig,
                 host_guards: bool | None = None, drafter: Drafter | None = None) -> None:
        super().__init__(config, ring_tensors, device, host_guards=host_guards)
        self.spec = spec
        #: the draft stage's source of tokens (None: the n-gram lookup)
        self.drafter: Drafter = drafter if drafter is not None else NgramDrafter()
        #: this step's draft length per row (0: not drafting)
        self.draft_len = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        #: whether this step's draft stage wrote a draft (False: draft_len is all zeros, and
        #: the step is the normal step without a read of draft_len)
        self.drafted = False
        #: drafts, draft tokens, accepted draft tokens (vLLM's spec_decode_num_* counters)
        self.spec_counters = torch.zeros(3, dtype=torch.int64, device=self.device)
        #: per row: drafts in a row that were wholly rejected, and the steps left before the
        #: row drafts again (1, 2, 4, ... up to 2**MAX_COOLDOWN_LOG2 after each such miss), so rows
        #: whose drafts keep missing (text that does not repeat) stop paying for them
        self.miss_streak = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        self.cooldown = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        #: the CPU loop (host guards, CPU memory): numpy views of miss_streak and cooldown, for
        #: the draft stage's host-side eligibility (:meth:`_eligible_host`); None otherwise
        self._host_views = ((self.miss_streak.numpy(), self.cooldown.numpy())
                            if self.host_guards and self.miss_streak.device.type == "cpu" else None)
        #: accepted draft tokens per draft position (acceptance rate per position)
        self.spec_accepted_per_pos = torch.zeros(spec.num_speculative_tokens, dtype=torch.int64,
                                                 device=self.device)
        # the ring's control words for /metrics (the frontend shows the counters when K > 0)
        K = spec.num_speculative_tokens
        self._spec_words = torch.tensor([C_STAT_SPEC_DRAFTS, C_STAT_SPEC_DRAFT_TOKENS, C_STAT_SPEC_ACCEPTED_TOKENS,
                                         *range(C_STAT_SPEC_ACCEPTED_PER_POS, C_STAT_SPEC_ACCEPTED_PER_POS + K)],
                                        device=self.device)
        self.ring["control"][C_SPEC_TOKENS] = spec.num_speculative_tokens

    def _write_stats(self) -> None:
        super()._write_stats()
        self.ring["control"][self._spec_words] = torch.cat([self.spec_counters, self.spec_accepted_per_pos])

    def _allocate(self) -> torch.Tensor:
        self._draft()
        return super()._allocate()

    def _build_batch(self, num_new: torch.Tensor) -> StepBatch:
        batch = super()._build_batch(num_new)
        if self.drafted:
            st = self._w.state
            st.num_tokens -= self.draft_len[: self._w.size]  # the drafts are not the row's tokens
        return batch

    def _draft(self) -> None:
        w, cfg, spec = self._w, self.config, self.spec
        st = w.state
        if self.drafted:  # draft_len is all zeros otherwise
            self.draft_len.zero_()
            self.drafted = False
        K = spec.num_speculative_tokens
        n = st.num_tokens
        width = cfg.max_model_len
        lookup_min = spec.prompt_lookup_min
        host = self.host_guards and self._host_views is not None
        if host:  # the CPU loop: the same rule read on the host
            streak_np, cooldown_np = self._host_views
            decode_np = self._eligible_host(streak_np[: w.size], cooldown_np[: w.size])
            if decode_np is None:
                return
            decode = torch.from_numpy(decode_np)
            # rows whose drafts keep missing need longer matches (below); the passes for
            # n-grams shorter than every drafting row's minimum are skipped
            lookup_min = min(lookup_min + int(streak_np[: w.size][decode_np].min()), spec.prompt_lookup_max)
            width = min(width, int(n.numpy()[decode_np].max()) + 1)  # only as far as the longest row
        sp = st.sampling
        streak, cooldown = self.miss_streak[: w.size], self.cooldown[: w.size]
        if not host:
            running = st.status == ROW_RUNNING
            streak.masked_fill_(~running, 0)  # a new request (or a recompute) starts afresh
            cooldown.masked_fill_(~running, 0)
            decode = (running & (st.num_computed == st.num_tokens - 1) & ~st.needs_lookup
                      & (sp["constrained"] == 0) & (cooldown == 0))
            cooldown.sub_(1).clamp_(min=0)
            if not self._when(lambda: decode.any()):
                return
        # Rows whose drafts keep missing need longer matches: min_n + the rows' wholly
        # rejected drafts in a row, at most max_n (chance one-token matches in text that
        # does not repeat stop costing verify steps; a row that copies matches long n-grams).
        row_min_n = (spec.prompt_lookup_min + streak).clamp(max=spec.prompt_lookup_max)
        room = self.stream_capacity - (w.ring["produced"] - w.ring["consumed"]) - 1
        max_tokens = sp["max_tokens"].long()
        left = torch.where(max_tokens > 0, max_tokens - (n - st.num_prompt) - 1, K)
        cap = torch.minimum(torch.minimum(room, left), cfg.max_model_len - n).clamp(min=0, max=K)
        draft, dlen = self.drafter.propose(st.tokens[:, :width], torch.where(decode, n, 0), K,
                                           lookup_min, spec.prompt_lookup_max, row_min_n)
        dlen = torch.where(decode, torch.minimum(dlen, cap), 0)
        j = torch.arange(K, device=n.device)
        sink = st.tokens.shape[1] - 1
        at = torch.where(j < dlen.unsqueeze(1), n.unsqueeze(1) + j, sink)
        rows = w.rows.unsqueeze(1).expand_as(at)
        st.tokens.index_put_((rows, at), draft.to(st.tokens.dtype))
        st.num_tokens += dlen
        self.draft_len[: w.size] = dlen
        self.drafted = True

    def _eligible_host(self, streak: np.ndarray, cooldown: np.ndarray) -> np.ndarray | None:
        """The CPU loop's draft eligibility (the tensor rule of :meth:`_draft`, read on the
        host from numpy views of the same memory, as plain ints: a step costs a few reads,
        not dozens of small ops): decode rows (RUNNING, only the last token uncomputed, no
        prefix lookup pending, unconstrained) out of back-off, whose last token occurred
        earlier. Updates the back-off like the tensor rule. None when no row can draft."""
        st = self._w.state
        status, cool = st.status.tolist(), cooldown.tolist()
        stale = [r for r, s in enumerate(status) if s != ROW_RUNNING and (cool[r] or streak[r])]
        if stale:  # a new request (or a recompute) starts afresh
            streak[stale] = 0
            cooldown[stale] = 0
            for r in stale:
                cool[r] = 0
        if any(cool):
            np.maximum(cooldown - 1, 0, out=cooldown)
        rows = [r for r, s in enumerate(status) if s == ROW_RUNNING and not cool[r]]
        if not rows:
            return None
        n, computed = st.num_tokens.tolist(), st.num_computed.tolist()
        lookup, constrained = st.needs_lookup.tolist(), st.sampling["constrained"].tolist()
        tokens = st.tokens.numpy()
        decode = np.zeros(len(status), dtype=bool)
        for r in rows:
            m = n[r]
            if computed[r] != m - 1 or lookup[r] or constrained[r] or m < 2:
                continue
            # Every n-gram match ends with an earlier occurrence of the row's last token: a row
            # whose last token did not occur before (most steps of text that does not repeat)
            # cannot draft, and a step where no row can skips the lookup (the same drafts).
            hist = tokens[r, :m]
            if not self.drafter.repeats_only or (hist[:-1] == hist[-1]).any():
                decode[r] = True
        return decode if decode.any() else None


def _lane_inputs(sched: SpecScheduler, lrow: torch.Tensor, j: torch.Tensor):
    """The sampler's inputs of each lane: its row's fields, at position n + j."""
    st = sched.state
    sp = st.sampling
    sampling = SamplingTensors(**{f.name: sp[f.name][lrow] for f in SAMPLER_FIELDS})
    prompt_lens, total_lens = st.num_prompt[lrow], st.num_tokens[lrow] + j
    eos = torch.where(sp["ignore_eos"][lrow].unsqueeze(1) != 0, -1, sched._eos.unsqueeze(0))
    suppress = torch.cat([sp["stop_token_ids"][lrow].long(), eos], 1)
    too_early = (total_lens - prompt_lens) < sp["min_tokens"][lrow]
    suppress_ids = torch.where(too_early.unsqueeze(1), suppress, -1).to(torch.int32)
    return sampling, prompt_lens, total_lens, suppress_ids, st.sampler_features[lrow]


def run_spec_step(parts: StepParts, on_scheduled=None) -> bool:
    """One eager CPU-loop step with speculation (module docstring). False when nothing
    was scheduled."""
    sched, executor, sampler = parts
    scheduled = schedule_on_host(parts, on_scheduled)
    if scheduled is None:
        return False
    batch, n, _ = scheduled
    sched.drafter.before_forward(parts, batch, n)  # a draft model drafts (blink.engine.draft_model)
    w = sched._w
    st = w.state
    S = w.size
    num_new = batch.num_new_tokens
    # no row verifies a draft (none drafted, or no drafting row was granted a token): the normal step
    spec_row = (sched.draft_len[:S] > 0) & (num_new > 0) if sched.drafted else None
    if spec_row is None or not bool(spec_row.any()):
        eager_model_phase(parts, *scheduled)
        return True

    # Lanes: every position of a drafting row, the last position of other sampling rows.
    sampled = (num_new > 0) & (st.num_computed + num_new == st.num_tokens)
    lanes_row = torch.where(spec_row, num_new, sampled.long())
    lane_end = lanes_row.cumsum(0)
    lane_start = lane_end - lanes_row
    L = int(lane_end[-1])
    lane = torch.arange(L, device=num_new.device)
    lrow = torch.searchsorted(lane_end, lane, right=True)
    j = lane - lane_start[lrow]
    qsl = batch.attn.query_start_loc.long()
    flat = qsl[lrow + 1] - lanes_row[lrow] + j

    logits = executor.execute(batch.input_ids[:n], compact_rows(batch, n), flat)
    sampling, prompt_lens, total_lens, suppress_ids, features = _lane_inputs(sched, lrow, j)
    plan = SamplerPlan.from_features(features, suppress_ids)
    history = (st.tokens[lrow, : sched.config.max_model_len]
               if plan.any_penalty or plan.any_bad_words else None)
    masks = None
    if plan.any_constrained:  # constrained rows never draft: one lane each, at j = 0
        masks = sched.token_masks(dataclasses.replace(batch, sample_rows=lrow), L, host_rows=True)
    out = sampler(logits, sampling, history, prompt_lens, total_lens, total_lens, suppress_ids,
                  plan=plan, masks=masks)
    tok = out.tokens.long()

    # Acceptance: lane j checks the draft token at position n + j (drafting rows only).
    draft_tok = st.tokens[lrow, (st.num_tokens[lrow] + j).clamp(max=st.tokens.shape[1] - 1)].long()
    match = spec_row[lrow] & (j < lanes_row[lrow] - 1) & (tok == draft_tok)
    big = sched.spec.num_speculative_tokens + 1
    first_miss = torch.full((S,), big, dtype=torch.int64, device=tok.device).scatter_reduce(
        0, lrow, torch.where(match, big, j), "amin")
    n_pub = torch.where(lanes_row > 0, first_miss + 1, 0)

    # KV that is right: the row's last token and the accepted drafts.
    valid_new = torch.where(spec_row, n_pub, num_new)
    if sched.config.enable_prefix_caching:
        from blink.engine import prefix_cache  # noqa: PLC0415

        md = batch.attn
        rows_t = md.token_seq_idx[:n]
        pos = md.positions[:n]
        valid = pos < (st.num_computed + valid_new)[rows_t]
        prefix_cache.register(st, sched.config, batch.input_ids[:n], pos, rows_t, md.slot_mapping[:n],
                              md.query_start_loc, valid, sched._hash,
                              sched._stamp(sched.config.max_blocks_per_seq), sched._when)
    st.num_computed += valid_new

    accepted = torch.where(spec_row, n_pub - 1, 0)
    verified = spec_row & (lanes_row > 1)  # at least one draft token was checked
    streak = sched.miss_streak[:S]
    streak.copy_(torch.where(verified, torch.where(accepted == 0, streak + 1, 0), streak))
    sched.cooldown[:S] = torch.where(verified & (accepted == 0),
                                     (2 ** (streak - 1).clamp(min=0, max=MAX_COOLDOWN_LOG2)), sched.cooldown[:S])
    sched.spec_counters += torch.stack([spec_row.sum(), torch.where(spec_row, lanes_row - 1, 0).sum(),
                                        accepted.sum()])
    pos_k = torch.arange(sched.spec.num_speculative_tokens, device=tok.device)
    sched.spec_accepted_per_pos += (pos_k.unsqueeze(0) < accepted.unsqueeze(1)).sum(0)

    # Publish position by position: the ordinary stage, so finishes cut the run exactly.
    width = out.top_ids.shape[1]
    for i in range(sched.spec.num_speculative_tokens + 1):
        pub = (n_pub > i) & (st.status != ROW_RELEASING)
        if not bool(pub.any()):
            break
        dest = torch.where(pub, pub.long().cumsum(0) - 1, S)
        rows_i = torch.full((S + 1,), -1, dtype=torch.int64, device=tok.device).scatter(0, dest, w.rows)[:S]
        li = (lane_start[rows_i.clamp(min=0)] + i).clamp(max=L - 1)
        top_ids = out.top_ids[li] if width else out.top_ids[:S]
        top_lp = out.top_logprobs[li] if width else out.top_logprobs[:S]
        if not width:
            top_ids = torch.empty(S, 0, dtype=torch.int64, device=tok.device)
            top_lp = top_ids.float()
        sched._publish_tokens(dataclasses.replace(batch, sample_rows=rows_i), out.tokens[li],
                              out.logprob[li], top_ids, top_lp)
    # A row that finished inside its accepted run: nothing past its last token is computed.
    st.num_computed.copy_(torch.where(spec_row, torch.minimum(st.num_computed, st.num_tokens - 1),
                                      st.num_computed))
    sched._write_stats()
    return True
