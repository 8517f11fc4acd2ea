"""The fused bf16 CPU ops (blink.kernels.cpu.fused, the eager CPU table's entries) against the
torch references: the rotary embedding and the KV write bit for bit, the norms and SiLU to
the bit but for rare one-step roundings; the layouts the model passes (strided rows, a view
of the fused QKV, partial rotary); the sampler's logsumexp against torch's, and its greedy
argmax against torch.argmax; what falls back
to the reference; the errors; the build fallback; and that a compiled step still gets the
traceable references."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from blink.kernels import ops_for
from blink.kernels.cpu import fused as cpu_fused
from blink.kernels.reference import layers as reference, sampling as sampling_reference
from blink.kernels.cpu.threads import kernel_threads, set_kernel_threads
from blink.kernels.ops import compiled_cpu_ops
from blink.shared.native_build import build_library

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from native_helpers import forced_native  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def library_builds():
    """The library must build here (CI has a compiler too)."""
    with forced_native(cpu_fused.LIBRARY, cpu_fused.IMPL_ENV) as lib:
        assert lib is not None
        yield


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _at_most_one_step(out: torch.Tensor, expected: torch.Tensor, share: float = 0.01) -> None:
    """Equal but for a few elements (fp32 sums or exp rounding the other way), each at most
    one bf16 step (2^-8 relative) away."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    differ = out != expected
    assert differ.float().mean().item() <= share
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=2**-7)


def test_the_cpu_table_uses_them_and_the_compiled_one_the_references():
    table = ops_for("cpu")
    for name in ("rms_norm", "fused_add_rms_norm", "apply_rope", "silu_and_mul", "write_kv_cache"):
        assert getattr(table, name) is getattr(cpu_fused, name)
    compiled = compiled_cpu_ops()
    for name in ("rms_norm", "fused_add_rms_norm", "apply_rope", "silu_and_mul"):
        assert getattr(compiled, name) is getattr(reference, name)
    assert table.logsumexp_rows is cpu_fused.logsumexp_rows
    assert compiled.logsumexp_rows is sampling_reference.logsumexp_rows


@pytest.mark.parametrize("rows,dim", [(1, 576), (16, 576), (5, 100), (3, 4096)])
def test_norms(rows, dim):
    g = _gen()
    x = (torch.randn(rows, dim, generator=g) * 3).to(BF16)
    residual = torch.randn(rows, dim, generator=g).to(BF16)
    weight = torch.randn(dim, generator=g).to(BF16)
    _at_most_one_step(cpu_fused.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    out, res = cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_res = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(res, expected_res)  # the residual add is one bf16 rounding: exact
    _at_most_one_step(out, expected)


def test_norm_of_strided_rows():
    """Rows of a wider buffer (a view), as a split can hand them over."""
    g = _gen(1)
    wide = torch.randn(7, 1000, generator=g).to(BF16)
    x, residual = wide[:, :576], wide[:, 300:876]
    weight = torch.randn(576, generator=g).to(BF16)
    assert not x.is_contiguous()
    out, res = cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected, expected_res = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(res, expected_res)
    _at_most_one_step(out, expected)


@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(9, 3, 64, 64), (4, 4, 32, 32), (8, 2, 96, 32)])
def test_rope_is_bit_exact_on_views_of_the_fused_projection(heads, kv_heads, head_dim, rotary_dim):
    g = _gen(2)
    T = 13
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(BF16)
    q = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    cos_sin = reference.rope_cos_sin_cache(rotary_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (T,), generator=g)
    q_out, k_out = cpu_fused.apply_rope(q, k, positions, cos_sin)
    q_ref, k_ref = reference.apply_rope(q, k, positions, cos_sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_kv_write_is_exact_and_touches_only_its_slots():
    g = _gen(3)
    T, kv_heads, head_dim = 6, 3, 64
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(BF16)
    kv = torch.randn(T, 2 * kv_heads * head_dim, generator=g).to(BF16)
    v = kv[:, kv_heads * head_dim:].view(T, kv_heads, head_dim)  # a view, rows strided
    before = torch.randn(5, 16, kv_heads, head_dim, generator=g).to(BF16)
    caches = [before.clone() for _ in range(4)]
    slots = torch.tensor([3, 70, 0, 79, 41, 16])
    cpu_fused.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("rows,dim", [(1, 1536), (16, 1536), (3, 77)])
def test_silu_and_mul(rows, dim):
    g = _gen(4)
    x = (torch.randn(rows, 2 * dim, generator=g) * 4).to(BF16)
    x[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 1e-3, -1e-3])  # both tails
    _at_most_one_step(cpu_fused.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("rows,cols", [(1, 49152), (16, 49152), (3, 77), (2, 16), (4, 1)])
def test_logsumexp_rows(rows, cols):
    x = torch.randn(rows, cols, generator=_gen(11)) * 8
    got = cpu_fused.logsumexp_rows(x)
    assert got.shape == (rows, 1) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.logsumexp(x, -1, keepdim=True), rtol=2e-6, atol=2e-6)


