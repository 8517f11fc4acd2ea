"""Load-time work over chunks of rows, side by side on the process's cores.

A GGUF file's codes are unpacked (numpy), packed into the CPU kernels' layout (torch) and,
for tensors that stay plain, dequantized a few MB of rows at a time
(:func:`blink.loader.gguf_weights.unpack_codes`, ``_dequantize_rows``,
:func:`blink.kernels.cpu.quant_linear.pack`); each chunk writes its own rows of one result.
numpy's and torch's element-wise ops release the GIL, so chunks run on several threads at
once: a 1B Q4_K_M file's ~11 s of unpacking and packing on one core (quiet, torch at one
thread) took ~7.6 s on two (the engine loads before its step threads start, so nothing else
needs the cores then; docs/performance.md#gguf-load).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor


def load_workers() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (no affinity call: macOS)
        return max(1, os.cpu_count() or 1)


def run_chunks(work: Callable[[int], None], starts: Iterable[int]) -> None:
    """``work(start)`` for every chunk start, on up to :func:`load_workers` threads (here, in
    order, where there is one core or one chunk); the first exception is raised once all
    chunks have run."""
    starts = list(starts)
    workers = min(load_workers(), len(starts))
    if workers <= 1:
        for start in starts:
            work(start)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="blink-load") as pool:
        for _ in pool.map(work, starts):  # (map re-raises a chunk's exception here)
            pass
