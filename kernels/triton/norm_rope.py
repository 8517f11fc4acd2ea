"""Triton RMSNorm (plain and fused with the residual add) and neox-style RoPE.

Each function has the signature and semantics of its twin in :mod:`blink.kernels.reference.layers`,
including where the reference rounds to the activation dtype, so on a GPU bf16 results agree
with the reference up to the order of the fp32 reductions. (The CPU interpreter truncates
fp32 -> bf16 instead of rounding to nearest, so there they differ by up to one bf16 ulp.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.kernels.triton.common import check_last_dim_contiguous, next_pow2

# ----------------------------------------------------------------------------- rmsnorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, n_cols, stride_x, stride_res, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """BLOCK_R rows per program (several rows when the rows are short, e.g. per-head q/k
    norms), the whole row in one tile so the mean needs no second pass over memory."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        # The reference adds in the activation dtype: round the sum before normalising it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * n_cols + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / n_cols
    rstd = tl.rsqrt(var + eps)
    # Reference: weight * (x * rstd).to(x.dtype) -- round the normalised value first.
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out = normed * w[None, :]
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # a view for contiguous rows; strided rows stay strided
    check_last_dim_contiguous("rms_norm x", x2)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res_out = None
    res2 = x2
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        check_last_dim_contiguous("fused_add_rms_norm residual", res2)
        res_out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        if res_out.dtype != x.dtype:
            raise ValueError("fused_add_rms_norm: x and residual must share a dtype")
    n_rows = x2.shape[0]
    block_h = next_pow2(hidden)
    # Short rows (per-head norms): pack rows so that a program still moves ~4K elements.
    block_r = max(1, min(next_pow2(n_rows), 4096 // block_h))
    num_warps = 4 if block_h * block_r <= 4096 else (8 if block_h * block_r <= 8192 else 16)
    if n_rows:
        _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
            x2, res2, weight, out, res_out if res_out is not None else out,
            n_rows, hidden, x2.stride(0), res2.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_H=block_h,
            num_warps=num_warps,
        )
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if res_out is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; see :func:`blink.kernels.reference.layers.rms_norm`."""
    return _norm_launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual`` in one pass.

    Returns new tensors (like the reference): callers may still hold the old residual.
    """
    out, res = _norm_launch(x, residual, weight, eps)
    assert res is not None
    return out, res


# ----------------------------------------------------------------------------- rope


@triton.jit
def _rope_one(
    src_ptr, dst_ptr, pid, stride_t, stride_h, n_heads, cos, sin,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    REST_P2: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate the first 2*HALF channels of every head of token ``pid``; copy the rest."""
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HALF_P2)
    mask = (heads[:, None] < n_heads) & (offs[None, :] < HALF)
    src = src_ptr + pid * stride_t + heads[:, None] * stride_h
    dst = dst_ptr + pid * (n_heads * HEAD_DIM) + heads[:, None] * HEAD_DIM
    x1 = tl.load(src + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst + offs[None, :], o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs[None, :], o2.to(dst_ptr.dtype.element_ty), mask=mask)
    if REST_P2 > 0:  # partial rotary: pass the remaining channels through
        rest = 2 * HALF + tl.arange(0, REST_P2)
        rmask = (heads[:, None] < n_heads) & (rest[None, :] < HEAD_DIM)
        v = tl.load(src + rest[None, :], mask=rmask, other=0.0)
        tl.store(dst + rest[None, :], v, mask=rmask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache, n_q_heads, n_k_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    REST_P2: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    """One program per token: q and k share the token's cos/sin row."""
    pid = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + pid)
    offs = tl.arange(0, HALF_P2)
    cos = tl.load(cache_ptr + pos * stride_cache + offs, mask=offs < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs, mask=offs < HALF, other=0.0)
    _rope_one(q_ptr, q_out_ptr, pid, stride_qt, stride_qh, n_q_heads, cos, sin,
              HEAD_DIM, HALF, HALF_P2, REST_P2, BLOCK_HQ)
    _rope_one(k_ptr, k_out_ptr, pid, stride_kt, stride_kh, n_k_heads, cos, sin,
              HEAD_DIM, HALF, HALF_P2, REST_P2, BLOCK_HK)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox (rotate-half) RoPE on the first ``rotary_dim`` channels of each head.

    q: [T, H, D], k: [T, KVH, D] (strided views of a fused qkv output are fine);
    ``cos_sin_cache``: fp32 [max_positions, rotary_dim] from
    :func:`blink.kernels.reference.layers.rope_cos_sin_cache` (Llama-3 scaling lives in the table).
    Returns new contiguous tensors, like the reference.
    """
    check_last_dim_contiguous("apply_rope q", q)
    check_last_dim_contiguous("apply_rope k", k)
    n_tokens, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rest = head_dim - rotary_dim
    if n_tokens:
        _rope_kernel[(n_tokens,)](
            q, k, q_out, k_out, positions, cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
            n_q_heads, n_k_heads,
            HEAD_DIM=head_dim, HALF=rotary_dim // 2, HALF_P2=next_pow2(rotary_dim // 2),
            REST_P2=next_pow2(rest) if rest else 0,
            BLOCK_HQ=next_pow2(n_q_heads), BLOCK_HK=next_pow2(n_k_heads),
            num_warps=4,
        )
    return q_out, k_out
