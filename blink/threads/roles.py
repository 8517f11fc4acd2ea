"""The role of every thread Blink starts, and its stable OS name (at most 15 bytes).

Linux keeps a thread's name in ``/proc/self/task/<tid>/comm`` (``top -H``, ``ps -L``, py-spy,
Gthulhu's ``commandRegex`` all read it); ``prctl(PR_SET_NAME)`` sets the caller's, and writing
that file sets any thread's of the same process (used for threads Blink does not run code
on, such as OpenMP's workers). A new thread starts with its creator's name, so helper threads a
library starts from a named thread (tokenizers' rayon pool from a ``blink-tok-N`` worker)
carry their creator's role, and its policy.

:data:`ROLES` is the one table: the policy file's regexes are checked against it, the docs'
table (``docs/threads.md``) lists it, and the Gthulhu export names it.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

#: Linux's limit: 16 bytes with the terminating NUL
MAX_NAME_BYTES = 15


@dataclass(frozen=True)
class Role:
    """One kind of Blink thread."""

    #: the OS name, or for numbered threads its prefix (``blink-omp-`` + the worker index)
    name: str
    #: the process it lives in: supervisor (``blink serve``), engine, frontend
    process: str
    #: what it does, for the docs and the report
    what: str
    #: True when it spins while waiting (OpenMP's spin-wait, a CUDA spin sync): never give
    #: such a thread a real-time class on a shared core without the kernel's RT bound
    busy_polls: bool = False
    #: numbered (``name`` + index), one per worker
    numbered: bool = False

    @property
    def pattern(self) -> str:
        """A regex that matches exactly this role's thread names."""
        return f"^{re.escape(self.name)}[0-9]+$" if self.numbered else f"^{re.escape(self.name)}$"

    def matches(self, comm: str) -> bool:
        return re.match(self.pattern, comm) is not None


ROLES: tuple[Role, ...] = (
    Role("blink-serve", "supervisor", "blink serve's main thread: starts the engine and the "
         "frontend, restarts a dead engine"),
    Role("blink-eng-log", "supervisor", "forwards the engine's output to the supervisor's stderr"),
    Role("blink-fe-log", "supervisor", "forwards the frontend's output to the supervisor's stderr"),
    Role("blink-engine", "engine", "the engine process's main thread: start-up (model load), "
         "signals, liveness check every 0.2 s"),
    Role("blink-loop", "engine", "the CPU loop: schedule -> forward -> sample -> update; also "
         "OpenMP's master thread of every parallel op", busy_polls=True),
    Role("blink-omp-", "engine", "OpenMP compute workers of the CPU loop (torch's intra-op "
         "team beside the loop thread, named when the loop starts)", busy_polls=True,
         numbered=True),
    Role("blink-kern-", "engine", "workers of Blink's CPU kernels (kernels/cpu/pool.c): split "
         "a prefill's projections, attention and elementwise ops with the loop thread; poll "
         "200 us after a call, then sleep", busy_polls=True, numbered=True),
    Role("blink-hostloop", "engine", "tier A (--loop host): replays the step graphs, reads the "
         "mailbox each step", busy_polls=True),
    Role("blink-gpumon", "engine", "tier B (--loop device): launched the device loop once, "
         "checks it every 100 ms"),
    Role("blink-bootstrap", "engine", "the bootstrap listener (accepts frontends)"),
    Role("blink-bs-peer", "engine", "one attached frontend's bootstrap connection (its lease)"),
    Role("blink-ark", "engine", "a prefill engine's ARK bus (--fabric): accepts and dials the "
         "other prefill engines, sends and reads path claims, runs the protocol"),
    Role("blink-pwatch", "engine, frontend", "watches the supervisor's pid; the child exits "
         "with it"),
    Role("blink-threads", "supervisor, engine, frontend", "applies the thread policy to new threads, "
         "samples thread telemetry (every 0.5 s)"),
    Role("blink-http", "frontend", "the frontend's event loop: uvicorn HTTP, request "
         "validation, short encodes, the ring poller task, incremental detokenize, stop strings"),
    Role("blink-tok-", "frontend", "the frontend's worker pool: chat-template renders, long "
         "encodes/decodes, large JSON bodies", numbered=True),
)

