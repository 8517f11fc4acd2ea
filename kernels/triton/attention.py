"""Triton paged-KV attention: the cache write and one attention kernel for every step shape.

``paged_attention`` serves decode, prefill, chunked prefill and extend-over-a-cached-prefix
with the same kernel, so a mixed step needs no host-side decision and no host sync:

* the grid is sized from tensor *shapes* only: ``T // BLOCK_Q + B`` query tiles (an upper
  bound on the tiles the ragged sequences need), times KV heads, times context splits;
* each program finds its sequence by a binary search over ``query_start_loc`` on the device
  (tile start of row s = ``query_start_loc[s] // BLOCK_Q + s``, monotone in s), and spare
  programs exit at once;
* a tile holds BLOCK_Q consecutive query tokens of one sequence times the GROUP query heads
  that share a KV head (GQA), so decode (1 token, GROUP rows) and prefill (BLOCK_Q tokens)
  are the same code, and each K/V tile read from the cache is used by all of them;
* long contexts are split over ``NUM_SPLITS`` programs (split-K / flash-decoding); a
  reduction kernel merges the partial softmaxes. The split count is a function of shapes.

Token t attends to context positions ``j <= positions[t]`` and ``j < seq_lens[row]``, exactly
as the reference. Tokens that lie in no row's ``query_start_loc`` range (bucket padding) get
zeros, as do tokens of rows whose ``seq_lens`` is 0.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from blink.kernels.attention_metadata import AttentionMetadata
from blink.kernels.triton.common import check_last_dim_contiguous, dot_in_fp32, next_pow2

_LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------- cache write


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    n_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, H_P2: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    heads = tl.arange(0, H_P2)
    d = tl.arange(0, D_P2)
    # A negative slot means "do not store" (vLLM's convention); ours pad to a scratch block.
    # (The scalar is broadcast to a vector first: the interpreter rejects scalar & tensor masks.)
    slot_ok = (tl.zeros([H_P2], tl.int64) + slot) >= 0
    mask = (heads[:, None] < n_heads) & (d[None, :] < HEAD_DIM) & slot_ok[:, None]
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + d[None, :]
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V ([T, KVH, D], strided views allowed) into the paged
    caches ([num_blocks, block_size, KVH, D]) at ``slot_mapping``."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(f"write_kv_cache {name}", t)
    n_tokens, n_heads, head_dim = k.shape
    if n_tokens == 0:
        return
    _write_kv_kernel[(n_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_heads,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, D_P2=next_pow2(head_dim),
        H_P2=next_pow2(n_heads), num_warps=4,
    )


# ----------------------------------------------------------------------------- attention


@triton.jit
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr,
    qsl_ptr, seq_lens_ptr, pos_ptr, bt_ptr,
    num_seqs, scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_os, stride_ot, stride_oh,
    stride_ms, stride_mt,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Which sequence owns this tile: the last row s with tile_start(s) <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    if seq < 0:  # only if query_start_loc[0] > 0
        return
    q_begin = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    q0 = q_begin + (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q0 >= q_end:  # spare program: the grid is an upper bound
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // GROUP_P2
    g = rows % GROUP_P2
    tok_ok = tok < q_end
    row_ok = tok_ok & (g < GROUP)
    head = kvh * GROUP + g
    pos = tl.load(pos_ptr + tok, mask=tok_ok, other=-1)
    limit = tl.minimum(pos, seq_len - 1)  # last key each row may see; -1 = none
    kv_len = tl.max(tl.where(row_ok, limit, -1), axis=0) + 1

    # This program's share of the key blocks.
    n_kblocks = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_kblocks, NUM_SPLITS)
    kb_lo = split * per_split
    kb_hi = tl.minimum(kb_lo + per_split, n_kblocks)

    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_DIM
    tok64 = tok.to(tl.int64)
    q = tl.load(
        q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for kb in range(kb_lo, kb_hi):
        j = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < kv_len
        # Any BLOCK_N / cache block size ratio: look up the block of every key.
        blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        slot_off = j % BLOCK_SIZE
        k_off = blk * stride_kb + slot_off * stride_ks + kvh * stride_kh
        v_off = blk * stride_vb + slot_off * stride_vs + kvh * stride_vh
        kv_mask = j_ok[None, :] & d_ok[:, None]
        k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=kv_mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        s = tl.where(j[None, :] <= limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf; subtract 0 so no inf - inf = nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=tl.trans(kv_mask), other=0.0)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + split * stride_os + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        ml_off = split * stride_ms + tok64 * stride_mt + head
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)


@triton.jit
def _attn_reduce_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, S_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
):
    """Merge the splits' normalised partial outputs by their softmax mass (log2 domain)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, S_P2)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, D_P2)
    m = tl.load(m_ptr + sp * stride_ms + t * stride_mt + h, mask=sp_ok, other=float("-inf"))
    l = tl.load(l_ptr + sp * stride_ms + t * stride_mt + h, mask=sp_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(l > 0.0, tl.exp2(m - m_max) * l, 0.0)
    part = tl.load(
        part_ptr + sp[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
        mask=sp_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0,
    )
    part = tl.where(w[:, None] > 0.0, part, 0.0)  # never-written splits may hold garbage
    total = tl.sum(w, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of :func:`paged_attention_impl` (all derived from shapes)."""

    block_q: int  # query tokens per tile; rows per tile = block_q * next_pow2(group)
    block_n: int  # keys per inner step
    num_splits: int  # context splits (split-K); 1 = no reduction kernel
    num_warps: int = 4
    num_stages: int = 2


def choose_config(
    n_tokens: int,
    n_rows: int,
    n_kv_heads: int,
    group_p2: int,
    max_context: int,
    device: torch.device,
    max_query_len: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> AttnConfig:
    """Tile sizes and split count from shapes alone, so every call with the same shapes
    launches the same grid (CUDA-graph safe, no host sync).

    Decode-like steps (about one token per row) use 16-row tiles (the smallest ``tl.dot``
    takes); prefill-like steps use 128-row tiles with 8 warps (the usual FlashAttention-2
    shape for head dim 128), or 32 rows for fp32, which has no tensor-core path. Whenever
    the busy (tile, KV head) programs cannot fill the GPU twice over and the context is
    long, the context is split, keeping >= 512 keys per split. These defaults compile
    without register spills for sm_90 (see :mod:`blink.kernels.triton.compile_check`); they
    are not tuned on a GPU yet (``benchmarks/gpu_kernels.py --sweep`` times the alternatives).
    """
    if max_query_len is not None:
        decode_like = max_query_len <= 4
    else:
        decode_like = n_tokens <= 2 * n_rows
    if decode_like:
        block_q, block_n, warps = max(1, 16 // group_p2), 64, 4
    elif dtype == torch.float32:
        block_q, block_n, warps = max(1, 32 // group_p2), 32, 4
    else:
        block_q, block_n, warps = max(1, 128 // group_p2), 64, 8
    splits = 1
    if max_context > 1024:
        n_sm = _sm_count(device.index or 0) if device.type == "cuda" else 132
        # Upper bound of tiles with work: one per row, plus one per full query tile.
        busy_tiles = min(n_tokens, n_rows) + (0 if decode_like else n_tokens // block_q)
        busy = max(1, busy_tiles * n_kv_heads)
        splits = max(1, min(16, triton.cdiv(max_context, 512), triton.cdiv(2 * n_sm, busy)))
    return AttnConfig(block_q, block_n, splits, warps)


def paged_attention_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    config: AttnConfig,
) -> torch.Tensor:
    """:func:`paged_attention` with an explicit launch configuration (tests force these)."""
    check_last_dim_contiguous("paged_attention q", q)
    n_tokens, n_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads not a multiple of {n_kv_heads} KV heads")
    group = n_heads // n_kv_heads
    group_p2 = next_pow2(group)
    n_rows = md.seq_lens.shape[0]
    d_p2 = next_pow2(head_dim)
    block_q, block_n, num_splits = config.block_q, config.block_n, config.num_splits
    if n_tokens == 0:
        return torch.empty_like(q)

    out = torch.zeros_like(q) if num_splits == 1 else torch.empty_like(q)
    if num_splits == 1:
        part, m, l = out, out, out  # m/l are unused when there is one split
        part_strides = (0, out.stride(0), out.stride(1))
        ml_strides = (0, 0)
    else:
        part = torch.empty((num_splits, n_tokens, n_heads, head_dim), dtype=torch.float32, device=q.device)
        # -inf/0 mark (split, token) pairs no program wrote: padding tokens reduce to 0.
        m = torch.full((num_splits, n_tokens, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros((num_splits, n_tokens, n_heads), dtype=torch.float32, device=q.device)
        part_strides = part.stride()[:3]
        ml_strides = m.stride()[:2]

    grid = (n_tokens // block_q + n_rows, n_kv_heads, num_splits)
    _attn_kernel[grid](
        q, k_cache, v_cache, part, m, l,
        md.query_start_loc, md.seq_lens, md.positions, md.block_tables,
        n_rows, float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        md.block_tables.stride(0),
        *part_strides, *ml_strides,
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, D_P2=d_p2,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, DOT_F32=dot_in_fp32(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _attn_reduce_kernel[(n_tokens, n_heads)](
            part, m, l, out,
            *part_strides, *ml_strides, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, S_P2=next_pow2(num_splits), HEAD_DIM=head_dim, D_P2=d_p2,
            num_warps=4,
        )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's paged context.

    Same contract as :func:`blink.kernels.reference.layers.paged_attention`: q [T, H, D], caches
    [num_blocks, block_size, KVH, D] already hold this step's K/V. Serves prefill, chunked
    prefill over a cached prefix and decode in one launch; returns [T, H, D] in q's dtype.
    """
    block_size = k_cache.shape[1]
    max_context = md.block_tables.shape[1] * block_size
    if md.max_context is not None:
        max_context = min(max_context, md.max_context)
    config = choose_config(
        q.shape[0], md.seq_lens.shape[0], k_cache.shape[2], next_pow2(q.shape[1] // k_cache.shape[2]),
        max_context, q.device, md.max_query_len, q.dtype,
    )
    return paged_attention_impl(q, k_cache, v_cache, md, scale, config)
