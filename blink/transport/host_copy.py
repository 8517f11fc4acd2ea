"""Segment copies for the loopback transport: many (source, offset, length) pieces into one
region in one call, each byte moved once (``host_copy.c``, compiled at first use).

What it is for: a KV transfer from a fragmented block pool is one 6 KiB piece per block,
layer and K/V (thousands per prompt). A Python loop pays more per piece than the copy costs,
and numpy's gather-then-scatter moves every byte twice; either way the transfer ran at about
half a memcpy (docs/performance.md#kv-transfer). The C loop is a list of ``memcpy`` calls,
split by bytes over the caller's thread count, the loopback counterpart of an RDMA WRITE list.

It is built with the system C compiler once per machine
(:func:`blink.shared.native_build.build_library`); loading takes milliseconds. Without a
compiler (a slim container image) the same copies run as a Python loop
(:func:`copy_segments_python`, also the tests' reference), said once in the log. numpy and
ctypes only: the frontend imports the transport without torch.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from blink.shared.native_build import NativeLibrary
from blink.transport.base import TransportError

log = logging.getLogger("blink.transport")

_SOURCE = Path(__file__).with_name("host_copy.c")
#: set to "python" to use the Python loop even where the C one builds (tests, diagnosis)
IMPL_ENV = "BLINK_HOST_COPY"


def _declare(library: ctypes.CDLL) -> None:
    fn = library.blink_copy_segments
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


LIBRARY = NativeLibrary(
    _SOURCE, what="loopback segment copies: the C loop", logger=log,
    fallback="a Python loop does them instead, slower for fragmented KV transfers",
    flags=("-O2",), env=IMPL_ENV, env_value="python", setup=_declare)


def load() -> str:
    """Build or load the C copy loop once per process; returns ``"c"`` or ``"python"``."""
    return "c" if LIBRARY.get() is not None else "python"


class Sources:
    """Flat contiguous uint8 arrays a copy list reads from, with their addresses and sizes
    taken once: a caller that copies from the same arrays many times (a prefill engine's KV
    caches) keeps one and skips that per copy."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = list(arrays)
        for a in self.arrays:
            if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
                raise TransportError("segment copy: every source must be a flat contiguous uint8 array")
        # (address, size) of each; __array_interface__ is much cheaper than .ctypes
        self.info = np.array([(a.__array_interface__["data"][0], a.nbytes) for a in self.arrays],
                             dtype=np.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.arrays[index]


def check_segments(dst: np.ndarray, sources: "Sequence[np.ndarray] | Sources",
                   segments: np.ndarray) -> np.ndarray:
    """``segments`` ([n, 4] ints: source index, source byte offset, destination byte offset,
    length) checked against ``sources`` (flat uint8 arrays) and ``dst``; returns the [n, 3]
    int64 table the C loop takes (source address, destination offset, length)."""
    src = sources if isinstance(sources, Sources) else Sources(sources)
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 4)
    table = np.empty((len(seg), 3), dtype=np.int64)
    if not len(seg):
        return table
    index, src_off, dst_off, length = seg.T
    if int(seg.min()) < 0 or int(index.max()) >= len(src) \
            or (src_off + length > src.info[index, 1]).any() or int((dst_off + length).max()) > dst.nbytes:
        raise TransportError(f"segment copy: a segment lies outside its source or the "
                             f"{dst.nbytes}-byte region")
    np.add(src.info[index, 0], src_off, out=table[:, 0])
    table[:, 1], table[:, 2] = dst_off, length
    return table


def copy_segments_python(dst: np.ndarray, sources: "Sequence[np.ndarray] | Sources",
                         segments: np.ndarray) -> int:
    """The reference: one slice assignment per segment."""
    moved = 0
    for index, src_off, dst_off, length in np.asarray(segments, dtype=np.int64).reshape(-1, 4).tolist():
        dst[dst_off : dst_off + length] = sources[index][src_off : src_off + length]
        moved += length
    return moved


class CopyList:
    """A copy list into ``dst`` checked once (:func:`check_segments`): then written whole or
    a range of its rows at a time (:meth:`copy`) for one C call each, no numpy work. Holds
    its sources, so their memory lives as long as it does; the caller keeps ``dst`` mapped."""

    def __init__(self, dst: np.ndarray, sources: "Sequence[np.ndarray] | Sources", segments: np.ndarray) -> None:
        if not dst.flags.writeable or not dst.flags.c_contiguous or dst.dtype != np.uint8 or dst.ndim != 1:
            raise TransportError("segment copy: the destination must be a writable flat uint8 array")
        self.dst = dst
        self.sources = sources if isinstance(sources, Sources) else Sources(sources)
        self.segments = np.array(segments, dtype=np.int64).reshape(-1, 4)
        self.table = check_segments(dst, self.sources, self.segments)
        self._dst_address = dst.__array_interface__["data"][0]

    def __len__(self) -> int:
        return len(self.segments)

    def copy(self, start: int = 0, stop: int | None = None, threads: int = 1) -> int:
        """Copy rows ``start:stop``; returns the bytes copied. ``threads``: how many threads
        the C loop may split the bytes over."""
        stop = len(self) if stop is None else min(stop, len(self))
        if stop <= start:
            return 0
        library = LIBRARY.get()
        if library is None:
            return copy_segments_python(self.dst, self.sources, self.segments[start:stop])
        fn = library.blink_copy_segments
        rows = self.table.__array_interface__["data"][0] + start * self.table.strides[0]
        return int(fn(self._dst_address, rows, stop - start, max(1, int(threads))))


def copy_segments(dst: np.ndarray, sources: "Sequence[np.ndarray] | Sources", segments: np.ndarray,
                  threads: int = 1) -> int:
    """Copy every segment (:func:`check_segments`) into ``dst`` (a writable flat uint8 array);
    returns the bytes copied. ``threads``: how many threads the C loop may split the bytes
    over."""
    return CopyList(dst, sources, segments).copy(threads=threads)
