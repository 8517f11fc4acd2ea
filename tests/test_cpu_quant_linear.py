"""The 4-bit / K-quant projection kernel for CPUs without AMX (blink.kernels.cpu.quant_linear),
each of its x86 builds (AVX-512 VNNI, AVX-512 BF16, AVX2 with AVX-VNNI, AVX2 int8, AVX2) this CPU runs whatever else
it has: its layout holds the file's exact weights, its products match an fp32 product on them
(of the int8 builds' quantized x) to the last bf16 bit almost everywhere for every format, row
count and shape it takes, extreme codes and activations included, the AVX2 builds hold no
AVX-512 instruction, the int8 builds give the same bits, and ``$BLINK_CPU_Q4`` chooses the
build (the AMX kernel off). The Arm build: tests/test_cpu_quant_linear_arm.py, under qemu-user."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blink.kernels.cpu import q4_linear as cpu_q4_linear, quant_linear as q
sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from quant_weights import CODE_BITS, FORMATS, MACHINE_BUILDS, close_to_exact, exact_product, weight  # noqa: E402

FLAGS = q.cpu_flags()


def runs(name: str) -> bool:
    return all(f in FLAGS for f in q.VARIANTS[name][1])


@pytest.fixture(params=MACHINE_BUILDS)
def build(request, monkeypatch):
    """Each build in turn, chosen through ``$BLINK_CPU_Q4`` as a user would."""
    if not runs(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, request.param)
    q.reset()
    if q.variant() != request.param:
        pytest.skip(f"the {request.param} build is not available here (no compiler?)")
    yield request.param
    monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
    q.reset()


@pytest.mark.parametrize("k", [96, 512])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_layout_holds_the_weights(fmt, k):
    codes, d, m, group, bits, k_scales = weight(fmt, 48, k)
    w = q.pack(codes, d, m, group, bits, k_scales)
    assert w is not None and w.bits == CODE_BITS[fmt] and w.group == group
    want = codes.float().view(48, k // group, group) * d[..., None] + (0 if m is None else m[..., None])
    assert torch.equal(q.dequantize(w), want.view(48, k))
    assert w.codes.numel() * w.codes.element_size() == 48 * k * w.bits // 8
    # fp16 scales where the file's are; a K-quant's file scales where k is whole super-blocks
    assert bool(w.format & q.F_K) == (k_scales is not None) == (FORMATS[fmt][3] and k % 256 == 0)
    assert bool(w.format & q.F_FP32) == (FORMATS[fmt][3] and k % 256 != 0)
    assert bool(w.format & q.F_M8) == (fmt == "q4_0")
    if bits == 8:  # the 8-bit layout on request (benchmarks), the same weights
        eight = q.pack(codes, d, m, group, bits, k_scales, narrow=False)
        assert eight.bits == 8 and torch.equal(q.dequantize(eight), want.view(48, k))
    if k_scales is not None:  # scales the file's d and m do not give are refused
        k_scales.sc[3, 1] += 1
        with pytest.raises(ValueError, match="not its d and m"):
            q.pack(codes, d, m, group, bits, k_scales)


def test_pack_refuses_what_the_kernel_cannot_hold():
    codes, d, m, group, bits, _ = weight("q4_1", 48, 96)
    assert q.pack(codes[:40], d[:40], m[:40]) is None  # not whole tiles
    assert q.pack(codes[:, :80], d[:, :2], m[:, :2]) is None  # not whole groups
    assert q.pack(codes, d[:, :2], m) is None
    assert q.pack(codes + 16, d, m) is None  # not 4-bit codes


# rows: one pass, passes of 8 with a partial last, two panels of 128; k: K-quants with fp32
# scales per group (not whole super-blocks) and with the file's (512, 768)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 33, 300])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 160), (80, 576), (32, 512), (16, 768)])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_matches_the_fp32_product(build, fmt, rows, n, k):
    codes, d, m, group, bits, k_scales = weight(fmt, n, k, seed=rows + n)
    w = q.pack(codes, d, m, group, bits, k_scales)
    assert bool(w.format & q.F_K) == (k_scales is not None)
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k).bfloat16()
    x[:, k // 2] = 2  # (the channel whose code is made wrong below)
    bias = torch.randn(n).bfloat16() if rows % 2 else None
    got = q.linear(x, [w], bias)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    dense = q.dequantize(w)
    want = exact_product(build, fmt, x, codes, d, m, group, bias)
    close_to_exact(got, want, x.float().abs() @ dense.abs().T + (0 if bias is None else bias.float().abs()))
    # the test can fail: one wrong code moves its column (and only it) by ~d |x| >> a bf16 step
    wrong = codes.clone()
    if w.bits == 6:  # both planes: the low nibble's top bit and the 2 high bits
        wrong[n // 2, k // 2] = ((wrong[n // 2, k // 2] + 32) ^ 56) - 32
    elif w.bits == 5:  # both planes: the low nibble's top bit and the top bit
        wrong[n // 2, k // 2] ^= 24
    else:
        wrong[n // 2, k // 2] ^= 8 if bits == 4 else 64
    bad = q.pack(wrong, d, m, group, bits, k_scales)
    assert bad.format == w.format
    off = q.linear(x, [bad], bias).float()
    assert (off[:, n // 2] - got[:, n // 2].float()).abs().max() > 0
    assert torch.equal(off[:, : n // 2], got[:, : n // 2].float())


def test_parts_strided_rows_leading_dims_and_an_empty_step(build):
    """A fused projection whose parts are in different formats (Q4_K q, k and a Q6_K v) is one
    call per part into one output, the same bits as each part alone."""
    parts = [q.pack(*weight("q4_k", 32, 256, seed=1)), q.pack(*weight("q6_k", 16, 256, seed=2)),
             q.pack(*weight("q4_1", 48, 256, seed=3))]
    assert [p.format & (q.F_K | q.F_BITS6) for p in parts] == [q.F_K, q.F_K | q.F_BITS6, 0]
    torch.manual_seed(0)
    fused = torch.randn(3, 5, 3 * 256).bfloat16()
    x = fused[..., 256:512]  # a view into a fused projection's output: rows 768 apart
    bias = torch.randn(96).bfloat16()
    got = q.linear(x, parts, bias)
    assert got.shape == (3, 5, 96)
    assert torch.equal(got, q.linear(x.contiguous(), parts, bias))
    assert torch.equal(got[..., 32:48], q.linear(x, parts[1:2], bias[32:48]))
    assert torch.equal(got[..., 48:], q.linear(x, parts[2:], bias[48:]))
    assert q.linear(torch.zeros(0, 256).bfloat16(), parts, None).shape == (0, 96)


@pytest.mark.parametrize("rows", [3, 40])
def test_threads_split_the_work_with_the_same_bits(build, rows):
    w = q.pack(*weight("q4_k", 1024, 2048))
    x = torch.randn(rows, 2048).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q.linear(x, [w], None)
        torch.set_num_threads(2)
        two = q.linear(x, [w], None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_builds_agree_and_the_avx2_ones_have_no_avx512_instruction(monkeypatch):
    names = [name for name in q.VARIANTS if runs(name)]
    if len(names) < 2:
        pytest.skip("this CPU cannot run two builds")
    codes, d, m, group, bits, k_scales = weight("q6_k", 64, 256)
    w = q.pack(codes, d, m, group, bits, k_scales)
    x = torch.randn(4, 256).bfloat16()
    out = {}
    for name in names:
        monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, name)
        q.reset()
        assert q.variant() == name and not cpu_q4_linear.available()  # the AMX kernel stays off
        out[name] = q.linear(x, [w], None).float()
        if shutil.which("objdump"):
            path = q.LIBRARIES[name].get()._name
            text = subprocess.run(["objdump", "-d", path], capture_output=True, text=True, check=True).stdout
            avx2 = name in ("avx2", "avx2_int8", "avx2_vnni")
            assert ("zmm" in text) == (not avx2) and ("vdpbf16ps" in text) == (name == "avx512")
            # the AVX-VNNI build's vpdpbusd is the VEX one, on ymm registers only
            assert ("vpdpbusd" in text) == (name in ("avx512_vnni", "avx2_vnni"))
            assert ("vpmaddubsw" in text) == (name == "avx2_int8")
    monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
    q.reset()
    dense = q.dequantize(w)
    for name, got in out.items():
        close_to_exact(got, exact_product(name, "q6_k", x, codes, d, m, group), x.float().abs() @ dense.abs().T)
    int8 = [out[name] for name in sorted(q.INT8_BUILDS & set(out))]
    for other in int8[1:]:  # the same integer sums and fp32 operations in the same order
        assert torch.equal(other, int8[0])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_int8_builds_agree_for_every_format_and_row_count(monkeypatch, fmt):
    """The int8 builds keep x in blocks of their own rows per pass (8 and 4) and a loop per
    format kind: the same bits still, for each format and for row counts that end a block
    partway, fill several and cross a panel of 128 (a wrong block offset reads another row's x),
    with the tile's codes unpacked once for a panel's passes (68: 8 passes and a last of 4 in
    the VNNI build; 133) or not (up to 9 rows), and a row's bits whichever its call took."""
    names = sorted(name for name in q.INT8_BUILDS if runs(name))  # (the Arm one: test_cpu_quant_linear_arm.py)
    if len(names) < 2:
        pytest.skip("this CPU cannot run two int8 builds")
    w = q.pack(*weight(fmt, 48, 512))
    torch.manual_seed(0)
    x, bias = torch.randn(133, 512).bfloat16(), torch.randn(48).bfloat16()
    out = {}
    for name in names:
        monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, name)
        q.reset()
        assert q.variant() == name
        out[name] = [q.linear(x[:rows], [w], bias) for rows in (1, 5, 9, 68, 133)]
    monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
    q.reset()
    first, *others = out.values()
    for other in others:
        for a, b in zip(first, other):
            assert torch.equal(a, b)
    for calls in out.values():
        for part in calls[:-1]:
            assert torch.equal(part, calls[-1][:part.shape[0]])


