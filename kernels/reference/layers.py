"""Torch reference implementations of every op the model executor calls.

These run on CPU (tests, CPU serving) and are the ground truth every back-end's kernels
(:mod:`blink.kernels.triton`, :mod:`blink.kernels.cpu`) are tested against, under the same op
names. Every op works on a flattened batch of tokens: all sequences' new tokens side by side,
described by :class:`AttentionMetadata` tensors. None of them loops in
Python over requests and none of them reads a tensor value on the host, so the same call
sequence can later be captured in a CUDA graph with the Triton versions swapped in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blink.kernels.attention_metadata import AttentionMetadata


# ----------------------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in ``x``'s dtype (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


# ----------------------------------------------------------------------------- rope


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """Inverse frequencies for RoPE; supports Llama-3 style frequency scaling.

    ``scaling`` is the HF ``rope_scaling`` dict (already validated by the config); only
    ``{"rope_type": "llama3", ...}`` (or ``"default"``/None) reach this function.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin_cache(
    rotary_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None = None,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """fp32 table ``[max_positions, rotary_dim]``: first half cos, second half sin."""
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half, the HF Llama convention) RoPE on the first ``rotary_dim``
    channels of each head, computed in fp32. q: [T, H, D], k: [T, KVH, D]. Returns new
    tensors (views into one buffer: q and k are rotated together, in one pass)."""
    rotary_dim = cos_sin_cache.shape[-1]
    n_q_heads = q.shape[1]
    qk = torch.cat([q, k], dim=1)
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = qk[..., :rotary_dim].float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(q.dtype)
    if rotary_dim < qk.shape[-1]:
        out = torch.cat([out, qk[..., rotary_dim:]], dim=-1)
    return out[:, :n_q_heads], out[:, n_q_heads:]


# ----------------------------------------------------------------------------- mlp


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate_up projection output."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- kv cache


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V ([T, KVH, D]) into the paged caches
    ([num_blocks, block_size, KVH, D]) at ``slot_mapping``."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


# Bytes of gathered K/V (plus mask) per chunk of sequence rows above which the reference
# splits the rows into chunks, so long contexts do not materialise everything at once.
_GATHER_BUDGET_BYTES = 64 << 20


# Masks up to this many elements are built once per step; larger ones per chunk of tiles.
_WHOLE_MASK_ELEMENTS = 1 << 22


@dataclass
class _AttentionPlan:
    """Index tensors the reference derives from the metadata; the same for every layer.

    The new tokens are laid out in query tiles of ``Qt`` slots: each sequence row gets
    ``ceil(n_new / Qt)`` consecutive tiles, and every tile attends to its row's context.
    """

    key: tuple
    cell: torch.Tensor  # [T] slot of each token in the [NT*Qt (+1 dump)] tile grid
    tables: torch.Tensor  # [NT, n_blocks] int64 block ids of each tile's row
    limit: torch.Tensor  # [NT, Qt] last key position each slot may see (-1: none)
    mask: torch.Tensor | None  # [NT, 1, Qt, L] additive fp32 mask, when small enough


def _attention_plan(md: AttentionMetadata, T: int, block_size: int) -> _AttentionPlan:
    """Tile the step's queries, from shapes and metadata tensors only (no host reads).

    With ``Qt = ceil(T / B)`` (capped at the longest query) there are at most ``B + T/Qt``
    tiles, so the work is within about 2x of the ideal for any mix: decode-only steps get
    one single-slot tile per sequence, a lone prefill one tile, a chunked prefill beside
    many decodes small tiles, and no token copies its context for itself alone.
    """
    B, n_blocks = md.block_tables.shape
    if md.max_context is not None:
        n_blocks = max(1, min(n_blocks, -(-md.max_context // block_size)))
    L = n_blocks * block_size
    Q = T if md.max_query_len is None else max(1, min(T, md.max_query_len))
    Qt = max(1, min(Q, -(-T // B)))
    NT = min(B * -(-Q // Qt), B + -(-T // Qt))  # upper bound on the tiles needed
    key = (T, block_size, B, n_blocks, Q)
    cache = md.step_cache
    if cache is not None and getattr(cache.get("paged_attention"), "key", None) == key:
        return cache["paged_attention"]

    device = md.positions.device
    starts = md.query_start_loc.long()
    n_new = starts[1:] - starts[:-1]  # [B]
    tiles = (n_new + Qt - 1) // Qt
    tile_end = torch.cumsum(tiles, 0)
    rows = md.token_seq_idx
    q_idx = torch.arange(T, device=device) - starts.index_select(0, rows)
    fits = (q_idx >= 0) & (q_idx < n_new.index_select(0, rows))
    tile = (tile_end - tiles).index_select(0, rows) + q_idx // Qt
    cell = torch.where(fits & (tile < NT), tile * Qt + q_idx % Qt, NT * Qt)  # last: dump
    # Row of each tile; tiles past the last row's are unused (their slots see nothing).
    tile_row = torch.searchsorted(tile_end, torch.arange(NT, device=device), right=True)
    tile_row = tile_row.clamp_(max=B - 1)
    limit = torch.full((NT * Qt + 1,), -1, dtype=torch.long, device=device)
    limit.index_copy_(0, cell, md.positions.long())
    row_limit = md.seq_lens.long().index_select(0, tile_row) - 1
    limit = torch.minimum(limit[:-1].view(NT, Qt), row_limit.unsqueeze(1))
    tables = md.block_tables[:, :n_blocks].long().index_select(0, tile_row)
    mask = _additive_mask(limit, L) if NT * Qt * L <= _WHOLE_MASK_ELEMENTS else None
    plan = _AttentionPlan(key, cell, tables, limit, mask)
    if cache is not None:
        cache["paged_attention"] = plan
    return plan


def _additive_mask(limit: torch.Tensor, L: int) -> torch.Tensor:
    """[n, Qt] last visible key -> [n, 1, Qt, L] fp32 mask of 0 / -inf (SDPA would
    otherwise convert a bool mask on every call)."""
    key_pos = torch.arange(L, device=limit.device)
    hidden = (key_pos > limit.unsqueeze(-1)).unsqueeze(1)
    return torch.zeros(hidden.shape, device=limit.device).masked_fill_(hidden, float("-inf"))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context.

    q: [T, H, D]; caches [num_blocks, block_size, KVH, D] already hold this step's K/V.
    Token t of sequence s attends to context positions ``j <= positions[t]`` (and
    ``j < seq_lens[s]``). This one function serves prefill, chunked prefill over a cached
    prefix, and decode. Returns [T, H, D] in q's dtype; tokens of unused rows get zeros.

    The reference lays the queries out in tiles (see :func:`_attention_plan`), gathers
    each tile's context once and runs fp32 SDPA with a mask. Tokens outside every tile
    (padding) land in a dump slot. The plan is memoised in ``md.step_cache`` (when set)
    for the next layers. Gathers use ``index_select``: advanced indexing (``t[idx]``)
    starts a parallel region even for a few KiB, which costs milliseconds per call when
    the CPU is shared.
    """
    T, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    plan = _attention_plan(md, T, block_size)
    NT, Qt = plan.limit.shape
    L = plan.tables.shape[1] * block_size

    q_grid = q.new_zeros(NT * Qt + 1, H, D).index_copy_(0, plan.cell, q)
    q_grid = q_grid[:-1].view(NT, Qt, H, D).transpose(1, 2)  # [NT, H, Qt, D]
    out_grid = torch.zeros(NT * Qt + 1, H, D, dtype=torch.float32, device=q.device)
    out_view = out_grid[:-1].view(NT, Qt, H, D)
    per_tile_bytes = L * KVH * D * 4 * 2 + Qt * L * H * 4
    chunk = max(1, _GATHER_BUDGET_BYTES // per_tile_bytes)
    for start in range(0, NT, chunk):  # chunks of tiles sized by shapes only, never by values
        end = min(NT, start + chunk)
        n = end - start
        blocks = plan.tables[start:end].reshape(-1)
        # [n, KVH, L, D]; fp32 because CPU SDPA is both faster and more exact in fp32.
        k = k_cache.index_select(0, blocks).view(n, L, KVH, D).transpose(1, 2).float()
        v = v_cache.index_select(0, blocks).view(n, L, KVH, D).transpose(1, 2).float()
        mask = plan.mask[start:end] if plan.mask is not None else _additive_mask(plan.limit[start:end], L)
        o = F.scaled_dot_product_attention(
            q_grid[start:end].float(), k, v, attn_mask=mask, scale=scale, enable_gqa=KVH != H
        )
        out_view[start:end] = o.transpose(1, 2)
    return out_grid.index_select(0, plan.cell).to(q.dtype)


# ----------------------------------------------------------------------------- moe


def moe_topk_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), keep the ``top_k`` largest, optionally renormalise them
    to sum to one (Qwen3-MoE's ``norm_topk_prob``). Returns (weights [T, k] fp32,
    expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture of SiLU-gated experts: ``sum_k weights[t,k] * expert_{ids[t,k]}(x[t])`` with
    ``expert_e(x) = w2[e] @ (silu(w13[e][:I] @ x) * (w13[e][I:] @ x))``.

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; weights [T, k] (fp32), ids [T, k].
    Returns [T, H] in x's dtype. No data-dependent shapes or host reads: few tokens gather
    their experts' weights (decode), many tokens run every expert densely and weight the
    results (the choice depends on shapes only). Triton replaces this on GPU.
    """
    T, k = ids.shape
    E = w13.shape[0]
    if 2 * T * k < E:
        # Gather each (token, choice) pair's expert: [T*k, 2I, H] and [T*k, H, I].
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        h = silu_and_mul(torch.bmm(w13.index_select(0, flat), xs).squeeze(-1))  # [T*k, I]
        y = torch.bmm(w2.index_select(0, flat), h.unsqueeze(-1)).squeeze(-1)  # [T*k, H]
        y = y.float().view(T, k, -1) * weights.unsqueeze(-1)
        return y.sum(dim=1).to(x.dtype)
    # Per-token weight of each expert (0 where not chosen): [T, E].
    coef = torch.zeros(T, E, dtype=torch.float32, device=x.device)
    coef.scatter_add_(1, ids, weights.float())
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(E):  # loop over experts (a fixed count), not over requests
        h = silu_and_mul(F.linear(x, w13[e]))
        out += F.linear(h, w2[e]).float() * coef[:, e : e + 1]
    return out.to(x.dtype)
