"""Small helpers shared by the Triton kernel modules.

The kernels run on CUDA in production and under the Triton interpreter on CPU in tests.
The interpreter is chosen by ``TRITON_INTERPRET=1`` *when a kernel is decorated* (i.e. when
its module is imported), so that variable must be set before any ``triton_*`` module of this
package is imported.
"""
from __future__ import annotations

import torch
import triton


def interpreting() -> bool:
    """True when Triton kernels defined now run in the interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (Triton block shapes must be powers of two)."""
    return triton.next_power_of_2(max(1, int(n)))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be up-cast to fp32 for this input dtype.

    On a GPU, bf16/fp16 operands go to the tensor cores as they are; fp32 inputs are kept in
    fp32 (and the dot uses IEEE precision, not tf32). The interpreter stores bf16 as raw
    uint16 and would multiply the bit patterns, so there every dot runs in fp32.
    """
    return interpreting() or dtype == torch.float32


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels index rows by stride but assume unit stride along the last dimension."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, got strides {t.stride()}")