def test_the_choice_is_said_once_and_torch_turns_it_off(monkeypatch, caplog):
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, "torch")
    q.reset()
    try:
        assert q.variant() is None and not q.available()
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        q.reset()
        with caplog.at_level("INFO", logger="blink.kernels"):
            chosen = q.variant()
            q.variant()
        said = [r.getMessage() for r in caplog.records if "K-quant CPU projections" in r.getMessage()]
        if chosen is None:
            pytest.skip("no build runs here")
        assert len(said) == 1 and q.VARIANTS[chosen][3] in said[0] and "chosen by the CPU's flags" in said[0]
        assert chosen == next(name for name in q.VARIANTS if runs(name))
    finally:
        q.reset()


def test_a_build_the_cpu_cannot_run_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(q, "cpu_flags", lambda: {"avx2", "fma", "f16c"})  # a CPU without AVX-512
    monkeypatch.setenv(cpu_q4_linear.IMPL_ENV, "avx512")
    q.reset()
    try:
        with caplog.at_level("WARNING", logger="blink.kernels"):
            assert q.variant() is None
        assert any("lacks avx512f" in r.getMessage() for r in caplog.records)
        monkeypatch.delenv(cpu_q4_linear.IMPL_ENV)
        q.reset()
        assert q.variant() in ("avx2_int8", None)  # by the flags: the AVX2 int8 build
    finally:
        q.reset()


