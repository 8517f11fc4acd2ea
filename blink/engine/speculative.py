"""Speculative decoding with n-gram (prompt lookup) drafts, verified in the same step
(issue 36; ``--speculative-config '{"method": "ngram", ...}'``). Every step runner: the CPU
loop (eager; CPU graphs replay its decode and verify steps, blink.decode_graphs), ``--compile`` (verify steps:
the compiled layers, then the head and sampler eager) and the GPU tiers, which capture the
draft stage and the verify phase (:func:`spec_model_phase`) as tensor code with fixed shapes.

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
2. **Verify**: the forward returns logits on a fixed grid of K + 1 lanes per sample row
   (:class:`VerifyGrid`; ``SpecScheduler._build_batch`` makes every row whose real last token
   is computed a sample row, a drafting row granted part of its draft too): lane j of a row
   with g verified positions (1 + the draft tokens granted) is position n - 1 + j; lanes at
   j >= g are computed and ignored. The captured step (:func:`spec_model_phase`) runs the
   whole grid; the CPU loop (:func:`run_spec_step`) runs only the used lanes, read on the
   host, and puts their outputs back into the grid. Lane j is sampled exactly as the step
   that would produce that token without speculation: its history includes the draft tokens
   before it, its ``total_lens`` (penalties, min_tokens, the RNG counter) is n + j. Both
   paths then call :func:`accept_and_publish` (the one declaration of the rules): the row
   publishes lane tokens t_0..t_a, a the number of leading lanes whose token equals the draft
   token it checks (a cumulative product over the grid).
   Greedy rows: a is the longest prefix where the draft equals the argmax, plus the bonus
   token. Sampled rows: the draw at each position is the one the non-speculative step would
   make (same seed and counter), so a seeded request gives the same tokens with and without
   speculation; as a rule this is "accept draft x with probability p(x), else draw from p
   without x, renormalised" -- the rejection rule of the speculative sampling papers for a
   point-mass (n-gram) draft (tests/test_spec_decode.py checks it with a chi-square test).
3. **Publish**: the accepted tokens go through the ordinary publish stage one position at a
   time (K + 1 unrolled passes with masks; the CPU loop stops when no row publishes more),
   so stop ids, EOS, ``min_tokens``, ``max_tokens`` and ``max_model_len`` finish the row exactly where they would without speculation, and
   tokens after the finishing one are dropped. ``num_computed`` advances by the positions
   whose KV is right (1 + accepted drafts); the rejected positions' KV is left behind the
   row's length and overwritten later. The blocks allocated for them stay with the row
   (used by its next steps, released with it), so block accounting stays exact.

Rows that do not speculate in a step run exactly the normal step; on the CPU loop a step with
no drafting row *is* the normal step (:func:`blink.engine.step.run_step`'s path).

Back-off (per row, tensor state): a row whose draft is wholly rejected skips 1, 4, 16, 64
steps and then needs longer n-grams (``miss_streak``, ``cooldown``); the captured step keeps
them in the same tensors. The CPU loop reads the draft eligibility on the host
(:meth:`SpecScheduler._eligible_host`, the same rule) to skip the lookup when no row can draft.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from blink.engine.sampler import SamplerPlan, SamplingTensors
from blink.engine.sched.scheduler import Scheduler, StepBatch
from blink.engine.sched.state import ROW_RELEASING, ROW_RUNNING
from blink.engine.step import StepParts, bucket_metadata, compact_rows, eager_model_phase, schedule_on_host
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

#: after a row's n-th wholly rejected draft in a row it skips 4**(n-1) steps, at most 2**6,
#: and drafts again only from an n-gram of at least prompt_lookup_min + n (at most _max).
#: Growing by 4 (not 2) halves the drafts a row that never hits still tries in its first
#: hundred tokens (5 against 8): each is a verify step of K+1 tokens that costs ~1.7x a plain
#: one on SmolLM2-135M (docs/performance.md#spec-decode, the sampled workload).
MAX_COOLDOWN_LOG2 = 6
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
        #: row drafts again (1, 4, 16, ... up to 2**MAX_COOLDOWN_LOG2 after each such miss), so rows
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
        if not self.drafted:
            return batch
        w = self._w
        st, S = w.state, w.size
        st.num_tokens -= self.draft_len[:S]  # the drafts are not the row's tokens
        # Sample rows: every row whose real last token is computed this step (a drafting row
        # granted part of its draft too); logits_indices: that token's flat index, the first
        # of the row's verify lanes (verify_grid).
        sampled = (num_new > 0) & (st.num_computed + num_new >= st.num_tokens)
        dest = torch.where(sampled, sampled.long().cumsum(0) - 1, S)
        sample_rows = torch.full((S + 1,), -1, dtype=torch.int64, device=num_new.device).scatter(0, dest, w.rows)[:S]
        r = sample_rows.clamp(min=0)
        first = batch.attn.query_start_loc.long()[r] + st.num_tokens[r] - 1 - st.num_computed[r]
        return dataclasses.replace(batch, sample_rows=sample_rows, num_sample_rows=sampled.sum(),
                                   logits_indices=torch.where(sample_rows >= 0, first, 0))

    def verify_phase(self, parts: StepParts, batch: StepBatch, *, tokens: int, rows: int) -> None:
        """The captured step's second half (:func:`blink.engine.step.graph_model_phase`):
        :func:`spec_model_phase`."""
        spec_model_phase(parts, batch, tokens=tokens, rows=rows)

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


class VerifyGrid(NamedTuple):
    """A step's verify lanes as a fixed grid [R, K + 1]: sample row i's lane j samples the
    token after position n + j - 1 (n: the row's tokens, drafts not counted), so lane 0 is
    the ordinary next token and lane j > 0 checks draft token j - 1. Lanes at j >= ``g[i]``
    (past the positions the row computes this step) are computed but never used.

    rows   int64 [R]  the sample row of each lane row (-1: padding)
    g      int64 [R]  positions verified: 1 + the draft tokens granted (1: no draft; 0: padding)
    flat   int64 [R, K+1]  each lane's flat token index in the step (clamped into it)
    """

    rows: torch.Tensor
    g: torch.Tensor
    flat: torch.Tensor


def verify_grid(sched: SpecScheduler, batch: StepBatch, rows: int, tokens: int) -> VerifyGrid:
    """The grid of ``batch``'s first ``rows`` sample rows in a step of ``tokens`` flat
    positions (fixed shapes: what a graph captures; the CPU loop passes its real counts)."""
    st = sched.state
    lane_row = sched.sample_rows(batch, rows)
    r = lane_row.clamp(min=0)
    live = lane_row >= 0
    # SpecScheduler._build_batch: the first lane is the row's real last token
    first = F.pad(batch.logits_indices[:rows], (0, max(0, rows - batch.logits_indices.shape[0])))
    g = torch.where(live, st.num_computed[r] + batch.num_new_tokens[r] - st.num_tokens[r] + 1, 0)
    j = torch.arange(sched.spec.num_speculative_tokens + 1, device=r.device)
    flat = (first.unsqueeze(1) + j).clamp(max=tokens - 1)
    return VerifyGrid(lane_row, g, flat)


def _grid_inputs(sched: SpecScheduler, grid: VerifyGrid):
    """``_lane_inputs`` of every grid lane, flattened row-major ([R * (K + 1)])."""
    R, K1 = grid.flat.shape
    lrow = grid.rows.clamp(min=0).unsqueeze(1).expand(R, K1).reshape(-1)
    j = torch.arange(K1, device=lrow.device).unsqueeze(0).expand(R, K1).reshape(-1)
    return lrow, j


def spec_model_phase(parts: StepParts, batch: StepBatch, *, tokens: int, rows: int) -> None:
    """Forward -> sample every lane of the verify grid -> accept and publish: the step's
    second half as the GPU tiers capture it (fixed shapes per bucket: ``rows`` x (K + 1)
    lanes, every sampler stage, no host read; :func:`blink.engine.step.graph_model_phase`)."""
    sched, executor, sampler = parts
    sched.drafter.before_forward(parts, batch, tokens)  # NgramDrafter: nothing
    grid = verify_grid(sched, batch, rows, tokens)
    lrow, j = _grid_inputs(sched, grid)
    logits = executor.execute(batch.input_ids[:tokens], bucket_metadata(batch, tokens), grid.flat.reshape(-1))
    sampling, prompt_lens, total_lens, suppress_ids, _ = _lane_inputs(sched, lrow, j)
    history = sched.state.tokens[lrow, : sched.config.max_model_len]
    lanes = grid.rows.unsqueeze(1).expand(grid.flat.shape).reshape(-1)
    masks = sched.token_masks(dataclasses.replace(batch, sample_rows=lanes), lanes.shape[0])
    out = sampler(logits, sampling, history, prompt_lens, total_lens, total_lens, suppress_ids, masks=masks)
    K1 = grid.flat.shape[1]
    accept_and_publish(sched, batch, grid, out.tokens.view(-1, K1), out.logprob.view(-1, K1),
                       out.top_ids.view(-1, K1, out.top_ids.shape[1]),
                       out.top_logprobs.view(-1, K1, out.top_logprobs.shape[1]), tokens)


def accept_and_publish(sched: SpecScheduler, batch: StepBatch, grid: VerifyGrid, tok: torch.Tensor,
                       logprob: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor,
                       num_tokens: int) -> None:
    """The rules every speculative step shares (the CPU loop's and the captured one): which
    lanes are accepted, the KV that stays, the back-off, the counters, and the publish of
    the accepted tokens. Tensor code over the grid ([R, K + 1] sampler outputs), no host
    read except the CPU loop's early end of the publish passes (``_when``).

    Row i publishes lane tokens 0..a, a = the number of leading lanes j < g - 1 whose
    sampled token equals the draft token they check (a cumulative product): greedy rows
    accept while the draft is the argmax and add the bonus token; sampled rows accept while
    the draw (the one the non-speculative step makes) is the draft token."""
    w = sched._w
    st = w.state
    S = w.size
    R, K1 = tok.shape
    dev = tok.device
    num_new = batch.num_new_tokens
    live = grid.rows >= 0
    r = grid.rows.clamp(min=0)
    tok = tok.long()
    j = torch.arange(K1, device=dev)
    n = st.num_tokens[r]  # the drafts are not the row's tokens (SpecScheduler._build_batch)
    draft_tok = st.tokens[r.unsqueeze(1), (n.unsqueeze(1) + j).clamp(max=st.tokens.shape[1] - 1)].long()
    match = (j < (grid.g - 1).unsqueeze(1)) & (tok == draft_tok)
    n_pub = torch.where(live, match.long().cumprod(1).sum(1) + 1, 0)  # [R]

    # Per row (padding lanes write a sink): tokens published, and the rows that drafted.
    dest = torch.where(live, grid.rows, S)
    row_pub = torch.zeros(S + 1, dtype=torch.int64, device=dev).scatter(0, dest, n_pub)[:S]
    spec_row = (sched.draft_len[:S] > 0) & (num_new > 0)
    lanes_row = torch.where(spec_row, num_new, 0)  # 1 + the draft tokens verified

    # KV that is right: the row's last token and the accepted drafts.
    valid_new = torch.where(spec_row, row_pub, num_new)
    if sched.config.enable_prefix_caching:
        from blink.engine import prefix_cache  # noqa: PLC0415

        md = batch.attn
        rows_t = md.token_seq_idx[:num_tokens]
        pos = md.positions[:num_tokens]
        valid = (pos < (st.num_computed + valid_new)[rows_t]) & (torch.arange(num_tokens, device=dev)
                                                                  < batch.num_scheduled_tokens)
        prefix_cache.register(st, sched.config, batch.input_ids[:num_tokens], pos, rows_t,
                              md.slot_mapping[:num_tokens], md.query_start_loc, valid, sched._hash,
                              sched._stamp(sched.config.max_blocks_per_seq), sched._when)
    st.num_computed += valid_new

    # Back-off (tensor state, per row): a wholly rejected draft lengthens the row's streak
    # and its cooldown; an accepted token ends the streak.
    accepted = torch.where(spec_row, row_pub - 1, 0).clamp(min=0)
    verified = spec_row & (lanes_row > 1)  # at least one draft token was checked
    streak = sched.miss_streak[:S]
    streak.copy_(torch.where(verified, torch.where(accepted == 0, streak + 1, 0), streak))
    sched.cooldown[:S] = torch.where(verified & (accepted == 0),
                                     (2 ** (2 * (streak - 1)).clamp(min=0, max=MAX_COOLDOWN_LOG2)), sched.cooldown[:S])
    sched.spec_counters += torch.stack([spec_row.sum(), torch.where(spec_row, lanes_row - 1, 0).sum(),
                                        accepted.sum()])
    pos_k = torch.arange(K1 - 1, device=dev)
    sched.spec_accepted_per_pos += (pos_k.unsqueeze(0) < accepted.unsqueeze(1)).sum(0)

    # Publish position by position (K + 1 passes): the ordinary stage, so finishes cut the
    # run exactly where they would without speculation.
    lane_ids = torch.arange(R, device=dev)
    for i in range(K1):
        pub = (n_pub > i) & (st.status[r] != ROW_RELEASING)
        if not sched._when(lambda: pub.any()):  # the CPU loop: no row publishes more
            break
        at = torch.where(pub, pub.long().cumsum(0) - 1, R)
        rows_i = torch.full((R + 1,), -1, dtype=torch.int64, device=dev).scatter(0, at, grid.rows)[:R]
        src = torch.zeros(R + 1, dtype=torch.int64, device=dev).scatter(0, at, lane_ids)[:R]
        sched._publish_tokens(dataclasses.replace(batch, sample_rows=rows_i), tok[src, i],
                              logprob[src, i], top_ids[src, i], top_lp[src, i])
    # A row that finished inside its accepted run: nothing past its last token is computed.
    st.num_computed.copy_(torch.where(spec_row, torch.minimum(st.num_computed, st.num_tokens - 1),
                                      st.num_computed))
    sched._write_stats()


def run_spec_step(parts: StepParts, on_scheduled=None, *, forward=None, normal=None) -> bool:
    """One CPU-loop step with speculation (module docstring). False when nothing was
    scheduled. The lanes are the grid's used ones only (read on the host, so the forward
    and sampler do not run the unused lanes); their outputs go back into the grid for
    :func:`accept_and_publish`, the rules the captured step uses. ``forward(batch, tokens,
    flat)``: the forward (default: the executor's, eager); ``normal(batch, tokens, rows)``:
    a step where no row verifies a draft (default: the eager second half) -- the compiled
    runner passes its own."""
    sched, executor, sampler = parts
    scheduled = schedule_on_host(parts, on_scheduled)
    if scheduled is None:
        return False
    batch, n, rows = scheduled
    sched.drafter.before_forward(parts, batch, n)  # a draft model drafts (blink.engine.draft_model)
    S = sched._w.size
    num_new = batch.num_new_tokens
    # no row verifies a draft (none drafted, or no drafting row was granted a token): the normal step
    if not sched.drafted or not bool(((sched.draft_len[:S] > 0) & (num_new > 0)).any()):
        (normal or (lambda *a: eager_model_phase(parts, *a)))(*scheduled)
        return True

    grid = verify_grid(sched, batch, rows, n)
    K1 = grid.flat.shape[1]
    used = torch.arange(K1) < grid.g.unsqueeze(1)  # [R, K+1]
    lane = used.reshape(-1).nonzero().squeeze(1)  # host: only the used lanes run
    lrow_all, j_all = _grid_inputs(sched, grid)
    lrow, j = lrow_all[lane], j_all[lane]
    st = sched.state
    flat = grid.flat.reshape(-1)[lane]
    logits = (forward(batch, n, flat) if forward is not None
              else executor.execute(batch.input_ids[:n], compact_rows(batch, n), flat))
    sampling, prompt_lens, total_lens, suppress_ids, features = _lane_inputs(sched, lrow, j)
    plan = SamplerPlan.from_features(features, suppress_ids)
    history = (st.tokens[lrow, : sched.config.max_model_len]
               if plan.any_penalty or plan.any_bad_words else None)
    masks = None
    if plan.any_constrained:  # constrained rows never draft: one lane each, at j = 0
        masks = sched.token_masks(dataclasses.replace(batch, sample_rows=lrow), lane.shape[0], host_rows=True)
    out = sampler(logits, sampling, history, prompt_lens, total_lens, total_lens, suppress_ids,
                  plan=plan, masks=masks)

    def to_grid(x: torch.Tensor, fill) -> torch.Tensor:
        full = torch.full((grid.rows.shape[0] * K1, *x.shape[1:]), fill, dtype=x.dtype)
        full[lane] = x
        return full.view(grid.rows.shape[0], K1, *x.shape[1:])

    accept_and_publish(sched, batch, grid, to_grid(out.tokens, 0), to_grid(out.logprob, 0.0),
                       to_grid(out.top_ids, -1), to_grid(out.top_logprobs, float("-inf")), n)
    return True
