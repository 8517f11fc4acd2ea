"""The eager CPU paged attention (blink.kernels.cpu.attention, the CPU table's entry) against
the reference, both of its paths (the C kernel and the SDPA one): decode, prefill, extend
over a cached prefix, an unused row and padding in one step; GQA/MQA/MHA; fp32 and bf16;
strided queries; the C kernel's threads; chunked tiles; the per-step memos; which path a
step takes; a bad block id; the fallback without a compiler; the C kernel's tiles for prompt
rows (AVX-512's on every AVX-512 CPU, AMX's where it has AMX)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from attention_cases import CPU_CASES, MIXED, kernel_threads_as_torchs, make_batch  # noqa: E402
from native_helpers import forced_native  # noqa: E402

from blink.kernels import ops_for  # noqa: E402
from blink.kernels.cpu import attention as cpu_attention
from blink.kernels.reference import layers as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

CASES = [
    *CPU_CASES,
    ([(0, 33), (12, 20)], 4, 1, 32, 8, torch.bfloat16),  # prefill + extend, bf16
]


def native_only(q, k_cache, v_cache, md, scale):
    """The C kernel whatever the cost estimate says."""
    md = dataclasses.replace(md, step_cache={"cpu_attention_prefer_native": True})
    assert cpu_attention._native_takes(q, k_cache, v_cache, md)
    return cpu_attention.paged_attention(q, k_cache, v_cache, md, scale)


def on_two_threads(q, k_cache, v_cache, md, scale):
    """The C kernel's output with its work split over two threads."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        return native_only(q, k_cache, v_cache, dataclasses.replace(md, step_cache=None), scale)
    finally:
        torch.set_num_threads(previous)


def native_against_fp32_reference(rows, n_heads, n_kv_heads, head_dim, block_size, dtype, pad_tokens):
    """The C kernel on a random step over ``rows`` and the reference in fp32 on the same
    inputs: (out, expected, live tokens, (q, k_cache, v_cache, md, scale))."""
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        rows, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype, pad_tokens=pad_tokens)
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    T = md.slot_mapping.shape[0]
    q = torch.randn(T, n_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    scale = head_dim**-0.5
    expected = ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), md, scale)
    return native_only(q, k_cache, v_cache, md, scale), expected, n_live, (q, k_cache, v_cache, md, scale)


IMPLS = {"native": native_only, "sdpa": cpu_attention.sdpa_paged_attention}


@pytest.fixture(scope="module", autouse=True)
def native_kernel_builds():
    """The C kernel must build here (CI has a compiler too), forced on so that a host
    without AVX-512, where it is not used by default, tests it as well."""
    with forced_native(cpu_attention.LIBRARY, cpu_attention.IMPL_ENV):
        assert cpu_attention.native_kernel() is not None
        yield