# ------------------------------------------------------------- a GGUF file's codes, K-quants too


def random_blocks(qtype, rows: int, cols: int, seed: int = 0):
    """Random bytes in ``qtype``'s block layout, its fp16 fields finite (every code, scale and
    min bit pattern occurs)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[qtype.name]
    for at in halves:
        data[..., at:at + 2] = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


#: the kernel's bytes (codes and scales) over the file's: Q4_K's 6-bit sc/mn kept in a byte each
#: (4.625 bits a weight, the file 4.5; Q5_K 5.625, the file 5.5), the others' the file's (Q4_0's
#: m = -8d formed in the kernel)
FILE_BYTES_MARGIN = {"Q4_0": 1.0, "Q4_1": 1.0, "Q8_0": 1.0, "Q4_K": 1.03, "Q5_K": 1.03, "Q6_K": 1.0}


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_unpacked_codes_are_what_gguf_dequantizes_bit_for_bit(name):
    import gguf
    import numpy as np

    from blink.loader.gguf_weights import unpack_codes

    qtype = gguf.GGMLQuantizationType[name]
    rows, cols = 48, 512
    data = random_blocks(qtype, rows, cols, seed=len(name))
    codes = unpack_codes(data, name, rows, cols)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(rows, cols).astype(np.float32))
    assert torch.equal(codes.dequantize(), want)
    assert codes.codes.dtype == (torch.uint8 if codes.bits == 4 else torch.int8)
    assert (codes.bits, codes.group) == {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32),
                                         "Q5_K": (8, 32), "Q6_K": (8, 16)}[name]
    # and the kernel's layout holds them (fp16 scales where the file's are)
    w = q.pack(codes.codes, codes.d, codes.m, codes.group, codes.bits, codes.k_scales)
    assert torch.equal(q.dequantize(w), want)
    assert bool(w.format & q.F_K) == name.endswith("_K") and not w.format & q.F_FP32
    # what a product reads is (about) the file's bytes: scales included
    file_bytes = data.nbytes
    assert w.nbytes() <= FILE_BYTES_MARGIN[name] * file_bytes, (w.nbytes(), file_bytes)
    # the test can fail: a block's bytes one off give other weights
    data[0, 5] ^= 0x11
    assert not torch.equal(unpack_codes(data, name, rows, cols).dequantize(), want)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_extreme_codes_and_activations_stay_exact(build, fmt):
    """Every code at its format's largest (or smallest) value against x whose quantized codes
    are all +-127: the int8 builds' 16-bit pair sums (vpmaddubsw) and their sums in int16
    reach their bounds and must not saturate or wrap (an 8-bit code as q + 128 would)."""
    bits, group, _, _ = FORMATS[fmt]
    low, high = {"q6_k": (-32, 31), "q5_k": (0, 31), "q8_0": (-128, 127)}.get(fmt, (0, 15))
    n, k = 32, 512
    codes, d, m, _, _, k_scales = weight(fmt, n, k, seed=3)
    codes[: n // 2] = high  # columns all at the top, then all at the bottom, then alternating
    codes[n // 2: 3 * n // 4] = low
    codes[3 * n // 4:] = torch.where(torch.arange(k) % 2 == 0, high, low).to(codes.dtype)
    w = q.pack(codes, d, m, group, bits, k_scales)
    signs = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    x = torch.stack([torch.full((k,), 1.5), torch.full((k,), -0.75), 3.0 * signs, -signs]).bfloat16()
    assert q.quantize_activations(x)[0].abs().eq(127).all()  # each group's codes all +-127
    got = q.linear(x, [w], None)
    dense = q.dequantize(w)
    close_to_exact(got, exact_product(build, fmt, x, codes, d, m, group), x.float().abs() @ dense.abs().T)


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q4_k", "q5_k", "q6_k"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(build, fmt):
    """A decode graph pads a step to its bucket, and a served row shares its step with others:
    each row is summed the same way whatever the step's row count."""
    w = q.pack(*weight(fmt, 64, 768))
    x = torch.randn(11, 768).bfloat16()
    alone = torch.cat([q.linear(x[i:i + 1], [w], None) for i in range(11)])
    for rows in (2, 5, 8, 11):
        assert torch.equal(q.linear(x[:rows], [w], None), alone[:rows])


