"""Small C sources built into shared libraries at first use, cached once per machine.

Blink ships its C loops as source rather than prebuilt binaries: the loopback transport's
copy loop (``blink/transport/host_copy.c``) and the CPU kernels of ``kernels/cpu/`` (the
worker pool, the paged attention, the fused elementwise ops, the 4-bit projections on AMX and
on AVX-512/AVX2; each declared by a :class:`NativeLibrary` beside its source). The wheel stays
pure Python and each host builds for its own CPU. :func:`build_library` compiles a source with
the system C compiler (``$CC``, else ``cc``, else ``gcc``) into ``$XDG_CACHE_HOME/blink``
(else ``~/.cache/blink``), named by a hash of the source, its headers, the compiler (its path
and its version, :func:`compiler_version`: an upgraded compiler rebuilds), the flags and, for
``-march=native`` builds, the CPU's feature flags (a home directory shared by different CPUs
never loads a library built for another). A source may need more than C11 from its compiler
(``requires``: the paged attention needs GCC >= 12 or clang, for ``__builtin_shufflevector``);
where the compiler is older the build fails and the fallback's warning names the requirement
and the compiler found. The file is renamed into place atomically, so concurrent builders
are safe.
Callers keep a torch or Python fallback for hosts without a compiler; :class:`NativeLibrary`
is the build-once, load-once, warn-once wrapper they share, and :func:`prepare_libraries` builds
(or loads) every declared library at once, which the CPU engine does before it reports ready.

A cache directory that cannot be written (a full disk, a quota, a read-only mount) is not a
compiler problem: the first build that meets it gives up at once (no retry with the fallback
flags), the failure is remembered for the rest of the process (no further build is tried;
libraries already in the cache still load), and it is said once (:class:`CacheDirError`).

Standard library only: the frontend (torch-free) reaches it through the transport.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from blink import env as blink_env
from blink.shared.cpu_features import march_flags, read_cpu_flags


class NativeBuildError(RuntimeError):
    """The library could not be built or loaded (no compiler, a compile error, a bad file)."""


class CacheDirError(NativeBuildError):
    """The cache directory cannot take a new library (no space, a quota, read-only, no
    permission): remembered for the rest of the process (:func:`cache_dir_failure`)."""


#: errno values that mean "this directory cannot take the file", not "this source is wrong"
_CACHE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
#: what compilers and linkers print for the same (their errno text)
_CACHE_MESSAGES = tuple(os.strerror(e) for e in sorted(_CACHE_ERRNOS))
_cache_failure: str | None = None  # why the cache directory failed, once it did
_cache_failure_said = False
_cache_failure_lock = threading.Lock()
logger = logging.getLogger(__name__)


def cache_dir_failure() -> str | None:
    """Why the cache directory could not take a library earlier in this process, or None."""
    return _cache_failure


def forget_cache_dir_failure() -> None:
    """Forget a remembered cache-directory failure (tests; a new process starts clean)."""
    global _cache_failure, _cache_failure_said
    with _cache_failure_lock:
        _cache_failure, _cache_failure_said = None, False


def _cache_dir_failed(reason: str) -> CacheDirError:
    """Remember (once) that the cache directory cannot take a library; the error to raise."""
    global _cache_failure
    with _cache_failure_lock:
        if _cache_failure is None:
            _cache_failure = f"{cache_dir()}: {reason}"
        return CacheDirError(f"the kernel cache directory {_cache_failure}")


def _say_cache_failure_once() -> bool:
    """True the first time a cache-directory failure is to be logged in this process."""
    global _cache_failure_said
    with _cache_failure_lock:
        said, _cache_failure_said = _cache_failure_said, True
    return not said


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/blink``, else ``~/.cache/blink``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blink"


def _cpu_flags() -> bytes:
    """The CPU's own flags (not $BLINK_CPU_ISA's: a capped build is no -march=native build) for
    the cache key of -march=native builds; the processor's name where there is no cpuinfo."""
    flags = read_cpu_flags()
    return " ".join(sorted(flags)).encode() if flags else platform.processor().encode()


def find_compiler() -> str | None:
    """The C compiler builds use: ``$CC``, else ``cc``, else ``gcc`` (None: none found)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=None)
def compiler_version(compiler: str) -> str:
    """The first line of ``compiler --version`` (e.g. ``cc (Debian 12.2.0-14) 12.2.0``, ``clang
    version 17.0.6``), "" where it does not answer. Part of every build's cache key (an
    upgraded compiler at the same path rebuilds) and of the fallback warning of a source that
    needs a newer one. Asked once per compiler per process."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines else ""


