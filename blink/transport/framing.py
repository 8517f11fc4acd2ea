"""The bootstrap's message framing: length-prefixed compact JSON over a TCP socket, bounded
in size, nesting and time. Used by the handshake (:mod:`blink.transport.bootstrap`), the verbs
transport's second handshake step (:mod:`blink.transport.verbs`) and the ARK bus.

A ``deadline`` (``time.monotonic()`` seconds) bounds a whole exchange, not each ``recv()``:
a peer that trickles one byte every few seconds cannot hold a reader past it. Nesting is
counted on the raw bytes before parsing (a few thousand ``[`` made ``json.loads`` raise
``RecursionError`` in the reading thread).
"""
from __future__ import annotations

import json
import re
import socket
import struct
import time
from typing import Any

from blink.transport.base import HandshakeError

MAX_MESSAGE_BYTES = 1 << 20
#: deepest JSON nesting a message may have (Blink's own are at most 4 deep)
MAX_NESTING = 32
_HEADER = struct.Struct(">I")
#: a JSON string (skipped: its brackets are text) or one bracket
_NESTING_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def nesting_depth(body: bytes, limit: int = MAX_NESTING) -> int:
    """How deep ``body``'s JSON nests (brackets outside strings): an upper bound when that
    is at most ``limit``, else the depth counted up to ``limit + 1``, where the count stops.
    Bytes operations and a scan of the brackets only."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return min(body.count(b"[") + body.count(b"{"), limit)  # cannot be deeper than that
    depth = deepest = 0
    for token in _NESTING_TOKENS.finditer(body):
        c = token.group()[:1]
        if c in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def _remaining(deadline: float | None, peer: str) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandshakeError(f"bootstrap: {peer} did not complete the exchange in time")
    return left


def encode_message(obj: dict[str, Any]) -> bytes:
    """Length-prefixed compact JSON."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise HandshakeError(f"bootstrap message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def send_message(sock: socket.socket, obj: dict[str, Any], *, deadline: float | None = None,
                 peer: str = "peer") -> None:
    """Send one message; with ``deadline``, :class:`HandshakeError` if it cannot be sent by
    then."""
    data = encode_message(obj)
    left = _remaining(deadline, peer)
    if left is not None:
        sock.settimeout(left)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise HandshakeError(f"bootstrap: {peer} did not read in time") from None


def _recv_exact(sock: socket.socket, n: int, peer: str, deadline: float | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = _remaining(deadline, peer)
        if left is not None:
            sock.settimeout(left)
        try:
            chunk = sock.recv(n - got)
        except socket.timeout:
            raise HandshakeError(f"bootstrap: {peer} did not answer in time") from None
        if not chunk:
            raise HandshakeError(f"bootstrap: {peer} closed the connection mid-handshake")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket, peer: str = "peer", *, deadline: float | None = None,
                 max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """One message; :class:`HandshakeError` on EOF, timeout (the socket's, or ``deadline``
    for the whole message), over ``max_bytes``, nesting deeper than :data:`MAX_NESTING`, or
    non-JSON."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, peer, deadline))
    if length > max_bytes:
        raise HandshakeError(
            f"bootstrap: {peer} sent a {length}-byte message (limit {max_bytes}): "
            f"not a Blink bootstrap endpoint?"
        )
    body = _recv_exact(sock, length, peer, deadline)
    if nesting_depth(body) > MAX_NESTING:
        raise HandshakeError(f"bootstrap: {peer} sent JSON nested deeper than {MAX_NESTING}")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise HandshakeError(f"bootstrap: {peer} sent malformed JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise HandshakeError(f"bootstrap: {peer} sent a message without a type: {obj!r:.200}")
    return obj
