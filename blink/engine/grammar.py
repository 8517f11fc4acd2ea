"""Structured outputs on the device: each row's automaton state, as fixed-shape tensor code.

The frontend compiles a request's constraint into an entry of the ring's grammar region and
points the request record's ``grammar_entry`` at it (:mod:`blink.dpu.structured`). Here:

- :meth:`GrammarRows.admit` (in the scheduler's admission copy): a newly admitted row starts
  in its entry's initial state.
- :meth:`GrammarRows.batch` (in the model phase): the sample rows' (entry, state) for the
  sampler, which masks the logits with ``ops.apply_grammar_mask`` before anything else
  (so the raw logprobs are those of the masked distribution, as in vLLM).
- :meth:`GrammarRows.advance` (in ``Scheduler.update``, next to where the sampled token is
  written): the sampled rows' states step on their token.

A preempted row keeps its state (its tokens are kept, only KV is recomputed). No host read,
no data-dependent shape: capture-safe. Unconstrained rows (``grammar_entry`` -1) are left
alone by every op; the CPU loop skips the mask entirely when no sample row is constrained.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from blink.kernels.grammar_reference import advance_grammar
from blink.ring import G_INITIAL_STATE


class GrammarBatch(NamedTuple):
    """What the sampler needs to mask B sample rows: the grammar region's words and each
    row's entry offset (-1 = unconstrained) and automaton state.

    ``rows``: the indices (into the B rows) of the constrained ones, read on the host by the
    CPU loop so the mask touches only those rows' logits; None = pass every row to the mask
    op, which leaves unconstrained rows as they are (graphs: no host read)."""

    words: torch.Tensor
    entry: torch.Tensor
    state: torch.Tensor
    rows: torch.Tensor | None = None

    @property
    def any_constrained(self) -> bool:
        """Host-side: whether any row is constrained (only meaningful with ``rows``)."""
        return self.rows is None or self.rows.numel() > 0

    def apply(self, apply_mask, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` masked with ``apply_mask`` (an ``ops.apply_grammar_mask``): every row,
        or only ``rows`` when the host found some rows unconstrained."""
        if self.rows is None:
            return apply_mask(logits, self.words, self.entry, self.state)
        masked = apply_mask(logits[self.rows], self.words, self.entry[self.rows], self.state[self.rows])
        return logits.index_copy(0, self.rows, masked)


class GrammarRows:
    """Per-row automaton state over the ring's grammar region (``words``, int32)."""

    def __init__(self, words: torch.Tensor, num_rows: int, device: torch.device | str) -> None:
        self.words = words
        self.state = torch.full((num_rows,), -1, dtype=torch.int32, device=device)

    def admit(self, admitted: torch.Tensor, entry: torch.Tensor) -> None:
        """Rows in ``admitted`` (bool over rows [0, n): the scheduler's row window) start in
        their entry's initial state; ``entry`` likewise [n]."""
        base = entry.long().clamp(min=0)
        initial = self.words[(base + G_INITIAL_STATE).clamp(max=self.words.shape[0] - 1)]
        start = torch.where(entry >= 0, initial, -1).to(self.state.dtype)
        state = self.state[: admitted.shape[0]]
        state.copy_(torch.where(admitted, start, state))

    def advance(self, rows: torch.Tensor, live: torch.Tensor, entry: torch.Tensor,
                token: torch.Tensor) -> None:
        """Lane i: row ``rows[i]`` sampled ``token[i]`` if ``live[i]``; constrained ones step.
        ``entry``: every row's grammar entry [S]. Duplicate lanes (the scheduler's padding
        repeats the last live lane) write the same value."""
        entry = entry[rows]
        state = self.state[rows]
        nxt = advance_grammar(self.words, entry, state, token).to(self.state.dtype)
        self.state.index_put_((rows,), torch.where(live & (entry >= 0), nxt, state))

    def batch(self, entry: torch.Tensor, sample_rows: torch.Tensor,
              host_rows: bool = False) -> GrammarBatch:
        """The sample rows' (entry, state); padding rows (-1) read row 0, whose result the
        scheduler discards. ``entry``: every row's grammar entry [S]. ``host_rows`` (CPU
        loop only: a host read): also find which rows are constrained, so the sampler masks
        only those (``rows`` stays None when all of them are)."""
        r = sample_rows.clamp(min=0)
        g = GrammarBatch(self.words, entry[r], self.state[r])
        if host_rows:
            on = (g.entry >= 0) & (sample_rows >= 0)  # padding rows need no mask
            if not bool(on.all()):
                g = g._replace(rows=on.nonzero().flatten())
        return g
