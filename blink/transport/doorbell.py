"""The engine's doorbell: one datagram after each step, so that a frontend on the same host
reads the ring when there is something new instead of on a timer.

Why: on a host whose cores run both the engine's kernels and the frontend (two vCPUs: both run
the kernels during a step), each tick of the frontend's ring poller that lands mid-step stops a
kernel thread, and the step waits for the part that thread holds. SmolLM2-135M's steps are
~2.6 ms; the poller's backoff (0.2 ms after output, doubling) ticks ~3 times in each, and finds
the token up to a backoff late. With the doorbell the poller wakes once a step, right after the
step published its tokens, while the engine's loop does its host work and no kernel part runs
(docs/performance.md#doorbell).

How: the frontend binds a Linux abstract-namespace UNIX datagram socket under a random name
(:class:`DoorbellListener`) and sends the name in its bootstrap hello; an engine serving the
loopback transport (frontend and engine on one host) rings it after every step of its loop
(:class:`Doorbell`, one non-blocking ``send``), for the frontend that holds its lease, and its
welcome says ``doorbell: true``. A bell carries nothing: the ring stays the only data path, and
a lost or spurious bell costs at most one poll (a full socket buffer already holds bells that
will wake the poller). Over verbs (the frontend on a DPU or another host) there is no bell:
the poller ticks on its timers as before. ``$BLINK_FRONTEND_DOORBELL=0`` turns it off.
"""
from __future__ import annotations

import re
import secrets
import select
import socket
import sys

#: the hello's and the welcome's field
FIELD = "doorbell"
NAME_PREFIX = "blink-doorbell-"
_NAME = re.compile(r"blink-doorbell-[0-9a-f]{32}")


def supported() -> bool:
    """Abstract-namespace UNIX sockets are Linux's; elsewhere the poller keeps its timers."""
    return sys.platform.startswith("linux")


def valid_name(name: object) -> bool:
    """A name a :class:`DoorbellListener` makes: the engine rings nothing else."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


class _DatagramEnd:
    """A non-blocking UNIX datagram socket, closed by :meth:`close` or when dropped (the engine's
    bell is dropped by whoever held it last: the lease's end, or the loop's step)."""

    _sock: socket.socket

    def close(self) -> None:
        self._sock.close()

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()


class DoorbellListener(_DatagramEnd):
    """The frontend's end: a bound, non-blocking datagram socket under a fresh random name."""

    def __init__(self) -> None:
        self.name = NAME_PREFIX + secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def wait(self, timeout_s: float) -> int:
        """Block until a bell comes or ``timeout_s`` passes, then read every bell waiting; how
        many there were (0: timed out). For a thread of its own (:class:`blink.llm.LLM`); the
        frontend's event loop watches :meth:`fileno` instead."""
        select.select([self._sock], [], [], timeout_s)
        return self.drain()

    def drain(self) -> int:
        """Read every bell waiting; how many there were."""
        count = 0
        try:
            while True:
                self._sock.recv(16)
                count += 1
        except (BlockingIOError, InterruptedError):
            return count


class Doorbell(_DatagramEnd):
    """The engine's end, connected to one listener's name."""

    def __init__(self, name: str) -> None:
        if not valid_name(name):
            raise ValueError(f"not a doorbell name: {name!r}")
        self.name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            self._sock.connect("\0" + name)
        except BaseException:
            self._sock.close()
            raise

    def ring(self) -> None:
        """One bell, never blocking and never raising: a full buffer already holds bells, and a
        listener that is gone (its frontend exited) has nobody to wake."""
        try:
            self._sock.send(b"\0")
        except OSError:
            pass

