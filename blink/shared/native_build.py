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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol


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


class CallRecorder(Protocol):
    """What :func:`recording_calls` installs (:class:`blink.kernels.cpu_graph.CpuGraph`'s recorder)."""

    def library_view(self, native: NativeLibrary, library: ctypes.CDLL) -> Any:
        """What :meth:`NativeLibrary.get` returns on the recording thread instead of ``library``."""


_RECORDING = threading.local()  # .recorder: this thread's active CallRecorder, if any


@contextmanager
def recording_calls(recorder: CallRecorder) -> Iterator[None]:
    """While active, :meth:`NativeLibrary.get` on this thread returns
    ``recorder.library_view(native, library)`` instead of the library, so the recorder sees
    every call this thread makes into a native library (other threads are unaffected). One
    recorder per thread at a time."""
    if getattr(_RECORDING, "recorder", None) is not None:
        raise RuntimeError("this thread is already recording native calls")
    _RECORDING.recorder = recorder
    try:
        yield
    finally:
        _RECORDING.recorder = None


class NativeLibrary:
    """One C source, built (:func:`build_library`) and loaded once per process on first
    :meth:`get`, or None where it cannot be: then ``logger`` warns once, naming ``what`` and
    the ``fallback`` that runs instead. ``$env == env_value`` (or one of them, a tuple) skips it
    without a warning (tests and diagnosis force the fallback so). ``setup(library)`` declares the functions'
    signatures; a missing symbol counts as a failed build.

    For a recording (:func:`recording_calls`), the functions say what they are: ``kernels``
    may be recorded and replayed later with the same arguments (they touch only memory their
    pointer arguments name, and every scalar argument they take is a shape or a constant,
    never a value read from the data); ``queries`` only report facts about the build or the
    CPU, and are called through."""

    def __init__(self, source: Path, *, what: str, fallback: str, logger: logging.Logger,
                 flags: Sequence[str] = ("-O2",), fallback_flags: Sequence[str] | None = None,
                 headers: Sequence[Path] = (), env: str | None = None,
                 env_value: str | tuple[str, ...] = "torch",
                 setup: Callable[[ctypes.CDLL], None] | None = None,
                 kernels: Sequence[str] = (), queries: Sequence[str] = ()) -> None:
        self.source, self.what, self.fallback, self.log = source, what, fallback, logger
        self.flags, self.fallback_flags, self.headers = tuple(flags), fallback_flags, tuple(headers)
        self.env, self.env_value, self.setup = env, env_value, setup
        self.kernels, self.queries = frozenset(kernels), frozenset(queries)
        self._lock = threading.Lock()
        self._state: list[ctypes.CDLL | None] = []  # [library or None] once decided

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (the caller's fallback runs); on a thread that is
        recording native calls, the recorder's view of it."""
        if not self._state:
            with self._lock:
                if not self._state:
                    self._state.append(self._load())
        library = self._state[0]
        recorder = getattr(_RECORDING, "recorder", None)
        if recorder is None or library is None:
            return library
        return recorder.library_view(self, library)

    def reset(self) -> None:
        """Forget the decision: the next :meth:`get` builds or loads again (tests)."""
        with self._lock:
            self._state.clear()

    def switch(self) -> str:
        """``$env`` as the library reads it (stripped, lower case; "" when unset or none)."""
        return os.environ.get(self.env, "").strip().lower() if self.env else ""

    def _load(self) -> ctypes.CDLL | None:
        if self.switch() in ((self.env_value,) if isinstance(self.env_value, str) else self.env_value):
            return None
        try:
            library = build_library(self.source, self.flags, self.fallback_flags, self.headers)
            if self.setup is not None:
                self.setup(library)
            return library
        except (NativeBuildError, AttributeError) as exc:
            self.log.warning("%s (%s) is not available (%s); %s", self.what, self.source.name, exc, self.fallback)
            return None
