"""The AMX 4-bit projection kernel (blink.kernels.cpu.q4_linear): its layout holds the file's
exact weights, its products match an fp32 product on them to the last bf16 bit almost
everywhere, every shape and row count it takes, and where it cannot run (no compiler, no
AMX, switched off) torch's int4 kernel takes over. The same for its 8-bit (Q8_0) codes, and
a model's Q8_0 head on them."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from blink.kernels.cpu import q4_linear as cpu_q4_linear
from blink.loader.gguf_weights import unpack_q4, unpack_q8
from blink.models import int4_linear

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from executor_helpers import build_metadata  # noqa: E402

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


@needs_amx
# 1100: three panels of rows in the many-rows path, the last one partial
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32, 33, 48, 50, 1100])
# 1-5 tiles; 1, 5, 18 groups; many rows run K in slabs of at most 18 groups: 19 groups are two
# uneven slabs, 48 three
@pytest.mark.parametrize("n, k", [(16, 32), (48, 160), (80, 576), (32, 608), (16, 1536)])
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
    if rows > cpu_q4_linear.few_rows():
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
# both paths; 300 rows on 2 threads: many rows in parts of 32-row blocks (the last one partial),
# 40: parts of column tiles
@pytest.mark.parametrize("rows", [3, 40, 300])
def test_threads_split_the_work_with_the_same_bits(rows):
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
    assert torch.equal(one, two)  # each output's sum is the same whichever thread does it


@needs_amx
def test_the_int4_path_prefers_it_and_a_model_step_uses_it():
    """Every step runs on the AMX weight; where the int8 VNNI build runs, steps of at most
    INT8_MAX_ROWS_BESIDE_AMX_KERNEL tokens take it on the same codes and scales (a view: no
    second copy, also once the weights are placed elsewhere), larger ones the AMX kernel."""
    from blink.kernels.cpu import quant_linear as cpu_quant_linear

    codes, scale, zero = gguf_like(64, 128)
    weight = int4_linear.pack(codes, scale, zero)
    assert (weight.kernel, weight.max_rows) == ("amx", int4_linear.AMX_MAX_ROWS)
    few, many = int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL, int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL + 1
    x = torch.randn(many, 128).bfloat16()
    assert torch.equal(int4_linear.linear(x, weight, None), cpu_q4_linear.linear(x, weight.amx, None))
    if cpu_quant_linear.variant() != "avx512_vnni":
        assert weight.int8_view is None and weight.on_amx(1)
        return
    for w in (weight, int4_linear.placed(weight, lambda t: t.clone())):
        view = w.int8_view
        assert view.codes.data_ptr() == w.amx.codes.data_ptr()
        assert view.scales.data_ptr() == w.amx.scales.data_ptr()
        assert not w.on_amx(few) and w.on_amx(many)
        got = int4_linear.linear(x[:few], w, None)
        assert torch.equal(got, cpu_quant_linear.linear(x[:few], [view], None, build="avx512_vnni"))
        assert not torch.equal(got, cpu_q4_linear.linear(x[:few], w.amx, None))  # int8 x: other bits
    assert int4_linear.placed(weight, lambda t: t.clone()).amx.codes.data_ptr() != weight.amx.codes.data_ptr()
    # the explicit kernel "amx" (benchmarks, tests): that kernel for every step
    assert int4_linear.pack(codes, scale, zero, kernel="amx").int8_view is None


def test_switched_off_the_torch_kernel_takes_the_weights(monkeypatch):
    from blink.kernels.cpu import quant_linear as cpu_quant_linear

    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, "torch")
    cpu_quant_linear.reset()  # (the AMX kernel's choice too, and the kernel without AMX is off)
    try:
        assert not cpu_q4_linear.available()
        codes, scale, zero = gguf_like(64, 128)
        weight = int4_linear.pack(codes, scale, zero)
        assert (weight.kernel, weight.max_rows) == ("torch", int4_linear.TORCH_MAX_ROWS)
        with pytest.raises(RuntimeError, match="not available"):
            cpu_q4_linear.linear(torch.randn(1, 128).bfloat16(), cpu_q4_linear.pack(codes, scale, zero), None)
    finally:
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        cpu_quant_linear.reset()


def test_without_a_compiler_it_is_said_once_and_not_used(without_c_compiler, caplog, monkeypatch):
    monkeypatch.delenv(cpu_q4_linear.IMPL_ENV, raising=False)
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
    monkeypatch.delenv(cpu_q4_linear.IMPL_ENV, raising=False)
    monkeypatch.setenv("CC", str(wrapper))
    with caplog.at_level("WARNING", logger="blink.kernels"):
        assert not cpu_q4_linear.available()
    assert any("no AMX" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- 8-bit codes (Q8_0)


def gguf_q8(n: int, k: int, seed: int = 0):
    """A real Q8_0 weight as blink.loader.gguf_weights.unpack_q8 gives it, and gguf's own
    dequantization of the same bytes."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.05, 2, (n, 1)).astype(np.float32)
    data = gguf.quants.quantize(weight, Q.Q8_0)
    return unpack_q8(data, n, k), torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0).reshape(n, k).astype(np.float32))


