"""The start-up heap moved out of the garbage collector's scans, once a process is loaded.

Why: CPython's cyclic collector runs a full collection when the objects that survived the
younger ones reach a quarter of the long-lived ones, and a full collection scans every
tracked object, on whichever thread allocated last, holding the GIL throughout. A loaded
engine holds ~320K of them (torch and triton's modules, the model's Python objects, the
tokenizer): one full collection took 140 ms on the EPYC Zen 5 VM, ~9 decode steps of the
1B-class model in one inter-token gap of every stream of the step. Rare (none in 2,000
offline requests, docs/performance.md#gc-freeze), but nothing bounds it. Objects that live
through a serving process's life need no scanning, so after the load (the engine) or the
app's start (the frontend) they are collected once and frozen (``gc.freeze``, as vLLM and
SGLang do): later collections scan only what was allocated since, and the collector still
frees cycles among those.

Standard library only: the frontend (``blink.frontend_main``) calls it too.
"""
from __future__ import annotations

import gc
import logging
import time


def freeze_startup_heap(logger: logging.Logger, what: str) -> int:
    """Collect, then freeze every object alive now (``what``: the process, for the log line);
    returns how many objects are frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects moved out of the garbage collector's scans (gc.freeze, %.0f ms)",
                what, frozen, (time.perf_counter() - start) * 1000)
    return frozen