def test_the_cpu_table_uses_it():
    assert ops_for("cpu").paged_attention is cpu_attention.paged_attention


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("step_cache", [False, True])
@pytest.mark.parametrize("rows,n_heads,n_kv_heads,head_dim,block_size,dtype", CASES)
def test_matches_reference(rows, n_heads, n_kv_heads, head_dim, block_size, dtype, step_cache, impl):
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
        out = IMPLS[impl](q, k_cache, v_cache, md, scale)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out[:n_live].float(), expected[:n_live].float(), **TOL[dtype])
        assert torch.count_nonzero(out[n_live:]) == 0  # padding tokens: exact zeros
    if step_cache and impl == "sdpa":
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
    chunked = cpu_attention.sdpa_paged_attention(q, k_cache, v_cache, md, 0.25)
    torch.testing.assert_close(chunked[:n_live].float(), expected[:n_live].float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_strided_queries_threads_and_a_long_context(dtype):
    """q as the model passes it (a view of the fused QKV projection, rows strided), blocks
    of 32 keys (two 16-key score chunks each), contexts of thousands of keys, and the work
    split over threads (the kernel splits from 2 x 2^16 score multiply-adds, token-key
    visits x query heads x channels; this step has thousands of visits x 8 x 64): the same as
    the reference."""
    rows = [(3000, 1), (0, 0), (700, 1), (0, 40), (300, 2)]
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        rows, n_kv_heads=2, head_dim=64, block_size=32, dtype=dtype, pad_tokens=2)
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    T = md.slot_mapping.shape[0]
    qkv = torch.randn(T, (8 + 2 * 2) * 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = qkv[:, : 8 * 64].view(T, 8, 64)
    assert not q.is_contiguous()
    expected = ref.paged_attention(q.contiguous(), k_cache, v_cache, md, 0.125)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = native_only(q, k_cache, v_cache, md, 0.125)
            torch.testing.assert_close(out[:n_live].float(), expected[:n_live].float(), **TOL[dtype])
            assert torch.count_nonzero(out[n_live:]) == 0
    finally:
        torch.set_num_threads(previous)


# (query heads, KV heads, head size, block size): every group size 1-8 at heads of 64 and three
# at 128 (the shapes the kernel's per-token pass has as constants), and around them a group of
# 12, heads of 32 and 96 (the same pass with shapes read at run time) and of 80 (a head the
# bf16 chunks of an AVX-512 build do not take: 80 is not a multiple of 32), over blocks of 8 to
# 128 keys.
DECODE_SHAPES = [
    (1, 1, 64, 16), (4, 2, 64, 16), (9, 3, 64, 16), (8, 2, 64, 8), (5, 1, 64, 16), (12, 2, 64, 48),
    (14, 2, 64, 16), (8, 1, 64, 128), (2, 2, 128, 16), (32, 8, 128, 16), (8, 1, 128, 32),
    (24, 2, 64, 16), (4, 2, 32, 16), (6, 2, 96, 16), (4, 2, 80, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,block_size", DECODE_SHAPES)
def test_decode_rows_on_every_group_and_head_size(n_heads, n_kv_heads, head_dim, block_size, dtype):
    """Decode rows (the per-token pass) against the reference in fp32 on the same inputs,
    closer than the suite's bf16 bound: to bf16's rounding of the output. The bf16 pass of an
    AVX-512 or AVX2 build cuts a token's keys into chunks of about 128 in whole blocks and
    merges their softmax states: contexts of 4 keys (one chunk), 256 (two: 128 + 128 with
    blocks of 16), 257 (three: 96 + 96 + 65) and 601 (five), beside an unused row."""
    rows = [(255, 1), (0, 0), (256, 1), (600, 1), (3, 1)]
    out, expected, n_live, _ = native_against_fp32_reference(rows, n_heads, n_kv_heads, head_dim, block_size,
                                                             dtype, pad_tokens=2)
    # bf16: the output's rounding (2^-9 of a value) and fp32 sums in another order
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-4, rtol=4e-3)
    torch.testing.assert_close(out[:n_live].float(), expected[:n_live], **tol)
    assert torch.count_nonzero(out[n_live:]) == 0


def test_native_rejects_a_block_outside_the_cache():
    k_cache, v_cache, k_new, v_new, md, _ = make_batch([(20, 1)], n_kv_heads=1, head_dim=16,
                                                        block_size=4, dtype=torch.float32)
    md.block_tables[0, 2] = k_cache.shape[0] + 5
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="outside the KV cache"):
        native_only(q, k_cache, v_cache, md, 0.25)


@pytest.fixture(scope="module", params=["avx512-without-bf16", "avx2"])
def chunks_elsewhere(request):
    """The kernel built for another CPU than this one, where this one runs its code: AVX-512
    less AVX512_BF16 (as for Ice Lake or Skylake-X: the decode chunks score with FMAs on
    widened K instead of vdpbf16ps), and AVX2 (8-float vectors, as for Zen 2/3)."""
    from blink.shared.cpu_features import read_cpu_flags
    from blink.shared.native_build import build_library

    flags, native = read_cpu_flags() or frozenset(), cpu_attention.LIBRARY
    if request.param == "avx2":
        if not {"avx2", "fma"} <= flags:
            pytest.skip("this CPU runs no AVX2 code")
        build_flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in native.flags)
    else:
        if "avx512f" not in flags:
            pytest.skip("this CPU runs no AVX-512 code")
        build_flags = (*native.flags, "-mno-avx512bf16")
    library = build_library(native.source, build_flags, None, native.headers)
    native.setup(library)
    assert bool(library.blink_has_avx512()) == (request.param != "avx2")
    return library


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (32, 8, 128, 16), (24, 2, 64, 8), (6, 2, 96, 48)])
def test_decode_chunks_on_other_builds(n_heads, n_kv_heads, head_dim, block_size, chunks_elsewhere):
    """The same contract and bound as test_decode_rows_on_every_group_and_head_size on those
    builds, and within bf16's rounding of this CPU's build."""
    rows = [(255, 1), (0, 0), (600, 1), (3, 1)]
    with cpu_attention.LIBRARY.using(chunks_elsewhere):
        out, expected, n_live, step = native_against_fp32_reference(
            rows, n_heads, n_kv_heads, head_dim, block_size, torch.bfloat16, pad_tokens=2)
    torch.testing.assert_close(out[:n_live].float(), expected[:n_live], atol=2e-4, rtol=4e-3)
    assert torch.count_nonzero(out[n_live:]) == 0
    this_cpu = native_only(*step)
    torch.testing.assert_close(out[:n_live].float(), this_cpu[:n_live].float(), atol=2e-4, rtol=4e-3)