def test_logsumexp_rows_special_values_strides_and_threads():
    """torch's results for NaN, all -inf (a row the grammar masks whole), +inf, masked halves
    and huge values; strided rows; a split over threads gives the one-thread bits."""
    x = torch.randn(6, 100, generator=_gen(12)) * 4
    x[0] = float("-inf")
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3, ::2] = float("-inf")
    x[4] *= 1e30
    got, want = cpu_fused.logsumexp_rows(x), torch.logsumexp(x, -1, keepdim=True)
    assert got[0].item() == float("-inf") and got[1].isnan().item() and got[2].item() == float("inf")
    torch.testing.assert_close(got[3:], want[3:], rtol=2e-6, atol=2e-6)
    wide = torch.randn(3, 200, generator=_gen(13))
    torch.testing.assert_close(cpu_fused.logsumexp_rows(wide[:, 50:150]),
                               torch.logsumexp(wide[:, 50:150], -1, keepdim=True), rtol=2e-6, atol=2e-6)
    big = torch.randn(96, 49152, generator=_gen(14))  # 4.7M entries: enough to split
    before = kernel_threads()
    try:
        set_kernel_threads(1)
        one = cpu_fused.logsumexp_rows(big)
        set_kernel_threads(2)
        assert torch.equal(cpu_fused.logsumexp_rows(big), one)
    finally:
        set_kernel_threads(before)
    assert torch.equal(cpu_fused.logsumexp_rows(big.double()),  # not fp32: the reference
                       torch.logsumexp(big.double(), -1, keepdim=True))


@pytest.mark.parametrize("rows,cols", [(1, 49152), (16, 49152), (3, 77), (2, 16), (4, 1), (1, 128256)])
def test_argmax_logsumexp_rows(rows, cols):
    """torch.argmax's index, logsumexp_rows' bits and the index's logprob as the reference takes
    it (the greedy sampler's three values, one pass)."""
    x = torch.randn(rows, cols, generator=_gen(15)) * 8
    argmax, log_norm, logprob = cpu_fused.argmax_logsumexp_rows(x)
    assert argmax.dtype == torch.int64 and argmax.shape == (rows,)
    assert torch.equal(argmax, torch.argmax(x, -1))
    assert torch.equal(argmax, sampling_reference.argmax_rows(x))
    assert torch.equal(log_norm, cpu_fused.logsumexp_rows(x))
    assert logprob.dtype == torch.float32 and logprob.shape == (rows,)
    assert torch.equal(logprob, (x.gather(-1, argmax.unsqueeze(-1)) - log_norm).squeeze(-1))
    ref = sampling_reference.argmax_logsumexp_rows(x)  # the same three, from torch
    assert torch.equal(ref[0], argmax) and torch.equal(ref[2], (x.gather(-1, argmax.unsqueeze(-1)) - ref[1]).squeeze(-1))


