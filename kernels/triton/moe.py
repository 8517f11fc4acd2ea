"""Triton MoE: top-k routing and an expert-grouped (token-sorted) SiLU-gated MLP.

Twins of :func:`blink.kernels.reference.layers.moe_topk_route` and
:func:`blink.kernels.reference.layers.moe_experts`, same signatures.

The grouped matmul follows the fused-MoE layout (as in vLLM): the T*k (token, choice) pairs
are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so every
BLOCK_M-row tile belongs to one expert and a program multiplies it by that expert's weights
only. The padded length has the static bound ``T*k + E*(BLOCK_M-1)``, so the grids depend on
shapes alone (CUDA-graph safe, no host sync); tiles past the real end exit at once. The
alignment is a handful of torch ops (sort, scatter, cumsum, searchsorted) on the device.

Per pair, kernel 1 computes ``h = silu(x W_gate^T) * (x W_up^T)`` (fused, one read of x per
K step for both halves); kernel 2 computes ``weight * (h W_2^T)`` into a per-pair fp32
buffer, and the k choices of a token are summed in fp32 (deterministic: no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.kernels.triton.common import check_last_dim_contiguous, dot_in_fp32, next_pow2

# ----------------------------------------------------------------------------- routing


@triton.jit
def _route_kernel(
    logits_ptr, w_ptr, ids_ptr, n_experts, stride_row,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + row * stride_row + e, mask=e < n_experts, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < n_experts, p, -1.0)  # padding lanes are never picked
    lanes = tl.arange(0, K_P2)
    top_w = tl.zeros([K_P2], tl.float32)
    top_i = tl.zeros([K_P2], tl.int32)
    for i in tl.static_range(TOP_K):  # k rounds of argmax: k is small (8 for Qwen3-MoE)
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, E_P2), axis=0)  # lowest index among ties
        top_w = tl.where(lanes == i, best, top_w)
        top_i = tl.where(lanes == i, idx, top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)  # lanes >= TOP_K hold 0
    tl.store(w_ptr + row * TOP_K + lanes, top_w, mask=lanes < TOP_K)
    tl.store(ids_ptr + row * TOP_K + lanes, top_i.to(tl.int64), mask=lanes < TOP_K)


def moe_topk_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), the ``top_k`` largest (descending), optionally
    renormalised. Returns (weights [T, k] fp32, ids [T, k] int64)."""
    check_last_dim_contiguous("moe_topk_route router_logits", router_logits)
    n_tokens, n_experts = router_logits.shape
    if not 0 < top_k <= n_experts:
        raise ValueError(f"top_k={top_k} out of range for {n_experts} experts")
    weights = torch.empty((n_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((n_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if n_tokens:
        _route_kernel[(n_tokens,)](
            router_logits, weights, ids, n_experts, router_logits.stride(0),
            TOP_K=top_k, K_P2=next_pow2(top_k), E_P2=next_pow2(n_experts),
            RENORMALIZE=bool(renormalize), num_warps=1 if n_experts <= 128 else 4,
        )
    return weights, ids


# ----------------------------------------------------------------------------- experts


def _align_by_expert(
    ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sort the (token, choice) pairs by expert and pad each expert's run to ``block_m``.

    Returns (sorted_pairs int32 [P]: pair index per padded row, ``T*k`` = padding;
    tile_expert int32 [P // block_m]: expert of each tile, ``n_experts`` = past the end;
    P). P = T*k + E*(block_m - 1) rounded up to block_m, a bound fixed by shapes.
    """
    flat = ids.reshape(-1)
    n_pairs = flat.numel()
    device = flat.device
    max_rows = triton.cdiv(n_pairs + n_experts * (block_m - 1), block_m) * block_m
    expert_sorted, order = torch.sort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n_pairs, device=device) - start[expert_sorted]
    dest = (padded_end - padded)[expert_sorted] + rank
    sorted_pairs = torch.full((max_rows,), n_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(0, max_rows, block_m, device=device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return sorted_pairs, tile_expert, max_rows


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, pairs_ptr, tile_expert_ptr,
    n_pairs, n_experts, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_h,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """h[row, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for one tile."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= n_experts:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    row_ok = pair < n_pairs
    tok = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_base = w13_ptr + expert * stride_we
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        a = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (inter + n[None, :]).to(tl.int64) * stride_wn + kk[:, None],
                     mask=w_mask, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            acc_g += tl.dot(a, wg.to(tl.float32), input_precision="ieee")
            acc_u += tl.dot(a, wu.to(tl.float32), input_precision="ieee")
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    # Round where the reference does: gate/up projections, silu, product in the act dtype.
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :], (act * u).to(dt),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w2_ptr, y_ptr, pairs_ptr, tile_expert_ptr, weights_ptr,
    n_pairs, n_experts, hidden, inter,
    stride_h, stride_we, stride_wn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """y[pair, n] = weight[pair] * (h[row] . w2[e, n]) in fp32, one row per pair."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= n_experts:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    row_ok = pair < n_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w_base = w2_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < inter
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    # The reference rounds the expert output to the act dtype, then weights it in fp32.
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    wt = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + pair[:, None].to(tl.int64) * stride_y + n[None, :], y * wt[:, None],
             mask=row_ok[:, None] & n_ok[None, :])


def _moe_tiles(n_pairs: int, n_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from shapes: small M tiles when each expert sees few rows."""
    rows_per_expert = n_pairs / max(1, n_experts)
    block_m = 16 if rows_per_expert <= 16 else (32 if rows_per_expert <= 64 else 64)
    return block_m, 64, 64


def moe_experts_impl(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """:func:`moe_experts` with explicit tile sizes (tests force small ones)."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(f"moe_experts {name}", t)
    n_tokens, hidden = x.shape
    n_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    n_pairs = n_tokens * top_k
    if n_tokens == 0:
        return torch.empty_like(x)
    sorted_pairs, tile_expert, max_rows = _align_by_expert(ids, n_experts, block_m)
    n_tiles = max_rows // block_m
    h = torch.empty((max_rows, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((n_pairs, hidden), dtype=torch.float32, device=x.device)
    flat_w = weights.reshape(-1).float()
    dot_f32 = dot_in_fp32(x.dtype)
    _moe_gate_up_kernel[(n_tiles, triton.cdiv(inter, block_n))](
        x, w13, h, sorted_pairs, tile_expert,
        n_pairs, n_experts, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32,
        num_warps=4, num_stages=3,
    )
    _moe_down_kernel[(n_tiles, triton.cdiv(hidden, block_n))](
        h, w2, y, sorted_pairs, tile_expert, flat_w,
        n_pairs, n_experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32,
        num_warps=4, num_stages=3,
    )
    return y.view(n_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_k weights[t,k] * w2[e] @ (silu(w13[e][:I] @ x[t]) * (w13[e][I:] @ x[t]))`` with
    ``e = ids[t,k]``; x [T, H], w13 [E, 2I, H], w2 [E, H, I]. Returns [T, H] in x's dtype."""
    block_m, block_n, block_k = _moe_tiles(ids.numel(), w13.shape[0])
    return moe_experts_impl(x, w13, w2, weights, ids, block_m=block_m, block_n=block_n, block_k=block_k)