@pytest.mark.parametrize("context,bad_column", [(20, 0), (300, 9)])
def test_native_rejects_a_block_outside_the_cache_in_bf16_chunks(context, bad_column):
    """The bf16 decode pass (chunks of ~128 keys in AVX-512 and AVX2 builds, the per-token pass
    elsewhere) says so too: a bad block in a one-chunk context, and in the second of three."""
    k_cache, v_cache, k_new, v_new, md, _ = make_batch([(context, 1)], n_kv_heads=3, head_dim=64,
                                                        block_size=16, dtype=torch.bfloat16)
    md.block_tables[0, bad_column] = k_cache.shape[0] + 5
    q = torch.randn(1, 9, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="outside the KV cache"):
        native_only(q, k_cache, v_cache, md, 0.125)


def test_shapes_the_kernel_does_not_take_go_to_sdpa():
    """A head size that is not a multiple of 16, or 17 query heads per KV head: the torch
    path serves them (same contract), no error."""
    for n_heads, n_kv, head_dim in ((2, 1, 24), (17, 1, 16)):
        k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
            [(9, 1), (0, 4)], n_kv_heads=n_kv, head_dim=head_dim, block_size=4, dtype=torch.float32)
        q = torch.randn(md.slot_mapping.shape[0], n_heads, head_dim)
        assert not cpu_attention._native_takes(q, k_cache, v_cache, md)
        torch.testing.assert_close(cpu_attention.paged_attention(q, k_cache, v_cache, md, 0.25),
                                   ref.paged_attention(q, k_cache, v_cache, md, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,native", [
    ([(128, 1)] * 16, True),               # decode
    ([(2047, 1)] * 16, True),              # decode over long contexts
    ([(128, 1)] * 15 + [(0, 128)], True),  # a prompt among decodes
    ([(0, 128)], False),                   # a lone prefill: SDPA's blocked product
    ([(0, 128)] * 2, False),
    ([(100, 1), (0, 512)], False),         # one decode beside a long prompt
    ([(300, 1)] * 8 + [(1536, 512)], False),  # a long chunk over a long prefix
])
def test_which_path_a_step_takes(rows, native):
    """The cost estimate picks the path that was faster for these steps on SmolLM2's shapes
    (docs/performance.md#cpu-attention), and is made once per step."""
    k_cache, v_cache, _, _, md, _ = make_batch(rows, n_kv_heads=3, head_dim=64, block_size=16,
                                               dtype=torch.bfloat16)
    md = dataclasses.replace(md, max_context=max(c + n for c, n in rows),
                             max_query_len=max(n for c, n in rows), step_cache={})
    T = md.slot_mapping.shape[0]
    with kernel_threads_as_torchs():
        assert cpu_attention.prefer_native(md, T, 16) is native
    assert md.step_cache["cpu_attention_prefer_native"] is native