@pytest.mark.parametrize("cols", [49152, 100, 7])
def test_argmax_logsumexp_rows_of_bf16_rows_are_those_of_the_rows_widened(cols):
    """bf16 rows read as they are (a greedy step's logits as the head leaves them) give the
    three values of the fp32 rows x.float(), bit for bit, ties, NaN, -inf and +inf rows
    included, and so does the reference."""
    x = (torch.randn(8, cols, generator=_gen(19)) * 8).to(torch.bfloat16)
    x[1, cols // 2], x[1, cols // 3] = 9.0, 9.0  # a tie: the first
    x[2, cols - 1] = float("nan")
    x[3] = float("-inf")
    x[4, cols - 1] = float("inf")
    x[5] = 0.0
    wide = x.float()
    want = cpu_fused.argmax_logsumexp_rows(wide)
    for got in (cpu_fused.argmax_logsumexp_rows(x), cpu_fused.argmax_logsumexp_rows(torch.cat([x, x], 1)[:, :cols])):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    ref = sampling_reference.argmax_logsumexp_rows(x)
    assert torch.equal(ref[0], want[0])
    torch.testing.assert_close(ref[1], sampling_reference.argmax_logsumexp_rows(wide)[1], rtol=0, atol=0,
                               equal_nan=True)


def test_argmax_logsumexp_rows_ties_special_values_strides_and_threads():
    """The first maximum whichever of the 16 lanes holds it (ties within a lane and across
    lanes, in the masked tail), the first NaN, 0 for a row of -inf, the first of two +inf;
    strided rows; a split over threads gives the one-thread results."""
    x = torch.randn(9, 100, generator=_gen(16))
    x[0, 37], x[0, 5] = 9.0, 9.0   # across lanes: the lower index
    x[1, 3], x[1, 19] = 9.0, 9.0   # one lane (3 and 19 are 16 apart): the first
    x[2, 99] = 9.0                 # in the masked tail (100 = 6 x 16 + 4)
    x[3, 40], x[3, 8] = float("nan"), float("nan")
    x[3, 2] = 1e30                 # a NaN wins over anything, the first NaN
    x[4] = float("-inf")
    x[5, 70], x[5, 60] = float("inf"), float("inf")
    x[6, ::2] = float("-inf")
    x[7] = 0.0                     # all equal: index 0
    x[8, 64], x[8, 96] = 9.0, 9.0  # the same lane, the later one past a NaN-free prefix
    argmax, log_norm, logprob = cpu_fused.argmax_logsumexp_rows(x)
    assert argmax.tolist() == [5, 3, 99, 8, 0, 60, torch.argmax(x[6]).item(), 0, 64]
    assert torch.equal(argmax, torch.argmax(x, -1))
    torch.testing.assert_close(log_norm, cpu_fused.logsumexp_rows(x), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(logprob, (x.gather(-1, argmax.unsqueeze(-1)) - log_norm).squeeze(-1),
                               rtol=0, atol=0, equal_nan=True)  # NaN and -inf rows as torch has them
    wide = torch.randn(3, 200, generator=_gen(17))
    argmax, _, _ = cpu_fused.argmax_logsumexp_rows(wide[:, 50:150])
    assert torch.equal(argmax, torch.argmax(wide[:, 50:150], -1))
    big = torch.randn(96, 49152, generator=_gen(18))  # enough to split
    before = kernel_threads()
    try:
        set_kernel_threads(1)
        one = cpu_fused.argmax_logsumexp_rows(big)
        set_kernel_threads(2)
        two = cpu_fused.argmax_logsumexp_rows(big)
    finally:
        set_kernel_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]) and torch.equal(one[2], two[2])
    assert torch.equal(one[0], torch.argmax(big, -1))
    double = cpu_fused.argmax_logsumexp_rows(big.double())  # not fp32: the reference
    assert torch.equal(double[0], torch.argmax(big, -1))


def test_what_falls_back_to_the_reference():
    """fp32 (the exact mode against transformers), per-head q/k norms ([T, H, D]) and K/V
    whose dtype differs from the cache's run the reference, with its result."""
    g = _gen(5)
    x32 = torch.randn(4, 64, generator=g)
    w32 = torch.randn(64, generator=g)
    assert torch.equal(cpu_fused.rms_norm(x32, w32, 1e-5), reference.rms_norm(x32, w32, 1e-5))
    assert torch.equal(cpu_fused.silu_and_mul(x32), reference.silu_and_mul(x32))
    heads = torch.randn(4, 3, 64, generator=g).to(BF16)
    w = torch.randn(64, generator=g).to(BF16)
    assert torch.equal(cpu_fused.rms_norm(heads, w, 1e-5), reference.rms_norm(heads, w, 1e-5))
    k = torch.randn(2, 1, 16, generator=g).to(BF16)
    caches = [torch.zeros(2, 4, 1, 16) for _ in range(4)]  # fp32 caches
    cpu_fused.write_kv_cache(k, k, caches[0], caches[1], torch.tensor([1, 6]))
    reference.write_kv_cache(k, k, caches[2], caches[3], torch.tensor([1, 6]))
    assert torch.equal(caches[0], caches[2])


