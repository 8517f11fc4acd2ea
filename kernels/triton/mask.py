"""Triton twins of :mod:`blink.kernels.reference.mask` (same signatures, same results): the
structured-output sampling gate as a device-side wait, and the token mask.

- ``wait_token_masks``: one program per sample row spins on its slot's ``mask_epoch`` with
  volatile loads (the frontend writes it into the ring, which the GPU reads in mapped host
  memory) until it equals the row's expected output count, at most ``max_polls`` loads
  (``timeout_s`` at >= 1 µs a load of mapped memory; docs/architecture.md, "Structured
  outputs"). No host involvement: it runs inside the captured step. Launch shapes depend on
  the tensor shapes only.
- ``apply_token_mask``: one program per (row, block of ``BLOCK_V`` tokens); unconstrained rows
  copy their logits, constrained ones read one mask word per 32 tokens.

Out of place, like the references; over fake tensors they return outputs without launching.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

#: Loads of a mapped-memory word per second of ``timeout_s`` (a load over PCIe is >= ~1 µs).
POLLS_PER_SECOND = 1_000_000


@triton.jit
def _wait_kernel(epoch_ptr, slots_ptr, constrained_ptr, expected_ptr, max_polls):
    row = tl.program_id(0)
    slot = tl.maximum(tl.load(slots_ptr + row), 0)
    on = tl.load(constrained_ptr + row) != 0
    want = tl.load(expected_ptr + row).to(tl.int32)
    cur = tl.load(epoch_ptr + slot, volatile=True)
    polls = 0
    while on & (cur != want) & (polls < max_polls):
        cur = tl.load(epoch_ptr + slot, volatile=True)
        polls += 1


@triton.jit
def _mask_kernel(logits_ptr, out_ptr, words_ptr, epoch_ptr, slots_ptr, constrained_ptr,
                 expected_ptr, missing_ptr, vocab, n_words, stride_l, stride_o, stride_w,
                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = cols < vocab
    x = tl.load(logits_ptr + row * stride_l + cols, mask=in_vocab, other=0.0)
    raw_slot = tl.load(slots_ptr + row)
    slot = tl.maximum(raw_slot, 0).to(tl.int64)
    on = (tl.load(constrained_ptr + row) != 0) & (raw_slot >= 0)
    ready = tl.load(epoch_ptr + slot, volatile=True) == tl.load(expected_ptr + row).to(tl.int32)
    # Per-column copies of the row's flags: the interpreter takes only vector load masks.
    zeros = tl.zeros([BLOCK_V], dtype=tl.int32)
    word_ok = in_vocab & ((cols // 32) < n_words) & ((zeros + on.to(tl.int32)) != 0)
    packed = tl.load(words_ptr + slot * stride_w + cols // 32, mask=word_ok, other=0)
    bit = ((packed >> (cols % 32).to(tl.int32)) & 1) != 0
    allowed = bit & ready
    y = tl.where(on & (allowed == 0), float("-inf"), x)
    tl.store(out_ptr + row * stride_o + cols, y, mask=in_vocab)
    first = block == 0
    tl.store(missing_ptr + row, (on & (ready == 0)).to(tl.int8), mask=first)


def wait_token_masks(epoch: torch.Tensor, slots: torch.Tensor, constrained: torch.Tensor,
                     expected: torch.Tensor, timeout_s: float) -> None:
    """See :func:`blink.kernels.reference.mask.wait_token_masks` (returns nothing: the
    device cannot tell the host; :func:`apply_token_mask` reports the rows still missing)."""
    rows = slots.shape[0]
    if rows and not is_fake(epoch):
        _wait_kernel[(rows,)](epoch, slots.to(torch.int32).contiguous(),
                              constrained.to(torch.int32).contiguous(),
                              expected.to(torch.int32).contiguous(),
                              max(1, int(timeout_s * POLLS_PER_SECOND)))


def apply_token_mask(logits: torch.Tensor, words: torch.Tensor, epoch: torch.Tensor,
                     slots: torch.Tensor, constrained: torch.Tensor,
                     expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`blink.kernels.reference.mask.apply_token_mask`."""
    n_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty_like(logits)
    missing = torch.zeros(n_rows, dtype=torch.int8, device=logits.device)
    if n_rows and not is_fake(logits):
        block = min(1024, triton.next_power_of_2(vocab))
        _mask_kernel[(n_rows, triton.cdiv(vocab, block))](
            logits, out, words, epoch, slots.to(torch.int32).contiguous(),
            constrained.to(torch.int32).contiguous(), expected.to(torch.int32).contiguous(),
            missing, vocab, words.shape[1], logits.stride(0), out.stride(0), words.stride(0),
            BLOCK_V=block,
        )
    return out, missing.bool()
