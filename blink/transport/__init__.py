"""Transports between the frontend and the engine's ring memory (numpy only, no torch).

- :mod:`blink.transport.base`: the :class:`Transport` (frontend) and :class:`Region` (engine)
  interfaces, errors, ``memory_fence`` and ``set_thread_name``.
- :mod:`blink.transport.loopback`: POSIX shared memory, for a frontend on the same machine.
- :mod:`blink.transport.inprocess`: the engine's own memory, for a frontend in its process.
- :mod:`blink.transport.verbs`: RDMA over an RC queue pair (pyverbs), for a frontend on a DPU.
- :mod:`blink.transport.bootstrap`: the TCP handshake that tells the frontend where the region is.
- :mod:`blink.transport.auth`: the bootstrap secret the handshake's challenge–response checks.

Engine::

    region = create_region("loopback", RingLayout(cfg).total_bytes)
    ring = Ring.create(region.buffer, cfg)
    server = BootstrapServer(region, model_name=..., max_model_len=..., tokenizer=...,
                             host=..., port=..., secret=secret).start()

Frontend::

    info, transport = connect(host, port, secret=secret)
"""
from __future__ import annotations

from typing import Any

from blink.transport.base import (
    HandshakeError,
    Region,
    Transport,
    TransportError,
    memory_fence,
    set_thread_name,
)
from blink.transport.auth import SECRET_ENV, SecretError, generate_secret, load_secret_file
from blink.transport.bootstrap import TRANSPORT_KINDS, BootstrapServer, EngineInfo, connect
from blink.transport.inprocess import InProcessRegion, InProcessTransport
from blink.transport.loopback import LoopbackRegion, LoopbackTransport, cleanup_stale_segments

__all__ = [
    "BootstrapServer",
    "EngineInfo",
    "HandshakeError",
    "InProcessRegion",
    "InProcessTransport",
    "LoopbackRegion",
    "LoopbackTransport",
    "Region",
    "SECRET_ENV",
    "SecretError",
    "TRANSPORT_KINDS",
    "Transport",
    "TransportError",
    "cleanup_stale_segments",
    "connect",
    "create_region",
    "generate_secret",
    "load_secret_file",
    "memory_fence",
    "set_thread_name",
]


def create_region(kind: str, total_bytes: int, **options: Any) -> Region:
    """Engine side: a region of ``total_bytes`` for transport ``kind``.

    Options: loopback ``cleanup_stale``; verbs ``device``, ``port``, ``gid_index``, ``gpu_ptr``.
    A verbs region on a machine without an RDMA device raises :class:`TransportError`
    naming ``--transport loopback``.
    """
    if kind == "loopback":
        return LoopbackRegion(total_bytes, **options)
    if kind == "verbs":
        from blink.transport.verbs import VerbsRegion

        return VerbsRegion(total_bytes, **options)
    if kind == "inprocess":  # the engine's own memory, for a frontend in its process (LLM)
        return InProcessRegion(bytearray(total_bytes), total_bytes)
    raise TransportError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORT_KINDS)}")