def test_errors_name_the_bad_index():
    g = _gen(6)
    q = torch.randn(2, 2, 16, generator=g).to(BF16)
    cos_sin = reference.rope_cos_sin_cache(16, 8, 10000.0)
    with pytest.raises(IndexError, match="outside the 8-position table"):
        cpu_fused.apply_rope(q, q, torch.tensor([3, 8]), cos_sin)
    caches = [torch.zeros(2, 4, 2, 16, dtype=BF16) for _ in range(2)]
    with pytest.raises(IndexError, match="slot lies outside the cache"):
        cpu_fused.write_kv_cache(q, q, caches[0], caches[1], torch.tensor([0, 8]))
    assert not caches[0].any() and not caches[1].any()  # checked before any write: slot 0 too


def test_a_prefill_sized_kv_write_splits_and_lands_every_row():
    """2048 tokens of 3 x 64 channels: the copy runs in parts on the kernel threads."""
    g = _gen(12)
    k, v = (torch.randn(2048, 3, 64, generator=g).to(BF16) for _ in range(2))
    slots = torch.randperm(4096, generator=g)[:2048]
    caches = [torch.zeros(256, 16, 3, 64, dtype=BF16) for _ in range(4)]
    cpu_fused.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_without_a_compiler_the_references_serve(without_c_compiler, caplog):
    without_c_compiler(cpu_fused.LIBRARY)
    with caplog.at_level("WARNING", logger="blink.kernels"):
        assert cpu_fused.library() is None
        assert cpu_fused.library() is None
    assert sum("fused CPU ops" in r.getMessage() for r in caplog.records) == 1
    x = torch.randn(3, 2 * 40, generator=_gen(7)).to(BF16)
    assert torch.equal(cpu_fused.silu_and_mul(x), reference.silu_and_mul(x))