def test_without_a_compiler_the_torch_path_serves(without_c_compiler, caplog):
    """No C compiler: one warning, and every step runs (correctly) on the SDPA path."""
    without_c_compiler(cpu_attention.LIBRARY)
    with caplog.at_level("WARNING", logger="blink.kernels"):
        assert cpu_attention.native_kernel() is None
        assert cpu_attention.native_kernel() is None
    assert sum("C kernel" in r.getMessage() for r in caplog.records) == 1
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(MIXED, n_kv_heads=2, head_dim=16,
                                                            block_size=4, dtype=torch.float32)
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    q = torch.randn(md.slot_mapping.shape[0], 4, 16)
    torch.testing.assert_close(cpu_attention.paged_attention(q, k_cache, v_cache, md, 0.25)[:n_live],
                               ref.paged_attention(q, k_cache, v_cache, md, 0.25)[:n_live],
                               atol=1e-5, rtol=1e-5)


NO_AVX512_CC = """#!/bin/sh
# the system compiler, building for a CPU without AVX-512
for a; do shift; [ "$a" = "-march=native" ] && a="-march=x86-64-v3"; set -- "$@" "$a"; done
exec cc -mno-avx512f "$@"
"""


def test_a_build_without_avx512_runs_priced_as_measured(request, tmp_path, monkeypatch):
    """Without AVX-512 (AVX2 code, 8-float vectors) the kernel runs, correctly, at its own cost a
    key, without tiles: the estimate keeps decode steps on it (as decode graphs do) and sends
    long prompts to SDPA."""
    wrapper = tmp_path / "cc-no-avx512"
    wrapper.write_text(NO_AVX512_CC)
    wrapper.chmod(0o755)
    request.getfixturevalue("without_c_compiler")(cpu_attention.LIBRARY)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.delenv(cpu_attention.IMPL_ENV, raising=False)
    assert cpu_attention.native_kernel() is not None
    library = cpu_attention.LIBRARY.get()
    assert library.blink_has_avx512() == 0 and library.ns_per_visit == cpu_attention._AVX2_NATIVE_NS_PER_VISIT
    assert cpu_attention.tile_min_tokens() == 0
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (16, 64):  # one and several 8-float vectors a head
            k_cache, v_cache, k_new, v_new, md, n_live = make_batch(MIXED, n_kv_heads=2, head_dim=head_dim,
                                                                    block_size=4, dtype=dtype)
            ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
            q = torch.randn(md.slot_mapping.shape[0], 4, head_dim).to(dtype)
            torch.testing.assert_close(native_only(q, k_cache, v_cache, md, 0.25)[:n_live].float(),
                                       ref.paged_attention(q, k_cache, v_cache, md, 0.25)[:n_live].float(),
                                       **TOL[dtype])

    def picks_native(rows):
        *_, md, _ = make_batch(rows, n_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
        md = dataclasses.replace(md, max_query_len=max(n for _, n in rows), step_cache={})
        with kernel_threads_as_torchs():
            return cpu_attention.prefer_native(md, sum(n for _, n in rows), 16)

    assert picks_native([(127, 1)]) and picks_native([(2047, 1)] * 16) and picks_native([(4095, 1)])
    assert not picks_native([(0, 512)]) and not picks_native([(300, 1)] * 8 + [(1536, 512)])


def _cpu_has_amx() -> bool:
    """AMX in the CPU's flags, and the OS lets this process use it (the 4-bit kernel asks)."""
    from blink.kernels.cpu import q4_linear as cpu_q4_linear

    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags and " amx_tile" in flags and cpu_q4_linear.available()


def test_prompt_rows_take_tiles_on_every_avx512_cpu():
    """Prompt rows take tiles from 8 new tokens wherever the kernel is built with AVX-512: AMX's
    for bf16 queries and cache with whole 32-channel parts where the CPU has AMX (and the OS
    grants it), AVX-512's for every other call, each with its figure for the cost estimate; a
    build without AVX-512 has none."""
    library = cpu_attention.LIBRARY.get()
    if not library.blink_has_avx512():
        assert cpu_attention.tile_min_tokens() == 0
        assert cpu_attention.prompt_tiles(torch.float32, torch.float32, 64) == (0, 0.0)
        return
    amx = _cpu_has_amx()
    assert cpu_attention.tile_min_tokens() == 8 and library.tiles_on_amx == amx
    bf16, avx512 = torch.bfloat16, (8, cpu_attention._AVX512_TILE_NS_PER_VISIT)
    assert cpu_attention.prompt_tiles(bf16, bf16, 64) == ((8, cpu_attention._TILE_NS_PER_VISIT) if amx else avx512)
    assert cpu_attention.prompt_tiles(torch.float32, torch.float32, 64) == avx512
    assert cpu_attention.prompt_tiles(bf16, torch.float32, 64) == avx512
    assert cpu_attention.prompt_tiles(bf16, bf16, 48) == avx512  # not whole 32-channel parts
    assert ("AMX tiles for bf16" if amx else "AVX-512 tiles for prompt rows of 8+") in cpu_attention.describe()


needs_tiles = pytest.mark.skipif(not _cpu_has_amx(), reason="the tiles need AMX")

TILE_CASES = [
    # rows (cached, new), query heads, KV heads, head size, block size
    ([(0, 128), (0, 128)], 9, 3, 64, 16),              # SmolLM2's prompts
    ([(0, 37), (12, 20), (300, 1), (0, 8), (5, 7), (0, 0)], 4, 2, 64, 16),  # part tiles, decodes, 7 < 8 new
    ([(0, 100), (64, 50)], 8, 1, 128, 32),             # MQA, 32-key blocks
    ([(0, 33), (12, 20)], 4, 1, 32, 8),                # 8-key blocks: chunks span blocks
    ([(3000, 40)], 4, 2, 64, 16),                      # a long cached prefix
    ([(0, 40), (1, 9)], 2, 2, 256, 16),                # MHA, the largest head
    ([(0, 70)], 6, 2, 96, 16),                         # a head of three 32-channel parts
    ([(17, 16), (0, 16)], 32, 2, 64, 16),              # 16 query heads per KV head
]


@needs_tiles
@pytest.mark.parametrize("rows,n_heads,n_kv_heads,head_dim,block_size", TILE_CASES)
def test_amx_tiles_match_the_reference(rows, n_heads, n_kv_heads, head_dim, block_size):
    """bf16 prompt rows on the tiles (probabilities rounded to bf16 for the product with V):
    within bf16's tolerance of the fp32 reference and of the kernel's own fp32 per-token
    pass; padding tokens exact zeros; the same bits with two threads."""
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        rows, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
        pad_tokens=3)
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    T = md.slot_mapping.shape[0]
    q = torch.randn(T, n_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    scale = head_dim**-0.5
    expected = ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), md, scale)
    per_token = native_only(q.float(), k_cache.float(), v_cache.float(), md, scale)
    out = native_only(q, k_cache, v_cache, md, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:n_live].float(), expected[:n_live], **TOL[torch.bfloat16])
    torch.testing.assert_close(out[:n_live].float(), per_token[:n_live], **TOL[torch.bfloat16])
    assert torch.count_nonzero(out[n_live:]) == 0
    assert torch.equal(on_two_threads(q, k_cache, v_cache, md, scale), out)


