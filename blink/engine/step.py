"""One engine step: schedule → forward → sample → update. Every loop runs this.

``run_step`` is the CPU loop's eager step (:mod:`blink.engine.runners` picks how an engine
runs its step): ``scheduler.schedule()`` then :func:`model_phase` (forward → sampler →
``scheduler.update``). The GPU tiers capture exactly
these two calls into CUDA graphs: ``schedule()`` as the schedule graph, and ``model_phase``
with capture-friendly options (``compact=False``: the bucket's fixed token count, all rows,
no host-side sampler plan) as one graph per bucket. Being on the host, the CPU loop instead
reads the step's token count and compacts the metadata (``compact=True``), which only
removes padding: the tokens are the same.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from blink.engine.prompt_logprobs import prompt_logprob_jobs, write_prompt_logprobs
from blink.engine.sampler import Sampler, SamplerPlan
from blink.engine.sched.scheduler import SamplerInputs, Scheduler, StepBatch
from blink.kernels.attention_metadata import AttentionMetadata

class StepParts(NamedTuple):
    scheduler: Scheduler
    executor: Any  # ModelExecutor-like: execute(input_ids, md, logits_indices) -> logits
    sampler: Sampler


def compact_rows(batch: StepBatch, n: int, scheduler: Scheduler | None = None) -> AttentionMetadata:
    """Host loops only: the step's metadata cut down to its ``n`` real tokens and the rows
    that have tokens this step, so the reference attention neither pads nor gathers idle
    rows. (A captured graph keeps the fixed shapes instead: :func:`bucket_metadata`.)
    ``scheduler``: the batch's, whose C stages compact it in one call where it has them."""
    compacted = None if scheduler is None else scheduler.compact_metadata(batch, n)
    if compacted is not None:
        return compacted
    md = batch.attn
    active = torch.nonzero(batch.num_new_tokens > 0).squeeze(1)
    remap = torch.zeros(batch.num_new_tokens.shape[0], dtype=torch.int64, device=active.device)
    remap[active] = torch.arange(active.shape[0], device=active.device)
    seq_lens = md.seq_lens[active]
    return AttentionMetadata(
        slot_mapping=md.slot_mapping[:n],
        positions=md.positions[:n],
        token_seq_idx=remap[md.token_seq_idx[:n]],
        query_start_loc=torch.cat([md.query_start_loc[active], md.query_start_loc[-1:]]),
        seq_lens=seq_lens,
        block_tables=md.block_tables[active],
        max_context=int(seq_lens.max()),
        max_query_len=int(batch.num_new_tokens.max()),
    )


def bucket_metadata(batch: StepBatch, tokens: int) -> AttentionMetadata:
    """Fixed-shape metadata of a ``tokens``-token bucket: views of the step's tensors, every
    row kept (idle rows have ``seq_lens`` 0), padding tokens in the scratch block. No host
    read: this is what a captured graph runs."""
    md = batch.attn
    return AttentionMetadata(
        slot_mapping=md.slot_mapping[:tokens],
        positions=md.positions[:tokens],
        token_seq_idx=md.token_seq_idx[:tokens],
        query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        block_tables=md.block_tables,
    )


