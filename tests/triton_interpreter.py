"""Test-suite speedups for Triton's interpreter that keep its results bit for bit, installed
by tests/conftest.py before anything imports triton, and checked by
tests/test_triton_interpreter.py. Kernels are unchanged: only how the interpreter computes
one of its reductions and how often it re-patches triton.language."""
from __future__ import annotations

import importlib.machinery
import sys
from types import ModuleType

import numpy as np

INTERPRETER = "triton.runtime.interpreter"


def fast_xor_sum(interpreter: ModuleType) -> None:
    """Triton's interpreter reduces with any combine function but sum/min/max one element at
    a time in Python; ``tl.sort`` (the fused scheduler's allocator and queue order) runs an
    ``xor_sum`` per compare-and-swap round, which made ~90% of the fused scheduler tests'
    time (60 s for one test). The xor reduction is exact, so numpy's gives the same bits.
    No-op where the interpreter has another shape (the tests are then only slower)."""
    ops = getattr(interpreter, "ReduceOps", None)
    if ops is None or not hasattr(ops, "apply_impl") or getattr(ops, "_blink_fast_xor", False):
        return
    generic = ops.apply_impl

    def apply_impl(self, input):
        standard = sys.modules.get("triton.language.standard")  # loaded after the interpreter
        if standard is None or self.combine_fn is not getattr(standard, "_xor_combine", None) \
                or len(input) != 1:
            return generic(self, input)
        (x,) = input
        data = x.handle.data
        if self.axis is None:  # every element, as the generic path: a scalar, or shape (1,) kept
            out = np.bitwise_xor.reduce(data.reshape(-1), axis=0)
            out = out.reshape(1) if self.keep_dims else out.item()
        else:
            out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
        return [self.to_tensor(out, x.dtype)]

    ops.apply_impl = apply_impl
    ops._blink_fast_xor = True
    ops._blink_generic_apply_impl = generic


class _NoChanges:
    """A patch scope with nothing to restore."""

    def restore(self) -> None:
        pass


def patch_lang_once_per_launch(interpreter: ModuleType) -> None:
    """The interpreter maps triton.language onto itself (``_patch_lang``: ``inspect.getmembers``
    over the language modules) at each launch, restoring it after, and again at every call of a
    ``@triton.jit`` helper inside the launch (tl.sort's compare-and-swap rounds, the
    scheduler's helpers): ~40% of the fused scheduler tests' time. Within a launch, patching
    modules already patched sets the same functions again (the builtins are already replaced),
    so a helper whose language modules this launch patched skips it; any other still patches,
    as before. No-op where the interpreter has another shape."""
    real = getattr(interpreter, "_patch_lang", None)
    if real is None or getattr(real, "_blink_once_per_launch", False):
        return
    import inspect

    import triton.language as tl

    patched: list[set[int]] = []  # the language modules patched in the launch under way

    def langs_of(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    class LaunchScope:
        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            patched.clear()
            self.scope.restore()

    def patch_lang(fn):
        langs = langs_of(fn)
        if not patched:  # a launch (GridExecutor.__call__ restores what it gets)
            scope = LaunchScope(patch_lang._blink_real(fn))
            patched.append(langs)
            return scope
        if langs <= patched[0]:  # a helper inside the launch, its modules already patched
            return _NoChanges()
        patched[0] |= langs
        return patch_lang._blink_real(fn)

    patch_lang._blink_once_per_launch = True
    patch_lang._blink_real = real  # (a test counts its calls through this attribute)
    interpreter._patch_lang = patch_lang


class _PatchOnImport:
    """A meta path finder that applies :func:`fast_xor_sum` right after the interpreter's
    module runs (triton imports it with itself), then steps aside."""

    def find_spec(self, name, path, target=None):
        if name != INTERPRETER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            fast_xor_sum(module)
            # triton.language is importable once the interpreter's module has run
            patch_lang_once_per_launch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Speed up the interpreter now if triton is loaded, else when it is."""
    if INTERPRETER in sys.modules:
        fast_xor_sum(sys.modules[INTERPRETER])
        patch_lang_once_per_launch(sys.modules[INTERPRETER])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
