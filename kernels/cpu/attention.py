"""Paged attention for the eager CPU forward (the CPU op table's entry).

Two implementations with the reference's contract (:func:`blink.kernels.reference.layers.paged_attention`):

- **the C kernel** (``attention.c``, built once per machine at first use by
  :func:`blink.shared.native_build.build_library`): one online-softmax pass per (token, KV
  head) over the sequence's blocks, reading K/V where they lie in the cache, in its dtype,
  accumulating in fp32. Prompt rows (:func:`tile_min_tokens` new tokens or more) take tiles
  of 16 queries instead: a flash-attention pass over the row's context laid out once per KV
  head, its products on AMX on a CPU with it (bf16 queries and cache: 2.5-3x SDPA on
  SmolLM2's prefills), else in fp32 on AVX-512 (1.8-3.8x the per-token pass and 2.3-10x
  SDPA at 16-2048 new tokens on Zen 4). ``$BLINK_CPU_AMX=0``
  (:func:`blink.kernels.cpu.amx_allowed`) turns AMX off, as on a CPU without it. It serves
  the steps where a cost estimate says it is faster (:func:`prefer_native`): decode and mixed
  steps, where the torch path's gathers and per-op costs were ~25% of a 16-row SmolLM2 step,
  and with tiles prefills too.
- **the torch path** (:func:`sdpa_paged_attention`): the reference's tiling, but the gathered
  K/V stay in the cache's dtype and go straight to SDPA, whose CPU flash kernel accumulates
  in fp32 for bf16 anyway; the mask is made once per step in that dtype. Long prefills run
  here where the kernel has no tiles (a build without AVX-512: SDPA's blocked GEMMs beat a
  per-token loop there), as does everything when the C kernel cannot be built (no compiler:
  said once in the log) or ``$BLINK_CPU_ATTENTION`` is ``torch``.

Both are tested against the reference in ``tests/test_cpu_attention.py``.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from blink.kernels.cpu import abi, amx_allowed, pool as cpu_pool
from blink.kernels.cpu.threads import kernel_threads
from blink.shared.native_build import NativeLibrary

# the gather budget (bytes of K/V plus mask per chunk of query tiles) is the reference's
from blink.kernels.attention_metadata import AttentionMetadata
from blink.kernels.reference.layers import _GATHER_BUDGET_BYTES, _additive_mask, _attention_plan


log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("attention.c")
#: "torch": every step on the torch path; "c" or unset: the C kernel where the estimate
#: (:func:`prefer_native`) says it wins
IMPL_ENV = "BLINK_CPU_ATTENTION"
# Cost model of the two paths per layer, ns per unit, fitted on SmolLM2's shapes (9 heads,
# 3 KV heads, D 64, bf16; docs/performance.md#cpu-attention): the C kernel costs per
# (token, visible key); SDPA per (tile, key) for the gather
# plus per (tile, query slot, key) for the blocked product, plus a fixed cost per call. Only
# their ratio matters.
_NATIVE_NS_PER_VISIT = 70.0
# The per-token pass in a build without AVX-512 (8-float vectors, attention.c's W), in the same
# units: 1.36x the AVX-512 build's time a key at 16 rows of 2048 cached keys, two threads, AVX2
# code on the Xeon (BLINK_CPU_ISA=avx2; 1.5 against 1.1 ms a layer; docs/performance.md#avx2-cpus)
_AVX2_NATIVE_NS_PER_VISIT = 100.0
# the C kernel's AMX tiles (prompt rows): 7-11 ns per (token, visible key) at 128-2048 tokens
_TILE_NS_PER_VISIT = 10.0
# its AVX-512 tiles (a CPU without AMX, or not bf16): 12-17 ns on SmolLM2's prompts of
# 128-2048 tokens on two Zen 4 cores, where the per-token pass took 32-47 and SDPA 35-160: on
# Zen 4 both ran slower than the figures here (fitted on a Xeon) say, SDPA the most
# (docs/performance.md#cpu-attention)
_AVX512_TILE_NS_PER_VISIT = 16.0
_SDPA_NS_PER_TILE_KEY = 190.0
_SDPA_NS_PER_CELL = 11.0
_SDPA_NS_PER_CALL = 50_000.0
# the C kernel's stack limits (attention.c); larger shapes take the torch path
_MAX_GROUP, _MAX_HEAD_DIM, _MAX_BLOCK = 16, 256, 128
_DTYPES = (torch.float32, torch.bfloat16)
# Reassociating the sums lets the compiler vectorise the softmax's reductions (1.9x on the
# kernel); the kernel has no NaN, signed zero or errno to keep. Not -ffast-math: the
# masked keys' -inf must stay -inf.
_MATH_FLAGS = ("-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")


def _declare(library: ctypes.CDLL) -> None:
    abi.declare(library, abi.ATTENTION)
    cpu_pool.attach(library)  # calls that split run on the process's one pool
    # Without AVX-512 the per-token pass is slower a key and there are no tiles for prompt rows
    # (docs/performance.md#avx2-cpus): the estimate prices it so.
    library.ns_per_visit = _NATIVE_NS_PER_VISIT if library.blink_has_avx512() else _AVX2_NATIVE_NS_PER_VISIT
    # $BLINK_CPU_AMX=0: the path a CPU without AMX takes (AVX-512's tiles, scores on AVX-512)
    library.blink_paged_attention_allow_amx(int(amx_allowed()))
    library.tile_min_tokens = int(library.blink_paged_attention_tile_min_tokens())  # read per call
    library.tiles_on_amx = bool(library.blink_paged_attention_tiles_on_amx())


LIBRARY = NativeLibrary(
    _SOURCE, what="CPU paged attention: the C kernel", logger=log,
    fallback="the torch path (SDPA over gathered blocks) serves every step",
    flags=("-O3", "-march=native", *_MATH_FLAGS), fallback_flags=("-O3", *_MATH_FLAGS),
    headers=(_SOURCE.with_name("kernels.h"),), env=IMPL_ENV, setup=_declare,
    kernels=("blink_paged_attention",), queries=("blink_has_avx512", "blink_paged_attention_tile_min_tokens",
                                                     "blink_paged_attention_tiles_on_amx"),
    requires="GCC >= 12 or clang (__builtin_shufflevector)")


def native_kernel() -> "ctypes._CFuncPtr | None":
    """The C kernel, built or loaded once per process; None where it cannot be built (said
    once in the log) or ``$BLINK_CPU_ATTENTION=torch``."""
    library = LIBRARY.get()
    return None if library is None else library.blink_paged_attention


def tile_min_tokens() -> int:
    """The new-token count from which a row takes the C kernel's tiles (AMX's for bf16 queries
    and cache with a head size a multiple of 32 on a CPU with AMX, else AVX-512's); 0 where the
    kernel has none (a build without AVX-512, or not built)."""
    library = LIBRARY.get()
    return 0 if library is None else library.tile_min_tokens


def prompt_tiles(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> tuple[int, float]:
    """For a forward in ``dtype`` over a cache in ``cache_dtype``: the new-token count from
    which a row takes the C kernel's tiles (0: none) and their cost per (token, visible key)
    for :func:`prefer_native`: AMX's where they run (bf16, whole 32-channel parts, AMX
    granted and allowed), else AVX-512's."""
    library = LIBRARY.get()
    if library is None or not library.tile_min_tokens:
        return 0, 0.0
    amx = library.tiles_on_amx and dtype == cache_dtype == torch.bfloat16 and head_dim % 32 == 0
    return library.tile_min_tokens, _TILE_NS_PER_VISIT if amx else _AVX512_TILE_NS_PER_VISIT


