"""Blink: an LLM serving engine whose steady-state inference path needs no host CPU.

This package must stay importable without torch (the frontend, ``blink.dpu``, runs on a DPU
image that has none), so heavy names are imported lazily on first use.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("blink.llm", "LLM"),
    "SamplingParams": ("blink.shared.sampling_params", "SamplingParams"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'blink' has no attribute {name!r}")