def test_without_avx512_every_op_runs_in_c_with_the_same_bits(request, tmp_path, monkeypatch):
    """A build without AVX-512 (AVX2 code) runs every op, the SiLU and the sampler's logsumexp
    included, on kernels.h's 8-lane exp (a decode step's graph records only C calls): the
    SiLU gives the AVX-512 build's bits exactly (the same arithmetic, op for op; tails
    included), the logsumexp the reference's up to its sum's order."""
    from test_cpu_attention import NO_AVX512_CC

    x = torch.randn(5, 2 * 52, generator=_gen(8)).to(BF16) * 4  # 52: six 8-lane steps and a tail
    rows = torch.randn(3, 1000, generator=_gen(10)) * 5
    here = cpu_fused.library()
    silu_here = cpu_fused.silu_and_mul(x) if here.blink_has_avx512() else None
    wrapper = tmp_path / "cc-no-avx512"
    wrapper.write_text(NO_AVX512_CC)
    wrapper.chmod(0o755)
    request.getfixturevalue("without_c_compiler")(cpu_fused.LIBRARY)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.delenv(cpu_fused.IMPL_ENV)
    lib = cpu_fused.library()
    assert lib is not None and lib.blink_has_avx512() == 0
    calls = []
    silu = lib.blink_silu_and_mul
    monkeypatch.setattr(lib, "blink_silu_and_mul", lambda *a: (calls.append("silu"), silu(*a)))
    out = cpu_fused.silu_and_mul(x)
    assert calls == ["silu"]
    _at_most_one_step(out, reference.silu_and_mul(x))
    if silu_here is not None:
        assert torch.equal(out, silu_here)
    torch.testing.assert_close(cpu_fused.logsumexp_rows(rows), torch.logsumexp(rows, -1, keepdim=True),
                               rtol=1e-6, atol=1e-5)
    argmax, lse, _ = cpu_fused.argmax_logsumexp_rows(rows)
    assert torch.equal(argmax, rows.argmax(-1))
    cos_sin = reference.rope_cos_sin_cache(16, 8, 10000.0)
    q = torch.randn(2, 2, 16, generator=_gen(9)).to(BF16)
    q_out, k_out = cpu_fused.apply_rope(q, q, torch.tensor([1, 5]), cos_sin)
    q_ref, k_ref = reference.apply_rope(q, q, torch.tensor([1, 5]), cos_sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


NO_VECTOR_OPS_CC = """#!/bin/sh
exec cc -mno-avx512bf16 "$@"
"""


def test_the_vector_ops_are_the_scalar_code_bit_for_bit(tmp_path, monkeypatch):
    """With AVX512-BF16 the norms, the SiLU and the rotary embedding run intrinsics; a build
    without it runs the scalar loops. Both builds give the same bits, tails (dims not a multiple
    of 16) included."""
    lib = cpu_fused.library()
    if not lib.blink_has_vector_ops():
        pytest.skip("this host has no AVX512-BF16: only the scalar code exists here")
    wrapper = tmp_path / "cc-no-bf16"
    wrapper.write_text(NO_VECTOR_OPS_CC)
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib_ = cpu_fused.LIBRARY
    scalar = build_library(lib_.source, lib_.flags, lib_.fallback_flags, lib_.headers)
    cpu_fused._declare(scalar)
    assert not scalar.blink_has_vector_ops()

    def run(library, op, *args):
        monkeypatch.setattr(cpu_fused.LIBRARY, "get", lambda: library)
        return op(*args)

    g = _gen(11)
    for rows, dim in [(3, 576), (2, 100), (5, 1536)]:
        x = (torch.randn(rows, 2 * dim, generator=g) * 6).to(BF16)
        x[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 1e-3, -1e-3])
        assert torch.equal(run(lib, cpu_fused.silu_and_mul, x), run(scalar, cpu_fused.silu_and_mul, x))
        h, res = x[:, :dim].contiguous(), x[:, dim:].contiguous()
        weight = torch.randn(dim, generator=g).to(BF16)
        for a, b in zip(run(lib, cpu_fused.fused_add_rms_norm, h, res, weight, 1e-6),
                        run(scalar, cpu_fused.fused_add_rms_norm, h, res, weight, 1e-6)):
            assert torch.equal(a, b)
        assert torch.equal(run(lib, cpu_fused.rms_norm, h, weight, 1e-5), run(scalar, cpu_fused.rms_norm, h, weight, 1e-5))
    for heads, kv_heads, head_dim, rotary_dim in [(9, 3, 64, 64), (8, 2, 96, 32), (4, 4, 80, 80)]:
        qkv = torch.randn(7, (heads + kv_heads) * head_dim, generator=g).to(BF16)
        q = qkv[:, : heads * head_dim].view(7, heads, head_dim)
        k = qkv[:, heads * head_dim:].view(7, kv_heads, head_dim)
        cos_sin = reference.rope_cos_sin_cache(rotary_dim, 4096, 10000.0)
        positions = torch.randint(0, 4096, (7,), generator=g)
        for a, b in zip(run(lib, cpu_fused.apply_rope, q, k, positions, cos_sin),
                        run(scalar, cpu_fused.apply_rope, q, k, positions, cos_sin)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("vocab,n_words", [(100, 4), (96, 3), (130, 3)])
def test_token_mask_matches_the_reference(vocab: int, n_words: int) -> None:
    """The structured-output mask's C pass gives the reference's result bit for bit: masked
    rows, unconstrained rows (copied), rows whose mask has not arrived (all -inf, reported
    missing), padding rows, and columns past the mask's width (forbidden)."""
    from blink.kernels.cpu import fused as cpu_fused
    from blink.kernels.reference import mask as mask_reference

    if cpu_fused.library() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    words = torch.randint(-2**31, 2**31 - 1, (8, n_words), generator=gen, dtype=torch.int64).to(torch.int32)
    epoch = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    slots = torch.tensor([3, 1, -1, 7, 0, 2])
    constrained = torch.tensor([True, True, True, False, True, True])
    expected = torch.tensor([3, 1, 0, 0, 9, 2])  # row 4: its mask has not arrived
    got, got_missing = cpu_fused.apply_token_mask(logits, words, epoch, slots, constrained, expected)
    want, want_missing = mask_reference.apply_token_mask(logits, words, epoch, slots, constrained, expected)
    assert torch.equal(got, want) and torch.equal(got_missing, want_missing)
    assert got_missing.tolist() == [False, False, False, False, True, False]
    assert not torch.isfinite(got[4]).any() and torch.equal(got[3], logits[3])
