"""Triton RMSNorm, fused add+RMSNorm, RoPE and SiLU-mul against the torch reference.

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` must be set before the kernel
modules are imported). Tolerances: fp32 1e-5 (rsqrt/exp ulps, reduction order); bf16
atol/rtol 2e-2 (the interpreter truncates fp32 -> bf16 where a GPU rounds: <= 1 ulp = 2^-7
relative at each of the reference's rounding points).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest
import torch

from blink.kernels.reference import layers as ref

triton_norm_rope = pytest.importorskip("blink.kernels.triton.norm_rope")
from blink.kernels.triton import activation as triton_activation  # noqa: E402
from blink.kernels.triton.common import interpreting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
if DEVICE == "cpu" and not interpreting():
    pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu().float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (3, 2, 100), (1, 1024)])
def test_rms_norm(dtype, shape):
    x = rand(*shape, dtype=dtype, scale=3.0)
    w = rand(shape[-1], dtype=dtype, seed=1)
    close(triton_norm_rope.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6), ref.rms_norm(x, w, 1e-6), dtype)


def test_rms_norm_per_head_on_strided_view():
    """Qwen3 q/k norm: [T, H, D] column slice of a fused qkv output, many short rows packed
    into one program."""
    qkv = rand(6, 8 * 16 + 2 * 16 * 2)
    q = qkv[:, : 8 * 16].view(6, 8, 16)
    w = rand(16, seed=2)
    close(triton_norm_rope.rms_norm(q.to(DEVICE), w.to(DEVICE), 1e-6), ref.rms_norm(q, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_new_residual(dtype):
    x, res = rand(7, 96, dtype=dtype), rand(7, 96, dtype=dtype, seed=1)
    w = rand(96, dtype=dtype, seed=2)
    x_d, res_d = x.to(DEVICE), res.to(DEVICE)
    res_before = res_d.clone()
    out, new_res = triton_norm_rope.fused_add_rms_norm(x_d, res_d, w.to(DEVICE), 1e-5)
    ref_out, ref_res = ref.fused_add_rms_norm(x, res, w, 1e-5)
    close(out, ref_out, dtype)
    close(new_res, ref_res, dtype)
    assert torch.equal(res_d, res_before), "the caller's residual must not be modified"


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,rotary_dim,scaling,dtype",
    [
        (4, 2, 32, 32, None, torch.float32),
        (8, 2, 64, 64, LLAMA3_SCALING, torch.bfloat16),
        (3, 1, 48, 24, None, torch.float32),          # partial rotary (Phi-style), odd head count
        (4, 4, 128, 128, LLAMA3_SCALING, torch.float32),
    ],
)
def test_apply_rope(n_heads, n_kv_heads, head_dim, rotary_dim, scaling, dtype):
    T = 5
    cache = ref.rope_cos_sin_cache(rotary_dim, 512, 500000.0, scaling)
    # q/k as views of a fused qkv projection (row stride larger than H * D).
    qkv = rand(T, (n_heads + 2 * n_kv_heads) * head_dim, dtype=dtype, seed=3)
    q = qkv[:, : n_heads * head_dim].view(T, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv_heads) * head_dim].view(T, n_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 77, 300, 511])
    q_out, k_out = triton_norm_rope.apply_rope(q.to(DEVICE), k.to(DEVICE), positions.to(DEVICE), cache.to(DEVICE))
    q_ref, k_ref = ref.apply_rope(q, k, positions, cache)
    close(q_out, q_ref, dtype)
    close(k_out, k_ref, dtype)
    if rotary_dim < head_dim:  # pass-through channels are copied bit for bit
        assert torch.equal(q_out[..., rotary_dim:].cpu(), q[..., rotary_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2 * 48), (2, 3, 2 * 1100)])
def test_silu_and_mul(dtype, shape):
    x = rand(*shape, dtype=dtype, scale=4.0)
    close(triton_activation.silu_and_mul(x.to(DEVICE)), ref.silu_and_mul(x), dtype)
