"""Structured outputs on the engine side: the sample rows' token masks from the ring.

The frontend follows each constrained request's tokens with a grammar matcher and publishes
the next token's mask into the slot's row of the ring's mask area, then the slot's
``mask_epoch`` (the output count the mask is for; :mod:`blink.ring`). The engine holds no
grammar state: at sampling time a constrained row waits at the gate until its slot's epoch
equals its output count (``ops.wait_token_masks``: bounded; the forward ran meanwhile), then
its logits are masked (``ops.apply_token_mask``). A row whose mask did not arrive in time is
not sampled: the sampler gives it token -1 and ``Scheduler.update`` finishes it with
FINISH_ERROR. A preempted row keeps its output count, so its mask stays valid.

No host read except the CPU loop's choices (``rows``); fixed shapes: capture-safe with the
Triton ops.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch

#: Default bound of the sampling gate: how long a constrained row waits for its mask.
DEFAULT_MASK_TIMEOUT_S = 5.0


class MaskBatch(NamedTuple):
    """What the sampler needs to mask B sample rows.

    words:       int32 [S, W]  the ring's mask area
    epoch:       int32 [S]     the ring's mask_epoch words
    slots:       int64 [B]     each sample row's slot (-1: a padding row)
    constrained: bool  [B]     the row is constrained (its request record says so)
    expected:    int64 [B]     the row's output count (the epoch its mask must carry)
    timeout_s:   the gate's bound
    rows:        the indices of the constrained rows, found on the host by the CPU loop so
                 only their logits are touched; None = every row goes through the ops
    """

    words: torch.Tensor
    epoch: torch.Tensor
    slots: torch.Tensor
    constrained: torch.Tensor
    expected: torch.Tensor
    timeout_s: float
    rows: torch.Tensor | None = None

    def apply(self, ops: SimpleNamespace, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait at the gate, then ``(masked logits, missing rows)`` (bool [B])."""
        if self.rows is None:
            ops.wait_token_masks(self.epoch, self.slots, self.constrained, self.expected,
                                 self.timeout_s)
            return ops.apply_token_mask(logits, self.words, self.epoch, self.slots,
                                        self.constrained, self.expected)
        r = self.rows
        slots, on, expected = self.slots[r], self.constrained[r], self.expected[r]
        ops.wait_token_masks(self.epoch, slots, on, expected, self.timeout_s)
        masked, missing = ops.apply_token_mask(logits[r], self.words, self.epoch, slots, on, expected)
        full_missing = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        return logits.index_copy(0, r, masked), full_missing.index_copy(0, r, missing)


def mask_batch(ring_tensors: dict[str, torch.Tensor], constrained: torch.Tensor,
               num_tokens: torch.Tensor, num_prompt: torch.Tensor, sample_rows: torch.Tensor,
               timeout_s: float, host_rows: bool = False) -> MaskBatch:
    """The :class:`MaskBatch` of ``sample_rows`` (-1 padded) from every row's ``constrained``
    field and token counts [S]. ``host_rows`` (CPU loop only, a host read): find which rows
    are constrained, so the ops touch only those (``rows`` stays None when all are)."""
    r = sample_rows.clamp(min=0)
    on = (constrained[r] != 0) & (sample_rows >= 0)
    batch = MaskBatch(ring_tensors["mask"], ring_tensors["mask_epoch"], sample_rows.long(), on,
                      (num_tokens[r] - num_prompt[r]).long(), timeout_s)
    if host_rows and not bool(on.all()):
        batch = batch._replace(rows=on.nonzero().flatten())
    return batch
