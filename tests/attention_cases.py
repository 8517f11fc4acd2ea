"""Random paged-attention steps shared by the attention kernel tests (Triton and CPU)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from blink.kernels.attention_metadata import AttentionMetadata


def make_batch(
    rows: list[tuple[int, int]],
    *,
    n_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    pad_tokens: int = 0,
    extra_table_cols: int = 1,
    seed: int = 0,
):
    """A step over ``rows`` = [(cached_len, new_len)] with a random cache and block layout.

    Rows with (0, 0) are unused (seq_lens 0). Physical blocks are shuffled so a wrong block
    lookup cannot pass by accident; the last block is the scratch block padding writes to.
    Returns (caches, new K/V, metadata, number of live tokens).
    """
    g = torch.Generator().manual_seed(seed)
    n_rows = len(rows)
    blocks_per_row = [-(-(c + n) // block_size) for c, n in rows]
    max_blocks = max(blocks_per_row) + extra_table_cols
    n_blocks = sum(blocks_per_row) + 1  # + scratch
    perm = torch.randperm(n_blocks - 1, generator=g)
    tables = torch.zeros(n_rows, max_blocks, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_row):
        tables[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    k_cache = torch.randn(n_blocks, block_size, n_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(n_blocks, block_size, n_kv_heads, head_dim, generator=g).to(dtype)

    slots, positions, seq_idx, starts = [], [], [], [0]
    for r, (cached, new) in enumerate(rows):
        for p in range(cached, cached + new):
            positions.append(p)
            seq_idx.append(r)
            slots.append(int(tables[r, p // block_size]) * block_size + p % block_size)
        starts.append(starts[-1] + new)
    n_live = len(slots)
    pad_row = next((r for r, (c, n) in enumerate(rows) if c + n == 0), 0)
    for i in range(pad_tokens):
        positions.append(0)
        seq_idx.append(pad_row)
        slots.append((n_blocks - 1) * block_size + i % block_size)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        token_seq_idx=torch.tensor(seq_idx, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in rows], dtype=torch.int32),
        block_tables=tables,
    )
    T = len(slots)
    k_new = torch.randn(T, n_kv_heads, head_dim, generator=g).to(dtype)
    v_new = torch.randn(T, n_kv_heads, head_dim, generator=g).to(dtype)
    return k_cache, v_cache, k_new, v_new, md, n_live


# A mixed step: decode rows, a fresh prefill, an extend over a cached prefix (prefix cache /
# chunked prefill), an unused row, and bucket padding.
MIXED = [(37, 1), (0, 9), (0, 0), (20, 5), (5, 1)]

# (rows, heads, kv heads, head dim, block size, dtype) that the CPU attention kernels are
# checked on against the reference
CPU_CASES = [
    (MIXED, 4, 2, 16, 4, torch.float32),          # GQA 2, tiny blocks
    (MIXED, 4, 4, 16, 16, torch.float32),         # MHA
    (MIXED, 8, 2, 64, 16, torch.bfloat16),        # GQA 4, Llama-like head
    ([(40, 1), (3, 1), (0, 0), (70, 1)], 9, 3, 64, 16, torch.bfloat16),  # SmolLM2 decode
    # decode scores on AMX: 16 query heads per KV head (a full-width score tile), 4 channel
    # tiles, two 16-key tiles per block; and 3 channel tiles of 96
    ([(40, 1), (17, 1), (0, 0), (100, 1)], 16, 1, 128, 32, torch.bfloat16),
    ([(5, 1), (50, 1)], 6, 2, 96, 16, torch.bfloat16),
    ([(0, 33)], 4, 1, 32, 8, torch.float32),      # MQA, one prefill
]


@contextlib.contextmanager
def kernel_threads_as_torchs() -> Iterator[None]:
    """The C kernels' threads following torch's for the block (restored after): the attention
    estimate prices SDPA on torch's threads and the C kernel on the kernel threads
    (kernels/cpu/attention.py, ``prefer_native``), and an engine started earlier in the same
    process leaves its own kernel thread count set."""
    from blink.kernels.cpu import threads as cpu_threads

    saved = cpu_threads._threads
    cpu_threads.set_kernel_threads(None)
    try:
        yield
    finally:
        cpu_threads.set_kernel_threads(saved)
