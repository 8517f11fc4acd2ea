"""The AMX 4-bit projection kernel (blink.kernels.cpu_q4_linear): its layout holds the file's
exact weights, its products match an fp32 product on them to the last bf16 bit almost
everywhere, every shape and row count it takes, and where it cannot run (no compiler, no
AMX, switched off) torch's int4 kernel takes over."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from blink.kernels import cpu_q4_linear
from blink.loader.gguf_weights import unpack_q4
from blink.models import int4_linear

needs_amx = pytest.mark.skipif(not cpu_q4_linear.available(),
                               reason="the AMX kernel does not run here (no AMX, compiler or permission)")

# A build for a CPU without AMX (AVX2 only), whatever this host has.
NO_AMX_CC = """#!/bin/sh
for a; do shift; [ "$a" = "-march=native" ] && a="-march=x86-64-v3"; set -- "$@" "$a"; done
exec cc "$@"
"""


def gguf_like(n: int, k: int, seed: int = 0, qtype: Q = Q.Q4_1):
    """Codes, scale and zero as blink.loader.gguf_weights.unpack_q4 gives them for a real
    quantized weight (fp16 d and m; zero = m + 8d)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.05, 2, (n, 1)).astype(np.float32)
    q4 = unpack_q4(gguf.quants.quantize(weight, qtype), qtype.name, n, k)
    return q4.codes, q4.scale, q4.zero


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_the_layout_holds_the_values_gguf_dequantizes(qtype):
    codes, scale, zero = gguf_like(48, 96, qtype=qtype)
    weight = cpu_q4_linear.pack(codes, scale, zero)
    assert weight is not None and weight.codes.numel() * 2 == 48 * 96 // 2  # 4 bits a weight
    assert torch.equal(cpu_q4_linear.dequantize(weight), int4_linear.dequantize(codes, scale, zero))


def test_pack_refuses_what_the_kernel_cannot_hold():
    codes, scale, zero = gguf_like(48, 96)
    assert cpu_q4_linear.pack(codes[:40], scale[:40], zero[:40]) is None  # 40 columns: not whole tiles
    assert cpu_q4_linear.pack(codes[:, :80], scale[:, :2], zero[:, :2]) is None  # not whole groups
    assert cpu_q4_linear.pack(codes, scale * (1 + 1e-6), zero) is None  # d not an fp16: not a file's
    with pytest.raises(ValueError, match="AMX kernel does not take"):
        int4_linear.pack(codes[:40], scale[:40], zero[:40], kernel="amx")


