"""Helpers for the tests of the CPU C kernels (blink.shared.native_build users)."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def forced_native(library, env: str):
    """``library`` (a ``NativeLibrary``) built and used even where it is not by default (a
    host without AVX-512): ``$env=c`` for the block, then the previous value, and the
    library decides again both times."""
    previous = os.environ.get(env)
    os.environ[env] = "c"
    library.reset()
    try:
        yield library.get()
    finally:
        if previous is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = previous
        library.reset()
