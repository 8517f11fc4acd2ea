"""Torch reference implementations of every op the model executor calls.

These run on CPU (tests, CPU serving) and are the ground truth the Triton kernels in this
folder are tested against. Every op works on a flattened batch of tokens: all sequences' new
tokens side by side, described by :class:`AttentionMetadata` tensors. None of them loops in
Python over requests and none of them reads a tensor value on the host, so the same call
sequence can later be captured in a CUDA graph with the Triton versions swapped in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    token_seq_idx: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_context: int | None = None


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
    channels of each head. q: [T, H, D], k: [T, KVH, D]. Returns new tensors."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rotary_dim/2]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = rot.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    return rotate(q), rotate(k)


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


# Bytes of gathered K (per chunk of query tokens) above which the reference splits the
# tokens into chunks, so long prefills do not materialise [T, context, KVH, D] at once.
_GATHER_BUDGET_BYTES = 64 << 20


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
    prefix, and decode. Returns [T, H, D] in q's dtype.
    """
    T, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    n_blocks = md.block_tables.shape[1]
    if md.max_context is not None:
        n_blocks = max(1, min(n_blocks, -(-md.max_context // block_size)))
    L = n_blocks * block_size
    group = H // KVH
    tables = md.block_tables[:, :n_blocks].long()

    out = torch.empty_like(q)
    per_token_bytes = L * KVH * D * 4 * 2
    chunk = max(1, _GATHER_BUDGET_BYTES // max(per_token_bytes, 1))
    key_pos = torch.arange(L, device=q.device)
    for start in range(0, T, chunk):  # chunks of tokens, not requests
        end = min(T, start + chunk)
        rows = md.token_seq_idx[start:end]
        blocks = tables[rows]  # [t, n_blocks]
        k = k_cache[blocks].reshape(end - start, L, KVH, D).float()
        v = v_cache[blocks].reshape(end - start, L, KVH, D).float()
        qc = q[start:end].float().view(end - start, KVH, group, D)
        scores = torch.einsum("tkgd,tlkd->tkgl", qc, k) * scale
        limit = torch.minimum(md.positions[start:end], md.seq_lens[rows].long() - 1)
        mask = key_pos.unsqueeze(0) > limit.unsqueeze(1)  # [t, L]
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows fully masked = padding
        o = torch.einsum("tkgl,tlkd->tkgd", probs, v)
        out[start:end] = o.reshape(end - start, H, D).to(q.dtype)
    return out
