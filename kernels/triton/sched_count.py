"""The launch counter of the fused scheduler stages (:mod:`blink.kernels.triton.sched`):
every launch goes through :func:`note`, so a benchmark can count Triton launches per step
(``benchmarks/gpu_sched_launches.py``) without a profiler. Torch- and Triton-free."""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator

_launches: collections.Counter[str] = collections.Counter()
_depth = 0


@contextlib.contextmanager
def launch(kernel: str) -> Iterator[None]:
    """One launch of ``kernel``: counted, and marked as under way while it runs, so that a
    dispatch counter can leave out what the Triton interpreter itself dispatches on CPU
    tensors (its copies to and from numpy are not the kernel's launches)."""
    global _depth
    _launches[kernel] += 1
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def inside() -> bool:
    """Whether a counted launch is under way."""
    return _depth > 0


def total() -> int:
    """Launches so far, every kernel."""
    return sum(_launches.values())


def by_kernel() -> dict[str, int]:
    return dict(_launches)