def test_without_a_compiler_torchs_kernel_takes_the_weights(without_c_compiler, monkeypatch, caplog):
    from blink.models import int4_linear

    monkeypatch.delenv(cpu_q4_linear.IMPL_ENV, raising=False)
    q.reset()
    for library in (*q.LIBRARIES.values(), cpu_q4_linear.LIBRARY):
        without_c_compiler(library)
    try:
        with caplog.at_level("WARNING", logger="blink.kernels"):
            assert q.variant() is None
        assert any("K-quant" not in r.getMessage() and "not available" in r.getMessage() for r in caplog.records)
        codes, d, m, _, _, _ = weight("q4_1", 64, 128)
        packed = int4_linear.pack(codes, d, m + 8 * d)
        assert packed.kernel == "torch"
        with pytest.raises(RuntimeError, match="not available"):
            q.linear(torch.randn(1, 128).bfloat16(), [q.pack(codes, d, m)], None)
    finally:
        q.reset()


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_the_file_scales_and_6_bit_codes_give_the_bits_of_fp32_scales_and_8_bit_codes(build, fmt):
    """The compact layout (the file's scales, d * sc formed in the kernel, exact; Q6_K's codes in
    6 bits, Q5_K's in 5) is the same product as the one it replaced (fp32 d and m per group, 8-bit codes),
    bit for bit, at decode and prefill row counts (the int8 builds: each the exact product on its
    own x, per super-block on the file's scales: activation_group), and reads about 2/3 of its
    bytes or less."""
    codes, d, m, group, bits, k_scales = weight(fmt, 48, 512, seed=7)
    compact = q.pack(codes, d, m, group, bits, k_scales)
    before = q.pack(codes, d, m, group, bits, None, narrow=False)
    assert compact.format & q.F_K and not before.format & q.F_K and before.format & q.F_FP32
    assert compact.nbytes() <= (0.78 if fmt == "q4_k" else 0.67) * before.nbytes()
    x = torch.randn(40, 512).bfloat16()
    magnitude = x.float().abs() @ q.dequantize(compact).abs().T
    for rows in (1, 3, 16, 40):
        got = q.linear(x[:rows], [compact], None)
        if build in q.INT8_BUILDS:  # x per super-block on the file's scales, per 32 on fp32 ones
            close_to_exact(got, exact_product(build, fmt, x[:rows], codes, d, m, group), magnitude[:rows])
        else:
            assert torch.equal(got, q.linear(x[:rows], [before], None))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_packing_some_rows_at_a_time_gives_the_whole_weights_layout(fmt, monkeypatch):
    """``pack`` packs the codes 16 rows at a time here (a large head packs a few MB at a time):
    the same layout, scales and format as in one piece."""
    codes, d, m, group, bits, k_scales = weight(fmt, 48, 512, seed=3)
    whole = q.pack(codes, d, m, group, bits, k_scales)
    monkeypatch.setattr(q, "PACK_ROW_WEIGHTS", 16 * 512)
    parts = q.pack(codes, d, m, group, bits, k_scales)
    assert torch.equal(parts.codes, whole.codes) and torch.equal(parts.scales, whole.scales)
    assert (parts.format, parts.codes.shape) == (whole.format, whole.codes.shape)
    monkeypatch.setattr(q, "PACK_ROW_WEIGHTS", 1 << 40)  # the test can fail: other codes, other layout
    other = codes.clone()
    other[40] = other[41]
    assert not torch.equal(q.pack(other, d, m, group, bits, k_scales).codes, whole.codes)


