"""The ring where the GPU can reach it.

The ring stays where the frontend writes it: the loopback region (POSIX shared memory) is
registered with ``cudaHostRegister(..., Mapped | Portable)`` and the scheduler reads and writes
it through device views of that mapping, so a frontend process sees tokens with no host
engine thread in between (:func:`map_ring`). Where the driver refuses to register shared
memory (gVisor), the ring is pinned memory the engine allocates itself (:class:`PinnedRegion`,
mapped under unified addressing) and only a frontend in the engine's process can reach it.
(A GPUDirect RDMA ring in GPU memory would work the same way through a device pointer.)
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blink.engine.gpu.cudart import clear_cuda_last_error
from blink.engine.sched.state import ring_views
from blink.errors import BlinkError
from blink.ring import RingLayout
from blink.transport.inprocess import InProcessRegion

log = logging.getLogger("blink.gpu")

#: cudaHostRegisterPortable | cudaHostRegisterMapped
HOST_REGISTER_FLAGS = 1 | 2


class CudaArray:
    """``__cuda_array_interface__`` over a raw device address (keeps ``owner`` alive)."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None, "version": 2,
        }


@dataclass
class MappedRing:
    """A host ring region registered with the GPU, and device views of its fields."""

    host_ptr: int
    device_ptr: int
    nbytes: int
    views: dict[str, torch.Tensor]
    registered: bool = True

    def unregister(self) -> bool:
        """Unregister the ring from the GPU. False when the driver refused (the ring must
        then stay mapped: the GPU may still address it)."""
        if self.registered:
            err = torch.cuda.cudart().cudaHostUnregister(self.host_ptr)
            if int(err) != 0:
                log.warning("cudaHostUnregister failed with CUDA error %s; the ring stays mapped", int(err))
                return False
            self.registered = False
            self.views.clear()
        return True


def device_pointer(host_ptr: int) -> int:
    """Device address of registered/pinned host memory (cudaHostGetDevicePointer; the
    same address under unified addressing when cuda-bindings is missing)."""
    try:
        from cuda.bindings import runtime  # noqa: PLC0415
    except ImportError:
        return host_ptr
    err, dptr = runtime.cudaHostGetDevicePointer(host_ptr, 0)
    if err != runtime.cudaError_t.cudaSuccess:
        raise BlinkError(f"cudaHostGetDevicePointer failed: {err}")
    return int(dptr)


def map_ring(buffer: Any, layout: RingLayout, device: torch.device) -> MappedRing:
    """Register the ring's host buffer (mapped, portable) and view it from ``device``."""
    nbytes = layout.total_bytes
    host_ptr = np.frombuffer(buffer, dtype=np.uint8, count=nbytes).ctypes.data
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping covers whole pages
    err = torch.cuda.cudart().cudaHostRegister(host_ptr, size, HOST_REGISTER_FLAGS)
    if int(err) != 0:
        clear_cuda_last_error()  # else torch's next launch check reports this error as its own
        raise BlinkError(f"cudaHostRegister of the ring ({size} bytes) failed with CUDA error "
                         f"{int(err)}: the ring cannot be mapped into the GPU")
    dptr = device_pointer(host_ptr)
    base = torch.as_tensor(CudaArray(dptr, nbytes, buffer), device=device)
    if base.data_ptr() != dptr:
        raise BlinkError("torch copied the mapped ring instead of viewing it")
    return MappedRing(host_ptr, dptr, nbytes, ring_views(layout, base))


class PinnedRegion(InProcessRegion):
    """The ring in pinned host memory the engine allocates itself (``cudaHostAlloc`` through
    torch; mapped into the GPU under unified addressing, so no ``cudaHostRegister``): the
    fallback where registering a shared-memory segment is refused. Only a frontend in this
    process can reach it (:mod:`blink.transport.inprocess`)."""

    def __init__(self, total_bytes: int) -> None:
        pinned = torch.zeros(total_bytes, dtype=torch.uint8, pin_memory=True)
        super().__init__(pinned.numpy(), total_bytes, owner=pinned)


def map_pinned_ring(region: PinnedRegion, layout: RingLayout, device: torch.device) -> MappedRing:
    """Device views of a :class:`PinnedRegion`'s ring (already mapped: nothing to register)."""
    host_ptr = np.frombuffer(region.buffer, dtype=np.uint8, count=layout.total_bytes).ctypes.data
    dptr = device_pointer(host_ptr)
    base = torch.as_tensor(CudaArray(dptr, layout.total_bytes, region.buffer), device=device)
    return MappedRing(host_ptr, dptr, layout.total_bytes, ring_views(layout, base), registered=False)
