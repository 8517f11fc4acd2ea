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

#: Binary-search iterations of :func:`advance_grammar`: rows of up to 2**20 - 1 transitions.
ADVANCE_STEPS = 20


def _read(words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``words[index]`` as int64, the index clamped into the region."""
    return words[index.clamp(0, words.shape[0] - 1)].long()


def apply_grammar_mask(logits: torch.Tensor, words: torch.Tensor, entry: torch.Tensor,
                       state: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the tokens each constrained row's state forbids set to -inf.

    words int32 [R] (the grammar region), entry int32/int64 [B] (-1 = unconstrained),
    state int32/int64 [B] (-1 = dead: only the entry's EOS stays).
    """
    batch, vocab = logits.shape
    on = entry >= 0
    base = entry.long().clamp(min=0)
    wps = _read(words, base + G_WORDS_PER_STATE).clamp(min=1)
    vocab_bits = _read(words, base + G_VOCAB_BITS)
    dead = state < 0
    row_word = base + _read(words, base + G_MASK) + state.long().clamp(min=0) * wps  # [B]
    n_words = -(-vocab // 32)
    w = torch.arange(n_words, device=logits.device)
    index = row_word.unsqueeze(1) + torch.minimum(w.unsqueeze(0), wps.unsqueeze(1) - 1)
    packed = words[index.clamp(0, words.shape[0] - 1)].contiguous()  # int32 [B, n_words]
    # Unpack bytewise through a 256 x 8 table: bit j of byte k of word w is token
    # 32 w + 8 k + j (little-endian words, as numpy wrote them and every device reads them).
    codes = torch.arange(256, device=logits.device)
    table = ((codes.unsqueeze(1) >> torch.arange(8, device=logits.device)) & 1) != 0
    bits = table[packed.view(torch.uint8).long()].reshape(batch, n_words * 32)[:, :vocab]
    col = torch.arange(vocab, device=logits.device).unsqueeze(0)
    eos = _read(words, base + G_EOS).unsqueeze(1)
    allowed = torch.where(dead.unsqueeze(1), col == eos, bits & (col < vocab_bits.unsqueeze(1)))
    return logits.masked_fill(on.unsqueeze(1) & ~allowed, float("-inf"))


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
