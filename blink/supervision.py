"""Children of ``blink serve`` die with their supervisor, even when it is killed outright.

``PR_SET_PDEATHSIG`` is set between fork and exec (:func:`child_preexec`), and each child also
watches its parent pid (:func:`watch_supervisor`), which covers the cases where the death
signal is not delivered (it follows the forking *thread*, and is lost if the parent died
before it was set). Torch-free: the frontend process uses it too.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
import signal
import sys
import threading
import time
from typing import Callable

from blink import env as blink_env
from blink.threads.roles import set_thread_name

#: environment variable that tells a child the pid of the ``blink serve`` it must die with
SUPERVISOR_PID_ENV = "BLINK_SUPERVISOR_PID"
#: seconds an orphaned child gets for a clean exit before it exits hard
ORPHAN_GRACE_S = 5.0

_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    try:  # resolved here, in the parent: the preexec hook must not load libraries after fork
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        _prctl = None


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux)."""
    if _prctl is None:
        return False
    return _prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(signum)), 0, 0, 0) == 0


def child_preexec() -> None:
    """Runs in the child between fork and exec: only the prctl syscall, nothing that locks."""
    set_parent_death_signal(signal.SIGTERM)


def watch_supervisor(what: str, on_orphan: Callable[[], None] | None = None
                     ) -> Callable[[], bool] | None:
    """In a child of ``blink serve``: make sure it dies with its supervisor.

    Reads (and removes) :data:`SUPERVISOR_PID_ENV`; without it (a standalone process) does
    nothing and returns None. Otherwise sets the parent-death signal again (harmless) and
    starts a daemon thread that, as soon as the parent pid is no longer the supervisor's,
    calls ``on_orphan``, sends this process SIGTERM (its clean shutdown) and, if it is still
    alive ``ORPHAN_GRACE_S`` later, removes its shared-memory regions and exits hard. Returns
    a function telling whether the supervisor is gone.
    """
    value = blink_env.pop(SUPERVISOR_PID_ENV)
    if not value or not value.isdigit():
        return None
    supervisor = int(value)
    set_parent_death_signal(signal.SIGTERM)

    def gone() -> bool:
        return os.getppid() != supervisor

    def watch() -> None:
        set_thread_name("blink-pwatch")
        while not gone():
            time.sleep(0.2)
        print(f"blink {what}: its blink serve supervisor (pid {supervisor}) is gone; exiting",
              file=sys.stderr, flush=True)
        if on_orphan is not None:
            on_orphan()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        from blink.transport.loopback import unlink_all_regions

        unlink_all_regions()
        os._exit(1)

    threading.Thread(target=watch, name="blink-pwatch", daemon=True).start()
    return gone


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft descriptor limit (RLIMIT_NOFILE) to its hard limit, as
    servers do (the usual soft default, 1024, is what ~1,000 idle connections exhaust; the
    children of ``blink serve`` inherit it). Returns (soft, hard) as they are afterwards.
    Never lowers anything; a refusal (a sandbox) is logged and the limit kept."""
    import logging
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # pragma: no cover - e.g. a sandbox refusing it
            logging.getLogger("blink.serve").warning(
                "could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft, hard


def child_processes(pid: int, *, recursive: bool = False) -> list[int]:
    """The live children of ``pid`` (every descendant with ``recursive``), read from /proc
    (Linux; no psutil). Zombies and dead processes are left out. For whoever checks on a
    supervisor from outside: the tests, ``benchmarks/gpu_check.py``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2:].split()[:2]  # the name may hold spaces and ')'
        if state not in ("Z", "X"):
            children.setdefault(int(ppid), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            if recursive:
                todo.append(child)
    return out

