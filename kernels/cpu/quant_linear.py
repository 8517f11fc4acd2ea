"""Projections on a GGUF file's own codes on CPUs without AMX: ``quant_linear.c``.

Why: a decode step streams every projection weight once, so its cost is the weight's bytes;
the file's 4-bit codes are ~4x fewer than bf16, its 8-bit ones 2x. The AMX kernel
(:mod:`blink.kernels.cpu.q4_linear`) needs AMX, which most CPUs people serve on lack (AMD
EPYC/Ryzen, older Xeons, cloud VMs that hide it); there torch's int4 kernel read Q4_0/Q4_1
codes for steps of few rows, and K-quants were dequantized to bf16 at load.

Two builds of one source, chosen at load by the CPU's flags (:func:`variant`, said once in the
log): ``avx512`` (AVX-512 F/BW/VL with BF16: per group of 32 channels ``x . q`` by vdpbf16ps on
the codes as exact bf16, then ``d (x . q) + m sum(x)`` in fp32) and ``avx2`` (x86-64-v3, no
AVX-512 instruction in that build: ``x . q`` in fp32 FMAs on x's fp32 values, then the same).
Both multiply
gguf's fp32 weights, no weight rounded (tests/test_cpu_quant_linear.py: the exactly rounded
fp32 product in all but a few outputs in a thousand, one bf16 step off).

Formats: ``w = d q + m`` per group of 32 (Q6_K: 16) input channels; 4-bit codes (Q4_0, Q4_1,
Q4_K) or 8-bit (Q8_0, Q6_K, Q5_K); d and m fp16 where they are (Q4_0, Q4_1, Q8_0), else fp32
(K-quants: the super-block's d times a sub-block scale). The layout is the AMX kernel's
(:func:`blink.kernels.cpu.q4_linear._b_tile_rows`).

``$BLINK_CPU_Q4``: ``avx512`` or ``avx2`` picks that build (and keeps the AMX kernel off, so a
CPU with AMX runs the path a CPU without it would), ``torch`` turns both off; unset, AMX where
it runs (:mod:`blink.models.int4_linear`) and this kernel for what the AMX kernel does not take.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from blink import env as blink_env
from blink.kernels.cpu import abi, pool as cpu_pool, q4_linear as cpu_q4_linear
from blink.kernels.cpu.q4_linear import GROUP, IMPL_ENV, TILE, _b_tile_rows, _from_b_tile_rows, _is_fp16
from blink.kernels.cpu.threads import kernel_threads
from blink.shared.native_build import NativeBuildError, NativeLibrary

log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("quant_linear.c")

#: the C kernel's format bits
F_BITS8, F_GROUP16, F_FP32, F_M = 1, 2, 4, 8

#: build -> (compiler flags, /proc/cpuinfo flags it needs, what the C reports, its name in the log)
VARIANTS = {
    "avx512": (("-O3", "-march=x86-64-v4", "-mavx512bf16", "-mtune=generic"),
               ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma", "f16c"), 512, "AVX-512 BF16"),
    "avx2": (("-O3", "-march=x86-64-v3", "-mtune=generic"), ("avx2", "fma", "f16c"), 2, "AVX2"),
}


def _declare(isa: int):
    def declare(library: ctypes.CDLL) -> None:
        abi.declare(library, abi.QUANT_LINEAR)
        cpu_pool.attach(library)
        if library.blink_quant_linear_isa() != isa:
            raise NativeBuildError(f"the build has no {isa} path (compiler flags ignored?)")
    return declare


def _library(name: str) -> NativeLibrary:
    flags, _, isa, label = VARIANTS[name]
    others = tuple(v for v in VARIANTS if v != name)
    return NativeLibrary(
        _SOURCE, what=f"4-bit CPU projections: the {label} kernel", logger=log,
        fallback=("4-bit projections run on the AVX2 build if it loads, else " if name == "avx512" else
                  "4-bit projections run on ") + "torch's int4 kernel for few rows and bf16 otherwise",
        # -ffp-contract=off: the sums' order and roundings are the source's
        flags=(*flags, "-ffp-contract=off"), headers=(_SOURCE.with_name("kernels.h"),),
        env=IMPL_ENV, env_value=("torch", *others), setup=_declare(isa),
        kernels=("blink_quant_linear",), queries=("blink_quant_linear_isa",))


LIBRARIES = {name: _library(name) for name in VARIANTS}

_chosen: list[str | None] = []  # [variant or None] once decided


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def switch() -> str:
    """``$BLINK_CPU_Q4`` (stripped, lower case; "" when unset)."""
    return blink_env.choice(IMPL_ENV)


def forced() -> bool:
    """Whether ``$BLINK_CPU_Q4`` names one of this kernel's builds (the AMX kernel stays off)."""
    return switch() in VARIANTS


def variant() -> str | None:
    """The build that runs here (``avx512`` or ``avx2``), decided once and said once in the
    log; None where neither runs (no compiler, a CPU without AVX2, ``$BLINK_CPU_Q4=torch``)."""
    if not _chosen:
        _chosen.append(_choose())
    return _chosen[0]


def reset() -> None:
    """Forget the choice and the builds, the AMX kernel's too, which ``$BLINK_CPU_Q4`` also
    governs (tests)."""
    _chosen.clear()
    for library in (*LIBRARIES.values(), cpu_q4_linear.LIBRARY):
        library.reset()