def _avx512_build() -> bool:
    return bool(cpu_attention.LIBRARY.get().blink_has_avx512())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n_heads,n_kv_heads,head_dim,block_size", TILE_CASES)
def test_avx512_tiles_match_the_reference(rows, n_heads, n_kv_heads, head_dim, block_size, dtype):
    """Prompt rows on AVX-512's tiles (everything in fp32): within the dtype's tolerance of
    the fp32 reference (fp32's 1e-5); in fp32 other bits than the per-token pass (the kernel
    built without tiles) on the rows of 8+ new tokens, so the tiles ran (bf16 outputs may
    round both to the same bits), and the same bits on the others; padding tokens exact
    zeros; the same bits with two threads."""
    if not _avx512_build():
        pytest.skip("the kernel's tiles need AVX-512")
    if dtype == torch.bfloat16 and cpu_attention.LIBRARY.get().tiles_on_amx and head_dim % 32 == 0:
        pytest.skip("bf16 prompt rows take AMX's tiles on this CPU (test_amx_tiles_match_the_reference)")
    from benchmarks.bench_forward import _built_with

    out, expected, n_live, step = native_against_fp32_reference(rows, n_heads, n_kv_heads, head_dim, block_size,
                                                                dtype, pad_tokens=3)
    q, k_cache, v_cache, md, scale = step
    assert out.dtype == dtype
    torch.testing.assert_close(out[:n_live].float(), expected[:n_live], **TOL[dtype])
    assert torch.count_nonzero(out[n_live:]) == 0

    with cpu_attention.LIBRARY.using(_built_with(cpu_attention.LIBRARY, "TILES=0")):
        assert cpu_attention.tile_min_tokens() == 0
        per_token = native_only(q, k_cache, v_cache, dataclasses.replace(md, step_cache=None), scale)
    tokens = 0
    for cached, new in rows:
        span = slice(tokens, tokens + new)
        if new >= 8:
            if dtype == torch.float32:
                assert not torch.equal(out[span], per_token[span]), (cached, new)
        else:
            assert torch.equal(out[span], per_token[span]), (cached, new)
        tokens += new
    assert torch.equal(on_two_threads(q, k_cache, v_cache, md, scale), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["avx512", "amx"])