def test_q8_codes_and_layout_hold_the_values_gguf_dequantizes():
    q8, dequantized = gguf_q8(48, 96)
    assert q8.codes.dtype == torch.int8 and q8.scale.shape == (48, 3)
    assert torch.equal(q8.codes.float().view(48, 3, 32).mul(q8.scale[..., None]).view(48, 96), dequantized)
    weight = cpu_q4_linear.pack_q8(q8.codes, q8.scale)
    assert weight is not None and weight.bits == 8 and weight.codes.numel() == 48 * 96  # a byte a weight
    assert torch.equal(cpu_q4_linear.dequantize(weight), dequantized)


def test_pack_q8_refuses_what_the_kernel_cannot_hold():
    q8, _ = gguf_q8(48, 96)
    assert cpu_q4_linear.pack_q8(q8.codes[:40], q8.scale[:40]) is None  # not whole tiles
    assert cpu_q4_linear.pack_q8(q8.codes[:, :80], q8.scale[:, :2]) is None  # not whole groups
    assert cpu_q4_linear.pack_q8(q8.codes, q8.scale * (1 + 1e-6)) is None  # d not an fp16
    assert cpu_q4_linear.pack_q8(q8.codes.to(torch.int16), q8.scale) is None


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 160), (80, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q8_kernel_matches_the_fp32_product(rows, n, k, with_bias):
    """Up to 16 rows: the product on gguf's fp32 weights; more: on their bf16 rounding."""
    q8, dense = gguf_q8(n, k, seed=rows + n)
    weight = cpu_q4_linear.pack_q8(q8.codes, q8.scale)
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    got = cpu_q4_linear.linear(x, weight, bias)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    if rows > 16:
        dense = dense.bfloat16().float()
    want = torch.nn.functional.linear(x.float(), dense, None if bias is None else bias.float())
    close_to_exact(got, want, x.float().abs() @ dense.abs().T)
    wrong = q8.codes.clone()  # the test can fail: one wrong code moves its column
    wrong[n // 2, k // 2] = -wrong[n // 2, k // 2] - 1
    off = cpu_q4_linear.linear(x, cpu_q4_linear.pack_q8(wrong, q8.scale), bias).float()
    assert (off[:, n // 2] - got[:, n // 2].float()).abs().max() > 0
    assert torch.equal(off[:, : n // 2], got[:, : n // 2].float())


@needs_amx
def test_a_tied_head_stored_as_q8_computes_small_steps_logits_on_its_codes(tmp_path):
    """The head's Q8_0 codes give the logits of steps of up to Q8_HEAD_MAX_ROWS rows (the fp32
    product on the file's weights); larger steps keep the packed bf16 head, bit for bit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers_models import make_tiny_model

    from blink.executor import ModelExecutor
    from blink.loader import open_model
    from blink.models import decoder, packed_linear

    files = open_model(make_tiny_model("qwen2", tmp_path))  # tied embeddings
    ex = ModelExecutor(files, dtype=torch.bfloat16, num_blocks=32, max_model_len=64, pack_weights=False)
    model = ex.model
    embed = model.model.embed_tokens.weight.float()
    if embed.shape[0] % 16:
        pytest.skip("the tiny vocabulary is not whole tiles")
    data = gguf.quants.quantize(embed.numpy(), Q.Q8_0)
    q8 = unpack_q8(data, *embed.shape)
    assert model.use_q8_head([("model.embed_tokens.weight", q8)])
    model.use_packed_weights()
    dense = torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0).reshape(embed.shape).astype(np.float32))
    hidden = torch.randn(decoder.Q8_HEAD_MAX_ROWS, embed.shape[1]).bfloat16()
    want = torch.nn.functional.linear(hidden.float(), dense)
    # steps of more rows than the int8 build takes beside AMX: the AMX kernel's exact product
    rows = slice(0, int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL + 1)
    close_to_exact(model.compute_logits(hidden[rows]), want[rows], hidden[rows].float().abs() @ dense.abs().T)
    if model.q8_head.int8_view is not None:  # fewer: the same codes on the int8 VNNI build
        from blink.kernels.cpu import quant_linear as cpu_quant_linear

        assert torch.equal(model.compute_logits(hidden[:3]),
                           cpu_quant_linear.linear(hidden[:3], [model.q8_head.int8_view], None, build="avx512_vnni"))
    many = torch.randn(decoder.Q8_HEAD_MAX_ROWS + 1, embed.shape[1]).bfloat16()
    assert torch.equal(model.compute_logits(many), packed_linear.linear(many, model.packed_head, None))


@needs_amx
def test_smollm2s_q8_head_runs_on_its_codes_unless_switched_off():
    """The shipped GGUF stores its tied embedding as Q8_0: the executor's head takes the codes,
    and ``int4_decode=False`` (``--int4-decode off``) keeps it bf16."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_loader_gguf import smollm_path

    from blink.executor import ModelExecutor
    from blink.loader import open_model

    files = open_model(smollm_path())
    kw = dict(dtype=torch.bfloat16, num_blocks=8, max_model_len=64)
    on, off = ModelExecutor(files, **kw), ModelExecutor(files, int4_decode=False, **kw)
    if not on.packed_weights:
        pytest.skip("no native oneDNN bf16 here")
    assert on.q8_head and on.model.q8_head.amx.bits == 8 and not off.q8_head
    ids, md, last = build_metadata(on, [([1, 2, 3, 4], 0, [0])])
    a, b = on.execute(ids, md, last), off.execute(*build_metadata(off, [([1, 2, 3, 4], 0, [0])]))
    assert not torch.equal(a, b)  # other weights (the file's, not their bf16 rounding)
    assert (a - b).abs().max() < 0.1 * b.abs().max()
    # few logits rows: the same codes on the int8 VNNI build where it runs beside the AMX kernel
    from blink.kernels.cpu import quant_linear as cpu_quant_linear
    from blink.models.int4_linear import INT8_MAX_ROWS_BESIDE_AMX_KERNEL as FEW

    model = on.model
    if not int4_linear.int8_beside_amx():
        assert model.q8_head.int8_view is None
        return
    view = model.q8_head.int8_view
    assert view.codes.data_ptr() == model.q8_head.amx.codes.data_ptr()  # placed in 2 MB pages, still shared
    hidden = torch.randn(FEW + 1, model.model.embed_tokens.weight.shape[1]).bfloat16()
    assert torch.equal(model.compute_logits(hidden[:FEW]),
                       cpu_quant_linear.linear(hidden[:FEW], [view], None, build="avx512_vnni"))
    assert torch.equal(model.compute_logits(hidden), cpu_q4_linear.linear(hidden, model.q8_head.amx, None))


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 100, 600])  # both paths, partial row tiles, 2 panels
@pytest.mark.parametrize("n", [32, 96, 3072])  # 1, 3 and 96 tiles per half: odd chunks too
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [96, 1152])  # 1152: 36 groups, two slabs of K in the many-rows path
def test_gated_is_the_projection_then_the_silu_to_the_bit(rows, n, with_bias, k):
    """A fused gate/up projection with the activation applied as the kernel stores: the bits of
    the plain call followed by cpu_fused's SiLU (which the op table runs otherwise)."""
    from blink.kernels.cpu import fused as cpu_fused

    codes, scale, zero = gguf_like(n, k, seed=rows + n)
    weight = cpu_q4_linear.pack(codes, scale, zero)
    torch.manual_seed(rows)
    x = torch.randn(rows, k).bfloat16() * 3  # gate values of both signs, some large
    bias = torch.randn(n).bfloat16() if with_bias else None
    got = cpu_q4_linear.linear(x, weight, bias, gated=True)
    assert got.shape == (rows, n // 2)
    assert torch.equal(got, cpu_fused.silu_and_mul(cpu_q4_linear.linear(x, weight, bias)))
    # the test can fail: an up column's wrong code moves that output column only
    wrong = codes.clone()
    wrong[n // 2 + 1, 7] ^= 8
    off = cpu_q4_linear.linear(x, cpu_q4_linear.pack(wrong, scale, zero), bias, gated=True)
    assert not torch.equal(off[:, 1], got[:, 1]) and torch.equal(off[:, 2:], got[:, 2:])


@needs_amx
def test_gated_threads_give_the_same_bits_and_refusals_are_clear():
    codes, scale, zero = gguf_like(1024, 4096)
    weight = cpu_q4_linear.pack(codes, scale, zero)
    x = torch.randn(8, 4096).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_q4_linear.linear(x, weight, None, gated=True)
        torch.set_num_threads(2)
        two = cpu_q4_linear.linear(x, weight, None, gated=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    codes, scale, zero = gguf_like(48, 64)  # 3 tiles: no whole tiles per half
    with pytest.raises(ValueError, match="gated kernel takes"):
        cpu_q4_linear.linear(torch.randn(2, 64).bfloat16(), cpu_q4_linear.pack(codes, scale, zero), None,
                             gated=True)


@needs_amx
def test_smollm2s_mlp_takes_the_gated_kernel_for_decode_steps_with_the_same_logits(monkeypatch):
    """SmolLM2's GGUF gate/up projections are 4-bit: a decode-sized step runs them with the
    activation fused, and the logits are those of the separate SiLU bit for bit; a prefill
    keeps the SiLU apart."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_loader_gguf import smollm_path

    from blink.executor import ModelExecutor
    from blink.loader import open_model
    from blink.models.decoder import Linear

    ex = ModelExecutor(open_model(smollm_path()), dtype=torch.bfloat16, num_blocks=16, max_model_len=128)
    if not ex.packed_weights:
        pytest.skip("no native oneDNN bf16 here")
    calls = []
    original = Linear.gated

    def counted(self, x):
        out = original(self, x)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(Linear, "gated", counted)
    seqs = [([5 + i, 9, 2], 0, [i]) for i in range(4)]  # 4 rows x 3 tokens: 12 rows, few
    fused = ex.execute(*build_metadata(ex, seqs))
    assert calls and all(calls)  # every layer's MLP
    monkeypatch.setattr(Linear, "gated", lambda self, x: None)
    assert torch.equal(fused, ex.execute(*build_metadata(ex, seqs)))
    monkeypatch.setattr(Linear, "gated", counted)
    calls.clear()
    ex.execute(*build_metadata(ex, [(list(range(1, 41)), 0, [0, 1, 2])]))  # 40 rows: many
    assert calls and not any(calls)


def test_the_int8_bound_beside_amx_is_a_decode_graph_bucket():
    """A decode step replays the graph of the smallest bucket holding it, with that bucket's
    rows: the bound between the int8 build and the AMX kernel must be a bucket, or a step
    just under it would run one kernel eager and the other replayed (other bits)."""
    from blink.decode_graphs import DECODE_BUCKETS

    assert int4_linear.INT8_MAX_ROWS_BESIDE_AMX_KERNEL in DECODE_BUCKETS
