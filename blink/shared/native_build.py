"""Small C sources built into shared libraries at first use, cached once per machine.

Blink ships a few C loops as source (the loopback transport's copy list, the CPU paged
attention, the fused CPU elementwise ops) rather than prebuilt binaries: the wheel stays pure
Python and each host builds for its own CPU. :func:`build_library` compiles a source with the system C compiler
(``$CC``, else ``cc``, else ``gcc``) into ``$XDG_CACHE_HOME/blink`` (else ``~/.cache/blink``),
named by a hash of the source, the compiler, the flags and, for ``-march=native`` builds, the
CPU's feature flags (a home directory shared by different CPUs never loads a library built
for another). The file is renamed into place atomically, so concurrent builders are safe.
Callers keep a torch or Python fallback for hosts without a compiler; :class:`NativeLibrary`
is the build-once, load-once, warn-once wrapper they share.

Standard library only: the frontend (torch-free) reaches it through the transport.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path


class NativeBuildError(RuntimeError):
    """The library could not be built or loaded (no compiler, a compile error, a bad file)."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/blink``, else ``~/.cache/blink``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blink"


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as info:
            for line in info:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return platform.processor().encode()


def build_library(source: Path, flags: Sequence[str] = ("-O2",),
                  fallback_flags: Sequence[str] | None = None,
                  headers: Sequence[Path] = ()) -> ctypes.CDLL:
    """Build ``source`` (once per machine) and load it. ``flags`` go before the usual
    ``-shared -fPIC -pthread``; if that compile fails and ``fallback_flags`` is given, those
    are tried instead (e.g. without ``-march=native``, which some compilers reject).
    ``headers``: files the source includes, hashed into the name so that editing one
    rebuilds. Raises :class:`NativeBuildError`."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeBuildError("no C compiler ($CC, cc, gcc)")
    errors = []
    for attempt in ([list(flags)] + ([list(fallback_flags)] if fallback_flags is not None else [])):
        try:
            return ctypes.CDLL(str(_built(source, compiler, attempt, headers)))
        except NativeBuildError as exc:
            errors.append(str(exc))
        except OSError as exc:  # a library that does not load
            errors.append(f"loading it failed: {exc}")
    raise NativeBuildError("; ".join(errors))


def _built(source: Path, compiler: str, flags: list[str], headers: Sequence[Path]) -> Path:
    text = source.read_bytes()
    key_parts = [text, *(h.read_bytes() for h in headers), compiler.encode(), " ".join(flags).encode(),
                 platform.machine().encode()]
    if any(flag.startswith(("-march=native", "-mcpu=native")) for flag in flags):
        key_parts.append(_cpu_flags())
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-pthread", "-o", tmp, str(source), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler} {' '.join(flags)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's file is as good as ours
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"{compiler} could not run: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class NativeLibrary:
    """One C source, built (:func:`build_library`) and loaded once per process on first
    :meth:`get`, or None where it cannot be: then ``logger`` warns once, naming ``what`` and
    the ``fallback`` that runs instead. ``$env == env_value`` skips it without a warning (tests
    and diagnosis force the fallback so). ``setup(library)`` declares the functions'
    signatures; a missing symbol counts as a failed build."""

    def __init__(self, source: Path, *, what: str, fallback: str, logger: logging.Logger,
                 flags: Sequence[str] = ("-O2",), fallback_flags: Sequence[str] | None = None,
                 headers: Sequence[Path] = (), env: str | None = None, env_value: str = "torch",
                 setup: Callable[[ctypes.CDLL], None] | None = None) -> None:
        self.source, self.what, self.fallback, self.log = source, what, fallback, logger
        self.flags, self.fallback_flags, self.headers = tuple(flags), fallback_flags, tuple(headers)
        self.env, self.env_value, self.setup = env, env_value, setup
        self._lock = threading.Lock()
        self._state: list[ctypes.CDLL | None] = []  # [library or None] once decided

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (the caller's fallback runs)."""
        if self._state:
            return self._state[0]
        with self._lock:
            if not self._state:
                self._state.append(self._load())
        return self._state[0]

    def reset(self) -> None:
        """Forget the decision: the next :meth:`get` builds or loads again (tests)."""
        with self._lock:
            self._state.clear()

    def switch(self) -> str:
        """``$env`` as the library reads it (stripped, lower case; "" when unset or none)."""
        return os.environ.get(self.env, "").strip().lower() if self.env else ""

    def _load(self) -> ctypes.CDLL | None:
        if self.switch() == self.env_value:
            return None
        try:
            library = build_library(self.source, self.flags, self.fallback_flags, self.headers)
            if self.setup is not None:
                self.setup(library)
            return library
        except (NativeBuildError, AttributeError) as exc:
            self.log.warning("%s (%s) is not available (%s); %s", self.what, self.source.name, exc, self.fallback)
            return None
