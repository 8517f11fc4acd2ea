"""Torch reference implementations of every op the model executor calls.

These run on CPU (tests, CPU serving) and are the ground truth the Triton kernels in this
folder are tested against. Every op works on a flattened batch of tokens: all sequences' new
tokens side by side, described by :class:`AttentionMetadata` tensors. None of them loops in
Python over requests and none of them reads a tensor value on the host, so the same call
sequence can later be captured in a CUDA graph with the Triton versions swapped in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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


@dataclass
class _AttentionPlan:
    """Index tensors the reference derives from the metadata; the same for every layer."""

    key: tuple
    cell: torch.Tensor  # [T] cell of each token in the padded [B*Q (+1 dump)] query grid
    mask: torch.Tensor  # [B, 1, Q, L] fp32, additive: 0 where cell (b, i) may see key j, else -inf
    tables: torch.Tensor  # [B, n_blocks] int64 block ids


def _attention_plan(md: AttentionMetadata, T: int, block_size: int) -> _AttentionPlan:
    B, n_blocks = md.block_tables.shape
    if md.max_context is not None:
        n_blocks = max(1, min(n_blocks, -(-md.max_context // block_size)))
    Q = T if md.max_query_len is None else max(1, min(T, md.max_query_len))
    key = (T, block_size, B, n_blocks, Q)
    cache = md.step_cache
    if cache is not None and getattr(cache.get("paged_attention"), "key", None) == key:
        return cache["paged_attention"]

    device = md.positions.device
    rows = md.token_seq_idx
    q_idx = torch.arange(T, device=device) - md.query_start_loc.index_select(0, rows)
    fits = (q_idx >= 0) & (q_idx < Q)
    cell = torch.where(fits, rows * Q + q_idx, B * Q)  # B*Q is the dump cell
    # Last key position each cell may see (-1: none); bounded by the row's context length.
    limit = torch.full((B * Q + 1,), -1, dtype=torch.long, device=device)
    limit.index_copy_(0, cell, md.positions.long())
    limit = torch.minimum(limit[:-1].view(B, Q), md.seq_lens.long().unsqueeze(1) - 1)
    key_pos = torch.arange(n_blocks * block_size, device=device)
    # additive float mask: SDPA would convert a bool mask to this on every layer
    visible = (key_pos <= limit.unsqueeze(-1)).unsqueeze(1)
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    plan = _AttentionPlan(key, cell, mask, md.block_tables[:, :n_blocks].long())
    if cache is not None:
        cache["paged_attention"] = plan
    return plan


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

    The reference lays the queries out on a padded [B, Q] grid (Q = ``md.max_query_len``,
    or T when unknown), gathers each row's context once and runs fp32 SDPA with a mask, so
    decode (Q = 1) costs one gather per sequence and a prefill does not copy its context
    once per token. Tokens that do not fit the grid (padding) land in a dump cell. The grid
    indices and mask are memoised in ``md.step_cache`` (when set) for the next layers.
    Gathers use ``index_select``: advanced indexing (``t[idx]``) starts a parallel region
    even for a few KiB, which costs milliseconds per call when the CPU is shared.
    """
    T, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    plan = _attention_plan(md, T, block_size)
    B, _, Q, L = plan.mask.shape

    q_grid = q.new_zeros(B * Q + 1, H, D).index_copy_(0, plan.cell, q)
    q_grid = q_grid[:-1].view(B, Q, H, D).transpose(1, 2)  # [B, H, Q, D]
    out_grid = torch.zeros(B * Q + 1, H, D, dtype=torch.float32, device=q.device)
    out_view = out_grid[:-1].view(B, Q, H, D)
    per_row_bytes = L * KVH * D * 4 * 2 + Q * L * H * 4
    chunk = max(1, _GATHER_BUDGET_BYTES // per_row_bytes)
    for start in range(0, B, chunk):  # chunks of rows sized by shapes only, never by values
        end = min(B, start + chunk)
        n = end - start
        blocks = plan.tables[start:end]
        # [n, KVH, L, D]; fp32 because CPU SDPA is both faster and more exact in fp32.
        k = k_cache.index_select(0, blocks.reshape(-1)).view(n, L, KVH, D).transpose(1, 2).float()
        v = v_cache.index_select(0, blocks.reshape(-1)).view(n, L, KVH, D).transpose(1, 2).float()
        o = F.scaled_dot_product_attention(
            q_grid[start:end].float(), k, v, attn_mask=plan.mask[start:end], scale=scale,
            enable_gqa=KVH != H,
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
