"""Filter cases shared by the sampling kernel tests (Triton and CPU) against the reference."""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def tied_filter_case(seed: int, n_rows: int, vocab: int):
    """Half-integer logits in [-6, 6] (many exact ties at the top-k and top-p cut-offs, like
    bf16 logits upcast to fp32, where a selection-based filter could differ from a sort), a row
    without ties, suppressed entries, a row of equal values (+0.0 and -0.0: every filter cuts
    inside one tie); top-k, top-p and min-p on and off across rows. Returns (logits, top_k,
    top_p, min_p)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-12, 13, (n_rows, vocab), generator=g).float() / 2
    logits[0] = torch.randn(vocab, generator=g) * 3  # one row without ties
    logits[1, : vocab // 3] = NEG_INF  # suppressed tokens
    logits[2] = -0.0
    logits[2, ::5] = 0.0
    top_k = torch.randint(-1, 12, (n_rows,), generator=g, dtype=torch.int32)
    top_k[3] = vocab + 10  # larger than the vocabulary: off
    top_p = torch.rand(n_rows, generator=g) * 0.98 + 0.02
    top_p[4] = 1.0
    min_p = torch.where(torch.rand(n_rows, generator=g) < 0.5, torch.rand(n_rows, generator=g) * 0.5, 0.0)
    return logits, top_k, top_p, min_p