def close_to_exact(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """``got`` (bf16) is ``want`` (fp32) rounded, up to one bf16 step where the fp32 sums'
    order puts it on a rounding edge, in a few outputs in a thousand at most. ``magnitude``:
    each output's sum of |x w|, which bounds the fp32 sums' own error where terms cancel."""
    got = got.float()
    exact = want.to(torch.bfloat16).float()
    step = torch.maximum(want.abs() * 2.0 ** -7, magnitude * 2.0 ** -18)
    assert ((got - exact).abs() <= step).all()
    assert (got == exact).float().mean() > 0.99


def few_rows() -> int:
    return cpu_q4_linear.LIBRARY.get().blink_q4_linear_few_rows()


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32, 33, 48, 50])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 160), (80, 576)])  # 1-5 tiles; 1, 5, 18 groups
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_the_fp32_product(rows, n, k, with_bias):
    """Few rows: the product on gguf's fp32 weights. Many rows (a prefill): on those weights
    rounded to bf16, the engine's bf16 copy, as oneDNN's product on that copy."""
    codes, scale, zero = gguf_like(n, k, seed=rows + n)
    weight = cpu_q4_linear.pack(codes, scale, zero)
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    got = cpu_q4_linear.linear(x, weight, bias)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    dense = int4_linear.dequantize(codes, scale, zero)
    if rows > few_rows():
        dense = dense.bfloat16().float()
    want = torch.nn.functional.linear(x.float(), dense, None if bias is None else bias.float())
    close_to_exact(got, want, x.float().abs() @ dense.abs().T)
    # the test can fail: one wrong code moves its column by ~d |x| >> a bf16 step
    wrong = codes.clone()
    wrong[n // 2, k // 2] ^= 8
    off = cpu_q4_linear.linear(x, cpu_q4_linear.pack(wrong, scale, zero), bias).float()
    assert (off[:, n // 2] - got[:, n // 2].float()).abs().max() > 0
    assert torch.equal(off[:, : n // 2], got[:, : n // 2].float())


@needs_amx
def test_strided_rows_leading_dims_and_an_empty_step():
    codes, scale, zero = gguf_like(32, 64)
    weight = cpu_q4_linear.pack(codes, scale, zero)
    torch.manual_seed(0)
    fused = torch.randn(3, 5, 3 * 64).bfloat16()
    x = fused[..., 64:128]  # a view into a fused projection's output: rows 192 apart
    assert x.stride(-2) == 192
    got = cpu_q4_linear.linear(x, weight, None)
    assert got.shape == (3, 5, 32)
    assert torch.equal(got, cpu_q4_linear.linear(x.contiguous(), weight, None))
    assert cpu_q4_linear.linear(torch.zeros(0, 64).bfloat16(), weight, None).shape == (0, 32)


@needs_amx
@pytest.mark.parametrize("rows", [3, 40])  # both paths
def test_threads_split_the_columns_with_the_same_bits(rows):
    codes, scale, zero = gguf_like(1024, 4096)  # 4M weights: enough to start a second thread
    weight = cpu_q4_linear.pack(codes, scale, zero)
    x = torch.randn(rows, 4096).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_q4_linear.linear(x, weight, None)
        torch.set_num_threads(2)
        two = cpu_q4_linear.linear(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each column's sums are the same whichever thread did them


@needs_amx
def test_the_int4_path_prefers_it_and_a_model_step_uses_it():
    codes, scale, zero = gguf_like(64, 128)
    weight = int4_linear.pack(codes, scale, zero)
    assert (weight.kernel, weight.max_rows) == ("amx", int4_linear.AMX_MAX_ROWS)
    x = torch.randn(4, 128).bfloat16()
    assert torch.equal(int4_linear.linear(x, weight, None), cpu_q4_linear.linear(x, weight.amx, None))


def test_switched_off_the_torch_kernel_takes_the_weights(monkeypatch):
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, "torch")
    cpu_q4_linear.LIBRARY.reset()
    try:
        assert not cpu_q4_linear.available()
        codes, scale, zero = gguf_like(64, 128)
        weight = int4_linear.pack(codes, scale, zero)
        assert (weight.kernel, weight.max_rows) == ("torch", int4_linear.TORCH_MAX_ROWS)
        with pytest.raises(RuntimeError, match="not available"):
            cpu_q4_linear.linear(torch.randn(1, 128).bfloat16(), cpu_q4_linear.pack(codes, scale, zero), None)
    finally:
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        cpu_q4_linear.LIBRARY.reset()


def test_without_a_compiler_it_is_said_once_and_not_used(without_c_compiler, caplog):
    without_c_compiler(cpu_q4_linear.LIBRARY)
    with caplog.at_level("WARNING", logger="blink.kernels"):
        assert not cpu_q4_linear.available()
        assert not cpu_q4_linear.available()
    said = [r for r in caplog.records if "4-bit CPU projections" in r.getMessage()]
    assert len(said) == 1 and "torch's int4 kernel" in said[0].getMessage()


def test_a_build_for_a_cpu_without_amx_is_refused(without_c_compiler, tmp_path, monkeypatch, caplog):
    wrapper = tmp_path / "cc-no-amx"
    wrapper.write_text(NO_AMX_CC)
    wrapper.chmod(0o755)
    without_c_compiler(cpu_q4_linear.LIBRARY)
    monkeypatch.setenv("CC", str(wrapper))
    with caplog.at_level("WARNING", logger="blink.kernels"):
        assert not cpu_q4_linear.available()
    assert any("no AMX" in r.getMessage() for r in caplog.records)
