"""Transport interfaces shared by both sides, and small helpers (numpy only, no torch).

The transport has one-sided semantics, like RDMA verbs: the frontend puts bytes at an offset of
the engine's memory region and reads bytes back from it; the engine's CPU is never asked to
receive anything. Two roles:

- :class:`Region` (engine side): the memory the engine owns and lays the ring out in. It says
  how a peer reaches it (``session_offer``), which the bootstrap handshake sends to the frontend.
- :class:`Transport` (frontend side): ``write``/``read`` at (region, offset) plus ``fence``,
  which orders the writes before it ahead of the writes after it (the ring publishes a state
  word only after its payload).
"""
from __future__ import annotations

import ctypes
import socket
import sys
import threading
from functools import partial
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np

from blink.errors import BlinkError
# thread naming lives in blink.threads.roles; re-exported here (transport threads use it)
from blink.threads.roles import get_thread_name, set_thread_name  # noqa: F401

#: What ``Transport.write`` accepts.
Bytes = Union[bytes, bytearray, memoryview, np.ndarray]


class TransportError(BlinkError):
    """The transport cannot be set up or used (no device, bad address, peer gone...)."""


class HandshakeError(TransportError):
    """The bootstrap handshake failed: no engine listening, refused (layout version), malformed."""


@runtime_checkable
class Transport(Protocol):
    """Frontend side: one-sided access to the engine's region."""

    #: "loopback" or "verbs"
    kind: str
    #: size of the remote region in bytes
    total_bytes: int

    def write(self, offset: int, data: Bytes) -> None:
        """Put ``data`` at ``offset`` of the region. May return before the bytes land."""
        ...

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """A private copy (uint8 array) of ``nbytes`` of the region at ``offset``.

        Reads issued after a write see that write (both transports keep program order
        between one side's own reads and writes)."""
        ...

    def fence(self) -> None:
        """Every write issued before returns ahead of every write (and read) issued after."""
        ...

    def close(self) -> None:
        """Release the connection; idempotent."""
        ...

    # Optional (not part of the protocol check): ``peer_alive() -> bool | None``, whether the
    # engine process is still there (None: cannot tell). The loopback transport has it; the
    # ring client then declares a crashed engine dead at once instead of waiting out the
    # heartbeat limits.


class Region(Protocol):
    """Engine side: the memory region the ring lives in."""

    kind: str
    total_bytes: int

    @property
    def buffer(self) -> Any:
        """A writable buffer-protocol object over the region (for ``Ring.create``), or ``None``
        when the memory is not CPU-addressable (a GPU dma-buf region)."""
        ...

    def session_offer(self, hello: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """For the bootstrap handshake: what the frontend needs to reach the region (JSON-able)
        and a session object (``None`` if the transport needs no second step)."""
        ...

    def session_complete(self, session: Any, message: dict[str, Any]) -> dict[str, Any]:
        """Second handshake step (verbs: connect our QP to the frontend's); the reply."""
        ...

    def session_close(self, session: Any) -> None:
        """The frontend of ``session`` went away: release what was made for it."""
        ...

    def close(self) -> None:
        ...


# -- helpers ---------------------------------------------------------------------------------


def socket_peer_open(sock: Any) -> bool:
    """Whether the other end still holds the TCP connection ``sock`` open, without blocking
    (whatever the socket's timeout). Used on bootstrap leases, which carry no data after the
    handshake: readable means EOF or a reset."""
    import select

    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return True
        return sock.recv(1, socket.MSG_PEEK) != b""
    except (OSError, ValueError):  # reset, or already closed here
        return False


def as_byte_array(data: Bytes) -> np.ndarray:
    """View ``data`` as a flat uint8 array without copying when possible."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    raise TypeError(f"transport write takes bytes or a numpy array, got {type(data).__name__}")


def check_range(offset: int, nbytes: int, total: int, what: str = "access") -> None:
    """Raise :class:`TransportError` unless [offset, offset+nbytes) lies inside the region."""
    if offset < 0 or nbytes < 0 or offset + nbytes > total:
        raise TransportError(
            f"transport {what} of {nbytes} bytes at offset {offset} is outside the "
            f"{total}-byte region"
        )


def _load_fence() -> tuple[Any, str]:
    """A hardware full memory fence callable from Python.

    libatomic exports C11's ``atomic_thread_fence`` as a real function (mfence on x86, dmb ish on
    Arm, the DPU's architecture). Without it, a lock acquire/release pair is the best Python can
    do: enough on x86 (stores are not reordered with stores), weaker on Arm.
    """
    for name in ("libatomic.so.1", "libatomic.dylib", "libatomic.so"):
        try:
            lib = ctypes.CDLL(name)
            fn = lib.atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return partial(fn, 5), name  # 5 = memory_order_seq_cst
    lock = threading.Lock()

    def lock_fence() -> None:
        with lock:
            pass

    return lock_fence, "lock"


_fence, MEMORY_FENCE_IMPL = _load_fence()


def memory_fence() -> None:
    """Full hardware memory fence: loads and stores before it complete before those after it."""
    _fence()

