"""Projections of steps with few tokens on a GGUF file's own 4-bit weights (CPU, bf16).

A decode step of one or a few rows reads every weight once and does almost no arithmetic
with it, so on CPU it is bound by memory bandwidth: SmolLM2-135M's bf16 projections stream
~270 MB per step (~54 ms on one core here, ~5 GB/s). When the checkpoint is a GGUF file
with Q4_0/Q4_1 tensors, those tensors' 4-bit codes and per-group scales are kept beside the
bf16 copy, packed for torch's int4 weight-only GEMM (``torch._weight_int4pack_mm_for_cpu``,
the kernel gpt-fast and torchao use on CPU), which reads ~4x fewer bytes: over all of
SmolLM2's projections 3.7x faster for one row, but 0.65x at 16 (its cost grows with the
rows, the bf16 one's does not); the whole decode step 1.7x faster at 1 row, 1.1x at 6,
1.0x at 8 (docs/benchmarks.md, "CPU forward"). So steps of at most :data:`MAX_ROWS` tokens
take the int4 path and larger ones the packed bf16 one. Nothing is quantized here: the codes are the file's, and the int4 kernel's
``(q - 8) * scale + zero`` is Q4_1's ``d * q + m`` with ``zero = m + 8d`` (scales rounded
to bf16, the kernel's format). A row's logits therefore depend on whether its step had
more than MAX_ROWS tokens (as in any engine whose kernels change with the batch).

:func:`reference_linear` is the same product on the dequantized weight, for the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Steps with at most this many tokens (rows of the flattened batch) use the int4 weights.
#: Measured on SmolLM2-135M, one thread, Xeon with AMX: the decode step 1.6x faster at 4
#: rows, 1.1x at 6, 1.0x at 8.
MAX_ROWS = 6

#: Input channels per scale/zero pair: ggml's Q4_0/Q4_1 block.
GROUP = 32

# The kernel's inner-K tiling argument for the packed layout (the CPU kernel takes 1).
_INNER_K_TILES = 1


@dataclass
class Int4Weight:
    """One projection's weight in the int4 kernel's layout."""

    packed: torch.Tensor  # uint8 [N, K // 2]
    scale_zero: torch.Tensor  # bf16 [K // GROUP, N, 2]


#: whether the kernel ran correctly here (tried once, by :func:`available`)
_AVAILABLE: bool | None = None


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the int4 CPU kernel exists in this torch and runs here (tried once on a tiny
    weight, never assumed: private ops, and the CPU model varies between machines)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            codes = torch.arange(16 * GROUP * 2, dtype=torch.int32).remainder(16).view(16, 2 * GROUP)
            scale = torch.full((16, 2), 0.5)
            weight = pack(codes.to(torch.uint8), scale, torch.zeros_like(scale))
            x = torch.ones(1, 2 * GROUP, dtype=torch.bfloat16)
            got = linear(x, weight, None)
            want = reference_linear(x, codes.to(torch.uint8), scale, torch.zeros_like(scale), None)
            _AVAILABLE = bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
        except (AttributeError, RuntimeError, NotImplementedError):
            _AVAILABLE = False
    return _AVAILABLE



def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Weight:
    """codes uint8 [N, K] (0..15), scale and zero float [N, K // GROUP] -> the kernel's layout."""
    n, k = codes.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"int4 weight [{n}, {k}] needs scale/zero [{n}, {k // GROUP}] "
                         f"(groups of {GROUP}), got {tuple(scale.shape)} / {tuple(zero.shape)}")
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), _INNER_K_TILES)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return Int4Weight(packed, scale_zero)


def linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bf16 ``x [..., K]``."""
    lead = x.shape[:-1]
    y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), weight.packed, GROUP, weight.scale_zero)
    if bias is not None:
        y = y + bias
    return y.view(*lead, y.shape[-1])


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 weight the codes stand for (``(q - 8) * scale + zero`` per group)."""
    n, k = codes.shape
    groups = (codes.float() - 8).view(n, k // GROUP, GROUP)
    return (groups * scale[..., None] + zero[..., None]).view(n, k)


def reference_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The torch reference of :func:`linear` (fp32 product on the dequantized weight, scales
    rounded to bf16 as the kernel stores them), returned in x's dtype."""
    scale, zero = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()
    y = F.linear(x.float(), dequantize(codes, scale, zero), None if bias is None else bias.float())
    return y.to(x.dtype)
