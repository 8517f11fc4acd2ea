"""Host-side step inputs for tests and benchmarks that drive a
:class:`~blink.executor.ModelExecutor` directly (the engine's scheduler builds these tensors
on the device instead)."""
from __future__ import annotations

from typing import Any

import torch

from blink.kernels.attention_metadata import AttentionMetadata


def build_metadata(
    ex: Any, seqs: list[tuple[list[int], int, list[int]]]
) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """``ex.execute``'s inputs for ``seqs``: per sequence, (new token ids, number of tokens
    already in the cache, block ids). ``ex`` is a ModelExecutor (its block size, scratch
    block, ``max_model_len`` and device are used). Returns (input_ids, metadata, indices of
    each sequence's last token)."""
    bs = ex.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    for row, (new_ids, num_cached, block_ids) in enumerate(seqs):
        total = num_cached + len(new_ids)
        if not new_ids or len(block_ids) * bs < total or total > ex.max_model_len:
            raise ValueError(
                f"sequence {row}: {len(new_ids)} new + {num_cached} cached tokens need "
                f"{-(-total // bs)} blocks (max_model_len {ex.max_model_len}), "
                f"got {len(block_ids)}"
            )
        for pos in range(num_cached, total):
            positions.append(pos)
            slots.append(block_ids[pos // bs] * bs + pos % bs)
        ids.extend(new_ids)
        rows.extend([row] * len(new_ids))
        starts.append(starts[-1] + len(new_ids))
        seq_lens.append(total)
    width = max(len(b) for _, _, b in seqs)
    tables = [list(b) + [ex.scratch_block] * (width - len(b)) for _, _, b in seqs]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=ex.device)

    md = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        positions=tensor(positions, torch.int64),
        token_seq_idx=tensor(rows, torch.int64),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        max_context=max(seq_lens),
        max_query_len=max(len(n) for n, _, _ in seqs),
    )
    return tensor(ids, torch.int64), md, tensor([s - 1 for s in starts[1:]], torch.int64)
