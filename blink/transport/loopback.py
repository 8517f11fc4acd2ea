"""The loopback transport: a POSIX shared-memory region (the "simulated RDMA loopback").

The engine creates the region (:class:`LoopbackRegion`, a ``/dev/shm/blink-<pid>-<start>-<rand>``
segment); the frontend, a separate process, attaches by name (:class:`LoopbackTransport`) and
then only ever copies bytes in and out at offsets, as an RDMA NIC would.

No segment outlives its engine:

- the creator unlinks it on ``close()``, at interpreter exit (atexit) and on SIGTERM/SIGHUP
  (when nothing else handles those signals);
- the creator's multiprocessing resource tracker (a separate process) unlinks it if the creator
  is killed outright;
- :func:`cleanup_stale_segments` (run by every new region) removes ``blink-*`` segments whose
  creator is dead, identified by pid *and* process start time (a recycled pid is not mistaken
  for the creator), so even a SIGKILL leaves nothing behind after the next start.

Both sides map the segment with ``shm_open`` + ``mmap`` (what ``multiprocessing.shared_memory``
does underneath) rather than through ``SharedMemory`` objects: an attaching ``SharedMemory``
registers the segment with the resource tracker in Python < 3.13 (which would then unlink the
engine's region when the *frontend* exits, or complain about it), and ``SharedMemory.__del__``
raises when the engine's numpy/torch views of the ring outlive ``close()``. The creator registers
its segment with the resource tracker itself, as ``SharedMemory`` would.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import re
import secrets
import signal
import socket
import threading
from multiprocessing import resource_tracker
from typing import Any, Sequence

import numpy as np

from blink.transport.base import (
    Bytes,
    TransportError,
    as_byte_array,
    check_range,
    memory_fence,
    socket_peer_open,
)
from blink.transport.host_copy import CopyList, Sources, copy_segments

try:  # CPython's own binding, used by multiprocessing.shared_memory on every POSIX system
    import _posixshmem
except ImportError:  # pragma: no cover - non-CPython
    _posixshmem = None

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "blink-"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^blink-(\d+)-(\d+)-[0-9a-f]+$")


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22), or None if
    the process does not exist or is a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = stat[stat.rfind(")") + 2 :].split()
    state, start = rest[0], rest[19]
    if state in ("Z", "X"):
        return None
    return int(start)


def _creator_alive(pid: int, start_time: int) -> bool:
    if os.path.isdir("/proc/self"):
        return _proc_start_time(pid) == start_time
    try:  # no procfs: fall back to "does the pid exist"
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def segment_name() -> str:
    """A fresh segment name: prefix, creator pid, creator start time, random part."""
    pid = os.getpid()
    start = _proc_start_time(pid) or 0
    return f"{SEGMENT_PREFIX}{pid}-{start}-{secrets.token_hex(4)}"


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove ``blink-*`` segments whose creating process is gone; return their names.

    Segments of live engines and names this module did not make are left alone.
    """
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in entries:
        match = _NAME_RE.match(name)
        if not match:
            continue
        pid, start = int(match.group(1)), int(match.group(2))
        if _creator_alive(pid, start):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue  # another process cleaned it first
        except OSError as exc:
            logger.warning("cannot remove stale shared-memory segment %s: %s", name, exc)
            continue
        logger.info("removed stale shared-memory segment %s (its engine, pid %d, is gone)", name, pid)
        removed.append(name)
    return removed


# -- engine side ------------------------------------------------------------------------------


def _shm_open(name: str, flags: int, mode: int) -> int:
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, mode=mode)
    return os.open(os.path.join(SHM_DIR, name), flags, mode)  # pragma: no cover


def _shm_unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink("/" + name)
    else:  # pragma: no cover
        os.unlink(os.path.join(SHM_DIR, name))


# Segments this process created and has not unlinked yet: name -> creator pid.
# The pid keeps a forked child (which inherits this dict and the atexit hook) off its parent's
# segments. RLock: the signal handler may run while the main thread holds it.
_live: dict[str, int] = {}
_live_lock = threading.RLock()
_hooks_pid: int | None = None


def _tracker_unregister(name: str, from_signal_handler: bool) -> None:
    if not from_signal_handler:
        resource_tracker.unregister("/" + name, "shared_memory")
        return
    # In a signal handler the tracker client's lock may be held by the interrupted code: write
    # the message to the tracker's pipe directly, as its client does (one write under PIPE_BUF
    # is atomic). Without a running tracker there is nothing to tell.
    fd = getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None)
    if fd is None:
        return
    try:
        os.write(fd, f"UNREGISTER:/{name}:shared_memory\n".encode())
    except OSError:
        pass


