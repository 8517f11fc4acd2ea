"""Projections on a GGUF file's own 4-bit weights (CPU, bf16): every step with AMX or an int8
build (AVX-512 VNNI, AVX2), decode-sized ones elsewhere.

A decode step reads every weight once and does little arithmetic with it, so on CPU it is
bound by memory: SmolLM2-135M's bf16 projections stream ~210 MB per step (~23 ms on one
core here, the same for 1 or 16 rows). When the checkpoint is a GGUF file with Q4_0/Q4_1
tensors, each such projection keeps the file's 4-bit codes and per-group scales beside the
bf16 copy (~4x fewer bytes), in the layout of one of these kernels:

- ``amx``: Blink's C kernel on AMX (:mod:`blink.kernels.cpu.q4_linear`; Intel Sapphire
  Rapids and later). AMX does the arithmetic, so its cost stays flat up to a decode batch:
  over all of SmolLM2's projections 3.0x faster than bf16 at 1 row and 2.0x at 16; from 33
  rows on it rebuilds the bf16 weights once per panel of 512 rows and runs plain tile
  products: whole prefill steps on 2 threads 1.34-1.73x faster than on the packed bf16 copy
  (1 x 128 to 16 x 128 tokens; docs/performance.md#cpu-prefill, docs/performance.md#int4).
  So every step uses it, and the
  projection's bf16 copy is not kept (:meth:`blink.models.decoder.Linear.pack`); but steps
  of at most :data:`INT8_MAX_ROWS_BESIDE_AMX_KERNEL` tokens run the same codes and scales on
  the ``avx512_vnni`` build below (one useful row wastes a tile product: with its projections
  so, SmolLM2's one-row decode forward is 1.17x faster; with its Q8_0 head too, 1.24x).
- ``avx512_vnni`` / ``avx512`` / ``avx2_vnni`` / ``avx2_int8`` / ``avx2`` / ``neon_dotprod``: Blink's C kernel
  for CPUs without AMX (:mod:`blink.kernels.cpu.quant_linear`, the first build the CPU's flags
  allow; AMD Zen 4, Xeons whose AMX is hidden, AVX2 CPUs, Arm CPUs with the dot-product
  extension), which also takes the
  K-quants (Q4_K, Q5_K, Q6_K) and Q8_0 on their codes (:func:`pack_codes`), a fused
  projection's parts each in its own format. The int8 builds (``avx512_vnni``,
  ``avx2_vnni``, ``avx2_int8``, ``neon_dotprod``: :data:`blink.kernels.cpu.quant_linear.INT8_BUILDS`)
  quantize x to int8 per group of 32 channels (K-quants: per super-block of 256), as
  llama.cpp does, and multiply with vpdpbusd (AVX-VNNI: its 256-bit one; AVX2: vpmaddubsw; Arm: sdot): their
  cost grows slowly enough with the rows that every step uses them (VNNI: 3-3.5x the bf16
  build's GFLOPS at 16-512 rows) and no bf16 copy is kept, except where oneDNN's bf16 product
  runs on AMX (K-quants on a CPU with AMX): there steps of more than
  :data:`INT8_MAX_ROWS_BESIDE_AMX` tokens run the bf16 copy. The bf16 and AVX2 builds multiply
  x as it is, at a cost that grows with the rows (vdpbf16ps / FMAs), so steps of at most
  :data:`NATIVE_MAX_ROWS` tokens use them and larger ones the packed bf16 copy.
- ``torch``: torch's int4 weight-only GEMM (``torch._weight_int4pack_mm_for_cpu``, the
  kernel gpt-fast and torchao use on CPU), where neither C kernel runs: 3.7x faster than bf16
  at 1 row but slower beyond ~8, its arithmetic growing with the rows; steps of at most
  :data:`TORCH_MAX_ROWS` tokens use it.

Steps beyond a weight's ``max_rows`` run the packed bf16 copy. No weight is quantized here: the
codes are the file's (the int8 builds quantize the activations, x). The AMX kernel multiplies
gguf's fp32 weights exactly (``d * q + m``) for steps of up to 32 rows and their bf16 rounding (the bf16 copy's values) for larger ones;
torch's kernel takes ``(q - 8) * scale + zero`` with ``zero = m + 8d`` and scales rounded to bf16.
A row's logits therefore depend on whether its step took the 4-bit path (as in any engine
whose kernels change with the batch); ``--int4-decode off`` keeps every step on bf16.

:func:`reference_linear` is torch's kernel's product on the dequantized weight, for tests.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F

from blink.kernels.cpu import onednn_amx, q4_linear as cpu_q4_linear, quant_linear as cpu_quant_linear

#: Steps with at most this many tokens use torch's int4 kernel. Measured on SmolLM2-135M,
#: one thread, Xeon with AMX: the decode step 1.6x faster at 4 rows, 1.1x at 6, 1.0x at 8.
TORCH_MAX_ROWS = 6
#: Steps with at most this many tokens use the AMX kernel: None, all of them (the whole step
#: measured at least as fast as on the packed bf16 copy at every row count, 1 to 512).
AMX_MAX_ROWS: int | None = None

#: Steps with at most this many tokens use the kernel for CPUs without AMX, per build.
#: Measured over SmolLM2-135M's projections and head, one thread, against oneDNN's bf16
#: product without AMX (benchmarks/bench_int4.py, docs/performance.md#quant-no-amx).
#: The int8 builds: every step (VNNI: its cost grows ~8x slower with the rows than
#: vdpbf16ps'; AVX2: vpmaddubsw multiplies 4x the products of an fp32 FMA, and an AVX2 CPU has
#: no native bf16 for the bf16 copy: with AVX2 code on the Xeon, one thread, bench_int4
#: --k-quants under ONEDNN_MAX_CPU_ISA=AVX2, faster than the fp32 build at 1 to 512 rows,
#: 1.9-2.1x from 16, and 6.9-7.1x the plain bf16 weights from 128), but beside oneDNN on AMX
#: (:data:`INT8_MAX_ROWS_BESIDE_AMX`).
NATIVE_MAX_ROWS = {"avx512_vnni": None, "avx512": 32, "avx2_vnni": None, "avx2_int8": None, "avx2": 8, "neon_dotprod": None}
#: Where oneDNN's bf16 products run on AMX (a CPU with AMX and K-quant projections, which the
#: AMX kernel does not take), an int8 build takes steps of at most this many tokens and the
#: bf16 copy the others (``avx2_int8`` runs there only when ``$BLINK_CPU_Q4`` asks: every
#: CPU with AMX has AVX-512 VNNI, chosen first; it takes the VNNI build's bound). Measured
#: on the VNNI build over SmolLM2-135M-shaped Q4_K/Q6_K projections, one
#: thread, Xeon with AMX (benchmarks/bench_int4.py --k-quants): int8 / bf16 on AMX 1.13x as
#: fast at 32 rows, 0.72x at 64, 0.46x at 128.
INT8_MAX_ROWS_BESIDE_AMX = 32
#: Beside the AMX kernel (Q4_0/Q4_1 on a CPU with AMX), the int8 VNNI build takes steps of at
#: most this many tokens, on the AMX weight's own codes and scales (viewed, no copy:
#: :func:`blink.kernels.cpu.quant_linear.view_of_q4`): a tile product of one useful row
#: wastes AMX, while vpdpbusd multiplies the row's int8 x as it is. Measured over
#: SmolLM2-135M-shaped Q4_1 projections and head, Xeon with AMX, 2026-12-05
#: (``benchmarks/bench_int4.py --rows 1 2 4 8 16 --threads 2``; ``--threads 1``): VNNI / AMX
#: ms 5.9 / 7.8 at 1 row, 6.5 / 8.4 at 4, 7.4 / 11.7 at 8, 10.1 / 10.6 at 16 on two threads;
#: 8.8 / 9.9 at 1, 11.2 / 12.3 at 8, 16.1 / 14.8 at 16 on one.
INT8_MAX_ROWS_BESIDE_AMX_KERNEL = 8


def native_max_rows(build: str) -> int | None:
    """Steps of at most this many tokens run on ``build`` of the kernel without AMX (None:
    every step, no bf16 copy kept)."""
    if build in cpu_quant_linear.INT8_BUILDS and onednn_amx():
        return INT8_MAX_ROWS_BESIDE_AMX
    return NATIVE_MAX_ROWS[build]


def codes_every_step_kernel() -> str | None:
    """The build of the kernel without AMX that multiplies every step of a file's quantized
    projections on their codes here (an int8 build: :data:`NATIVE_MAX_ROWS` None), in the
    start log's words; None where steps of some size take a bf16 copy instead (or no build
    runs). What ``--dtype auto`` asks on a CPU without native bf16 (:func:`blink.dtypes.resolve_dtype`)."""
    build = cpu_quant_linear.variant()
    if build is None or native_max_rows(build) is not None:
        return None
    return cpu_quant_linear.VARIANTS[build][3]


#: Input channels per scale/zero pair: ggml's Q4_0/Q4_1 block.
GROUP = 32

# The kernel's inner-K tiling argument for the packed layout (the CPU kernel takes 1).
_INNER_K_TILES = 1

Kernel = Literal["amx", "avx512_vnni", "avx512", "avx2_vnni", "avx2_int8", "avx2", "neon_dotprod", "torch"]


@dataclass
class Int4Weight:
    """One projection's 4-bit weight in its kernel's layout. ``max_rows``: steps of at most
    this many tokens run it, None: every step (the caller checks, :meth:`takes`)."""

    kernel: Kernel
    max_rows: int | None
    packed: torch.Tensor | None = None  # torch: uint8 [N, K // 2]
    scale_zero: torch.Tensor | None = None  # torch: bf16 [K // GROUP, N, 2]
    amx: cpu_q4_linear.Q4Weight | None = None  # amx
    parts: list[cpu_quant_linear.QuantWeight] | None = None  # the kernel without AMX's builds: runs of columns
    #: beside ``amx``: its codes viewed for the int8 VNNI build, which takes steps of at most
    #: :data:`INT8_MAX_ROWS_BESIDE_AMX_KERNEL` tokens (:meth:`on_amx`); None: AMX takes them all
    int8_view: cpu_quant_linear.QuantWeight | None = None

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens runs on this weight."""
        return self.max_rows is None or rows <= self.max_rows

    def on_amx(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens runs on the AMX kernel (else, where this weight
        takes it, on the kernel without AMX)."""
        return self.amx is not None and (self.int8_view is None or rows > INT8_MAX_ROWS_BESIDE_AMX_KERNEL)

    @property
    def every_step(self) -> bool:
        """Whether every step runs on it (then the bf16 copy is never read)."""
        return self.max_rows is None

    @property
    def gates(self) -> bool:
        """Whether :func:`linear` can apply a fused gate/up projection's activation as it
        stores (``gated``): the AMX kernel's 4-bit codes, whole tiles per half."""
        return self.amx is not None and self.amx.bits == 4 and self.amx.n % (2 * cpu_q4_linear.TILE) == 0


#: whether torch's kernel ran correctly here (tried once, by :func:`_torch_kernel_runs`)
_TORCH_KERNEL: bool | None = None


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a 4-bit kernel runs here: bf16 on CPU, and the AMX kernel built for this CPU,
    the kernel without AMX or torch's int4 kernel working (each tried once, never assumed: the
    CPU model varies between machines)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return cpu_q4_linear.available() or cpu_quant_linear.available() or _torch_kernel_runs()


