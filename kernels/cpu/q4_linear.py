"""Projections on a GGUF file's own 4-bit codes (CPU, bf16, AMX): ``q4_linear.c``.

Why: on CPU a decode step is bound by the bytes of weight it streams (bf16 SmolLM2-135M:
~210 MB of projections per step, ~23 ms on one core here whether 1 or 16 rows). The file's
Q4_0/Q4_1 codes are 4x fewer bytes. torch's int4 kernel reads them too, but its arithmetic
grows with the rows; here AMX does the arithmetic (one tile product per 32 channels of 16
columns for up to 16 rows), so the cost stays near flat up to a decode batch: 2.0x the bf16
projections' speed at 16 rows; larger steps (prefills) rebuild bf16 weights once per panel
of 512 rows and run plain tile products, about as fast as oneDNN on a bf16 copy
(docs/performance.md#int4, docs/performance.md#cpu-prefill).
:mod:`blink.models.int4_linear` decides which kernel a weight gets and for which steps.

Arithmetic (steps of up to 32 rows): ``x . w = d (x . q) + m sum(x)`` per group of 32 channels, with the codes q as
exact bf16 and the file's fp16 d and m applied in fp32, so the product is on gguf's own fp32
weights, not on a bf16 rounding of them (tests/test_cpu_q4_linear.py: the exactly rounded
fp32 product in all but a few outputs in a thousand, which are one bf16 step off).

Q8_0 (``w = d q``, 8-bit codes) runs on the same kernel with m = 0 (:func:`pack_q8`): SmolLM2's
GGUF stores its tied embedding, the head, as Q8_0, half the bytes of the bf16 head a decode
step otherwise streams.

Used where :func:`available` says the kernel was built with AMX for this CPU and the OS lets
the process use it; otherwise that is said once in the log and torch's int4 kernel runs.
``$BLINK_CPU_Q4=torch`` turns it off (tests, diagnosis); a build's name (``avx512_vnni``, ``avx512``,
``avx2_vnni``, ``avx2_int8``, ``avx2``, ``neon_dotprod``) too, for that build of the kernel a CPU without AMX runs (:mod:`blink.kernels.cpu.quant_linear`), as does
``$BLINK_CPU_AMX=0`` (:func:`blink.kernels.cpu.amx_allowed`), with the build the CPU's flags choose.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from blink.kernels.cpu import abi, amx_allowed, pool as cpu_pool
from blink.kernels.cpu.threads import kernel_threads
from blink.shared.native_build import NativeBuildError, NativeLibrary

log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("q4_linear.c")
IMPL_ENV = "BLINK_CPU_Q4"
#: output columns per tile and input channels per scale (ggml's Q4 block)
TILE, GROUP = 16, 32


def _declare(library: ctypes.CDLL) -> None:
    abi.declare(library, abi.Q4_LINEAR)
    cpu_pool.attach(library)  # calls that split run on the process's one pool
    if not library.blink_q4_linear_supported():
        raise NativeBuildError("this CPU (or its compiler, or the OS) offers no AMX")
    if not amx_allowed():
        raise NativeBuildError("$BLINK_CPU_AMX=0: acting as a CPU without AMX")
    library.few_rows = int(library.blink_q4_linear_few_rows())  # read per call


# -march=native: the AMX and AVX-512 intrinsics exist only in a build for a CPU that has them
# (the cache key holds the CPU's flags); elsewhere the source builds a stub that says so.
# -ffp-contract=off: the gated epilogue's SiLU keeps fused.c's bits (kernels.h).
LIBRARY = NativeLibrary(
    _SOURCE, what="4-bit CPU projections: the AMX kernel", logger=log,
    fallback="4-bit projections run on the AVX-512/AVX2/Arm NEON kernel (quant_linear.c) where the CPU has one, "
             "else on torch's int4 kernel for few rows and bf16 otherwise",
    flags=("-O3", "-march=native", "-ffp-contract=off"), headers=(_SOURCE.with_name("kernels.h"),), env=IMPL_ENV,
    env_value=("torch", "avx512_vnni", "avx512", "avx2_vnni", "avx2_int8", "avx2", "neon_dotprod"), setup=_declare, kernels=("blink_q4_linear", "blink_q8_linear", "blink_q4_linear_gated"),
    queries=("blink_q4_linear_supported", "blink_q4_linear_few_rows"))


def few_rows() -> int:
    """The row count up to which a 4-bit call multiplies the codes as they are (steps above
    rebuild bf16 weights once per panel of 512 rows); 0 where the kernel is not available."""
    library = LIBRARY.get()
    return 0 if library is None else library.few_rows


def available() -> bool:
    """Whether the kernel is built and runs here (AMX in the CPU, the compiler and the OS);
    said once in the log if not."""
    return LIBRARY.get() is not None


@dataclass
class Q4Weight:
    """One ``[n, k]`` projection in the kernel's layout (``q4_linear.c``): 4-bit codes
    (:func:`pack`) or, with ``bits`` 8, 8-bit ones (:func:`pack_q8`)."""

    codes: torch.Tensor  # 4-bit: int16 (the bits of uint16 words) [n / 16, k / 32, 4, 32]; 8-bit: int8 [n / 16, k / 32, 16, 32]
    scales: torch.Tensor  # float16 [n / 16, k / 32, 2, 16]: d then m per column (8-bit: m = 0)
    n: int
    k: int
    bits: int = 4


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Q4Weight | None:
    """A :class:`blink.loader.gguf_weights.Q4Codes`'s tensors (codes uint8 [n, k] 0..15, and
    ``w = (q - 8) * scale + zero`` per group of 32) -> the kernel's layout. None where the
    shape does not tile (n not a multiple of 16, k of 32) or where d and m = zero - 8d are not
    the fp16 values a GGUF file holds (the kernel would not rebuild the file's weights)."""
    n, k = codes.shape
    if n % TILE or k % GROUP or scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        return None
    d = scale.float()
    m = zero.float() - 8 * d
    if not (_is_fp16(d) and _is_fp16(m)):
        return None
    # rows 4c .. 4c + 3 of a B tile share 32 16-bit words, one nibble each
    rows = _b_tile_rows(codes.to(torch.int32)).reshape(n // TILE, k // GROUP, GROUP // 8, 4, 2 * TILE)
    words = rows[:, :, :, 0] | (rows[:, :, :, 1] << 4) | (rows[:, :, :, 2] << 8) | (rows[:, :, :, 3] << 12)
    return Q4Weight(words.to(torch.int16).contiguous(), _scales(d, m), n, k)  # int16: the bits of uint16


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> Q4Weight | None:
    """A :class:`blink.loader.gguf_weights.Q8Codes`'s tensors (codes int8 [n, k], ``w = q *
    scale`` per group of 32) -> the kernel's 8-bit layout. None where the shape does not tile
    or the scales are not the fp16 values a GGUF file holds."""
    n, k = codes.shape
    if codes.dtype != torch.int8 or n % TILE or k % GROUP or scale.shape != (n, k // GROUP):
        return None
    d = scale.float()
    if not _is_fp16(d):
        return None
    return Q4Weight(_b_tile_rows(codes).contiguous(), _scales(d, torch.zeros_like(d)), n, k, bits=8)


def _is_fp16(values: torch.Tensor) -> bool:
    return torch.equal(values.half().float(), values)


def _b_tile_rows(values: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [n / 16, k / 32, 16, 32]: B-tile row p of (tile t, group g) holds word w =
    column 16t + w // 2 at channel 32g + 2p + w % 2."""
    n, k = values.shape
    rows = values.view(n // TILE, TILE, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    return rows.reshape(n // TILE, k // GROUP, GROUP // 2, 2 * TILE)


def _from_b_tile_rows(rows: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`_b_tile_rows`' inverse."""
    return rows.reshape(n // TILE, k // GROUP, GROUP // 2, TILE, 2).permute(0, 3, 1, 2, 4).reshape(n, k)


def _scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d and m [n, k / 32] -> fp16 [n / 16, k / 32, 2, 16]: per (tile, group) the 16 columns'
    d, then their m."""
    n, groups = d.shape
    return torch.stack([d, m]).half().view(2, n // TILE, TILE, groups).permute(1, 3, 0, 2).contiguous()


def linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None,
           gated: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bf16 ``x [..., k]`` (rows may be strided, channels contiguous),
    bf16 out. ``gated`` (4-bit codes of a fused gate/up projection, gate rows first): the MLP's
    activation instead, ``silu(gate) * up`` with ``[..., n / 2]`` channels, the bits of the plain
    call followed by :func:`blink.kernels.cpu.fused.silu_and_mul` in one pass."""
    library = LIBRARY.get()
    if library is None:
        raise RuntimeError("the 4-bit CPU kernel is not available here (see available())")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.k)
    if x2.dtype is not torch.bfloat16 or x2.stride(1) != 1 or x2.stride(0) < weight.k:
        x2 = x2.to(torch.bfloat16).contiguous()
    rows = x2.shape[0]
    if gated and (weight.bits != 4 or weight.n % (2 * TILE)):
        raise ValueError(f"the gated kernel takes 4-bit codes of an even number of {TILE}-column "
                         f"tiles, not a {weight.bits}-bit [{weight.n}, {weight.k}] weight")
    n_out = weight.n // 2 if gated else weight.n
    y = torch.empty((rows, n_out), dtype=torch.bfloat16)
    if rows == 0:
        return y.view(*lead, n_out)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    kernel = (library.blink_q4_linear_gated if gated else
              library.blink_q8_linear if weight.bits == 8 else library.blink_q4_linear)
    status = kernel(x2.data_ptr(), x2.stride(0), weight.codes.data_ptr(), weight.scales.data_ptr(),
                    None if bias is None else bias.data_ptr(), y.data_ptr(), n_out,
                    rows, weight.n, weight.k, kernel_threads())
    if status != 0:
        raise ValueError(f"{weight.bits}-bit CPU kernel refused x {tuple(x2.shape)} for a "
                         f"[{weight.n}, {weight.k}] weight")
    return y.view(*lead, n_out)


def dequantize(weight: Q4Weight) -> torch.Tensor:
    """The float32 ``[n, k]`` weight the kernel multiplies: ``d * q + m`` per group, gguf's
    own dequantization."""
    groups = weight.k // GROUP
    rows = weight.codes
    if weight.bits == 4:  # nibble i of each word is row 4c + i
        words = weight.codes.to(torch.int32) & 0xFFFF
        rows = torch.stack([(words >> (4 * i)) & 0x0F for i in range(4)], dim=3)  # [T, G, 4, 4, 32]
    q = _from_b_tile_rows(rows, weight.n, weight.k).view(weight.n, groups, GROUP)
    d, m = weight.scales.float().permute(2, 0, 3, 1).reshape(2, weight.n, groups)
    return (q.float() * d[..., None] + m[..., None]).view(weight.n, weight.k)