def build_library(source: Path, flags: Sequence[str] = ("-O2",),
                  fallback_flags: Sequence[str] | None = None,
                  headers: Sequence[Path] = ()) -> ctypes.CDLL:
    """Build ``source`` (once per machine) and load it. ``flags`` go before the usual
    ``-shared -fPIC -pthread``; if that compile fails and ``fallback_flags`` is given, those
    are tried instead (e.g. without ``-march=native``, which some compilers reject).
    ``headers``: files the source includes, hashed into the name so that editing one
    rebuilds. Raises :class:`NativeBuildError`."""
    compiler = find_compiler()
    if compiler is None:
        raise NativeBuildError("no C compiler ($CC, cc, gcc)")
    errors = []
    # $BLINK_CPU_ISA: -march=native builds for the capped CPU instead (blink.shared.cpu_features)
    attempts = [march_flags(flags)] + ([march_flags(fallback_flags)] if fallback_flags is not None else [])
    for attempt in attempts:
        try:
            return ctypes.CDLL(str(_built(source, compiler, attempt, headers)))
        except CacheDirError:
            raise  # other flags would meet the same full (or read-only) directory
        except NativeBuildError as exc:
            errors.append(str(exc))
        except OSError as exc:  # a library that does not load
            errors.append(f"loading it failed: {exc}")
    raise NativeBuildError("; ".join(errors))


