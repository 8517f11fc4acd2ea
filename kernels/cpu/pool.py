"""The process's one pool of worker threads for the CPU kernels (``pool.c``).

Each kernel library (:mod:`blink.kernels.cpu.attention`, :mod:`blink.kernels.cpu.q4_linear`,
:mod:`blink.kernels.cpu.fused`) gets the pool's entry point when it loads
(:func:`attach`), so that a call split over threads (:mod:`blink.kernels.cpu.threads` says how
many) runs on the same workers whichever library makes it. Without the pool (no compiler:
said once in the log) every call runs on its calling thread.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from blink.kernels.cpu import abi
from blink.shared.native_build import NativeLibrary

log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("pool.c")


def _declare(library: ctypes.CDLL) -> None:
    abi.declare(library, abi.POOL)


LIBRARY = NativeLibrary(
    _SOURCE, what="the CPU kernels' worker pool", logger=log,
    fallback="each kernel call runs on its calling thread",
    flags=("-O2",), headers=(_SOURCE.with_name("kernels.h"),), setup=_declare,
    queries=("blink_pool_split",))  # (only its address is taken: attach hands it to the kernels)


def attach(library: ctypes.CDLL) -> None:
    """Give a kernel library (one that includes ``kernels.h``, declared from
    :mod:`blink.kernels.cpu.abi`) the pool's entry point."""
    pool = LIBRARY.get()
    library.blink_use_pool(None if pool is None else ctypes.cast(pool.blink_pool_split, ctypes.c_void_p).value)