def describe() -> str:
    """The attention kernel this process runs, in a phrase for the engine's start log."""
    library = LIBRARY.get()
    if library is None:
        return "the torch path (SDPA over gathered blocks)" + (
            f" (${IMPL_ENV}=torch)" if LIBRARY.switched_off() else "")
    if not library.blink_has_avx512():
        return "the C kernel (without AVX-512: no tiles) where its cost estimate wins, else SDPA"
    rows = f"prompt rows of {library.tile_min_tokens}+ new tokens"
    if library.tiles_on_amx:
        tiles = f"AMX tiles for bf16 {rows}, AVX-512 tiles for the others"
    else:
        tiles = f"AVX-512 tiles for {rows}; no AMX" + ("; $BLINK_CPU_AMX=0" if not amx_allowed() else "")
    return f"the C kernel ({tiles}) where its cost estimate wins, else SDPA"


def _native_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  md: AttentionMetadata) -> bool:
    """Whether the C kernel takes this call: its dtypes, layouts and stack limits, and the
    cost estimate."""
    T, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    if not (q.is_cpu and q.dtype in _DTYPES and k_cache.dtype in _DTYPES
            and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous() and H % KVH == 0 and H // KVH <= _MAX_GROUP
            and D % 16 == 0 and D <= _MAX_HEAD_DIM and block_size <= _MAX_BLOCK):
        return False
    tile_min, tile_ns = prompt_tiles(q.dtype, k_cache.dtype, D)
    return prefer_native(md, T, block_size, tile_min, tile_ns)


