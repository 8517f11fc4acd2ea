"""In-process ring memory: the engine owns the buffer, a frontend in the same process
(the offline ``LLM``) reads and writes it directly.

This is the fallback for hosts where the GPU cannot register a shared-memory segment
(``cudaHostRegister`` is refused, e.g. under gVisor): the engine then allocates the ring as
pinned, GPU-mapped host memory itself (:class:`blink.engine.gpu.mapped_ring.PinnedRegion`), which
no other process can map. The device loop still runs with no host call per step; only the
frontend has to live in the engine's process. ``blink serve`` (a frontend in its own
process) cannot use it and refuses to start instead.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from blink.transport.base import Bytes, TransportError, as_byte_array, check_range, memory_fence


class InProcessRegion:
    """Engine side over a caller-provided writable buffer (``bytearray``, numpy array, or
    the pinned memory of a GPU engine). There is no bootstrap: nothing outside the process
    can reach it."""

    kind = "inprocess"

    def __init__(self, buffer: Any, total_bytes: int, owner: Any = None) -> None:
        if total_bytes <= 0:
            raise TransportError(f"in-process region size must be positive, got {total_bytes}")
        self._buffer = buffer
        self._owner = owner  # keeps the memory behind ``buffer`` alive (e.g. a pinned tensor)
        self.total_bytes = total_bytes
        self.name = f"inprocess-{id(self):x}"

    @property
    def buffer(self) -> Any:
        if self._buffer is None:
            raise TransportError("in-process region is closed")
        return self._buffer

    def session_offer(self, hello: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        raise TransportError("an in-process ring has no bootstrap: only a frontend in the engine's "
                             "own process (blink.LLM) can use it")

    def session_complete(self, session: Any, message: dict[str, Any]) -> dict[str, Any]:
        raise TransportError("an in-process ring has no bootstrap")

    def session_close(self, session: Any) -> None:
        pass

    def unlink(self) -> None:
        """Nothing has a name to remove (kept for the Region interface of loopback)."""

    def close(self) -> None:
        self._buffer = None
        self._owner = None


class InProcessTransport:
    """Frontend side of an :class:`InProcessRegion`: stores and loads on the same memory."""

    kind = "inprocess"

    def __init__(self, region: InProcessRegion) -> None:
        self._view = np.frombuffer(region.buffer, dtype=np.uint8, count=region.total_bytes)
        self.total_bytes = region.total_bytes
        self.name = region.name

    def write(self, offset: int, data: Bytes) -> None:
        src = as_byte_array(data)
        check_range(offset, src.nbytes, self.total_bytes, "write")
        self._view[offset: offset + src.nbytes] = src

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        check_range(offset, nbytes, self.total_bytes, "read")
        return self._view[offset: offset + nbytes].copy()

    def fence(self) -> None:
        memory_fence()

    def peer_alive(self) -> bool:
        return True  # the engine is this process

    def close(self) -> None:
        self._view = np.empty(0, dtype=np.uint8)
