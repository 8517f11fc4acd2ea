"""Paged attention for the eager CPU forward: the reference's plan, in the cache's dtype.

:func:`blink.kernels.reference.paged_attention` gathers each query tile's context and
converts it to fp32 (a strided copy of ``2 * tiles * L * KVH * D`` elements per layer) before
SDPA. For a bf16 cache that conversion was the largest single cost of a 16-row decode step
(~40% of the step's aten time on SmolLM2-135M). Here the gathered K/V stay in the cache's
dtype and go straight to SDPA, whose CPU flash kernel accumulates in fp32 for bf16 inputs
anyway; the mask is made once per step in that dtype. For an fp32 cache this is the
reference's own arithmetic. Tested against the reference in ``tests/test_cpu_attention.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# the gather budget (bytes of K/V plus mask per chunk of query tiles) is the reference's
from blink.kernels.reference import _GATHER_BUDGET_BYTES, AttentionMetadata, _additive_mask, _attention_plan


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`blink.kernels.reference.paged_attention` (q [T, H, D],
    caches [blocks, block_size, KVH, D] already holding this step's K/V; returns [T, H, D]
    in q's dtype, zeros for tokens of unused rows)."""
    T, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    dtype = k_cache.dtype
    plan = _attention_plan(md, T, block_size)
    NT, Qt = plan.limit.shape
    L = plan.tables.shape[1] * block_size
    cache = md.step_cache
    mask = None
    if plan.mask is not None:
        mask = cache.get("cpu_attention_mask") if cache is not None else None
        if mask is None or mask.dtype != dtype or mask.shape != plan.mask.shape:
            mask = plan.mask.to(dtype)
            if cache is not None:
                cache["cpu_attention_mask"] = mask

    q_grid = torch.zeros(NT * Qt + 1, H, D, dtype=dtype, device=q.device).index_copy_(0, plan.cell, q.to(dtype))
    q_grid = q_grid[:-1].view(NT, Qt, H, D).transpose(1, 2)  # [NT, H, Qt, D]
    out = q.new_zeros(NT * Qt + 1, H, D)
    out_view = out[:-1].view(NT, Qt, H, D)
    per_tile_bytes = (L * KVH * D * 2 + Qt * L) * k_cache.element_size()
    chunk = max(1, _GATHER_BUDGET_BYTES // per_tile_bytes)
    for start in range(0, NT, chunk):  # chunks of tiles sized by shapes only, never by values
        end = min(NT, start + chunk)
        n = end - start
        blocks = plan.tables[start:end].reshape(-1)
        k = k_cache.index_select(0, blocks).view(n, L, KVH, D).transpose(1, 2)  # [n, KVH, L, D]
        v = v_cache.index_select(0, blocks).view(n, L, KVH, D).transpose(1, 2)
        tile_mask = mask[start:end] if mask is not None else _additive_mask(plan.limit[start:end], L).to(dtype)
        o = F.scaled_dot_product_attention(
            q_grid[start:end], k, v, attn_mask=tile_mask, scale=scale, enable_gqa=KVH != H
        )
        out_view[start:end] = o.transpose(1, 2)
    return out.index_select(0, plan.cell)
