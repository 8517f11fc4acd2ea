"""Test hook for ``tests/test_disaggregation_e2e.py``: with this folder on ``PYTHONPATH``, every
Blink process started from the test holds a prefill engine's ready word back ``DELAY_S``
seconds after the prompt's KV blocks (``KVSender.delay_before_ready_s``), which widens the
window in which the test kills the decode engine. Python imports ``sitecustomize`` at start;
this one patches :mod:`blink.engine.kv_transfer` when (if ever) that module is imported, so
nothing of the product reads a test variable.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

DELAY_S = 1.0
TARGET = "blink.engine.kv_transfer"


def _patch(module: ModuleType) -> None:
    init = module.KVSender.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.delay_before_ready_s = DELAY_S

    module.KVSender.__init__ = __init__


class _KVReadyDelay(importlib.abc.MetaPathFinder):
    """Finds :data:`TARGET` with the other finders and patches it once it has run."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = run_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _KVReadyDelay())