def prefer_native(md: AttentionMetadata, T: int, block_size: int, tile_min: int = 0,
                  tile_ns_per_visit: float = _TILE_NS_PER_VISIT) -> bool:
    """Whether the C kernel's estimated cost is below the torch path's for this step (once per
    step, memoised in ``md.step_cache``). A host-side decision: this is the CPU loop, whose
    metadata lives in host memory; the GPU tiers run their own kernels.

    The C kernel's per-token pass goes over each token's visible keys, so it wins when most
    tokens are decodes; SDPA's blocked products win for prefills, whose tokens share one
    context, unless the kernel has tiles for them: rows of ``tile_min`` new tokens or more
    (0: none; :func:`prompt_tiles`) cost ``tile_ns_per_visit`` per key, a fraction. The
    estimate replays the torch path's tiling (:func:`_attention_plan`'s ``Qt``). The constants
    hold for the two paths on as many threads; SDPA runs on torch's intra-op threads and the
    C kernel on the kernel threads, so SDPA's estimate is scaled by their ratio (``blink
    serve`` on two cores: one compute thread, two kernel threads, so SDPA costs twice its
    figure: a 268-token chunk over 1,632 cached tokens took 14.9 ms a layer there against the
    C kernel's 3.8, where the unscaled estimate chose SDPA; docs/performance.md#chunk-over-cache)."""
    cache = md.step_cache
    if cache is not None and "cpu_attention_prefer_native" in cache:
        return cache["cpu_attention_prefer_native"]
    starts = md.query_start_loc.numpy().astype(np.int64)
    n_new = starts[1:] - starts[:-1]
    context = md.seq_lens.numpy().astype(np.int64)
    live = (context > 0) & (n_new > 0)
    n_new, context = n_new[live], context[live]
    row_visits = n_new * (context - n_new) + n_new * (n_new + 1) // 2
    tiled = n_new >= tile_min if tile_min > 0 else np.zeros(len(n_new), dtype=bool)
    B = md.block_tables.shape[0]
    longest = int(context.max()) if len(context) else 0
    Q = T if md.max_query_len is None else max(1, min(T, md.max_query_len))
    Qt = max(1, min(Q, -(-T // B)))
    tiles = float((-(-n_new // Qt)).sum())
    L = -(-longest // block_size) * block_size
    library = LIBRARY.get()
    per_visit = library.ns_per_visit if library is not None else _NATIVE_NS_PER_VISIT
    native = (float(row_visits[~tiled].sum()) * per_visit
              + float(row_visits[tiled].sum()) * tile_ns_per_visit)
    sdpa = tiles * L * (_SDPA_NS_PER_TILE_KEY + Qt * _SDPA_NS_PER_CELL) + _SDPA_NS_PER_CALL
    sdpa *= kernel_threads() / max(1, torch.get_num_threads())
    choice = native <= sdpa
    if cache is not None:
        cache["cpu_attention_prefer_native"] = choice
    return choice


def _native_metadata(md: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The metadata in the dtypes and layout the C kernel reads, once per step."""
    cache = md.step_cache
    if cache is not None and "cpu_attention_native" in cache:
        return cache["cpu_attention_native"]
    fields = (md.token_seq_idx.to(torch.int64).contiguous(), md.positions.to(torch.int64).contiguous(),
              md.query_start_loc.to(torch.int32).contiguous(), md.seq_lens.to(torch.int32).contiguous(),
              md.block_tables.to(torch.int32).contiguous())
    if cache is not None:
        cache["cpu_attention_native"] = fields
    return fields


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`blink.kernels.reference.layers.paged_attention` (q [T, H, D],
    caches [blocks, block_size, KVH, D] already holding this step's K/V; returns [T, H, D]
    in q's dtype, zeros for tokens of unused rows): the C kernel where it applies, else
    :func:`sdpa_paged_attention`."""
    kernel = native_kernel()
    if kernel is None or not _native_takes(q, k_cache, v_cache, md):
        return sdpa_paged_attention(q, k_cache, v_cache, md, scale)
    T, H, D = q.shape
    num_blocks, block_size, KVH = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    token_row, positions, query_start, seq_lens, tables = _native_metadata(md)
    if q.stride(2) != 1:  # rows may be strided (q is a view of the fused QKV), a head may not
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    status = kernel(q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    int(q.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16),
                    T, H, KVH, D, block_size, num_blocks, seq_lens.shape[0],
                    token_row.data_ptr(), positions.data_ptr(), query_start.data_ptr(),
                    seq_lens.data_ptr(), tables.data_ptr(), tables.stride(0), tables.shape[1],
                    scale, kernel_threads())
    if status == -4:
        raise MemoryError("paged attention: no memory for the C kernel's scratch (the prompt rows' "
                          "laid-out K/V, or the decode rows' chunk states)")
    if status != 0:
        raise ValueError("paged attention: a block table names a block outside the KV cache"
                         if status == -1 else "paged attention: shapes the C kernel does not take")
    return out


def sdpa_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The torch path: the reference's tiles and SDPA, in the cache's dtype (same contract
    as :func:`paged_attention`)."""
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