def _torch_kernel_runs() -> bool:
    """torch's int4 CPU kernel exists in this torch and is right on a tiny weight (private
    ops: tried once)."""
    global _TORCH_KERNEL
    if _TORCH_KERNEL is None:
        try:
            codes = torch.arange(16 * GROUP * 2, dtype=torch.int32).remainder(16).view(16, 2 * GROUP)
            scale = torch.full((16, 2), 0.5)
            weight = pack(codes.to(torch.uint8), scale, torch.zeros_like(scale), kernel="torch")
            x = torch.ones(1, 2 * GROUP, dtype=torch.bfloat16)
            got = linear(x, weight, None)
            want = reference_linear(x, codes.to(torch.uint8), scale, torch.zeros_like(scale), None)
            _TORCH_KERNEL = bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
        except (AttributeError, RuntimeError, NotImplementedError):
            _TORCH_KERNEL = False
    return _TORCH_KERNEL


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
         kernel: Kernel | None = None) -> Int4Weight:
    """codes uint8 [N, K] (0..15), scale and zero float [N, K // GROUP] (``(q - 8) * scale +
    zero``, as :class:`blink.loader.gguf_weights.Q4Codes`) -> a weight for ``kernel``: by
    default the AMX kernel where it runs and takes the weight (its few-row steps on the int8
    VNNI build where that runs: :data:`INT8_MAX_ROWS_BESIDE_AMX_KERNEL`), else torch's;
    ``"amx"``: the AMX kernel for every step."""
    n, k = codes.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"int4 weight [{n}, {k}] needs scale/zero [{n}, {k // GROUP}] "
                         f"(groups of {GROUP}), got {tuple(scale.shape)} / {tuple(zero.shape)}")
    if kernel in (None, "amx") and (kernel == "amx" or cpu_q4_linear.available()):
        amx = cpu_q4_linear.pack(codes, scale, zero)
        if amx is not None:  # kernel "amx": that kernel alone, every step (tests, benchmarks)
            return amx_weight(amx) if kernel is None else Int4Weight("amx", AMX_MAX_ROWS, amx=amx)
        if kernel == "amx":
            raise ValueError(f"the AMX kernel does not take this [{n}, {k}] weight "
                             f"(needs N % {cpu_q4_linear.TILE} == 0 and the file's fp16 scales)")
    native = kernel if kernel in cpu_quant_linear.VARIANTS else cpu_quant_linear.variant() if kernel is None else None
    if native is not None:
        part = cpu_quant_linear.pack(codes, scale, zero - 8 * scale)
        if part is not None:
            return Int4Weight(native, native_max_rows(native), parts=[part])
        if kernel == native:
            raise ValueError(f"the {native} kernel does not take this [{n}, {k}] weight (needs N % 16 == 0)")
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), _INNER_K_TILES)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return Int4Weight("torch", TORCH_MAX_ROWS, packed=packed, scale_zero=scale_zero)