def test_tiles_reject_a_block_outside_the_cache(dtype):
    """A prompt row's laid-out context meets a block id past the cache: an error, on either
    kind of tiles (fp32: AVX-512's; bf16 on a CPU with AMX: AMX's)."""
    if not _avx512_build():
        pytest.skip("the kernel's tiles need AVX-512")
    if dtype == torch.bfloat16 and not _cpu_has_amx():
        pytest.skip("the tiles need AMX")
    k_cache, v_cache, k_new, v_new, md, _ = make_batch([(0, 40)], n_kv_heads=1, head_dim=32,
                                                        block_size=8, dtype=dtype)
    md.block_tables[0, 3] = k_cache.shape[0] + 5
    q = torch.randn(40, 2, 32).to(dtype)
    with pytest.raises(ValueError, match="outside the KV cache"):
        native_only(q, k_cache, v_cache, md, 0.25)


@pytest.mark.parametrize("tile_ns", [cpu_attention._TILE_NS_PER_VISIT, cpu_attention._AVX512_TILE_NS_PER_VISIT],
                         ids=["amx", "avx512"])
@pytest.mark.parametrize("rows", [
    [(0, 128)], [(0, 128)] * 2, [(100, 1), (0, 512)], [(300, 1)] * 8 + [(1536, 512)], [(0, 2048)],
    [(1000, 24)] * 4, [(128, 1)] * 16,
])
def test_with_tiles_the_kernel_takes_prefills_too(rows, tile_ns):
    """With tiles for rows of 8 new tokens or more, the estimate gives the C kernel every
    one of these steps, the prefills that SDPA took without them included (AMX's measured
    1.7-3.2x SDPA on SmolLM2's shapes, AVX-512's 2.3-10x on Zen 4: docs/performance.md#cpu-attention)."""
    _, _, _, _, md, _ = make_batch(rows, n_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    md = dataclasses.replace(md, max_context=max(c + n for c, n in rows),
                             max_query_len=max(n for c, n in rows))
    with kernel_threads_as_torchs():
        assert cpu_attention.prefer_native(md, md.slot_mapping.shape[0], 16, tile_min=8, tile_ns_per_visit=tile_ns)


def test_the_estimate_prices_sdpa_on_torchs_threads_and_the_kernel_on_its_own():
    """SDPA runs on torch's intra-op threads, the C kernel on the kernel threads: with one of
    the first and two of the second (blink serve on two cores) SDPA's estimate doubles, and a
    long chunk over a long cached prefix goes to the C kernel's tiles (14.9 ms a layer on SDPA
    there against 3.8 on the tiles, docs/performance.md#chunk-over-cache); at equal counts the
    figures are the fitted ones, which priced SDPA below AVX-512's tiles for this step."""
    from blink.kernels.cpu import threads as cpu_threads

    rows = [(1632, 268)]
    _, _, _, _, md, _ = make_batch(rows, n_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    md = dataclasses.replace(md, max_context=1900, max_query_len=268)

    def picks(torch_threads: int, pool_threads: int) -> bool:
        saved_torch, saved_pool = torch.get_num_threads(), cpu_threads._threads  # (None: torch's)
        torch.set_num_threads(torch_threads)
        cpu_threads.set_kernel_threads(pool_threads)
        try:
            return cpu_attention.prefer_native(dataclasses.replace(md, step_cache={}), 268, 16, tile_min=8,
                                               tile_ns_per_visit=cpu_attention._AVX512_TILE_NS_PER_VISIT)
        finally:
            torch.set_num_threads(saved_torch)
            cpu_threads.set_kernel_threads(saved_pool)

    assert not picks(1, 1) and not picks(2, 2)
    assert picks(1, 2)
    assert not picks(4, 1)  # (torch's many threads, the kernel on one: SDPA the more)


NO_AMX_CC = """#!/bin/sh
# the system compiler, building for this CPU less its AMX: what a CPU without AMX builds
exec cc "$@" -mno-amx-tile -mno-amx-bf16 -mno-amx-int8
"""


@needs_tiles
def test_amx_off_takes_the_path_of_a_cpu_without_amx(tmp_path, monkeypatch):
    """``$BLINK_CPU_AMX=0`` on a CPU with AMX (benchmarks/peers.py --no-amx): AVX-512's tiles,
    and the same bits as the kernel built for this CPU less AMX (a CPU without AMX: prompt rows
    on AVX-512's tiles, the others on the per-token pass, its scores on AVX-512), which differ
    from AMX's; within bf16's
    tolerance of the reference. The start log says so; the 4-bit AMX kernel is off too."""
    from blink.kernels.cpu import q4_linear as cpu_q4_linear

    # prompts (tiles with AMX), an extend, decodes (AMX scores), padding
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        [(0, 64), (40, 24), (300, 1), (97, 1)], n_kv_heads=3, head_dim=64, block_size=16,
        dtype=torch.bfloat16, pad_tokens=3)
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    q = torch.randn(md.slot_mapping.shape[0], 9, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

    def run() -> torch.Tensor:
        return native_only(q, k_cache, v_cache, dataclasses.replace(md, step_cache=None), 0.125)

    assert cpu_attention.tile_min_tokens() == 8 and "AMX tiles" in cpu_attention.describe()
    with_amx = run()
    monkeypatch.setenv("BLINK_CPU_AMX", "0")
    cpu_attention.LIBRARY.reset()
    assert cpu_attention.tile_min_tokens() == 8 and not cpu_attention.LIBRARY.get().tiles_on_amx
    assert "no AMX; $BLINK_CPU_AMX=0" in cpu_attention.describe()
    amx_off = run()
    cpu_q4_linear.LIBRARY.reset()
    try:
        assert not cpu_q4_linear.available()
        assert "BLINK_CPU_AMX=0" in cpu_q4_linear.LIBRARY.failure
    finally:
        cpu_q4_linear.LIBRARY.reset()

    wrapper = tmp_path / "cc-no-amx"
    wrapper.write_text(NO_AMX_CC)
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh build cache
    monkeypatch.delenv("BLINK_CPU_AMX")
    cpu_attention.LIBRARY.reset()
    try:
        assert cpu_attention.tile_min_tokens() == 8 and not cpu_attention.LIBRARY.get().tiles_on_amx
        assert "no AMX)" in cpu_attention.describe()
        without = run()
    finally:
        monkeypatch.undo()
        cpu_attention.LIBRARY.reset()  # decides again under the real environment
        # and the 4-bit kernel is decided again now, under the real environment: left undecided,
        # it would be built by whichever later test first asks, maybe one without a C compiler
        # (tests/conftest.py without_c_compiler), and stay unavailable for the rest of the run
        cpu_q4_linear.LIBRARY.reset()
        cpu_q4_linear.available()

    assert torch.equal(amx_off, without)
    assert not torch.equal(amx_off[:n_live], with_amx[:n_live])  # AMX's tiles round differently
    expected = ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), md, 0.125)
    torch.testing.assert_close(amx_off[:n_live].float(), expected[:n_live], **TOL[torch.bfloat16])
    assert torch.count_nonzero(amx_off[n_live:]) == 0
