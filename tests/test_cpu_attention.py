"""The eager CPU paged attention (blink.kernels.cpu_attention, the CPU table's entry) against
the reference: decode, prefill, extend over a cached prefix, an unused row and padding in
one step; GQA/MQA/MHA; fp32 (the same arithmetic: tight) and bf16; chunked tiles; the
per-step mask memo."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from attention_cases import CPU_CASES, make_batch  # noqa: E402

from blink.kernels import cpu_attention, ops_for  # noqa: E402
from blink.kernels import reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

CASES = [
    *CPU_CASES,
    ([(0, 33), (12, 20)], 4, 1, 32, 8, torch.bfloat16),  # prefill + extend, bf16
]


def test_the_cpu_table_uses_it():
    assert ops_for("cpu").paged_attention is cpu_attention.paged_attention


@pytest.mark.parametrize("step_cache", [False, True])
@pytest.mark.parametrize("rows,n_heads,n_kv_heads,head_dim,block_size,dtype", CASES)
def test_matches_reference(rows, n_heads, n_kv_heads, head_dim, block_size, dtype, step_cache):
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        rows, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
        pad_tokens=3,
    )
    if step_cache:  # as in the model: one dict per forward, shared by the layers
        md = dataclasses.replace(md, step_cache={})
    T = md.slot_mapping.shape[0]
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    scale = head_dim**-0.5
    gen = torch.Generator().manual_seed(1)
    for layer in range(2):  # the second call reuses the memoised plan and mask
        q = torch.randn(T, n_heads, head_dim, generator=gen).to(dtype)
        expected = ref.paged_attention(q, k_cache, v_cache, md, scale)
        out = cpu_attention.paged_attention(q, k_cache, v_cache, md, scale)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out[:n_live].float(), expected[:n_live].float(), **TOL[dtype])
        assert torch.count_nonzero(out[n_live:]) == 0  # padding tokens: exact zeros
    if step_cache:
        assert md.step_cache["cpu_attention_mask"].dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_tiles_and_masks_made_per_chunk(dtype, monkeypatch):
    """Many tiles in small chunks, and a mask too big to build once per step, give the
    same result as one pass."""
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        [(50, 1), (0, 12), (7, 3), (90, 1), (0, 0), (33, 5)], n_kv_heads=2, head_dim=16,
        block_size=4, dtype=dtype, pad_tokens=2,
    )
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    q = torch.randn(md.slot_mapping.shape[0], 4, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = ref.paged_attention(q, k_cache, v_cache, md, 0.25)
    monkeypatch.setattr(cpu_attention, "_GATHER_BUDGET_BYTES", 4096)
    monkeypatch.setattr(ref, "_WHOLE_MASK_ELEMENTS", 8)
    chunked = cpu_attention.paged_attention(q, k_cache, v_cache, md, 0.25)
    torch.testing.assert_close(chunked[:n_live].float(), expected[:n_live].float(), **TOL[dtype])
