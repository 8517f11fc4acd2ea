"""Prompt logprobs: each prompt token's logprob, rank and the top-N alternatives at its
position, computed from the prefill the engine runs anyway (vLLM's ``prompt_logprobs``).

The forward already runs every prompt position; the step applies the head only at the
positions that sample. For a row whose request asks for prompt logprobs (``prompt_logprobs``
>= 0 in its sampling fields) and that has no output yet, :func:`prompt_logprob_jobs` lists the
positions of the step's chunk whose next token is a prompt token; the executor hands the
step's hidden states to :func:`write_prompt_logprobs` (its ``hidden_hook``), which applies
the head to them in sub-blocks of :data:`BLOCK_POSITIONS` rows (never a [chunk, vocab] fp32
tensor at once), takes the fp32 log-softmax's numbers (``ops_for(device).prompt_logprobs``:
on CPU one C call a block), and writes into the row's ring lane
(``prompt_logprob_lane``; :mod:`blink.ring`, "Prompt logprobs") at position q + 1: the
logprob of prompt token q + 1, its rank (1 + the ids with a larger logprob, ties counted
against it, as vLLM) and the top N (id, logprob). All before ``scheduler.update`` publishes
the row's first token, so a frontend that sees the token sees the whole lane.

A row with outputs (recomputed after a preemption) writes nothing: its lane may already
belong to another request. Positions served from the prefix cache have no logits: the
frontend gives such a request a cache salt of its own (:func:`blink.dpu.ring_packing.ring_fields`),
so it never hits. CPU loop only (host-side planning); the engine gives the ring no lanes
where its step runner cannot run this (``Engine._prompt_logprob_lanes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from blink.kernels import ops_for

#: positions whose logits one sub-block holds ([BLOCK_POSITIONS, vocab] fp32: 25 MB at a
#: 49k vocabulary)
BLOCK_POSITIONS = 128


@dataclass(frozen=True)
class PromptLogprobJob:
    """One row's positions in one step: hidden rows ``flat .. flat + count`` of the step give
    the logprobs of prompt positions ``first .. first + count`` (their tokens: ``targets``)."""

    row: int
    lane: int
    top_n: int
    flat: int
    first: int
    count: int
    targets: torch.Tensor  # int64 [count]


def prompt_logprob_jobs(scheduler: Any, batch: Any) -> list[PromptLogprobJob]:
    """The step's prompt-logprob work (host reads: the CPU loop only); [] when no row of the
    step asks for prompt logprobs, after one small check."""
    num_new = batch.num_new_tokens
    S = num_new.shape[0]
    if not scheduler.wants_prompt_logprobs(S):  # no row asks: a numpy read, no torch call
        return []
    st = scheduler.state
    want = st.sampling["prompt_logprobs"][:S]
    rows = (want >= 0) & (num_new > 0) & (st.num_tokens[:S] == st.num_prompt[:S])
    if not bool(rows.any()):
        return []
    lanes = st.sampling["prompt_logprob_lane"]
    starts = batch.attn.query_start_loc
    jobs = []
    for r in torch.nonzero(rows).squeeze(1).tolist():
        start, n, prompt = int(st.num_computed[r]), int(num_new[r]), int(st.num_prompt[r])
        count = min(start + n, prompt - 1) - start  # chunk positions q with q + 1 in the prompt
        lane = int(lanes[r])
        if count <= 0 or lane < 0:
            continue
        jobs.append(PromptLogprobJob(
            row=r, lane=lane, top_n=int(want[r]), flat=int(starts[r]), first=start + 1,
            count=count, targets=st.tokens[r, start + 1 : start + 1 + count].long()))
    return jobs


def write_prompt_logprobs(jobs: list[PromptLogprobJob], ring: dict[str, torch.Tensor],
                          hidden: torch.Tensor,
                          compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The executor's ``hidden_hook``: the jobs' logprobs from the step's ``hidden`` states
    into their ring lanes (the ``plp_*`` fields of ``ring``)."""
    for job in jobs:
        for off in range(0, job.count, BLOCK_POSITIONS):
            k = min(BLOCK_POSITIONS, job.count - off)
            h = hidden[job.flat + off : job.flat + off + k]
            logits = compute_logits(h).float()
            target = job.targets[off : off + k].to(logits.device)
            # vLLM's numbers: the target's logprob, its rank (ids at least as likely, itself
            # included), the top N (ops_for: one C call per block on CPU)
            chosen, rank, values, ids = ops_for(logits.device).prompt_logprobs(logits, target, job.top_n)
            at = slice(job.first + off, job.first + off + k)
            ring["plp_logprob"][job.lane, at] = chosen.to(ring["plp_logprob"].device)
            ring["plp_rank"][job.lane, at] = rank.to(torch.int32).to(ring["plp_rank"].device)
            if job.top_n > 0:
                ring["plp_top_ids"][job.lane, at, : job.top_n] = ids.to(torch.int32).cpu()
                ring["plp_top_logprobs"][job.lane, at, : job.top_n] = values.cpu()