_by_name = {r.name: r for r in ROLES}
for _r in ROLES:  # the table itself must respect the kernel's limit
    assert len((_r.name + ("99" if _r.numbered else "")).encode()) <= MAX_NAME_BYTES, _r.name


def role(name: str) -> Role:
    """The role named ``name`` (a :data:`ROLES` entry)."""
    return _by_name[name]


def role_of(comm: str) -> Role | None:
    """The role a thread name belongs to, or None for a thread that is not Blink's."""
    for r in ROLES:
        if r.matches(comm):
            return r
    return None


def role_label(comm: str) -> str:
    """The metrics label of a thread: its role's name without the worker index (all OpenMP
    workers are one series), or the name itself for a thread that is not Blink's."""
    r = role_of(comm)
    return (r.name.rstrip("-") if r.numbered else r.name) if r is not None else comm


def numbered_name(prefix_role: str, index: int) -> str:
    """``blink-omp-3``: the name of the ``index``-th worker of a numbered role."""
    r = role(prefix_role)
    if not r.numbered:
        raise ValueError(f"{prefix_role} is not a numbered role")
    return f"{r.name}{index}"


# -- naming ----------------------------------------------------------------------------------

_PR_SET_NAME = 15
_libc: ctypes.CDLL | None = None
#: called with (tid, name) whenever Blink names a thread (the policy runtime applies itself)
_on_named: list[Callable[[int, str], None]] = []


def on_thread_named(callback: Callable[[int, str], None]) -> Callable[[], None]:
    """Call ``callback(tid, name)`` each time a thread is named from now on; returns a
    function that removes it. This is how the policy reaches a thread at its creation."""
    _on_named.append(callback)
    return lambda: _on_named.remove(callback) if callback in _on_named else None


def _notify(tid: int, name: str) -> None:
    for cb in list(_on_named):
        try:
            cb(tid, name)
        except Exception:  # noqa: BLE001 - a policy failure must not break the thread's start
            pass


def _check(name: str) -> bytes:
    raw = name.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"thread name {name!r} is longer than {MAX_NAME_BYTES} bytes")
    return raw


def set_thread_name(name: str) -> bool:
    """Name the calling OS thread (and its Python ``threading`` name). At most 15 bytes (the
    kernel's limit; a longer name is a bug here, not something to truncate silently). Returns
    False where prctl is unavailable (not Linux)."""
    global _libc
    raw = _check(name)
    threading.current_thread().name = name
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        ok = _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok:
        _notify(threading.get_native_id(), name)
    return ok


def name_task(tid: int, name: str) -> bool:
    """Name another thread of this process (``/proc/self/task/<tid>/comm``). False if the
    thread is gone or the file cannot be written."""
    raw = _check(name)
    try:
        with open(f"/proc/self/task/{tid}/comm", "wb") as f:
            f.write(raw)
    except OSError:
        return False
    _notify(tid, name)
    return True


def task_name(tid: int, pid: int | str = "self") -> str | None:
    """A thread's OS name, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().rstrip("\n")
    except OSError:
        return None


def get_thread_name() -> str:
    """The calling OS thread's kernel name (Linux), for tests and diagnostics."""
    if not sys.platform.startswith("linux"):
        return threading.current_thread().name
    return task_name(threading.get_native_id()) or threading.current_thread().name


def task_ids(pid: int | str = "self") -> list[int]:
    """The thread ids of a process (``/proc/PID/task``), sorted; empty if it is gone."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit())
    except OSError:
        return []


def name_new_threads(before: Iterable[int], prefix_role: str, inherited: str) -> list[int]:
    """Name the threads of this process that did not exist in ``before`` and still carry the
    name ``inherited`` (their creator's: a new thread starts with it) as the workers of
    ``prefix_role`` (``blink-omp-0``, ``blink-omp-1``...), in tid order. For threads a library
    created (OpenMP's team, which appears at the first parallel op after
    ``torch.set_num_threads``); threads other code started meanwhile have other names.
    Returns the tids named."""
    old = set(before)
    new = [t for t in task_ids() if t not in old and task_name(t) == inherited]
    named = []
    for index, tid in enumerate(new):
        if name_task(tid, numbered_name(prefix_role, index)):
            named.append(tid)
    return named
