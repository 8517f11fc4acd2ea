"""Projections on a GGUF file's own codes on CPUs without AMX: ``quant_linear.c``.

Why: a decode step streams every projection weight once, so its cost is the weight's bytes;
the file's 4-bit codes are ~4x fewer than bf16, its 8-bit ones 2x. The AMX kernel
(:mod:`blink.kernels.cpu.q4_linear`) needs AMX, which most CPUs people serve on lack (AMD
EPYC/Ryzen, older Xeons, cloud VMs that hide it); there torch's int4 kernel read Q4_0/Q4_1
codes for steps of few rows, and K-quants were dequantized to bf16 at load.

Six builds of one source, the first the CPU's flags allow chosen at load (:func:`variant`,
said once in the log):

- ``avx512_vnni`` (AVX-512 F/BW/VL with VNNI: Intel Cascade Lake, Ice Lake and later, AMD
  Zen 4 and 5): x quantized to int8 as llama.cpp quantizes its activations
  (:func:`quantize_activations`: per row and group of 32 channels, or of 256 for K-quants on
  the file's scales as its Q8_K, :func:`activation_group`; scale max|x| / 127), each
  group's ``x . q`` an exact int32 sum by vpdpbusd, then ``s d (sum(u qx) - off sum(qx)) + m s
  sum(qx)`` in fp32 (the min on the sum of the rounded x, as llama.cpp's Q8_1: x's rounding
  errors meet the whole, centred weight). Its cost grows ~8x slower with the rows than
  vdpbf16ps' (two vpdpbusd a cycle with 64 products each, one vdpbf16ps every two with 32, on
  Sapphire Rapids), so every step runs on it, prefills too, and no bf16 copy is kept.
- ``avx2_int8`` (x86-64-v3: AVX2, FMA, F16C, no AVX-512 instruction; Intel Haswell to Comet
  Lake, AMD Zen 1 to 3): the same int8 arithmetic on 256-bit registers, each group's sum exact
  by vpmaddubsw (32 byte products an instruction) and vpmaddwd: the ``avx512_vnni`` build's
  bits. Every step runs on it, as on that build: the fp32 FMAs of ``avx2`` multiply 8 products
  an instruction, and such a CPU has no native bf16 for the bf16 copy.
- ``avx2_vnni`` (``avx2_int8`` with AVX-VNNI, ``avx_vnni`` in ``/proc/cpuinfo``, still no
  AVX-512 instruction: Intel Alder Lake and later client cores, Xeon 6 E-cores (Sierra
  Forest)): the 256-bit vpdpbusd sums a vector's byte products into int32 in one instruction
  where ``avx2_int8`` takes vpmaddubsw, vpaddw and a share of vpmaddwd; the same bits, chosen
  before ``avx2_int8``. On Zen 5 capped to it (no CPU without AVX-512 is at hand) 1.13-1.19x
  ``avx2_int8``'s products at 1 to 128 rows, one thread (docs/performance.md#avx-vnni).
- ``avx512`` (AVX-512 F/BW/VL with BF16: per group of 32 channels ``x . q`` by vdpbf16ps on
  the codes as exact bf16, then ``d (x . q) + m sum(x)`` in fp32) and ``avx2`` (x86-64-v3, no
  AVX-512 instruction in that build: ``x . q`` in fp32 FMAs on x's fp32 values, then the
  same): x as it is, for steps of few rows (a bf16 copy takes the others); ``avx2`` runs
  only where ``$BLINK_CPU_Q4`` asks for it (``avx2_int8`` runs on the same CPUs first).
- ``neon_dotprod`` (Armv8.2-A with the dot-product extension, ``asimddp`` in
  ``/proc/cpuinfo``: Arm Neoverse servers such as AWS Graviton 2-4 and Ampere Altra, Apple M1
  and later): the same int8 arithmetic by sdot (16 signed byte products into four int32
  sums an instruction), the x86 int8 builds' bits. No Arm machine is at hand here:
  tests/test_cpu_quant_linear_arm.py builds it with a cross compiler and runs it under
  qemu-user against the x86 int8 build this machine runs; its speed is not measured.

All multiply gguf's fp32 weights, no weight rounded (tests/test_cpu_quant_linear.py: the
exactly rounded fp32 product, of :func:`quantize_activations`' x for the int8 builds, in all
but a few outputs in a thousand, one bf16 step off).

Formats: ``w = d q + m`` per group of 32 (Q6_K: 16) input channels (Q4_0's m = -8d formed in
the kernel, not stored); 4-bit codes (Q4_0, Q4_1,
Q4_K), 5-bit (Q5_K), 6-bit (Q6_K) or 8-bit (Q8_0); d and m fp16 where they are (Q4_0, Q4_1, Q8_0), a
K-quant's as its file holds them (fp16 d and dmin per 256 channels, an int8 scale and min per
group: ``F_K``), so a decode step reads about the file's bytes (Q4_K 4.625 bits a weight, the
file 4.5; Q5_K 5.625, the file 5.5; Q6_K the file's 6.5625). The layout is the AMX kernel's
(:func:`blink.kernels.cpu.q4_linear._b_tile_rows`) for the 4- and 8-bit codes; that kernel
takes only Q4_0/Q4_1 and keeps its own scales.

``$BLINK_CPU_Q4``: ``avx512_vnni``, ``avx512``, ``avx2_vnni``, ``avx2_int8``, ``avx2`` or ``neon_dotprod`` picks that build (and keeps the AMX kernel off, so a
CPU with AMX runs the path a CPU without it would), ``torch`` turns both off; unset, AMX where
it runs (:mod:`blink.models.int4_linear`) and this kernel for what the AMX kernel does not take.
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from blink import env as blink_env
from blink.kernels.cpu import abi, pool as cpu_pool, q4_linear as cpu_q4_linear
from blink.kernels.cpu.q4_linear import GROUP, IMPL_ENV, TILE, _b_tile_rows, _from_b_tile_rows, _is_fp16
from blink.kernels.cpu.threads import kernel_threads
from blink.shared import cpu_features
from blink.shared.load_chunks import run_chunks
from blink.shared.native_build import NativeBuildError, NativeLibrary

log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("quant_linear.c")

#: the C kernel's format bits
F_BITS8, F_GROUP16, F_FP32, F_M, F_BITS6, F_K, F_BITS5, F_M8 = 1, 2, 4, 8, 16, 32, 64, 128
#: channels per K-quant super-block (F_K: one fp16 d and dmin per 256 channels)
SUPER = 256
#: 6-bit layout: the bit of each 16-bit word of a 2-bit plane where row 8h + j's high 2 bits
#: start (j = 0..7), so that each byte of the plane holds the high bits of the same byte of the
#: nibble vectors 2h and 2h + 1 (lo, hi, lo, hi: bits 0, 2, 4, 6): one shift (or none) and one
#: vpternlogd place a vector's high bits in the int8 build (quant_linear.c)
POS6 = (0, 2, 8, 10, 4, 6, 12, 14)

#: build -> (compiler flags, /proc/cpuinfo flags it needs, what the C reports, its name in the log)
VARIANTS = {
    "avx512_vnni": (("-O3", "-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
                    ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"), 8,
                    "AVX-512 VNNI (int8 activations)"),
    "avx512": (("-O3", "-march=x86-64-v4", "-mavx512bf16", "-mtune=generic"),
               ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma", "f16c"), 512, "AVX-512 BF16"),
    "avx2_vnni": (("-O3", "-march=x86-64-v3", "-mavxvnni", "-mtune=generic", "-DBLINK_QUANT_INT8_AVX2",
                   "-DBLINK_QUANT_AVX_VNNI"), ("avx2", "fma", "f16c", "avx_vnni"), 29, "AVX2 with AVX-VNNI (int8 activations)"),
    "avx2_int8": (("-O3", "-march=x86-64-v3", "-mtune=generic", "-DBLINK_QUANT_INT8_AVX2"), ("avx2", "fma", "f16c"), 28,
                  "AVX2 (int8 activations)"),
    "avx2": (("-O3", "-march=x86-64-v3", "-mtune=generic"), ("avx2", "fma", "f16c"), 2, "AVX2"),
    # (-fno-schedule-insns: GCC schedules before register allocation on Arm, not on x86, and
    # that pass took 71 of this build's 137 s with GCC 12; its effect on speed is not measured)
    "neon_dotprod": (("-O3", "-march=armv8.2-a+dotprod", "-mtune=generic", "-fno-schedule-insns"),
                     ("asimd", "asimddp"), 82, "Arm NEON dot product (int8 activations)"),
}
#: the builds that multiply x quantized to int8 (:func:`quantize_activations`), every step
INT8_BUILDS = frozenset({"avx512_vnni", "avx2_vnni", "avx2_int8", "neon_dotprod"})


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
        fallback=("4-bit projections run on the next build the CPU's flags allow if one loads, else "
                  if name != list(VARIANTS)[-1] else "4-bit projections run on ")
        + "torch's int4 kernel for few rows and bf16 otherwise",
        # -ffp-contract=off: the sums' order and roundings are the source's
        flags=(*flags, "-ffp-contract=off"), headers=(_SOURCE.with_name("kernels.h"),),
        env=IMPL_ENV, env_value=("torch", *others), setup=_declare(isa),
        kernels=("blink_quant_linear",), queries=("blink_quant_linear_isa",),
        # built at start only where the model's load chose it (the CPU runs one build; a model
        # without quantized projections none)
        wanted=lambda: _chosen == [name])


LIBRARIES = {name: _library(name) for name in VARIANTS}

_chosen: list[str | None] = []  # [variant or None] once decided


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernels see them (:func:`blink.shared.cpu_features.cpu_flags`:
    ``$BLINK_CPU_ISA`` applied; empty where there is no ``/proc/cpuinfo``)."""
    return cpu_features.cpu_flags() or frozenset()


