"""``x @ W.T`` for a few bf16 rows against a weight kept as ggml Q8_0 codes (``cpu_q8_matmul.c``,
built at first use), with its torch reference.

``W[n, k] = scales[n, k // 32] * codes[n, k]``: the GGUF file's own values, exactly (the bf16
copy the loader also makes rounds them). A step of a few rows is bound by the bytes it reads,
and the codes are about half the bf16 weight's: SmolLM2's tied 49152 x 576 head, ~40% of a
one-row decode step in bf16, is the case this exists for (docs/benchmarks.md, "Q8_0 head").
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import torch

from blink.shared.native_build import NativeBuildError, build_library

log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("cpu_q8_matmul.c")
#: "torch" runs the reference (tests, diagnosis)
IMPL_ENV = "BLINK_CPU_Q8"
#: values per scale (ggml's Q8_0 block)
GROUP = 32
#: the most rows the C kernel takes (cpu_q8_matmul.c's MAX_ROWS)
KERNEL_MAX_ROWS = 16

_lock = threading.Lock()
_kernel: list = []  # [function or None], set once per process


def kernel() -> "ctypes._CFuncPtr | None":
    """The C kernel, once per process; None where it cannot be built (said once in the log)
    or ``$BLINK_CPU_Q8=torch``."""
    if _kernel:
        return _kernel[0]
    with _lock:
        if not _kernel:
            fn = None
            if os.environ.get(IMPL_ENV, "").strip().lower() != "torch":
                try:
                    fn = build_library(_SOURCE, flags=("-O3", "-march=native", "-fno-math-errno"),
                                       fallback_flags=("-O3", "-fno-math-errno")).blink_q8_matmul
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int]
                except (NativeBuildError, AttributeError) as exc:
                    log.warning("Q8_0 matmul: the C kernel (%s) is not available (%s); the torch "
                                "reference runs instead, slower than the bf16 weight", _SOURCE.name, exc)
            _kernel.append(fn)
    return _kernel[0]


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same product in torch: dequantize in fp32, multiply in fp32, round to x's dtype."""
    n, k = codes.shape
    weight = (codes.float().view(n, k // GROUP, GROUP) * scales.unsqueeze(-1)).view(n, k)
    return (x.float() @ weight.T).to(x.dtype)


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] bf16 (channels contiguous) @ the Q8_0 weight (``codes`` int8 [N, K],
    ``scales`` fp32 [N, K // 32], both contiguous) -> [M, N] bf16. The reference for other
    dtypes, more than :data:`KERNEL_MAX_ROWS` rows, or without the C kernel."""
    fn = kernel()
    if (fn is None or x.dtype is not torch.bfloat16 or x.ndim != 2 or x.stride(1) != 1
            or x.shape[0] > KERNEL_MAX_ROWS or x.shape[0] == 0):
        return reference(x, codes, scales)
    M, K = x.shape
    N = codes.shape[0]
    out = torch.empty((M, N), dtype=torch.bfloat16)
    status = fn(x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), out.data_ptr(), N,
                M, N, K, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"Q8_0 matmul: the C kernel failed ({'out of memory' if status == -2 else 'bad shape'})")
    return out
