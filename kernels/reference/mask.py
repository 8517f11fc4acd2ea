"""Torch reference for structured outputs on the engine side: the sampling gate and the mask
(the spec the Triton kernels of :mod:`blink.kernels.triton.mask` reproduce).

The frontend computes each constrained request's next-token mask (llguidance, in
:mod:`blink.dpu.structured`) and writes it into the ring's mask area, one row of int32 words
per slot (bit ``t % 32`` of word ``t // 32``: token t allowed), then the slot's
``mask_epoch``: the output count the mask is for (:mod:`blink.ring`). A sample row is
``constrained`` and expects the mask of its output count ``expected``.

- :func:`wait_token_masks`: the sampling gate. Returns once every constrained row's epoch
  equals its expected count, or when ``timeout_s`` has passed (the forward ran meanwhile, so a
  frontend that keeps up costs no step time). This reference polls from the host: the CPU
  loop's gate. The Triton twin spins on the device with no host involvement.
- :func:`apply_token_mask`: ``logits`` with the tokens a constrained row's mask forbids set
  to -inf, and ``missing``: the constrained rows whose mask had not arrived. Every token of a
  missing row is forbidden: the caller finishes it with an error instead of sampling it.
  Unconstrained rows are returned unchanged. Columns past the mask's width are forbidden.

Fixed shapes and no host read in :func:`apply_token_mask`: safe inside a captured graph.
"""
from __future__ import annotations

import time

import numpy as np
import torch


def wait_token_masks(epoch: torch.Tensor, slots: torch.Tensor, constrained: torch.Tensor,
                     expected: torch.Tensor, timeout_s: float) -> bool:
    """Poll ``epoch`` (int32 [S], the ring's mask_epoch, written by another process) until
    ``epoch[slots[i]] == expected[i]`` for every ``constrained`` row i, at most ``timeout_s``
    seconds. True when every mask is there. Host-side: CPU tensors only, read through numpy
    views (the ring is host memory), so it dispatches no tensor op; a captured GPU step
    runs the Triton twin, a spin on the device, instead."""
    if epoch.device.type != "cpu":  # meta tensors (shape checks): nothing to wait for
        return True
    on = constrained.numpy()
    slot = slots.numpy()[on]
    want = expected.numpy()[on]
    ring_epoch = epoch.numpy()
    deadline = None
    delay = 2e-5
    while True:
        if (ring_epoch[slot] == want).all():
            return True
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout_s
        elif now >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


def token_mask_bits(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [B, vocab] from packed int32 mask rows [B, W] (bit t % 32 of word t // 32);
    tokens at or past 32 W are False. On CPU numpy's ``unpackbits`` (one C pass over the
    bytes, the ring's little-endian words read as bytes); torch's broadcast shifts measured
    ~10x slower at [16, 49152]."""
    batch, n_words = words.shape
    if words.device.type == "cpu":
        raw = np.ascontiguousarray(words.numpy()).view(np.uint8)
        bits = torch.from_numpy(np.unpackbits(raw, axis=1, bitorder="little")).view(torch.bool)
    else:
        shift = torch.arange(32, dtype=torch.int32, device=words.device)
        bits = ((words.unsqueeze(2) >> shift) & 1).reshape(batch, n_words * 32).bool()
    if n_words * 32 >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(batch, vocab - n_words * 32, dtype=torch.bool, device=words.device)
    return torch.cat([bits, pad], 1)


def mask_rows(epoch: torch.Tensor, slots: torch.Tensor, constrained: torch.Tensor,
              expected: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per sample row: ``(slot clamped to a valid index, constrained and not padding, its
    mask has arrived, constrained but its mask has not arrived)``."""
    s = slots.long().clamp(min=0)
    ready = epoch[s].long() == expected.long()
    on = constrained & (slots >= 0)
    return s, on, ready, on & ~ready


def apply_token_mask(logits: torch.Tensor, words: torch.Tensor, epoch: torch.Tensor,
                     slots: torch.Tensor, constrained: torch.Tensor,
                     expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked logits, missing)``.

    logits f32 [B, V]; words int32 [S, W] (the mask area); epoch int32 [S]; slots int [B]
    (a row's slot, -1 = padding row); constrained bool [B]; expected int [B] (the row's output
    count). ``missing`` bool [B]: constrained rows whose slot's epoch is not ``expected``
    (every token of theirs is -inf)."""
    s, on, ready, missing = mask_rows(epoch, slots, constrained, expected)
    allowed = token_mask_bits(words[s], logits.shape[1])
    allowed = torch.where(on.unsqueeze(1), allowed & ready.unsqueeze(1), True)
    return torch.where(allowed, logits, float("-inf")), missing