def switch() -> str:
    """``$BLINK_CPU_Q4`` (stripped, lower case; "" when unset)."""
    return blink_env.choice(IMPL_ENV)


def forced() -> bool:
    """Whether ``$BLINK_CPU_Q4`` names one of this kernel's builds (the AMX kernel stays off)."""
    return switch() in VARIANTS


def variant() -> str | None:
    """The build that runs here (a :data:`VARIANTS` name), decided once and said once in the
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
            log.info("4-bit and K-quant CPU projections: the %s kernel (%s, %s: %s; %s=%s|torch chooses)",
                     VARIANTS[name][3], _SOURCE.name, how, " ".join(VARIANTS[name][1]), IMPL_ENV, "|".join(VARIANTS))
            return name
    return None


def activation_group(format: int) -> int:
    """Channels per int8 scale of x in the int8 builds (:data:`INT8_BUILDS`) for a weight of
    these format bits: a K-quant's super-block (F_K: 256, llama.cpp's Q8_K), whose fp32 work
    then runs once per super-block instead of once per group of 32 (1.10-1.15x the kernel at
    16-128 rows on Zen 4), else 32 (llama.cpp's Q8_0)."""
    return SUPER if format & F_K else GROUP


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int8 builds (:data:`INT8_BUILDS`) multiply for ``x [..., k]``: per row and group of
    ``group`` channels (:func:`activation_group`), int8 codes ``round(x * (127 / max|x|))`` (ties
    to even; 0 where the group is 0) and the scale ``max|x| / 127``, so ``x ~ codes * scale``
    (llama.cpp's Q8_0 activations per 32, Q8_K's per 256). Returns (codes as float32 ``[..., k]``,
    scales float32 ``[..., k // group]``), the same fp32 operations as the kernel's, so the same
    values."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = groups.abs().amax(-1, keepdim=True)
    # (a tensor over a tensor: ``127.0 / amax`` is torch's reciprocal times 127, two roundings)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse)
    return codes.reshape(x.shape), (amax / 127.0).squeeze(-1)


def quantized_x(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """``codes * scale`` of :func:`quantize_activations`, float32 like ``x``'s shape."""
    codes, scales = quantize_activations(x, group)
    return (codes.reshape(*x.shape[:-1], -1, group) * scales[..., None]).reshape(x.shape)


def available() -> bool:
    """Whether one of the builds runs here (:func:`variant`)."""
    return variant() is not None


@dataclass
class QuantWeight:
    """One ``[n, k]`` projection (or a run of its output columns) in the kernel's layout."""

    codes: torch.Tensor  # 4-bit: int16 [n / 16, k / 32, 4, 32]; 5/6-bit: int16 [..., 5 / 6, 32]; 8-bit: int8 [..., 16, 32]
    scales: torch.Tensor  # uint8: [n / 16, k / group, 1 or 2, 16] fp16 or fp32 d (then m); F_K: see pack
    n: int
    k: int
    format: int  # F_* bits

    @property
    def bits(self) -> int:
        return 8 if self.format & F_BITS8 else 6 if self.format & F_BITS6 else 5 if self.format & F_BITS5 else 4

    @property
    def group(self) -> int:
        return 16 if self.format & F_GROUP16 else GROUP

    def nbytes(self) -> int:
        """The bytes a product reads: codes and scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel()


def view_of_q4(weight: cpu_q4_linear.Q4Weight) -> QuantWeight:
    """The AMX kernel's weight (:mod:`blink.kernels.cpu.q4_linear`) as this kernel's, on the
    same codes: both keep them in :func:`_b_tile_rows`' layout (4-bit: its nibble words;
    8-bit: its bytes, this kernel's ``narrow=False`` layout), byte for byte
    (tests/test_cpu_quant_linear.py packs the same weight both ways). 4-bit (Q4_0/Q4_1): its
    fp16 d and m per (tile, group) too, no copy at all; 8-bit (Q8_0): a copy of its d alone
    (1/16 of the codes' bytes), since this kernel's 8-bit layout has no m (the AMX kernel's
    m there is 0, and reading it costs ~2x at 8 rows)."""
    if weight.bits == 4:
        return QuantWeight(weight.codes, weight.scales.view(torch.uint8).view(-1), weight.n, weight.k, F_M)
    d = weight.scales[:, :, :1].contiguous()  # [n / 16, k / 32, 1, 16] fp16
    return QuantWeight(weight.codes, d.view(torch.uint8).view(-1), weight.n, weight.k, F_BITS8)


def _nibble_words(rows: torch.Tensor) -> torch.Tensor:
    """B-tile rows of 4-bit values (uint8 [n / 16, k / 32, 16, 32]) -> int16 [n / 16, k / 32, 4, 32]:
    word w of vector c holds rows 4c .. 4c + 3's values at nibbles 0..3."""
    rows = rows.reshape(*rows.shape[:2], GROUP // 8, 4, 2 * TILE)
    words = rows[:, :, :, 0].to(torch.int32)
    for i in range(1, 4):  # (a quarter of the codes widened at a time: a large head's load)
        words |= rows[:, :, :, i].to(torch.int32) << (4 * i)
    return words.to(torch.int16)


def _k_scales(k_scales, n: int, k: int, group: int, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """A K-quant's file scales -> the kernel's F_K bytes: per (tile, super-block) the 16 columns'
    fp16 d, (m) fp16 -dmin, then per group int8 sc x 16, then (m) int8 mn x 16. Raises
    ValueError where they are not the same weights as ``d`` and ``m``."""
    nsub, supers = SUPER // group, k // SUPER
    sc = k_scales.sc.to(torch.int8)
    with_m = m is not None
    if (k_scales.d.shape != (n, supers) or sc.shape != (n, k // group) or with_m != (k_scales.mn is not None)
            or not torch.equal(k_scales.d.float().repeat_interleave(nsub, 1) * sc.float(), d)
            or (with_m and not torch.equal(-k_scales.dmin.float().repeat_interleave(nsub, 1)
                                           * k_scales.mn.float(), m))):
        raise ValueError(f"the K-quant scales of a [{n}, {k}] weight are not its d and m per group of {group}")

    def halves(v: torch.Tensor) -> torch.Tensor:  # fp16 [n, supers] -> bytes [n / 16, supers, 32]
        return v.to(torch.float16).view(n // TILE, TILE, supers).permute(0, 2, 1).contiguous().view(torch.uint8)

    def ints(v: torch.Tensor) -> torch.Tensor:  # int8 [n, k / group] -> bytes [n / 16, supers, nsub * 16]
        v = v.to(torch.int8).view(n // TILE, TILE, supers, nsub).permute(0, 2, 3, 1)
        return v.contiguous().view(torch.uint8).reshape(n // TILE, supers, nsub * TILE)

    parts = [halves(k_scales.d)] + ([halves(-k_scales.dmin)] if with_m else []) + [ints(sc)]
    if with_m:
        parts.append(ints(k_scales.mn))
    return torch.cat(parts, dim=2).reshape(-1).contiguous()


#: output rows packed at a time: the packing's temporaries (int32 words, a few per code) stay
#: a few MB, reused by the allocator, instead of several times a large head's size in fresh
#: pages (a 1B model's Q6_K head packed whole took ~8 s, mostly first touches of new memory)
PACK_ROW_WEIGHTS = 1 << 20


def _code_layout(codes: torch.Tensor, bits: int, narrow: bool) -> int | None:
    """The F_BITS* bits of the layout ``pack`` keeps ``codes`` in (0: the 4-bit one), from
    the whole tensor's range; None where the codes do not fit ``bits``."""
    if bits == 4:
        return 0 if codes.dtype == torch.uint8 and int(codes.max()) <= 15 else None
    if bits != 8 or codes.dtype not in (torch.int8, torch.uint8):
        return None
    low, high = int(codes.min()), int(codes.max())
    if codes.dtype == torch.uint8 and high > 127:
        return None
    if narrow and 0 <= low and high <= 31:
        return F_BITS5
    if narrow and -32 <= low and high <= 31:
        return F_BITS6
    return F_BITS8


def _packed_rows(codes: torch.Tensor, layout: int) -> torch.Tensor:
    """Some output rows' codes (a multiple of 16) in ``layout`` (:func:`_code_layout`), as
    ``pack`` describes the layouts."""
    n, k = codes.shape
    if layout == 0:
        return _nibble_words(_b_tile_rows(codes))
    if layout == F_BITS8:
        return _b_tile_rows(codes.to(torch.int8))
    if layout == F_BITS5:
        rows = _b_tile_rows(codes.to(torch.uint8))
        top = (rows >> 4).reshape(n // TILE, k // GROUP, 1, 16, 2 * TILE)
        words = sum(top[:, :, :, p].to(torch.int32) << p for p in range(16)).to(torch.int16)
        return torch.cat([_nibble_words(rows & 0x0F), words], dim=2)
    rows = _b_tile_rows((codes + 32).to(torch.uint8))  # F_BITS6
    high = (rows >> 4).reshape(n // TILE, k // GROUP, 2, 8, 2 * TILE)
    words = sum(high[:, :, :, j].to(torch.int32) << POS6[j] for j in range(8)).to(torch.int16)
    return torch.cat([_nibble_words(rows & 0x0F), words], dim=2)


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int = GROUP,
         bits: int = 4, k_scales=None, narrow: bool = True,
         empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> QuantWeight | None:
    """``w[n, k] = codes[n, k] * d[n, k // group] + m[...]`` (m None: 0) -> the kernel's layout.
    ``codes``: uint8 0..15 (``bits`` 4) or int8 (``bits`` 8; kept in 5 bits where they are in
    0..31 as Q5_K's, else in 6 where they are in -32..31 as Q6_K's); d and m float32. ``k_scales``: a K-quant's scales as its
    file holds them (:class:`blink.loader.gguf_weights.KScales`, the same weights as d and m):
    kept so (F_K, ~0.6 bits a weight instead of 1 or 2 for fp32 d and m per group) where k is
    whole super-blocks. ``narrow`` False keeps 8-bit codes in the 8-bit layout (benchmarks: the
    layout before the 5- and 6-bit ones). None where the shape does not tile (n not a multiple of 16, k
    of 32, group not 16 or 32).

    Layouts (per tile of 16 output columns and group of 32 channels, :func:`_b_tile_rows`' rows):
    4-bit: 4 vectors of 32 int16 words, nibble i of vector c = row 4c + i; 8-bit: the rows' bytes;
    6-bit (``code + 32``, 0..63): the 4-bit layout of its low nibbles, then 2 vectors of 32 int16
    words whose bits POS6[j] .. POS6[j] + 1 of vector v are row 8v + j's high 2 bits (384
    bytes); 5-bit (0..31): the 4-bit layout of the low nibbles, then 32 int16 words whose bit p
    is row p's top bit (320 bytes). Every layout is tile-major, so the codes are packed
    :data:`PACK_ROW_WEIGHTS` weights of whole tiles at a time (side by side on the process's
    cores: :mod:`blink.shared.load_chunks`) into the one result, which ``empty(shape, dtype)``
    allocates where given (the executor's 2 MB pages, :mod:`blink.huge_pages`)."""
    n, k = codes.shape
    if (n % TILE or k % GROUP or group not in (16, GROUP) or d.shape != (n, k // group)
            or (m is not None and m.shape != d.shape)):
        return None
    layout = _code_layout(codes, bits, narrow)
    if layout is None:
        return None
    fmt = (F_GROUP16 if group == 16 else 0) | (F_M if m is not None else 0) | layout
    step = max(TILE, PACK_ROW_WEIGHTS // k // TILE * TILE)
    first = _packed_rows(codes[:step], layout)
    shape = (n // TILE, *first.shape[1:])
    packed = empty(shape, first.dtype) if empty is not None else torch.empty(shape, dtype=first.dtype)
    packed[: first.shape[0]] = first

    def pack_chunk(row: int) -> None:  # its own tiles of the result
        packed[row // TILE: (row + step) // TILE] = _packed_rows(codes[row: row + step], layout)

    run_chunks(pack_chunk, range(step, n, step))
    if k_scales is not None and k % SUPER == 0:
        return QuantWeight(packed, _k_scales(k_scales, n, k, group, d.float(), None if m is None else m.float()),
                           n, k, fmt | F_K)
    if m is not None and torch.equal(m.float(), -8 * d.float()):  # Q4_0: the kernel forms m = -8d
        fmt |= F_M8
        m = None
    fp32 = not (_is_fp16(d.float()) and (m is None or _is_fp16(m.float())))
    parts = [d] if m is None else [d, m]
    values = torch.stack([p.float() for p in parts]).to(torch.float32 if fp32 else torch.float16)
    groups = k // group
    scales = values.view(len(parts), n // TILE, TILE, groups).permute(1, 3, 0, 2).contiguous()
    return QuantWeight(packed, scales.view(torch.uint8).reshape(-1), n, k, fmt | (F_FP32 if fp32 else 0))


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The float32 ``[n, k]`` weight the kernel multiplies, ``d q + m``."""
    n, k = weight.n, weight.k

    def nibbles(words: torch.Tensor) -> torch.Tensor:  # int16 [.., 4, 32] -> [.., 16, 32]
        words = words.to(torch.int32) & 0xFFFF
        return torch.stack([(words >> (4 * i)) & 0x0F for i in range(4)], dim=3).flatten(2, 3)

    if weight.bits == 4:
        rows = nibbles(weight.codes)
    elif weight.bits == 6:
        words = weight.codes.to(torch.int32) & 0xFFFF
        high = torch.stack([(words[:, :, 4:] >> POS6[j]) & 3 for j in range(8)], dim=3).flatten(2, 3)
        rows = nibbles(weight.codes[:, :, :4]) + (high << 4) - 32
    elif weight.bits == 5:
        words = weight.codes[:, :, 4].to(torch.int32) & 0xFFFF
        top = torch.stack([(words >> p) & 1 for p in range(16)], dim=2)
        rows = nibbles(weight.codes[:, :, :4]) + (top << 4)
    else:
        rows = weight.codes
    q = _from_b_tile_rows(rows, n, k).float()
    s = 2 if weight.format & F_M and not weight.format & F_M8 else 1
    groups = k // weight.group
    if weight.format & F_K:
        supers, nsub = k // SUPER, SUPER // weight.group
        blocks = weight.scales.view(n // TILE, supers, -1)
        half = blocks[..., : 2 * TILE * s].contiguous().view(torch.float16).float().view(n // TILE, supers, s, TILE)
        ints = blocks[..., 2 * TILE * s:].contiguous().view(torch.int8).float().view(n // TILE, supers, s, nsub, TILE)
        scales = (half[:, :, :, None] * ints).permute(2, 0, 4, 1, 3).reshape(s, n, groups)
    else:
        dtype = torch.float32 if weight.format & F_FP32 else torch.float16
        scales = weight.scales.view(dtype).float().view(n // TILE, groups, s, TILE).permute(2, 0, 3, 1).reshape(s, n, groups)
    w = q.view(n, groups, weight.group) * scales[0][..., None]
    if s == 2:
        w = w + scales[1][..., None]
    elif weight.format & F_M8:
        w = w + (-8 * scales[0])[..., None]
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