def _unlink(name: str, from_signal_handler: bool = False) -> None:
    with _live_lock:
        if _live.get(name) != os.getpid():
            return
        del _live[name]
    try:
        _shm_unlink(name)
    except FileNotFoundError:
        pass
    _tracker_unregister(name, from_signal_handler)


def _unlink_all(from_signal_handler: bool = False) -> None:
    for name in list(_live):
        _unlink(name, from_signal_handler)


def _on_fatal_signal(signum: int, frame: Any) -> None:
    # CPython runs this in the main thread, the next time it executes bytecode: a process
    # whose main thread sleeps in a blocking read() while the kernel hands the signal to
    # another thread never gets here, so wait with timeouts (blink engine: stop.wait(0.2)).
    _unlink_all(from_signal_handler=True)
    # Die of the same signal, as the default action would have.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_hooks() -> None:
    global _hooks_pid
    if _hooks_pid == os.getpid():
        return
    if _hooks_pid is None:
        atexit.register(_unlink_all)  # inherited by forked children; _unlink checks the pid
    _hooks_pid = os.getpid()
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still runs
    for sig in (signal.SIGTERM, signal.SIGHUP):
        # Only replace the default action (which would skip atexit); someone else's handler
        # presumably exits cleanly and so runs atexit.
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_fatal_signal)


