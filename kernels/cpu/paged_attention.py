"""Paged attention for CPU that reads K/V where they lie in the cache: no gathered copy.

The reference (:func:`blink.kernels.reference.layers.paged_attention`) copies every query tile's
context out of the paged cache (``index_select``), converts it to fp32 and runs SDPA with a
mask: per layer and step that is ``2 * tiles * L * KVH * D`` elements written and read again.
Here the same tiles (the reference's own plan, :func:`~blink.kernels.reference.layers._attention_plan`)
go through :func:`tile_attention`, written so that inductor fuses the block-table gather into
the two reductions (``q·k`` over D, ``p·v`` over the context): each K/V element is read once
from the cache, in its own dtype, and never stored again.

:func:`tile_attention` is plain torch and only fast when compiled (eager it would materialise
``[tiles, Qt, L, H, D]``), so it never runs eager: the engine compiles it once, with dynamic
shapes (:func:`compile_options`: one graph for every tile count, query width and context
length), and hands the compiled function to :func:`paged_attention`. Tested against the
reference in ``tests/test_cpu_paged_attention.py``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from blink.kernels.attention_metadata import AttentionMetadata
from blink.kernels.reference.layers import _attention_plan

#: fp32 score bytes per chunk of tiles; bigger steps (long prefills) run in chunks
_SCORE_BUDGET_BYTES = 64 << 20
# Stands for -inf in the mask: a fully masked (padding) query slot stays finite, and
# exp(-1e30 - max) is exactly 0 for every visible one.
_MASKED = -1e30

TileKernel = Callable[..., torch.Tensor]


def tile_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    limit: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query tiles over their contexts, straight from the cache.

    q [N, Qt, H, D]; k_cache/v_cache [blocks, block_size, KVH, D] (the caches themselves,
    not views: dynamo guards an input's dispatcher state, which a view made in inference
    mode does not keep); slots [N, L] int64 cache slot of each tile's context position;
    limit [N, Qt] the last context position each query slot may see. Returns
    [N, Qt, H, D] in q's dtype. fp32 math, like the reference."""
    N, Qt, H, D = q.shape
    KVH = k_cache.shape[2]
    L = slots.shape[1]
    k_flat = k_cache.view(-1, KVH, D)
    v_flat = v_cache.view(-1, KVH, D)
    k = k_flat[slots].view(N, 1, L, KVH, 1, D).float()
    v = v_flat[slots].view(N, L, KVH, 1, D).float()
    scores = (q.view(N, Qt, 1, KVH, H // KVH, D).float() * k).sum(-1) * scale  # [N, Qt, L, KVH, G]
    hidden = torch.arange(L, device=q.device).view(1, 1, L, 1, 1) > limit.view(N, Qt, 1, 1, 1)
    p = torch.softmax(scores.masked_fill(hidden, _MASKED), dim=2)
    out = (p.unsqueeze(-1) * v.unsqueeze(1)).sum(2)  # [N, Qt, KVH, G, D]
    return out.reshape(N, Qt, H, D).to(q.dtype)


def compile_options() -> dict:
    """How :func:`tile_attention` is compiled: dynamic shapes with no duck sizing (a tile
    count that happens to equal the context length must not tie the two) and size-oblivious
    guards (sizes of 1 are not specialised), so one graph serves every step; the engine
    checks that no call compiles again."""
    return {"dynamic": True}


def shape_config():
    """The symbolic-shape settings :func:`compile_options` relies on, as a context manager
    to hold around every call of the compiled kernel (a recompile would trace under it too)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False, backed_size_oblivious=True)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    kernel: TileKernel,
) -> torch.Tensor:
    """Same contract as :func:`blink.kernels.reference.layers.paged_attention`; ``kernel`` is the
    compiled :func:`tile_attention`."""
    T, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    plan = _attention_plan(md, T, block_size)
    NT, Qt = plan.limit.shape
    cache = md.step_cache
    slots = cache.get("cpu_paged_slots") if cache is not None else None
    if slots is None or slots.shape[0] != NT:
        offsets = torch.arange(block_size, device=q.device)
        slots = (plan.tables.unsqueeze(-1) * block_size + offsets).view(NT, -1)
        if cache is not None:
            cache["cpu_paged_slots"] = slots
    L = slots.shape[1]

    q_grid = q.new_zeros(NT * Qt + 1, H, D).index_copy_(0, plan.cell, q)
    q_grid = q_grid[:-1].view(NT, Qt, H, D)
    out = q.new_zeros(NT * Qt + 1, H, D)
    out_view = out[:-1].view(NT, Qt, H, D)
    chunk = max(1, _SCORE_BUDGET_BYTES // (Qt * L * H * 4))
    with shape_config():
        for start in range(0, NT, chunk):  # chunks sized by shapes only
            end = min(NT, start + chunk)
            out_view[start:end] = kernel(
                q_grid[start:end], k_cache, v_cache, slots[start:end], plan.limit[start:end], scale
            )
    return out.index_select(0, plan.cell)
