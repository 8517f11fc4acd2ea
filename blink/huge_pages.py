"""The model's weights and KV cache in 2 MB pages on CPU (Linux transparent huge pages).

Why: a one-row decode step reads every weight once, so it runs at the rate the cores read
memory, and in 4 KB pages every 4 KB of that stream is a TLB miss and a page walk (two-level
in a VM). Linux backs private anonymous memory marked ``MADV_HUGEPAGE`` with 2 MB pages where
transparent huge pages are on ("always" or "madvise", the usual default); torch's allocator
does not mark its memory, so the weights are packed or copied into such mappings once, at load.
Measured on a Zen 4 VM (2 vCPUs), one process alternating the same 813 MB of a 1B model's
Q4_K_M projections and head at one row: 20-28 GB/s from 4 KB pages against 26-40 GB/s from
2 MB pages, 1.1-1.5x in each of 15 pairs (docs/performance.md#huge-pages).

They are placed in chunks of :data:`CHUNK` bytes (a larger tensor gets its own
mapping); a chunk's untouched tail takes no memory. A mapping is unmapped when the last tensor
in it is freed (``torch.frombuffer`` keeps it alive). ``$BLINK_CPU_HUGE_PAGES=0`` keeps
torch's own memory.
"""
from __future__ import annotations

import math
import mmap
import sys
from pathlib import Path

import torch

from blink import env as blink_env

#: the page size transparent huge pages use on x86-64 (and on arm64 with 4 KB base pages)
HUGE_PAGE = 2 << 20
#: bytes mapped at a time; tensors are packed into a chunk one after another
CHUNK = 64 << 20
#: each tensor starts at a multiple of this (a cache line, and any dtype's alignment)
ALIGN = 64
ENV = "BLINK_CPU_HUGE_PAGES"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where it
    has none (not Linux, or a kernel without them)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def unavailable_reason() -> str | None:
    """Why the weights stay in torch's own pages (None: they go to 2 MB pages)."""
    if not blink_env.is_true(ENV, default=True):
        return f"{ENV}=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    mode = thp_mode()
    if mode is None:
        return "this kernel has no transparent huge pages"
    if mode == "never":
        return f"transparent huge pages are off ({_THP_MODE}: never)"
    return None


class HugePageArena:
    """CPU tensors in private anonymous mappings marked ``MADV_HUGEPAGE``: copied there
    (:meth:`place`) or made there (:meth:`empty`, :meth:`zeros`)."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # uint8 view of the current chunk
        self._used = 0
        self._spans: list[tuple[int, int]] = []  # (first, end) address of each mapping's bytes
        #: bytes placed so far
        self.placed_bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in 2 MB pages (a weight packed straight into them: no copy
        to make later, :meth:`place` returns it as it is)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        self.placed_bytes += nbytes
        return self._take(nbytes).view(dtype).view(shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is the arena's."""
        address = tensor.data_ptr()
        return any(first <= address < end for first, end in self._spans)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in 2 MB pages (the same shape, strides, dtype and values), or
        ``tensor`` itself where it is in them already, is empty, or is not a plain CPU tensor
        laid out densely (oneDNN's opaque packed weights, a view with gaps)."""
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.numel() == 0:
            return tensor
        transposed = tensor.dim() == 2 and not tensor.is_contiguous() and tensor.t().is_contiguous()
        if not (tensor.is_contiguous() or transposed) or self.holds(tensor):
            return tensor
        dense = tensor.t() if transposed else tensor
        out = self.empty(tuple(dense.shape), dense.dtype).copy_(dense)
        return out.t() if transposed else out

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor in 2 MB pages of a mapping of its own (a KV cache), made as
        ``torch.zeros`` makes one: no view, storage offset 0. (``--compile`` compiles the
        paged attention kernel once for every layer's cache, and dynamo guards an input's
        storage offset and dispatcher state: on views of the arena's chunks at their own
        offsets, each layer's call would have compiled again, refused in steady state.)"""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        self.placed_bytes += nbytes
        storage = self._map(nbytes).untyped_storage()  # its own mapping: starts at its first byte
        out = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        # Fresh mappings read as zeros already; writing them commits the memory now, as
        # torch.zeros did, rather than on the step that first writes a block.
        return out.zero_()

    def _take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` fresh bytes, ALIGN-aligned, from the current chunk or a new mapping."""
        start = -(-self._used // ALIGN) * ALIGN
        if nbytes > CHUNK // 2:
            return self._map(nbytes)
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = self._map(CHUNK), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes]

    def _map(self, nbytes: int) -> torch.Tensor:
        mapped = _mapping(nbytes)
        self._spans.append((mapped.data_ptr(), mapped.data_ptr() + mapped.numel()))
        return mapped


def _mapping(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a new private anonymous mapping of at least ``nbytes``, starting on a
    2 MB boundary and marked ``MADV_HUGEPAGE`` (a kernel that refuses keeps 4 KB pages)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = (-start) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, size)
    except OSError:
        pass
    # a tensor (no view) whose storage starts at the aligned byte; it keeps ``region`` alive
    return torch.frombuffer(region, dtype=torch.uint8, offset=offset, count=nbytes)
