"""The description of a step's tokens in the paged KV cache that every attention op and the
KV-cache write take, whatever their back-end (:mod:`blink.kernels.reference`, ``.triton``,
``.cpu``); the scheduler builds it, the executor hands it to the model."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where the step's tokens live in the paged KV cache.

    T = number of new tokens in the step (padded to a bucket), B = number of sequence rows,
    M = max blocks per sequence.

    slot_mapping:    int64 [T]   flat cache slot (block * block_size + offset) each new
                                 token's K/V is written to. Padding tokens point at the
                                 scratch block (the cache's last block), never at a real one.
    positions:       int64 [T]   absolute position of each token within its sequence.
    token_seq_idx:   int64 [T]   row of ``block_tables``/``seq_lens`` each token belongs to.
    query_start_loc: int32 [B+1] start of each sequence's new tokens in the flat batch.
    seq_lens:        int32 [B]   context length after this step (cached + new); 0 = unused row.
    block_tables:    int32 [B,M] cache block ids of each sequence.
    max_context:     int | None  optional host-side upper bound on ``seq_lens`` that lets the
                                 CPU reference gather fewer blocks; ``None`` means M*block_size.
    max_query_len:   int | None  optional host-side upper bound on any row's number of new
                                 tokens (1 for a decode-only step); ``None`` means T.
    step_cache:      dict | None scratch space valid for one forward pass: ops may memoise
                                 tensors derived from the fields above in it, so per-layer ops
                                 do not redo per-step index work. The model gives each forward
                                 a fresh dict; ``None`` (the default) disables memoising, so a
                                 caller that edits the tensors in place never sees stale data.
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    token_seq_idx: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_context: int | None = None
    max_query_len: int | None = None
    step_cache: dict | None = field(default=None, repr=False, compare=False)