def _choose() -> str | None:
    wanted = switch()
    if wanted == "torch":
        return None
    flags = cpu_flags()
    names = [wanted] if wanted in VARIANTS else list(VARIANTS)
    for name in names:
        missing = [f for f in VARIANTS[name][1] if f not in flags]
        if missing:
            if wanted == name:
                log.warning("%s=%s: this CPU lacks %s; 4-bit projections run on torch's int4 kernel",
                            IMPL_ENV, name, " ".join(missing))
            continue
        if LIBRARIES[name].get() is not None:
            how = f"{IMPL_ENV}={wanted}" if wanted == name else "chosen by the CPU's flags"
            log.info("4-bit and K-quant CPU projections: the %s kernel (%s, %s: %s; %s=avx512|avx2|torch "
                     "chooses)", VARIANTS[name][3], _SOURCE.name, how, " ".join(VARIANTS[name][1]), IMPL_ENV)
            return name
    return None


def available() -> bool:
    """Whether one of the builds runs here (:func:`variant`)."""
    return variant() is not None


@dataclass
class QuantWeight:
    """One ``[n, k]`` projection (or a run of its output columns) in the kernel's layout."""

    codes: torch.Tensor  # 4-bit: int16 [n / 16, k / 32, 4, 32]; 8-bit: int8 [n / 16, k / 32, 16, 32]
    scales: torch.Tensor  # uint8: [n / 16, k / group, 1 or 2, 16] fp16 or fp32 d (then m)
    n: int
    k: int
    format: int  # F_* bits

    @property
    def bits(self) -> int:
        return 8 if self.format & F_BITS8 else 4

    @property
    def group(self) -> int:
        return 16 if self.format & F_GROUP16 else GROUP

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel()


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int = GROUP,
         bits: int = 4) -> QuantWeight | None:
    """``w[n, k] = codes[n, k] * d[n, k // group] + m[...]`` (m None: 0) -> the kernel's layout.
    ``codes``: uint8 0..15 (``bits`` 4) or int8 (``bits`` 8); d and m float32. None where the
    shape does not tile (n not a multiple of 16, k of 32, group not 16 or 32)."""
    n, k = codes.shape
    if (n % TILE or k % GROUP or group not in (16, GROUP) or d.shape != (n, k // group)
            or (m is not None and m.shape != d.shape)):
        return None
    fp32 = not (_is_fp16(d.float()) and (m is None or _is_fp16(m.float())))
    fmt = (F_GROUP16 if group == 16 else 0) | (F_FP32 if fp32 else 0) | (F_M if m is not None else 0)
    if bits == 4:
        if codes.dtype != torch.uint8 or int(codes.max()) > 15:
            return None
        rows = _b_tile_rows(codes.to(torch.int32)).reshape(n // TILE, k // GROUP, GROUP // 8, 4, 2 * TILE)
        words = rows[:, :, :, 0] | (rows[:, :, :, 1] << 4) | (rows[:, :, :, 2] << 8) | (rows[:, :, :, 3] << 12)
        packed = words.to(torch.int16).contiguous()
    elif bits == 8:
        if codes.dtype not in (torch.int8, torch.uint8) or (codes.dtype == torch.uint8 and int(codes.max()) > 127):
            return None
        packed = _b_tile_rows(codes.to(torch.int8)).contiguous()
        fmt |= F_BITS8
    else:
        return None
    parts = [d] if m is None else [d, m]
    values = torch.stack([p.float() for p in parts]).to(torch.float32 if fp32 else torch.float16)
    groups = k // group
    scales = values.view(len(parts), n // TILE, TILE, groups).permute(1, 3, 0, 2).contiguous()
    return QuantWeight(packed, scales.view(torch.uint8).reshape(-1), n, k, fmt)


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The float32 ``[n, k]`` weight the kernel multiplies, ``d q + m``."""
    n, k = weight.n, weight.k
    if weight.bits == 4:
        words = weight.codes.to(torch.int32) & 0xFFFF
        rows = torch.stack([(words >> (4 * i)) & 0x0F for i in range(4)], dim=3)
    else:
        rows = weight.codes
    q = _from_b_tile_rows(rows, n, k).float()
    s = 2 if weight.format & F_M else 1
    dtype = torch.float32 if weight.format & F_FP32 else torch.float16
    groups = k // weight.group
    scales = weight.scales.view(dtype).float().view(n // TILE, groups, s, TILE).permute(2, 0, 3, 1).reshape(s, n, groups)
    w = q.view(n, groups, weight.group) * scales[0][..., None]
    if s == 2:
        w = w + scales[1][..., None]
    return w.view(n, k)


def linear(x: torch.Tensor, parts: list[QuantWeight], bias: torch.Tensor | None,
           build: str | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bf16 ``x [..., k]`` (rows may be strided, channels contiguous),
    bf16 out; ``parts``: W's output columns in runs, each in its own format (a fused
    projection whose parts the file stores differently, e.g. Q4_K q/k and a Q6_K v).
    ``build``: that one (benchmarks), else :func:`variant`'s."""
    name = build or variant()
    library = None if name is None else LIBRARIES[name].get()
    if library is None:
        raise RuntimeError("the 4-bit CPU kernel without AMX is not available here (see available())")
    k = parts[0].k
    n = sum(p.n for p in parts)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype is not torch.bfloat16 or x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.to(torch.bfloat16).contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    if rows == 0:
        return y.view(*lead, n)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    col = 0
    threads = kernel_threads()
    for part in parts:
        status = library.blink_quant_linear(
            x2.data_ptr(), x2.stride(0), part.codes.data_ptr(), part.scales.data_ptr(),
            None if bias is None else bias.data_ptr() + 2 * col, y.data_ptr() + 2 * col, n,
            rows, part.n, part.k, part.format, threads)
        if status != 0:
            raise ValueError(f"the quantized CPU kernel refused x {tuple(x2.shape)} for a "
                             f"[{part.n}, {part.k}] weight of format {part.format} ({status})")
        col += part.n
    return y.view(*lead, n)
