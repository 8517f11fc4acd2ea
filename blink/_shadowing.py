"""Keep a checkout's top-level folders from shadowing third-party packages of the same name.

``kernels/`` and ``dpu/`` install as ``blink.kernels`` and ``blink.dpu``, but from a checkout's
root (the first entry of ``sys.path`` for ``python -m ...`` or a script there) they are also
importable as top-level ``kernels`` and ``dpu``: the names of unrelated PyPI packages (Hugging
Face's ``kernels``, which transformers imports whenever it is installed). Their ``__init__``
calls :func:`hand_on` when imported under such a name: the import goes to the installed
package of that name; where there is none, the module stays empty, with no ``__file__`` and
no submodules, as a folder without ``__init__.py`` would import (a PEP 420 namespace
package), which is how probes like transformers' tell "not installed". Torch-free and
import-light: it runs in other projects' environments (e.g. vLLM's, started from the root).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_on(name: str, module_globals: dict) -> None:
    """Called by the ``__init__`` whose globals are ``module_globals``, imported as ``name``:
    load the package ``name`` from ``sys.path`` without this checkout into
    ``sys.modules[name]``, or, when there is none, empty the calling module."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(module_globals["__file__"])))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        module_globals["__path__"] = []  # no submodules from this folder under a foreign name
        del module_globals["__file__"]
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
