"""How many threads the CPU kernels (:mod:`blink.kernels.cpu.q4_linear`,
:mod:`blink.kernels.cpu.attention`, :mod:`blink.kernels.cpu.fused`) may split one call over.

Default: torch's intra-op threads. The engine's CPU loop may give its kernels more than it
gives torch's OpenMP pool (``EngineConfig.kernel_threads``): a kernel splits a call with
~5-15 us of work or more per thread (a prefill's calls, and a decode step's projections and
attention), its parts claimed by whichever thread is free (``pool.c``), so a worker whose
core the frontend or the client holds leaves its part to the calling thread instead of
holding up the step. The workers poll for 200 us after a call, then sleep: between steps
and while the engine is idle the cores stay free.
"""
from __future__ import annotations

import torch

_threads: int | None = None


def kernel_threads() -> int:
    """Threads a kernel call may use (per call; cheap)."""
    return torch.get_num_threads() if _threads is None else _threads


def set_kernel_threads(threads: int | None) -> None:
    """Let the kernels split calls over ``threads`` (None: torch's intra-op threads)."""
    global _threads
    if threads is not None and threads < 1:
        raise ValueError(f"kernel threads must be at least 1, got {threads}")
    _threads = threads
