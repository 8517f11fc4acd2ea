"""Torch reference for structured-output masking and advancing (the spec the Triton kernel
of :mod:`blink.kernels.triton_grammar` reproduces).

The automata live in the ring's grammar region, one int32 tensor ``words`` (entry format:
:mod:`blink.ring`, ``G_*``). A row's constraint is ``entry`` (the word offset of its entry,
-1 = unconstrained) and ``state`` (its automaton state, -1 = dead: no transition matched).

- :func:`apply_grammar_mask`: logits of tokens the row's state does not allow become -inf;
  unconstrained rows are left as they are. A dead row may only emit the entry's EOS token.
- :func:`advance_grammar`: the state after a token: a binary search of the token in the
  state's CSR row of exceptions (``ADVANCE_STEPS`` fixed iterations, enough for rows of up
  to 2**20 entries), else the state's default next state if its mask allows the token, else
  -1 (EOS, which finishes the row anyway).

Branch-free and fixed-shape: every index is clamped into the region, so a row whose entry was
since replaced (a padding row of the batch reading a finished row's stale offset) reads valid
memory and its result is discarded by the caller. No host read, no data-dependent shape: safe
inside a captured CUDA graph.
"""
from __future__ import annotations

import torch

from blink.ring import (
    G_DEFAULT_NEXT, G_EOS, G_MASK, G_ROW_START, G_TRANS_NEXT, G_TRANS_TOKEN, G_VOCAB_BITS, G_WORDS_PER_STATE,
)

#: The bits of float32 -inf, as an int32.
_NEG_INF_BITS = int(torch.tensor(float("-inf")).view(torch.int32))

#: Binary-search iterations of :func:`advance_grammar`: rows of up to 2**20 - 1 transitions.
ADVANCE_STEPS = 20


def _read(words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``words[index]`` as int64, the index clamped into the region."""
    return words[index.clamp(0, words.shape[0] - 1)].long()


def grammar_mask_words(words: torch.Tensor, entry: torch.Tensor, state: torch.Tensor,
                       n_words: int) -> torch.Tensor:
    """Each row's allowed-token bitmask as int32 [B, n_words] (bit ``t % 32`` of word
    ``t // 32``: token t allowed): the state's mask words, with bits at or past the entry's
    ``vocab_bits`` cleared; only the EOS bit for a dead row; all ones for an unconstrained row.

    One gather of ``n_words`` words per row; everything else is [B, n_words] (1/32 of the
    logits), so what :func:`apply_grammar_mask` does over the vocabulary is two ops.
    """
    on = entry >= 0
    base = entry.long().clamp(min=0)
    wps = _read(words, base + G_WORDS_PER_STATE).clamp(min=1).unsqueeze(1)
    vocab_bits = _read(words, base + G_VOCAB_BITS).unsqueeze(1)
    row_word = base + _read(words, base + G_MASK) + state.long().clamp(min=0) * wps.squeeze(1)
    w = torch.arange(n_words, device=words.device).unsqueeze(0)
    packed = words[(row_word.unsqueeze(1) + torch.minimum(w, wps - 1)).clamp(0, words.shape[0] - 1)]
    # Bits of word w that are tokens below vocab_bits: all 32, the low (vocab_bits - 32 w), or none.
    below = (vocab_bits - 32 * w).clamp(0, 32)
    keep = torch.where(below >= 32, -1, (1 << below.clamp(max=31)) - 1).to(torch.int32)
    packed = packed & keep
    eos = _read(words, base + G_EOS).unsqueeze(1)
    eos_word = torch.where(w == eos // 32, 1 << (eos % 32), 0).to(torch.int32)  # 1 << 31 wraps
    packed = torch.where((state < 0).unsqueeze(1), eos_word, packed)
    return torch.where(on.unsqueeze(1), packed, -1)


def apply_grammar_mask(logits: torch.Tensor, words: torch.Tensor, entry: torch.Tensor,
                       state: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the tokens each constrained row's state forbids set to -inf.

    words int32 [R] (the grammar region), entry int32/int64 [B] (-1 = unconstrained),
    state int32/int64 [B] (-1 = dead: only the entry's EOS stays). Columns past the
    entry's vocabulary are forbidden too.
    """
    batch, vocab = logits.shape
    n_words = -(-vocab // 32)
    packed = grammar_mask_words(words, entry, state, n_words)
    # Bit j of each word moved to the sign and spread by an arithmetic shift: an int32 lane
    # mask, -1 where token 32 w + j is allowed, 0 where not.
    shift = 31 - torch.arange(32, dtype=torch.int32, device=logits.device)
    lanes = packed.unsqueeze(2) << shift
    lanes >>= 31  # in place: each [B, V] temporary is a fresh allocation (page faults on CPU)
    lanes = lanes.reshape(batch, n_words * 32)[:, :vocab]
    if logits.dtype != torch.float32:
        return torch.where(lanes != 0, logits, float("-inf"))
    # A bitwise select, (x & lanes) | (-inf & ~lanes), written as ((x ^ -inf) & lanes) ^ -inf:
    # int32 passes, measured several times faster on CPU than torch.where / masked_fill over
    # a bool mask (docs/benchmarks.md, "Structured outputs"); bit-exact, NaN included.
    out = logits.view(torch.int32) ^ _NEG_INF_BITS
    out &= lanes
    out ^= _NEG_INF_BITS
    return out.view(torch.float32)


def advance_grammar(words: torch.Tensor, entry: torch.Tensor, state: torch.Tensor,
                    token: torch.Tensor) -> torch.Tensor:
    """The automaton state after ``token`` [B] for each row (int64 [B]): -1 when the token has
    no transition from the row's state, or the row is dead. Unconstrained rows get -1 too
    (callers keep their own value for those)."""
    base = entry.long().clamp(min=0)
    s = state.long().clamp(min=0)
    row = base + _read(words, base + G_ROW_START) + s
    lo, hi = _read(words, row), _read(words, row + 1)
    end = hi
    tok_base = base + _read(words, base + G_TRANS_TOKEN)
    t = token.long()
    for _ in range(ADVANCE_STEPS):  # lower bound of t in [lo, hi)
        mid = (lo + hi) // 2
        active = lo < hi
        below = _read(words, tok_base + mid) < t
        lo = torch.where(active & below, mid + 1, lo)
        hi = torch.where(active & ~below, mid, hi)
    found = (lo < end) & (_read(words, tok_base + lo) == t)
    nxt = _read(words, base + _read(words, base + G_TRANS_NEXT) + lo)
    # Not an exception: the default next state, if the token is allowed at all.
    wps = _read(words, base + G_WORDS_PER_STATE).clamp(min=1)
    in_vocab = (t >= 0) & (t < _read(words, base + G_VOCAB_BITS))
    word = _read(words, base + _read(words, base + G_MASK) + s * wps + t.clamp(min=0) // 32)
    allowed = in_vocab & (((word >> (t.clamp(min=0) % 32)) & 1) != 0)
    default = _read(words, base + _read(words, base + G_DEFAULT_NEXT) + s)
    live = (state >= 0) & (entry >= 0)
    return torch.where(live & found, nxt, torch.where(live & allowed, default, -1))
