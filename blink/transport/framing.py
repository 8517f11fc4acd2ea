"""The bootstrap's message framing: length-prefixed compact JSON over a TCP socket, bounded
in size and time. Used by the handshake (:mod:`blink.transport.bootstrap`) and by the verbs
transport's second handshake step (:mod:`blink.transport.verbs`)."""
from __future__ import annotations

import json
import socket
import struct
from typing import Any

from blink.transport.base import HandshakeError

MAX_MESSAGE_BYTES = 1 << 20
_HEADER = struct.Struct(">I")


def encode_message(obj: dict[str, Any]) -> bytes:
    """Length-prefixed compact JSON."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise HandshakeError(f"bootstrap message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def send_message(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(encode_message(obj))


def _recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(n - got)
        except socket.timeout:
            raise HandshakeError(f"bootstrap: {peer} did not answer in time") from None
        if not chunk:
            raise HandshakeError(f"bootstrap: {peer} closed the connection mid-handshake")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket, peer: str = "peer") -> dict[str, Any]:
    """One message; :class:`HandshakeError` on EOF, timeout, oversize or non-JSON."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, peer))
    if length > MAX_MESSAGE_BYTES:
        raise HandshakeError(
            f"bootstrap: {peer} sent a {length}-byte message (limit {MAX_MESSAGE_BYTES}): "
            f"not a Blink bootstrap endpoint?"
        )
    body = _recv_exact(sock, length, peer)
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HandshakeError(f"bootstrap: {peer} sent malformed JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise HandshakeError(f"bootstrap: {peer} sent a message without a type: {obj!r:.200}")
    return obj