def model_phase(
    parts: StepParts,
    batch: StepBatch,
    *,
    tokens: int,
    rows: int,
    compact: bool,
    plan: SamplerPlan | None = None,
    inputs: SamplerInputs | None = None,
) -> None:
    """Forward → sample → update for a scheduled ``batch``: the second half of every step.

    ``tokens``: token positions to run (the real count on the host, the bucket size in a
    graph); ``rows``: sampler rows (>= the step's sample rows); ``compact``: host-side
    metadata compaction (CPU loop) or fixed bucket shapes (graphs); ``plan``: the CPU
    loop's host-side sampler plan, None (every stage) in graphs; ``inputs``: the sampler
    inputs of the ``rows`` rows when the caller already gathered them (the CPU loop)."""
    scheduler, executor, sampler = parts
    md = compact_rows(batch, tokens, scheduler) if compact else bucket_metadata(batch, tokens)
    # CPU loop: rows asking for prompt logprobs get them from this step's hidden states.
    jobs = prompt_logprob_jobs(scheduler, batch) if compact else []
    hook = {"hidden_hook": functools.partial(write_prompt_logprobs, jobs, scheduler.ring)} if jobs else {}
    if plan is not None and plan.greedy_untouched:  # its sampler reads the logits in the model's dtype
        hook = {**hook, "fp32": False}
    logits = executor.execute(batch.input_ids[:tokens], md, batch.logits_indices[:rows], **hook)
    # The [rows, max_model_len] history only when a row has a penalty (graphs: always).
    history = (scheduler.token_history(batch, rows)
               if plan is None or plan.any_penalty or plan.any_bad_words else None)
    if inputs is None:
        inputs = scheduler.sampler_inputs(batch, rows)
    # CPU loop: no masks to gather when the plan has no constrained row; otherwise the
    # constrained rows found on the host, so only their logits are masked.
    masks = None if plan is not None and not plan.any_constrained else scheduler.token_masks(
        batch, rows, host_rows=compact and plan is not None)
    out = sampler(
        logits,
        inputs.sampling,
        history,
        inputs.prompt_lens,
        inputs.total_lens,
        inputs.total_lens,
        inputs.suppress_ids,
        plan=plan,
        masks=masks,
    )
    scheduler.update(batch, out.tokens, out.logprob, out.top_ids, out.top_logprobs, num_tokens=tokens)


def graph_model_phase(parts: StepParts, batch: StepBatch, *, tokens: int, rows: int) -> None:
    """The step's second half as the GPU tiers capture it (fixed shapes, every stage, no
    host read): :func:`model_phase` with ``compact=False``, or, for a scheduler that verifies
    drafts in the step (speculative decoding), its ``verify_phase`` (the same contract)."""
    verify = getattr(parts.scheduler, "verify_phase", None)
    if verify is not None:
        verify(parts, batch, tokens=tokens, rows=rows)
        return
    model_phase(parts, batch, tokens=tokens, rows=rows, compact=False)


def schedule_on_host(
    parts: StepParts, on_scheduled: Callable[[StepBatch], None] | None = None
) -> tuple[StepBatch, int, int] | None:
    """A CPU-loop step's first half: ``schedule()``, then (batch, tokens, sample rows), or
    None when nothing was scheduled. ``on_scheduled(batch)``: host code between the schedule
    and the forward (the prefill role's KV sender opens the step's layer-by-layer transfers
    there)."""
    batch = parts.scheduler.schedule()
    n, sample_rows = parts.scheduler.host_counts(batch)  # CPU loop: plain memory reads, not a device sync
    if n == 0:  # admissions/cancels may have happened, but there is nothing to compute
        return None
    if on_scheduled is not None:
        on_scheduled(batch)
    # At least one (padding) sample row: a step of prefill chunks only samples nothing,
    # and update() indexes the sampler outputs (an empty tensor cannot be indexed).
    return batch, n, max(sample_rows, 1)


def run_step(parts: StepParts, on_scheduled: Callable[[StepBatch], None] | None = None) -> bool:
    """One eager CPU-loop step (:class:`blink.engine.runners.EagerRunner`). Returns False
    when nothing was scheduled; ``on_scheduled`` as in :func:`schedule_on_host`."""
    scheduled = schedule_on_host(parts, on_scheduled)
    if scheduled is None:
        return False
    eager_model_phase(parts, *scheduled)
    return True


def eager_model_phase(parts: StepParts, batch: StepBatch, tokens: int, rows: int) -> None:
    """A scheduled CPU-loop step's second half, eager: the sampler's inputs and the plan of
    the stages its rows use, then :func:`model_phase` (forward, sample, update)."""
    inputs = parts.scheduler.sampler_inputs(batch, rows)
    plan = inputs.plan or SamplerPlan.from_features(inputs.features, inputs.suppress_ids)  # skip unused stages
    model_phase(parts, batch, tokens=tokens, rows=rows, compact=True, plan=plan, inputs=inputs)
