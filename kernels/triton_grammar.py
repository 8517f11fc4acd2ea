"""Triton structured-output mask: the twin of
:func:`blink.kernels.grammar_reference.apply_grammar_mask` (same signature, same result).

One program per (row, block of ``BLOCK_V`` tokens). An unconstrained row (entry -1) reads a
few header words and its logits block and writes them back unchanged; its mask-word loads
are masked off. A constrained row loads its header
words, one packed mask word per 32 tokens and writes -inf where the bit is clear. Out of
place (a fresh output), like the reference. Launch shapes depend only on the tensor shapes,
so the call is capture-safe; over fake tensors it returns the output without launching.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from blink.ring import G_EOS, G_MASK, G_VOCAB_BITS, G_WORDS_PER_STATE


@triton.jit
def _grammar_mask_kernel(logits_ptr, out_ptr, words_ptr, entry_ptr, state_ptr, vocab, n_words,
                         stride_l, stride_o, G_WPS: tl.constexpr, G_BITS: tl.constexpr,
                         G_MASK_OFF: tl.constexpr, G_EOS_OFF: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = cols < vocab
    x = tl.load(logits_ptr + row * stride_l + cols, mask=in_vocab, other=0.0)
    entry = tl.load(entry_ptr + row).to(tl.int64)
    on = entry >= 0
    base = tl.minimum(tl.maximum(entry, 0), n_words - 1)
    # Header words (clamped into the region, so always a valid address).
    wps = tl.maximum(tl.load(words_ptr + tl.minimum(base + G_WPS, n_words - 1)), 1).to(tl.int64)
    vocab_bits = tl.load(words_ptr + tl.minimum(base + G_BITS, n_words - 1))
    mask_off = tl.load(words_ptr + tl.minimum(base + G_MASK_OFF, n_words - 1)).to(tl.int64)
    eos = tl.load(words_ptr + tl.minimum(base + G_EOS_OFF, n_words - 1))
    state = tl.load(state_ptr + row).to(tl.int64)
    dead = state < 0
    row_word = base + mask_off + tl.maximum(state, 0) * wps
    word_idx = row_word + tl.minimum(cols // 32, wps - 1)
    word_idx = tl.minimum(tl.maximum(word_idx, 0), n_words - 1)
    # Per-column copies of the row's flags: the interpreter takes only vector load masks.
    zeros = tl.zeros([BLOCK_V], dtype=tl.int64)
    load_mask = in_vocab & ((zeros + entry) >= 0) & ((zeros + state) >= 0)
    packed = tl.load(words_ptr + word_idx, mask=load_mask, other=0)
    bit = ((packed >> (cols % 32).to(tl.int32)) & 1) != 0
    allowed = tl.where(dead, cols == eos, bit & (cols < vocab_bits))
    y = tl.where(on & (allowed == 0), float("-inf"), x)
    tl.store(out_ptr + row * stride_o + cols, y, mask=in_vocab)


def apply_grammar_mask(logits: torch.Tensor, words: torch.Tensor, entry: torch.Tensor,
                       state: torch.Tensor) -> torch.Tensor:
    """See :func:`blink.kernels.grammar_reference.apply_grammar_mask`."""
    n_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty_like(logits)
    entry = entry.to(torch.int32).contiguous()
    state = state.to(torch.int32).contiguous()
    if n_rows and not is_fake(logits):
        block = min(1024, triton.next_power_of_2(vocab))
        _grammar_mask_kernel[(n_rows, triton.cdiv(vocab, block))](
            logits, out, words, entry, state, vocab, words.shape[0], logits.stride(0),
            out.stride(0), G_WPS=G_WORDS_PER_STATE, G_BITS=G_VOCAB_BITS, G_MASK_OFF=G_MASK,
            G_EOS_OFF=G_EOS, BLOCK_V=block,
        )
    return out
