"""Triton paged attention and KV-cache write against the torch reference.

Runs on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``, which must be set
before the kernel modules are imported: Triton reads it when a kernel is decorated). Shapes
are small because the interpreter executes every program in Python. With
``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the kernels on the GPU.

Tolerances: fp32 atol/rtol 1e-4 (same math, different summation order); bf16 atol/rtol
2e-2 (the interpreter truncates fp32 -> bf16 instead of rounding, ~1 ulp = 2^-8 relative,
plus reordered fp32 sums).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest
import torch

from blink.kernels.attention_metadata import AttentionMetadata
from blink.kernels.reference import layers as ref

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from attention_cases import MIXED, make_batch  # noqa: E402

triton_attention = pytest.importorskip("blink.kernels.triton.attention")
from blink.kernels.triton.common import interpreting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
if DEVICE == "cpu" and not interpreting():
    pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def to_device(*ts):
    out = []
    for t in ts:
        if isinstance(t, AttentionMetadata):
            out.append(AttentionMetadata(**{k: (v.to(DEVICE) if torch.is_tensor(v) else v)
                                                 for k, v in vars(t).items()}))
        else:
            out.append(t.to(DEVICE))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference_on_strided_views(dtype):
    k_cache, v_cache, _, _, md, _ = make_batch(MIXED, n_kv_heads=2, head_dim=16, block_size=4,
                                               dtype=dtype, pad_tokens=2)
    T = md.slot_mapping.shape[0]
    # K/V as column slices of a fused qkv projection: row stride != KVH * D.
    qkv = torch.randn(T, (4 + 2 + 2) * 16).to(dtype)
    k = qkv[:, 64:96].view(T, 2, 16)
    v = qkv[:, 96:128].view(T, 2, 16)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(k, v, kc_ref, vc_ref, md.slot_mapping)
    k_d, v_d, kc, vc, slots = to_device(k, v, k_cache.clone(), v_cache.clone(), md.slot_mapping)
    triton_attention.write_kv_cache(k_d, v_d, kc, vc, slots)
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,block_size,dtype",
    [
        (4, 4, 16, 4, torch.float32),     # MHA, tiny blocks
        (4, 2, 32, 16, torch.float32),    # GQA 2
        (8, 2, 64, 16, torch.bfloat16),   # GQA 4, Llama-like head
        (6, 2, 24, 8, torch.float32),     # group 3 and head dim 24: padded tiles
        (4, 1, 128, 16, torch.bfloat16),  # MQA, head 128
    ],
)
def test_mixed_step_matches_reference(n_heads, n_kv_heads, head_dim, block_size, dtype):
    """Decode + prefill + extend + unused row + padding in one launch, cache written by the
    Triton write kernel first (the model's order)."""
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        MIXED, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
        pad_tokens=3,
    )
    T = md.slot_mapping.shape[0]
    q = torch.randn(T, n_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = head_dim ** -0.5
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(k_new, v_new, kc_ref, vc_ref, md.slot_mapping)
    expected = ref.paged_attention(q, kc_ref, vc_ref, md, scale)

    q_d, k_d, v_d, kc, vc, md_d = to_device(q, k_new, v_new, k_cache.clone(), v_cache.clone(), md)
    triton_attention.write_kv_cache(k_d, v_d, kc, vc, md_d.slot_mapping)
    out = triton_attention.paged_attention(q_d, kc, vc, md_d, scale).cpu()

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out[:n_live].float(), expected[:n_live].float(), **TOL[dtype])
    # Padding tokens (outside every row's query range) come back as exact zeros.
    assert torch.count_nonzero(out[n_live:]) == 0


@pytest.mark.parametrize("num_splits", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_split_k(num_splits, dtype):
    """Decode over ~300 positions crossing 75 four-slot blocks; split-K partials (including
    splits that get no keys for the shorter rows) merge to the same result."""
    rows = [(299, 1), (130, 1), (0, 0), (3, 1)]
    k_cache, v_cache, _, _, md, n_live = make_batch(
        rows, n_kv_heads=2, head_dim=32, block_size=4, dtype=dtype, pad_tokens=1
    )
    T = md.slot_mapping.shape[0]
    q = torch.randn(T, 4, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = ref.paged_attention(q, k_cache, v_cache, md, 0.2)
    q_d, kc, vc, md_d = to_device(q, k_cache, v_cache, md)
    config = triton_attention.AttnConfig(block_q=8, block_n=16, num_splits=num_splits)
    out = triton_attention.paged_attention_impl(q_d, kc, vc, md_d, 0.2, config).cpu()
    torch.testing.assert_close(out[:n_live].float(), expected[:n_live].float(), **TOL[dtype])
    assert torch.count_nonzero(out[n_live:]) == 0


@pytest.mark.parametrize("block_q,block_n", [(1, 16), (4, 8), (16, 32)])
def test_tile_shapes_do_not_change_the_result(block_q, block_n):
    """Query tiles that straddle nothing / several tokens, key tiles smaller and larger than
    the cache block: a prefill longer than one query tile and an extend over a prefix."""
    rows = [(0, 19), (11, 7), (6, 1)]
    k_cache, v_cache, _, _, md, n_live = make_batch(
        rows, n_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32
    )
    q = torch.randn(n_live, 2, 16, generator=torch.Generator().manual_seed(3))
    expected = ref.paged_attention(q, k_cache, v_cache, md, 0.25)
    q_d, kc, vc, md_d = to_device(q, k_cache, v_cache, md)
    config = triton_attention.AttnConfig(block_q=block_q, block_n=block_n, num_splits=2)
    out = triton_attention.paged_attention_impl(q_d, kc, vc, md_d, 0.25, config).cpu()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_choose_config_depends_only_on_shapes():
    """Decode-like steps get 16-row tiles and, for long contexts with few sequences,
    several splits; big prefill steps get one split. Same shapes -> same launch."""
    cpu = torch.device("cpu")
    choose = triton_attention.choose_config
    cfg = choose(4, 4, 8, 4, 8192, cpu)
    assert cfg.block_q * 4 == 16 and cfg.num_splits > 1
    assert choose(4, 4, 8, 4, 8192, cpu) == cfg
    assert choose(4, 4, 8, 4, 512, cpu).num_splits == 1  # short context: no reduction
    assert choose(4, 256, 8, 4, 8192, cpu, max_query_len=1).block_q * 4 == 16
    big = choose(8192, 64, 8, 4, 8192, cpu)
    assert big.block_q * 4 == 128 and big.num_splits == 1