class LoopbackRegion:
    """Engine side: a new shared-memory segment of ``total_bytes`` (zero-filled)."""

    kind = "loopback"

    def __init__(self, total_bytes: int, *, cleanup_stale: bool = True) -> None:
        if total_bytes <= 0:
            raise TransportError(f"loopback region size must be positive, got {total_bytes}")
        if cleanup_stale:
            cleanup_stale_segments()
        _install_exit_hooks()
        name = segment_name()
        try:
            fd = _shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create shared-memory region {name!r}: {exc}") from exc
        with _live_lock:
            _live[name] = os.getpid()
        # The resource tracker (a separate process) unlinks it should this process be killed.
        resource_tracker.register("/" + name, "shared_memory")
        try:
            os.ftruncate(fd, total_bytes)
            self._mm = mmap.mmap(fd, total_bytes)
        except OSError as exc:
            _unlink(name)
            raise TransportError(
                f"cannot create a {total_bytes}-byte shared-memory region {name!r} in {SHM_DIR}: "
                f"{exc} (is /dev/shm large enough? docker: --shm-size)"
            ) from exc
        finally:
            os.close(fd)
        self.name = name
        self.total_bytes = total_bytes
        self._closed = False

    @property
    def buffer(self) -> mmap.mmap:
        """The segment's memory (writable), for ``Ring.create`` and the engine's own views."""
        if self._closed:
            raise TransportError(f"loopback region {self.name} is closed")
        return self._mm

    def session_offer(self, hello: dict[str, Any]) -> tuple[dict[str, Any], None]:
        return {"region_name": self.name}, None

    def session_complete(self, session: Any, message: dict[str, Any]) -> dict[str, Any]:
        raise TransportError("the loopback transport has no second handshake step")

    def session_close(self, session: Any) -> None:
        pass

    def unlink(self) -> None:
        """Remove the segment's name (attached processes keep their mapping). Idempotent."""
        _unlink(self.name)

    def close(self) -> None:
        """Unlink the segment and unmap it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.unlink()
        try:
            self._mm.close()
        except BufferError:
            # numpy/torch views of the buffer still exist (the engine's ring); the mapping is
            # released when they are, or with the process. The name is already gone.
            logger.debug("loopback region %s: views still alive, leaving the mapping", self.name)

    def __enter__(self) -> "LoopbackRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoopbackRegion({self.name!r}, {self.total_bytes} bytes)"


# -- frontend side ----------------------------------------------------------------------------


def _open_segment(name: str) -> int:
    """File descriptor of an existing segment, without the resource tracker noticing."""
    return _shm_open(name, os.O_RDWR, 0)


class LoopbackTransport:
    """Frontend side: attach to the engine's segment by name and copy bytes in and out."""

    kind = "loopback"

    def __init__(self, region_name: str, total_bytes: int | None = None, *,
                 lease: socket.socket | None = None) -> None:
        """``lease``: the bootstrap connection that holds this frontend's lease on the engine;
        kept open while attached, closed by :meth:`close`; its EOF also tells that the engine
        is gone (where the creator's pid is not visible)."""
        self._lease = lease
        if not isinstance(region_name, str) or not _NAME_RE.match(region_name):
            raise TransportError(
                f"loopback region name {region_name!r} is not a Blink segment name "
                f"({SEGMENT_PREFIX}<pid>-<start>-<hex>)"
            )
        try:
            fd = _open_segment(region_name)
        except FileNotFoundError:
            raise TransportError(
                f"shared-memory region {region_name!r} does not exist: the engine has exited, or "
                f"runs in another IPC namespace (container) than this frontend; a frontend on "
                f"another machine needs --transport verbs"
            ) from None
        except OSError as exc:
            raise TransportError(f"cannot open shared-memory region {region_name!r}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if total_bytes is not None and size < total_bytes:
                raise TransportError(
                    f"shared-memory region {region_name!r} has {size} bytes, the engine announced "
                    f"{total_bytes}"
                )
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name = region_name
        self.total_bytes = total_bytes if total_bytes is not None else size
        self._view: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)
        # The creator (the engine) as named in the segment name, if this process can see it:
        # in another pid namespace it cannot, and peer_alive() then answers None (unknown).
        match = _NAME_RE.match(region_name)
        pid, start = int(match.group(1)), int(match.group(2))  # type: ignore[union-attr]
        self._creator = (pid, start) if _creator_alive(pid, start) else None

    def peer_alive(self) -> bool | None:
        """Whether the engine process that created the region still exists (pid and start
        time, so a recycled pid does not count); None when this process cannot tell (the
        creator was not visible at attach time, e.g. another pid namespace). A few µs."""
        if self._lease is not None and not socket_peer_open(self._lease):
            return False  # the engine closed our lease: it exited, or stopped serving us
        if self._creator is None:
            return None
        return _creator_alive(*self._creator)

    def _mem(self) -> np.ndarray:
        if self._view is None:
            raise TransportError(f"loopback transport to {self.name} is closed")
        return self._view

    def write(self, offset: int, data: Bytes) -> None:
        src = as_byte_array(data)
        check_range(offset, src.size, self.total_bytes, "write")
        self._mem()[offset : offset + src.size] = src

    def write_segments(self, sources: Sequence[np.ndarray] | Sources, segments: np.ndarray,
                       threads: int = 1) -> int:
        """Gather-scatter: for each row ``(source index, source offset, region offset, length)``
        of ``segments``, put those bytes of ``sources[index]`` (flat uint8 arrays) at that
        offset of the region, each byte moved once, in one call (a list of RDMA WRITEs posted
        with one doorbell, in verbs terms; :mod:`blink.transport.host_copy`). Returns the bytes
        written. Optional: callers fall back to :meth:`write` per piece where a transport
        lacks it."""
        return copy_segments(self._mem(), sources, segments, threads)

    def prepare_segments(self, sources: Sequence[np.ndarray] | Sources, segments: np.ndarray) -> CopyList:
        """The checks and address table of :meth:`write_segments`, done once: the result is
        written with :meth:`write_prepared`, whole or a row range at a time (a transfer sent
        layer by layer)."""
        return CopyList(self._mem(), sources, segments)

    def write_prepared(self, copy_list: CopyList, start: int = 0, stop: int | None = None,
                       threads: int = 1) -> int:
        """Rows ``start:stop`` of a :meth:`prepare_segments` list; refused once this
        transport is closed (the list points into its mapping)."""
        if copy_list.dst is not self._mem():
            raise TransportError(f"a copy list prepared for another mapping than {self.name}'s")
        return copy_list.copy(start, stop, threads)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        check_range(offset, nbytes, self.total_bytes, "read")
        return self._mem()[offset : offset + nbytes].copy()

    def fence(self) -> None:
        # Plain stores through the mapping: a CPU fence orders them (x86 keeps store order
        # anyway; an Arm DPU does not).
        memory_fence()

    def close(self) -> None:
        if self._lease is not None:
            self._lease.close()  # gives up the engine's frontend lease
            self._lease = None
        if self._view is None:
            return
        self._view = None  # drop the exported buffer before unmapping
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover - a caller kept a view (read() returns copies)
            logger.debug("loopback transport %s: buffer still exported, leaving the mapping", self.name)

    def __enter__(self) -> "LoopbackTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoopbackTransport({self.name!r}, {self.total_bytes} bytes)"


def unlink_all_regions() -> None:
    """Unlink every segment this process created and has not unlinked yet (for a hard exit,
    which skips atexit)."""
    _unlink_all()
