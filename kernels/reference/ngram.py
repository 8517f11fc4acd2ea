"""Torch reference for n-gram (prompt lookup) drafting, speculative decoding's draft op.

:func:`ngram_propose`: per row of a token history, the latest earlier occurrence of the
row's last ``n`` tokens, ``n`` from ``max_n`` down to ``min_n`` (the longest n that occurs
wins), and the up to ``k`` tokens that followed it. Branch-free tensor code with fixed
shapes (no host read, no Python loop over rows): the history stays where the engine keeps
it, and the op could run inside a captured step.

vLLM's ``--speculative-config '{"method": "ngram", ...}'`` proposes the same way (its
``prompt_lookup_min``/``prompt_lookup_max`` are ``min_n``/``max_n``); Blink takes the
*latest* occurrence, which follows what the row is copying right now.
"""
from __future__ import annotations

import torch


def ngram_propose(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                  max_n: int, row_min_n: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens for each row.

    tokens   int [R, L]   each row's prompt + output tokens, valid up to ``lengths``
    lengths  int64 [R]    tokens so far per row (0: nothing to draft)
    Returns ``(draft [R, k] int64, draft_len [R] int64)``: row r's draft is
    ``draft[r, :draft_len[r]]`` (0 when no n-gram of the sizes occurs earlier; at most the
    tokens that follow the occurrence, which end before the row's last token).
    ``row_min_n`` int64 [R] (optional): a larger ``min_n`` per row (the engine raises it for
    rows whose drafts keep missing); sizes below it do not draft for that row."""
    R, L = tokens.shape
    dev = tokens.device
    n_tok = lengths.long()
    best = torch.full((R,), -1, dtype=torch.int64, device=dev)  # where the continuation starts
    for n in range(max_n, min_n - 1, -1):  # static sizes: a few passes, no value read
        if n > L - 1:
            continue
        windows = tokens.unfold(1, n, 1)  # [R, L-n+1, n]: window s = tokens[s : s+n]
        at = (n_tok - n).clamp(min=0).unsqueeze(1) + torch.arange(n, device=dev)  # [R, n]
        suffix = tokens.gather(1, at.clamp(max=L - 1))
        same = (windows == suffix.unsqueeze(1)).all(-1)  # [R, L-n+1]
        s = torch.arange(windows.shape[1], device=dev)
        # an earlier occurrence: starts before the suffix does (so a token follows it)
        ok = same & (s.unsqueeze(0) < (n_tok - n).unsqueeze(1)) & (n_tok >= n + 1).unsqueeze(1)
        last = torch.where(ok, s.unsqueeze(0), -1).amax(1)
        take = (best < 0) & (last >= 0)
        if row_min_n is not None:
            take &= row_min_n <= n
        best = torch.where(take, last + n, best)
    found = best >= 0
    draft_len = torch.where(found, torch.clamp(n_tok - best, max=k), 0)
    cols = best.clamp(min=0).unsqueeze(1) + torch.arange(k, device=dev)
    draft = tokens.gather(1, cols.clamp(max=L - 1)).long()
    draft = torch.where(torch.arange(k, device=dev) < draft_len.unsqueeze(1), draft, 0)
    return draft, draft_len


def ngram_propose_python(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same rule for one row in plain Python (the tests' oracle)."""
    length = len(history)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = history[length - n:]
        for s in range(length - n - 1, -1, -1):  # latest first
            if history[s:s + n] == suffix:
                return history[s + n: s + n + k]
    return []