def _built(source: Path, compiler: str, flags: list[str], headers: Sequence[Path]) -> Path:
    text = source.read_bytes()
    key_parts = [text, *(h.read_bytes() for h in headers), compiler.encode(),
                 compiler_version(compiler).encode(), " ".join(flags).encode(), platform.machine().encode()]
    if any(flag.startswith(("-march=native", "-mcpu=native")) for flag in flags):
        key_parts.append(_cpu_flags())
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target  # loading needs no space: it works on a full disk too
    if _cache_failure is not None:
        raise CacheDirError(f"the kernel cache directory {_cache_failure} (earlier in this start)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        if exc.errno in _CACHE_ERRNOS:
            raise _cache_dir_failed(exc.strerror or str(exc)) from None
        raise NativeBuildError(f"cannot create a file in {target.parent}: {exc}") from exc
    try:
        done = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-pthread", "-o", tmp, str(source), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            full = next((m for m in _CACHE_MESSAGES if m in done.stderr), None)
            if full is not None:  # the compiler or linker could not write its output
                raise _cache_dir_failed(full)
            raise NativeBuildError(f"{compiler} {' '.join(flags)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's file is as good as ours
    except OSError as exc:
        if exc.errno in _CACHE_ERRNOS:
            raise _cache_dir_failed(exc.strerror or str(exc)) from None
        raise NativeBuildError(f"{compiler} could not run: {exc}") from exc
    except subprocess.SubprocessError as exc:
        raise NativeBuildError(f"{compiler} could not run: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return target


class CallRecorder(Protocol):
    """What :func:`recording_calls` installs (:class:`blink.kernels.cpu.graph.CpuGraph`'s recorder)."""

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
    CPU, and are called through.

    ``requires``: what the source needs of its compiler beyond C11 (e.g. "GCC >= 12 or
    clang"), said with the compiler found when the library is not available.

    ``wanted``: whether this process will use the library (None: it will), e.g. one build among
    several of a source that the CPU chooses from; :func:`prepare_libraries` leaves the
    unwanted ones unbuilt (:meth:`get` still builds them when asked: tests, benchmarks)."""

    def __init__(self, source: Path, *, what: str, fallback: str, logger: logging.Logger,
                 flags: Sequence[str] = ("-O2",), fallback_flags: Sequence[str] | None = None,
                 headers: Sequence[Path] = (), env: str | None = None,
                 env_value: str | tuple[str, ...] = "torch",
                 setup: Callable[[ctypes.CDLL], None] | None = None,
                 kernels: Sequence[str] = (), queries: Sequence[str] = (),
                 requires: str | None = None, wanted: Callable[[], bool] | None = None) -> None:
        self.source, self.what, self.fallback, self.log = source, what, fallback, logger
        self.flags, self.fallback_flags, self.headers = tuple(flags), fallback_flags, tuple(headers)
        self.env, self.env_value, self.setup = env, env_value, setup
        self.kernels, self.queries = frozenset(kernels), frozenset(queries)
        self.requires, self.wanted = requires, wanted
        self.build_failed = False  # whether the failure was the build itself (not setup)
        self._lock = threading.Lock()
        self._state: list[ctypes.CDLL | None] = []  # [library or None] once decided
        #: why the library is not available (None: it is, or not decided yet)
        self.failure: str | None = None
        _REGISTRY.append(self)

    @property
    def decided(self) -> bool:
        """Whether :meth:`get` has built/loaded the library or settled on the fallback."""
        return bool(self._state)

    def switched_off(self) -> bool:
        """``$env`` names the fallback (:meth:`switch` is ``env_value``, or one of them)."""
        return self.switch() in ((self.env_value,) if isinstance(self.env_value, str)
                                 else self.env_value)

    def is_wanted(self) -> bool:
        """Whether this process will use the library (``wanted``; True where it has none)."""
        return self.wanted is None or self.wanted()

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (the caller's fallback runs); on a thread that is
        recording native calls, the recorder's view of it."""
        if not self._state:
            self._decide(quiet=False)
        library = self._state[0]
        recorder = getattr(_RECORDING, "recorder", None)
        if recorder is None or library is None:
            return library
        return recorder.library_view(self, library)

    def _decide(self, quiet: bool) -> None:
        """Build or load once; ``quiet``: leave the warning to the caller
        (:func:`prepare_libraries` says it once for all)."""
        with self._lock:
            if not self._state:
                self._state.append(self._load(quiet))

    def reset(self) -> None:
        """Forget the decision: the next :meth:`get` builds or loads again (tests)."""
        with self._lock:
            self._state.clear()
            self.failure, self.build_failed = None, False

    @contextmanager
    def using(self, library: ctypes.CDLL | None) -> Iterator[None]:
        """Inside the block :meth:`get` returns ``library`` (another build of this source, or
        None: the fallback) instead of this one's decision, which is back after it (a
        benchmark's A/B of two builds, tests)."""
        self._decide(quiet=False)
        with self._lock:
            usual = self._state[:]
            self._state[:] = [library]
        try:
            yield
        finally:
            with self._lock:
                self._state[:] = usual

    def switch(self) -> str:
        """``$env`` as the library reads it (stripped, lower case; "" when unset or none)."""
        return blink_env.choice(self.env) if self.env else ""

    def _load(self, quiet: bool = False) -> ctypes.CDLL | None:
        if self.switched_off():
            return None
        library = None
        try:
            library = build_library(self.source, self.flags, self.fallback_flags, self.headers)
            if self.setup is not None:
                self.setup(library)
            return library
        except CacheDirError as exc:
            self.failure = str(exc)
            if not quiet and _say_cache_failure_once():  # one line for every library
                self.log.warning("%s; Blink's C kernels not built yet run their slower fallbacks "
                                 "for the rest of this start (%s: %s). Free space there or set "
                                 "XDG_CACHE_HOME to a writable directory", exc, self.what,
                                 self.fallback)
            return None
        except (NativeBuildError, AttributeError) as exc:
            self.failure = str(exc)
            self.build_failed = library is None  # the compile (or the compiler) failed, not setup
            if not quiet:
                self.log.warning("%s", self.unavailable())
            return None

    def unavailable(self) -> str:
        """The warning line for a library that is not available: what, why, what it needs of
        the compiler (with the one found) where it says, and what runs instead."""
        needs = ""
        if self.requires and self.build_failed:
            compiler = find_compiler()
            found = (compiler_version(compiler) or compiler) if compiler else "none found"
            needs = f"; it needs {self.requires}, the C compiler here: {found}"
        return f"{self.what} ({self.source.name}) is not available ({self.failure}{needs}); {self.fallback}"


#: every NativeLibrary made in this process, in creation order (prepare_libraries' list)
_REGISTRY: list[NativeLibrary] = []


def prepare_libraries(libraries: Sequence[NativeLibrary] | None = None,
                      log: logging.Logger | None = None) -> dict[str, str | None]:
    """Build or load ``libraries`` (default: every :class:`NativeLibrary` declared so far)
    now rather than at first use: a progress line before and one after, every fallback said
    in one warning. Returns {source name: why it is not available, or None}. Libraries
    already decided, switched off by their variable, or not wanted (``wanted``: a build this
    process will not use) are left as they are."""
    log = log or logger
    todo = [lib for lib in (libraries if libraries is not None else list(_REGISTRY))
            if not lib.decided and not lib.switched_off() and lib.is_wanted()]
    if not todo:
        return {}
    t0 = time.monotonic()
    log.info("CPU kernels: building or loading %d C libraries (%s) in %s; the first start on "
             "a machine compiles them, later ones load them", len(todo),
             ", ".join(lib.source.name for lib in todo), cache_dir())
    for lib in todo:
        lib._decide(quiet=True)
    failed = [lib for lib in todo if lib.failure is not None]
    took = time.monotonic() - t0
    fallbacks = "; ".join(f"{lib.what}: {lib.fallback}" for lib in failed)
    if not failed:
        log.info("CPU kernels ready in %.1f s", took)
    elif cache_dir_failure() is not None and all("kernel cache directory" in (lib.failure or "")
                                                 for lib in failed):
        if _say_cache_failure_once():
            log.warning("CPU kernels: the kernel cache directory %s; for the rest of this start "
                        "these run their slower fallbacks: %s. Free space there or set "
                        "XDG_CACHE_HOME to a writable directory (%.1f s)", cache_dir_failure(),
                        fallbacks, took)
    else:
        for lib in failed:
            log.warning("%s", lib.unavailable())
    return {lib.source.name: lib.failure for lib in todo}