def test_the_layout_is_chosen_from_every_row_not_the_first_ones(monkeypatch):
    """Q6_K codes whose first rows all fit 5 bits keep the 6-bit layout of the whole tensor."""
    codes, d, m, group, bits, k_scales = weight("q6_k", 48, 512, seed=4)
    codes[:16] = codes[:16].abs().clamp(max=31)
    monkeypatch.setattr(q, "PACK_ROW_WEIGHTS", 16 * 512)
    w = q.pack(codes, d, m, group, bits, k_scales)
    assert w.format & q.F_BITS6 and not w.format & q.F_BITS5
    want = (codes.float().view(48, -1, group) * d[..., None]).view(48, 512)
    assert torch.equal(q.dequantize(w), want)


def test_the_codes_go_where_the_caller_allocates_them():
    """``pack(empty=...)``: the codes are packed into the caller's tensor (the executor's 2 MB
    pages), the same layout as in torch's memory."""
    codes, d, m, group, bits, k_scales = weight("q6_k", 48, 512, seed=5)
    made = []

    def empty(shape, dtype):
        made.append(torch.full(shape, 7, dtype=dtype))
        return made[-1]

    w = q.pack(codes, d, m, group, bits, k_scales, empty=empty)
    assert len(made) == 1 and w.codes.data_ptr() == made[0].data_ptr()
    assert torch.equal(w.codes, q.pack(codes, d, m, group, bits, k_scales).codes)


def test_the_amx_kernels_4_bit_weight_is_this_kernels_byte_for_byte():
    """view_of_q4's premise: the AMX kernel's pack and this kernel's pack of one Q4_1 weight
    (fp16 d and m) give the same codes and scales bytes, and of one Q8_0 weight the same
    codes, so the view is the weight this kernel would have packed. No AMX needed: the
    packing is torch code."""
    torch.manual_seed(3)
    n, k = 48, 256
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.02).half().float()
    m = (torch.randn(n, k // 32) * 0.05).half().float()
    amx = cpu_q4_linear.pack(codes, d, m + 8 * d)  # (scale, zero) as the AMX kernel takes them
    own = q.pack(codes, d, m)
    view = q.view_of_q4(amx)
    assert (view.n, view.k, view.format, view.bits, view.group) == (own.n, own.k, own.format, 4, 32)
    assert view.codes.data_ptr() == amx.codes.data_ptr() and view.scales.data_ptr() == amx.scales.data_ptr()
    assert torch.equal(view.codes.view(torch.uint8), own.codes.contiguous().view(torch.uint8))
    assert torch.equal(view.scales, own.scales.contiguous().view(-1))
    # 8-bit (a Q8_0 head): the same codes, d alone copied (this kernel's 8-bit layout has no m)
    codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    amx8, own8 = cpu_q4_linear.pack_q8(codes8, d), q.pack(codes8, d, None, bits=8, narrow=False)
    view8 = q.view_of_q4(amx8)
    assert (view8.format, view8.bits) == (own8.format, 8) and view8.codes.data_ptr() == amx8.codes.data_ptr()
    assert torch.equal(view8.codes.view(torch.uint8), own8.codes.contiguous().view(torch.uint8))
    assert torch.equal(view8.scales, own8.scales.contiguous().view(-1))
