"""Triton SiLU-and-multiply for the fused gate/up projection output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blink.kernels.triton.common import check_last_dim_contiguous, next_pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # large activations overflow int32 offsets
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # The reference rounds silu(gate) to the activation dtype before the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``; see :func:`blink.kernels.reference.layers.silu_and_mul`."""
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"silu_and_mul: last dimension {two_d} is odd")
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    check_last_dim_contiguous("silu_and_mul x", x2)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(d))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, d, x2.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], d)
