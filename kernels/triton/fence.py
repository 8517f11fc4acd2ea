"""The Triton kernel behind :class:`blink.kernels.system_fence.CudaSystemFence`.

Triton has no fence primitive, so the kernel issues PTX's ``fence.sc.sys`` through inline
assembly (the value moved through it is the scratch word, written back unchanged: the
store keeps the asm from being dropped). It only compiles for CUDA; the interpreter cannot
run inline assembly, and on CPU the scheduler uses a host fence instead.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fence_kernel(word_ptr):
    x = tl.load(word_ptr)
    y = tl.inline_asm_elementwise(
        "fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1,
    )
    tl.store(word_ptr, y)
