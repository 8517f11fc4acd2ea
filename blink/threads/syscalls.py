"""The per-thread scheduling syscalls a thread policy uses, and the capability probe.

Every call takes a thread id (Linux applies affinity, nice, class, ``sched_setattr`` and
``ioprio_set`` per thread when given a tid). :class:`Syscalls` holds them as plain attributes so
a test can inject failures (EPERM, ENOSYS) without privileges; :func:`probe` tries each kind of
setting once on a short-lived helper thread and says what this host allows, so that an
unprivileged container degrades to "denied" lines instead of errors.

Status words: ``applied`` (the kernel took it), ``denied`` (EPERM/EACCES: no CAP_SYS_NICE /
CAP_SYS_ADMIN, or an RLIMIT), ``unsupported`` (the kernel or platform lacks it: ENOSYS,
EINVAL from an older kernel, not Linux).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

APPLIED, DENIED, UNSUPPORTED = "applied", "denied", "unsupported"

#: scheduling classes by policy-file name (SCHED_* values of linux/sched.h)
SCHED_CLASSES = {"OTHER": 0, "FIFO": 1, "RR": 2, "BATCH": 3, "IDLE": 5}
REALTIME_CLASSES = ("FIFO", "RR")
#: I/O priority classes (linux/ioprio.h) and the shift of the class in the value
IOPRIO_CLASSES = {"rt": 1, "be": 2, "idle": 3}
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_WHO_PROCESS = 1  # with a tid: that thread

#: syscall numbers by machine (the libc has no wrapper for these two)
_SYSCALLS = {
    "x86_64": {"sched_setattr": 314, "sched_getattr": 315, "ioprio_set": 251, "ioprio_get": 252},
    "aarch64": {"sched_setattr": 274, "sched_getattr": 275, "ioprio_set": 30, "ioprio_get": 31},
}


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (linux/sched/types.h), SCHED_ATTR_SIZE_VER1 = 56 bytes."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("sched_util_min", ctypes.c_uint32), ("sched_util_max", ctypes.c_uint32)]


def status_of(exc: OSError) -> str:
    """``denied`` or ``unsupported`` for the error a scheduling call raised."""
    if exc.errno in (errno.EPERM, errno.EACCES):
        return DENIED
    return UNSUPPORTED


def _raw_syscall(name: str) -> Callable[..., int] | None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None or not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    number = numbers[name]

    def call(*args: object) -> int:
        ret = libc.syscall(number, *args)
        if ret < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{name}: {os.strerror(e)}")
        return ret

    return call


def _unsupported(what: str) -> Callable[..., None]:
    def fail(*args: object) -> None:
        raise OSError(errno.ENOSYS, f"{what} is not available on this platform")

    return fail


def _sched_setattr_slice(tid: int, policy: int, nice: int, runtime_ns: int) -> None:
    """``sched_setattr`` for a fair class (OTHER/BATCH) with ``sched_runtime`` = the EEVDF
    slice the thread asks for (Linux >= 6.12 reads it as the request size; older kernels
    ignore it for fair classes, which the probe reads back to tell)."""
    call = _raw_syscall("sched_setattr")
    if call is None:
        raise OSError(errno.ENOSYS, "sched_setattr is not available on this platform")
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=policy, sched_nice=nice,
                      sched_runtime=runtime_ns)
    call(ctypes.c_int(tid), ctypes.byref(attr), ctypes.c_uint(0))


def _sched_getattr_runtime(tid: int) -> int:
    call = _raw_syscall("sched_getattr")
    if call is None:
        raise OSError(errno.ENOSYS, "sched_getattr is not available on this platform")
    attr = _SchedAttr()
    call(ctypes.c_int(tid), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(_SchedAttr)),
         ctypes.c_uint(0))
    return int(attr.sched_runtime)


def _ioprio_set(tid: int, io_class: str, level: int) -> None:
    call = _raw_syscall("ioprio_set")
    if call is None:
        raise OSError(errno.ENOSYS, "ioprio_set is not available on this platform")
    value = (IOPRIO_CLASSES[io_class] << _IOPRIO_CLASS_SHIFT) | level
    call(ctypes.c_int(_IOPRIO_WHO_PROCESS), ctypes.c_int(tid), ctypes.c_int(value))


def _ioprio_get(tid: int) -> int:
    call = _raw_syscall("ioprio_get")
    if call is None:
        raise OSError(errno.ENOSYS, "ioprio_get is not available on this platform")
    return call(ctypes.c_int(_IOPRIO_WHO_PROCESS), ctypes.c_int(tid))


def _setscheduler(tid: int, policy: int, priority: int) -> None:
    os.sched_setscheduler(tid, policy, os.sched_param(priority))


def _setpriority(tid: int, nice: int) -> None:
    os.setpriority(os.PRIO_PROCESS, tid, nice)


def _getpriority(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _getscheduler(tid: int) -> int:
    return os.sched_getscheduler(tid)


def _linux_or(fn: Callable, what: str) -> Callable:
    return fn if sys.platform.startswith("linux") else _unsupported(what)


@dataclass
class Syscalls:
    """The calls a policy makes, per thread id. Each raises OSError on failure. Tests replace
    fields (e.g. ``setpriority`` raising EPERM) to take the unprivileged path as root."""

    setaffinity: Callable[[int, set[int]], None] = field(
        default_factory=lambda: _linux_or(os.sched_setaffinity, "sched_setaffinity"))
    getaffinity: Callable[[int], set[int]] = field(
        default_factory=lambda: _linux_or(os.sched_getaffinity, "sched_getaffinity"))
    setpriority: Callable[[int, int], None] = field(
        default_factory=lambda: _linux_or(_setpriority, "setpriority"))
    getpriority: Callable[[int], int] = field(
        default_factory=lambda: _linux_or(_getpriority, "getpriority"))
    setscheduler: Callable[[int, int, int], None] = field(
        default_factory=lambda: _linux_or(_setscheduler, "sched_setscheduler"))
    getscheduler: Callable[[int], int] = field(
        default_factory=lambda: _linux_or(_getscheduler, "sched_getscheduler"))
    set_slice: Callable[[int, int, int, int], None] = field(default=_sched_setattr_slice)
    get_slice: Callable[[int], int] = field(default=_sched_getattr_runtime)
    ioprio_set: Callable[[int, str, int], None] = field(default=_ioprio_set)
    ioprio_get: Callable[[int], int] = field(default=_ioprio_get)
    set_autogroup: Callable[[int], None] = field(default=lambda nice: _write_autogroup(nice))
    #: /proc/sys/kernel/sched_autogroup_enabled (None: no autogroup support)
    autogroup_enabled: Callable[[], int | None] = field(default=lambda: _read_int(
        "/proc/sys/kernel/sched_autogroup_enabled"))
    #: /proc/sys/kernel/sched_rt_runtime_us (-1: real-time threads may take a core forever)
    rt_runtime_us: Callable[[], int | None] = field(default=lambda: _read_int(
        "/proc/sys/kernel/sched_rt_runtime_us"))


def _write_autogroup(nice: int) -> None:
    """Set the nice of this process's autogroup (its session's scheduling group)."""
    fd = os.open("/proc/self/autogroup", os.O_WRONLY)
    try:
        os.write(fd, str(nice).encode())
    finally:
        os.close(fd)
    with open("/proc/self/autogroup") as f:  # e.g. "/autogroup-12 nice -10"
        now = int(f.read().split()[-1])
    if now != nice:
        raise OSError(errno.EPERM, f"the autogroup's nice stayed {now}")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


#: the kinds of setting a policy has, in report order
SETTINGS = ("cpus", "nice", "class", "slice", "ioprio")


@dataclass(frozen=True)
class Capabilities:
    """What this host lets this process do, per kind of setting (status word + detail)."""

    status: dict[str, str]
    detail: dict[str, str]
    #: sched_rt_runtime_us, or None where unreadable
    rt_runtime_us: int | None

    def allows(self, setting: str) -> bool:
        return self.status.get(setting) == APPLIED

    def summary(self) -> str:
        return ", ".join(f"{s} {self.status[s]}" + (f" ({self.detail[s]})" if self.detail.get(s) else "")
                         for s in SETTINGS)


def probe(calls: Syscalls | None = None) -> Capabilities:
    """Try each kind of setting once on a helper thread that exits right after (so nothing
    sticks to a real thread), in its privileged form: a CPU set (the current one), a higher
    priority (nice -1), a real-time class (FIFO 1), an EEVDF slice (sched_setattr
    sched_runtime, read back), the real-time I/O class. The unprivileged forms (a higher
    nice, BATCH/IDLE, best-effort or idle I/O) need no capability: see :func:`predict`."""
    calls = calls or Syscalls()
    status: dict[str, str] = {}
    detail: dict[str, str] = {}

    def attempt(setting: str, fn: Callable[[], str | None]) -> None:
        try:
            note = fn()
        except OSError as exc:
            status[setting], detail[setting] = status_of(exc), exc.strerror or str(exc)
        else:
            status[setting] = UNSUPPORTED if note == UNSUPPORTED else APPLIED
            if note and note != UNSUPPORTED:
                detail[setting] = note
            elif note == UNSUPPORTED:
                detail[setting] = "the kernel ignores it"

    def run() -> None:
        tid = threading.get_native_id()
        attempt("cpus", lambda: calls.setaffinity(tid, calls.getaffinity(tid)))
        attempt("nice", lambda: calls.setpriority(tid, -1))

        def realtime() -> str:
            calls.setscheduler(tid, SCHED_CLASSES["FIFO"], 1)
            calls.setscheduler(tid, SCHED_CLASSES["OTHER"], 0)
            rt = calls.rt_runtime_us()
            return "unbounded: sched_rt_runtime_us = -1" if rt == -1 else \
                f"bounded: sched_rt_runtime_us = {rt}" if rt is not None else ""

        attempt("class", realtime)

        def eevdf_slice() -> str | None:
            calls.set_slice(tid, SCHED_CLASSES["OTHER"], 0, 1_000_000)
            return None if calls.get_slice(tid) == 1_000_000 else UNSUPPORTED

        attempt("slice", eevdf_slice)
        attempt("ioprio", lambda: calls.ioprio_set(tid, "rt", 4))  # the privileged class

    helper = threading.Thread(target=run, name="blink-probe", daemon=True)
    helper.start()
    helper.join()
    return Capabilities(status, detail, calls.rt_runtime_us())


def predict(caps: Capabilities, setting: str, value: str) -> str:
    """What applying ``setting=value`` (as :meth:`Rule.settings` writes it) will report,
    from the probe: lowering a priority needs no privilege, raising one does."""
    if caps.status.get(setting) == UNSUPPORTED:
        return UNSUPPORTED
    if setting == "nice" and int(value) >= 0:
        return APPLIED
    if setting == "class" and value.split(":")[0] not in REALTIME_CLASSES:
        return APPLIED
    if setting == "ioprio" and not value.startswith("rt"):
        return APPLIED
    return caps.status.get(setting, UNSUPPORTED)