def amx_weight(amx: cpu_q4_linear.Q4Weight, max_rows: int | None = AMX_MAX_ROWS) -> Int4Weight:
    """An AMX kernel's weight (4-bit, or a Q8_0 head's 8-bit codes) for steps of at most
    ``max_rows`` tokens, with its int8 view for steps of few rows where the int8 VNNI build
    runs here (:data:`INT8_MAX_ROWS_BESIDE_AMX_KERNEL`)."""
    view = cpu_quant_linear.view_of_q4(amx) if int8_beside_amx() else None
    return Int4Weight("amx", max_rows, amx=amx, int8_view=view)


def int8_beside_amx() -> bool:
    """Whether the AMX kernel's few-row steps run on the int8 VNNI build here (it is the
    build chosen for this CPU: every CPU with AMX has AVX-512 VNNI, unless ``$BLINK_CPU_Q4``
    picked another)."""
    return cpu_quant_linear.variant() == "avx512_vnni"


def placed(weight: Int4Weight, place: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
    """The same weight with each of its tensors replaced by ``place``'s copy (the model's
    weights moved to 2 MB pages, :mod:`blink.huge_pages`); an int8 view is taken again of
    the placed AMX weight (a view, not a second copy; what it copies, an 8-bit weight's d,
    is placed too)."""
    maybe = lambda t: None if t is None else place(t)  # noqa: E731
    amx = None if weight.amx is None else replace(weight.amx, codes=place(weight.amx.codes),
                                                  scales=place(weight.amx.scales))
    return replace(weight, packed=maybe(weight.packed), scale_zero=maybe(weight.scale_zero), amx=amx,
                   parts=None if weight.parts is None else [replace(p, codes=place(p.codes), scales=place(p.scales))
                                                            for p in weight.parts],
                   int8_view=None if weight.int8_view is None else _placed_view(amx, place))


def _placed_view(amx: cpu_q4_linear.Q4Weight, place: Callable[[torch.Tensor], torch.Tensor]
                 ) -> cpu_quant_linear.QuantWeight:
    """The int8 view of an already placed AMX weight, its own scales (if any) placed too."""
    view = cpu_quant_linear.view_of_q4(amx)
    if view.scales.data_ptr() == amx.scales.data_ptr():
        return view
    return replace(view, scales=place(view.scales))


def linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None,
           gated: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bf16 ``x [..., K]``; ``gated`` (where ``weight.gates``): a fused
    gate/up projection's ``silu(gate) * up`` instead (:func:`blink.kernels.cpu.q4_linear.linear`;
    only for steps on the AMX kernel, :meth:`Int4Weight.on_amx`)."""
    if weight.amx is not None and weight.on_amx(x.numel() // x.shape[-1]):
        return cpu_q4_linear.linear(x, weight.amx, bias, gated=gated)
    if gated:
        raise ValueError("only the AMX kernel applies the activation (see Int4Weight.gates, Int4Weight.on_amx)")
    if weight.amx is not None:  # few rows beside the AMX kernel: its int8 view
        return cpu_quant_linear.linear(x, [weight.int8_view], bias, build="avx512_vnni")
    if weight.parts is not None:
        return cpu_quant_linear.linear(x, weight.parts, bias, build=weight.kernel)  # the build it was packed for
    lead = x.shape[:-1]
    y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), weight.packed, GROUP, weight.scale_zero)
    if bias is not None:
        y = y + bias
    return y.view(*lead, y.shape[-1])


#: formats torch's int4 kernel and the AMX kernel take (4-bit codes, the file's fp16 d and m)
_Q4_TYPES = ("Q4_0", "Q4_1")


def pack_codes(segments: list, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
               ) -> Int4Weight | None:
    """One projection's output rows as the file stores them, in order (``segments``:
    :class:`blink.loader.gguf_weights.QuantCodes`, e.g. a fused qkv projection's q, k and v,
    the same K each) -> a weight for the best kernel that takes them all: the AMX kernel for
    Q4_0/Q4_1 where it runs, else the kernel without AMX (every format of
    :data:`blink.loader.gguf_weights.CODED_TYPES`, each run of rows in its own), else torch's
    int4 kernel for Q4_0/Q4_1; None where none does (the bf16 copy runs). ``empty(shape,
    dtype)``: where the kernel without AMX's codes are allocated (default: torch's memory)."""
    if not segments or len({s.codes.shape[1] for s in segments}) != 1:
        return None
    q4 = all(s.qtype in _Q4_TYPES for s in segments)

    def joined():
        d = _joined(segments, "d")
        return _joined(segments, "codes"), d, _joined(segments, "m") + 8 * d  # (scale, zero) as Q4Codes: zero = m + 8d

    if q4 and cpu_q4_linear.available():
        amx = cpu_q4_linear.pack(*joined())
        if amx is not None:
            return amx_weight(amx)
    native = cpu_quant_linear.variant()
    if native is not None:
        parts, run = [], [segments[0]]
        for seg in segments[1:] + [None]:  # runs of one format, packed together
            if seg is not None and seg.qtype == run[0].qtype:
                run.append(seg)
                continue
            part = cpu_quant_linear.pack(_joined(run, "codes"), _joined(run, "d"), _joined(run, "m"), run[0].group,
                                         run[0].bits, _k_scales(run), empty=empty)
            if part is None:
                return None
            parts.append(part)
            run = [seg]
        return Int4Weight(native, native_max_rows(native), parts=parts)
    if q4 and _torch_kernel_runs():
        return pack(*joined(), kernel="torch")
    return None


def _joined(parts: list, name: str) -> torch.Tensor | None:
    """The parts' ``name`` tensors, one after another along the rows (one part's own tensor,
    not a copy: a large head's codes are not copied again)."""
    tensors = [getattr(part, name) for part in parts]
    if tensors[0] is None:
        return None
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _k_scales(run: list):
    """A run of K-quant segments' file scales, joined (:class:`blink.loader.gguf_weights.KScales`;
    None unless every segment has them)."""
    scales = [getattr(s, "k_scales", None) for s in run]
    if any(k is None for k in scales):
        return None
    return type(scales[0])(*(_joined(scales, name) for name in ("d", "sc", "dmin", "mn")))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 weight the codes stand for (``(q - 8) * scale + zero`` per group)."""
    n, k = codes.shape
    groups = (codes.float() - 8).view(n, k // GROUP, GROUP)
    return (groups * scale[..., None] + zero[..., None]).view(n, k)


def reference_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The torch reference of torch's kernel (fp32 product on the dequantized weight, scales
    rounded to bf16 as that kernel stores them), returned in x's dtype. The AMX kernel's
    weight is :func:`blink.kernels.cpu.q4_linear.dequantize`'s."""
    scale, zero = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()
    y = F.linear(x.float(), dequantize(codes, scale, zero), None if bias is None else bias.float())
    return y.to(x.dtype)
