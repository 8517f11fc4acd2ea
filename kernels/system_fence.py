"""A system-scope memory fence between a ring payload and the word that publishes it.

The engine publishes through the ring in two writes: the payload (stream tokens; a finish
reason and stream reset), then the word that tells the frontend to read it (``produced``;
the slot state word). Inside a CUDA graph the two are written by consecutive kernels, and
kernel order orders them only for observers on the GPU: a CPU (or NIC) reading the mapped
ring over PCIe may see the counter before the payload. A ``fence.sc.sys`` between the
kernels orders every earlier store of the stream before every later one, for all
observers. The Scheduler calls :func:`system_fence_for`'s fence at each such point, so both
GPU tiers capture it (tier A's schedule/bucket graphs and tier B's conditional bodies hold
the same code).

On CPU the loop runs the same scheduler in an engine thread; torch's stores on x86 are
ordered (TSO) but not on Arm, so the CPU fence is a real hardware fence
(:func:`blink.transport.base.memory_fence`: ``mfence`` / ``dmb ish``), wrapped as the custom
op ``blink::host_fence`` that declares it writes the ring region: a compiled step
(``torch.compile(fullgraph=True)``) keeps it in the graph, ordered after every earlier write
of the ring and before every later one.
"""
from __future__ import annotations

from typing import Callable

import torch

from blink.transport.base import memory_fence

Fence = Callable[[], None]


@torch.library.custom_op("blink::host_fence", mutates_args=("ordered",))
def host_fence(ordered: torch.Tensor) -> None:
    """A hardware memory fence; ``ordered`` (the ring region) is declared written so that
    a compiler keeps the ring's writes on their side of it."""
    memory_fence()


@host_fence.register_fake
def _(ordered: torch.Tensor) -> None:
    return None


def system_fence_for(device: torch.device | str, ordered: torch.Tensor) -> Fence:
    """The fence for a scheduler whose tensors live on ``device``; ``ordered`` is the ring
    region whose writes it orders."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaSystemFence(device)
    if device.type == "meta":  # shape-only runs (the capture audit) have nothing to order
        return lambda: None

    def fence() -> None:
        # Eager calls skip the custom op's dispatch (tens of microseconds a call); a traced
        # step gets the op, which is what keeps the compiler from moving ring writes past it.
        if torch.compiler.is_compiling():
            host_fence(ordered)
        else:
            memory_fence()

    return fence


class CudaSystemFence:
    """One one-thread Triton kernel that executes ``fence.sc.sys``, launched on the current
    stream (so a graph capture records it). Its 4-byte scratch word is allocated once, here,
    outside any capture."""

    def __init__(self, device: torch.device) -> None:
        from blink.kernels.triton.fence import fence_kernel  # noqa: PLC0415 - Triton on CUDA only

        self._kernel = fence_kernel
        self._word = torch.zeros(1, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self._kernel[(1,)](self._word, num_warps=1)
