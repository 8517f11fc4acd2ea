"""The Arm build of the kernel for CPUs without AMX (``neon_dotprod``: kernels/cpu/quant_linear.c
built for Armv8.2-A with the dot-product extension), which this machine cannot run: built by a
cross compiler for aarch64 and run under qemu-user (tests/cross/quant_linear_main.c drives it,
on the kernels' worker pool with two threads), its products are the bits of the x86 int8 build
this machine runs, for every format (a K-quant's file scales and fp32 ones, 6-bit codes in the
8-bit layout too), for row counts that end its block of 4 rows partway, fill several and cross
a panel of 128 (the tile's codes unpacked once for a panel's passes, or not), with a bias, and
for codes and activations at their extremes; they are the exact fp32 product of the quantized
x as the x86 builds' are; the build holds the dot-product instruction (sdot); and the CPU's
``asimddp`` flag chooses it.

Needs ``aarch64-linux-gnu-gcc`` and ``qemu-aarch64`` (Debian: gcc-aarch64-linux-gnu,
qemu-user; .ci/run installs them), skipped without them."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from blink.kernels.cpu import quant_linear as q
from blink.shared.native_build import compiler_version
sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from quant_weights import FORMATS, close_to_exact, exact_product, weight  # noqa: E402

CC, QEMU, OBJDUMP = "aarch64-linux-gnu-gcc", "qemu-aarch64", "aarch64-linux-gnu-objdump"
KERNELS = Path(q.__file__).parent
DRIVER = Path(__file__).with_name("cross") / "quant_linear_main.c"
BUILD = "neon_dotprod"

pytestmark = pytest.mark.skipif(not (shutil.which(CC) and shutil.which(QEMU)),
                                reason=f"needs {CC} and {QEMU} (Debian: gcc-aarch64-linux-gnu, qemu-user)")


@pytest.fixture(scope="module")
def arm_driver() -> Path:
    """The driver and the kernel, built for aarch64 with the flags the engine builds the
    ``neon_dotprod`` kernel with (the pool's copy of kernels.h's exported helpers renamed: each
    library that includes kernels.h defines them, and here both go in one binary). Kept in
    ``$XDG_CACHE_HOME/blink/cross`` by the hash of the compiler's version, the flags and the
    sources: the build takes a minute."""
    flags = [*q.VARIANTS[BUILD][0], "-ffp-contract=off", "-pthread"]
    sources = [KERNELS / "quant_linear.c", KERNELS / "pool.c", KERNELS / "kernels.h", DRIVER]
    key = hashlib.sha256((compiler_version(CC) or CC).encode() + " ".join(flags).encode()
                         + b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    out = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blink" / "cross" / key
    binary = out / "quant_linear_main"
    if binary.exists():
        return binary
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        pool, built = Path(tmp) / "pool.o", Path(tmp) / "quant_linear_main"
        subprocess.run([CC, *flags, "-Dblink_use_pool=blink_pool_use_pool", "-Dblink_has_avx512=blink_pool_has_avx512",
                        "-c", str(KERNELS / "pool.c"), "-o", str(pool)], check=True, capture_output=True, text=True)
        subprocess.run([CC, *flags, "-static", "-o", str(built), str(KERNELS / "quant_linear.c"), str(DRIVER),
                        str(pool), "-lm"], check=True, capture_output=True, text=True)
        os.replace(built, binary)  # whole or not at all (two test processes may build it at once)
    return binary


def run_on_arm(driver: Path, tmp: Path, weight_: q.QuantWeight, xs: list[torch.Tensor],
               bias: torch.Tensor | None) -> list[torch.Tensor]:
    """``x @ W.T (+ bias)`` for each x, by the Arm build under qemu-user, two threads."""
    lines = []
    for i, x in enumerate(xs):
        prefix = tmp / f"case{i}"
        x.bfloat16().contiguous().view(torch.int16).numpy().tofile(f"{prefix}.x")
        weight_.codes.contiguous().view(torch.uint8).numpy().tofile(f"{prefix}.codes")
        weight_.scales.contiguous().view(torch.uint8).numpy().tofile(f"{prefix}.scales")
        if bias is not None:
            bias.bfloat16().contiguous().view(torch.int16).numpy().tofile(f"{prefix}.bias")
        lines.append(f"{x.shape[0]} {weight_.n} {weight_.k} {weight_.format} 2 {int(bias is not None)} {prefix}")
    cases = tmp / "cases.txt"
    cases.write_text("\n".join(lines) + "\n")
    done = subprocess.run([QEMU, str(driver), str(cases)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = done.stdout.split("\n")
    assert said[0] == f"isa {q.VARIANTS[BUILD][2]}" and said[1:1 + len(xs)] == ["ok"] * len(xs), done.stdout
    return [torch.from_numpy(np.fromfile(tmp / f"case{i}.y", dtype=np.int16)).view(torch.bfloat16).view(x.shape[0], weight_.n)
            for i, x in enumerate(xs)]


def x86_int8_build() -> str:
    """An x86 int8 build this machine runs (they give the same bits: test_cpu_quant_linear.py)."""
    for name in ("avx512_vnni", "avx2_int8"):
        if all(f in q.cpu_flags() for f in q.VARIANTS[name][1]) and q.LIBRARIES[name].get() is not None:
            return name
    pytest.skip("no x86 int8 build runs here to compare with")


#: (format, n, k, packed in the 8-bit layout): each format with its file scales (k whole
#: super-blocks) and, for K-quants, fp32 ones (k = 160); Q6_K's codes in the 8-bit layout too
CASES = [(fmt, 48, 512, False) for fmt in FORMATS] + [(fmt, 32, 160, False) for fmt in ("q4_k", "q5_k", "q6_k")] \
    + [("q6_k", 32, 512, True)]


@pytest.mark.parametrize("fmt, n, k, wide", CASES)
def test_the_arm_build_gives_the_x86_int8_builds_bits(arm_driver, tmp_path, fmt, n, k, wide):
    codes, d, m, group, bits, k_scales = weight(fmt, n, k)
    w = q.pack(codes, d, m, group, bits, k_scales, narrow=not wide)
    assert (w.bits == 8) == (wide or fmt == "q8_0")
    torch.manual_seed(1)
    x, bias = torch.randn(133, k).bfloat16(), torch.randn(n).bfloat16()
    rows = (1, 3, 4, 5, 9, 68, 133)  # 68 and 133: 17 and 34 passes of 4 rows (unpacked codes)
    got = run_on_arm(arm_driver, tmp_path, w, [x[:r] for r in rows], bias)
    reference = x86_int8_build()
    for r, arm in zip(rows, got):
        assert torch.equal(arm, q.linear(x[:r], [w], bias, build=reference)), (reference, r)
        assert torch.equal(arm, got[-1][:r])  # a row's bits whatever the rows beside it
    close_to_exact(got[-1], exact_product(BUILD, fmt, x, codes, d, m, group, bias),
                   x.float().abs() @ q.dequantize(w).abs().T)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_extreme_codes_and_activations_stay_exact_on_arm(arm_driver, tmp_path, fmt):
    """Every code at its format's largest (or smallest) value against x whose quantized codes
    are all +-127 (as test_cpu_quant_linear.py's test for the x86 builds): sdot's int32 sums
    hold them, Q8_0's signed codes included."""
    bits, group, _, _ = FORMATS[fmt]
    low, high = {"q6_k": (-32, 31), "q5_k": (0, 31), "q8_0": (-128, 127)}.get(fmt, (0, 15))
    n, k = 32, 512
    codes, d, m, _, _, k_scales = weight(fmt, n, k, seed=3)
    codes[: n // 2] = high
    codes[n // 2: 3 * n // 4] = low
    codes[3 * n // 4:] = torch.where(torch.arange(k) % 2 == 0, high, low).to(codes.dtype)
    w = q.pack(codes, d, m, group, bits, k_scales)
    signs = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    x = torch.stack([torch.full((k,), 1.5), torch.full((k,), -0.75), 3.0 * signs, -signs]).bfloat16()
    (got,) = run_on_arm(arm_driver, tmp_path, w, [x], None)
    close_to_exact(got, exact_product(BUILD, fmt, x, codes, d, m, group), x.float().abs() @ q.dequantize(w).abs().T)
    assert torch.equal(got, q.linear(x, [w], None, build=x86_int8_build()))


def test_the_arm_build_multiplies_with_the_dot_product_instruction(arm_driver):
    if not shutil.which(OBJDUMP):
        pytest.skip(f"needs {OBJDUMP}")
    text = subprocess.run([OBJDUMP, "-d", str(arm_driver)], capture_output=True, text=True, check=True).stdout
    assert "\tsdot\t" in text and "zmm" not in text


def test_an_arm_cpu_with_the_dot_product_extension_chooses_it(monkeypatch):
    """A Neoverse N1's ``Features`` (AWS Graviton 2): the x86 builds lack their flags, so the
    Arm build is the one tried; without asimddp (an Armv8.0 core) none is."""
    graviton2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"
    tried = []

    class StandIn:  # records that the build was tried, loads nothing
        def __init__(self, name: str) -> None:
            self.name = name

        def get(self) -> None:
            tried.append(self.name)

        def reset(self) -> None:
            pass

    monkeypatch.setattr(q, "cpu_flags", lambda: frozenset(graviton2.split()))
    monkeypatch.delenv("BLINK_CPU_Q4", raising=False)
    monkeypatch.setattr(q, "LIBRARIES", {name: StandIn(name) for name in q.VARIANTS})
    q.reset()
    try:
        assert q.variant() is None and tried == [BUILD]
        q.reset()
        tried.clear()
        monkeypatch.setattr(q, "cpu_flags", lambda: frozenset(graviton2.replace(" asimddp", "").split()))
        assert q.variant() is None and tried == []
    finally:
        q.reset()
