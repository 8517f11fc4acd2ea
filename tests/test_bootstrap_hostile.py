"""The bootstrap before authentication under attack (issue 34, item 4): deeply nested JSON, a
peer trickling its hello, a flood of unauthenticated peers, a thread that cannot start. Before:
nested JSON raised RecursionError in the peer thread, the 10 s timeout was per recv() (one byte
every few seconds held a thread forever), unauthenticated peers were not capped, and a failed
thread start ended the accept loop (no frontend could attach any more)."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from blink.ring import Ring, RingConfig, RingLayout
from blink.transport import BootstrapServer, LoopbackRegion, connect
from blink.transport.framing import MAX_NESTING, nesting_depth

SECRET = b"s3cret-for-the-bootstrap-hostile-tests-0123"
CFG = RingConfig(n_slots=4, arena_tokens=256, stream_capacity=8, max_model_len=256)


@pytest.fixture
def region():
    region = LoopbackRegion(RingLayout(CFG).total_bytes)
    Ring.create(region.buffer, CFG)
    yield region
    region.close()


@pytest.fixture
def thread_errors():
    """Exceptions that escaped any thread while the test ran."""
    seen: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    yield seen
    threading.excepthook = previous


def _server(region, **kw) -> BootstrapServer:
    server = BootstrapServer(region, model_name="m", max_model_len=256, tokenizer="t",
                             secret=SECRET, **kw)
    server.start()
    return server


def _attach(server: BootstrapServer) -> None:
    """A legitimate frontend attaches (and lets go)."""
    info, transport = connect(*server.address, secret=SECRET, timeout_s=5)
    assert info.model_name == "m"
    transport.close()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed ``sock`` (EOF or reset, after whatever it sent) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


def test_nesting_depth_counts_outside_strings():
    assert nesting_depth(b'{"a": [1, {"b": "[[[[[[[["}]}', 2) == 3
    assert nesting_depth(b'{"a": "\\"[[[[[[[[[[[["}', 2) == 1
    assert nesting_depth(b"[" * 100_000, MAX_NESTING) == MAX_NESTING + 1
    assert nesting_depth(b"[]" * 10_000, MAX_NESTING) == 1


def test_deeply_nested_hello_is_refused_without_an_exception(region, thread_errors):
    server = _server(region)
    try:
        body = b'{"type": "hello", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
        sock = socket.create_connection(server.address, timeout=5)
        sock.sendall(struct.pack(">I", len(body)) + body)
        assert _closed_within(sock, 5)
        sock.close()
        _attach(server)  # the server still works
    finally:
        server.stop()
    assert not thread_errors, thread_errors


def test_trickling_peer_is_cut_at_the_handshake_deadline(region):
    server = _server(region, timeout_s=0.6)
    try:
        sock = socket.create_connection(server.address, timeout=5)
        body = json.dumps({"type": "hello", "nonce": "n" * 32}).encode()
        sock.sendall(struct.pack(">I", len(body)))
        t0 = time.monotonic()
        closed = False
        for byte in body:  # one byte every 0.2 s: under the old per-recv() timeout forever
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            if _closed_within(sock, 0.2):
                closed = True
                break
        assert closed and time.monotonic() - t0 < 2.0, time.monotonic() - t0
        sock.close()
    finally:
        server.stop()


def test_unauthenticated_flood_drops_the_oldest_and_a_frontend_still_attaches(region):
    server = _server(region, timeout_s=30.0, max_unauthenticated=4)
    idle = []
    try:
        for _ in range(10):  # idle peers: connect, send nothing
            idle.append(socket.create_connection(server.address, timeout=5))
        time.sleep(0.3)
        # the 6 oldest were closed to make room; the 4 newest still wait
        assert all(_closed_within(s, 2) for s in idle[:6])
        assert not any(_closed_within(s, 0.05) for s in idle[6:])
        assert server.dropped_unauthenticated == 6
        t0 = time.monotonic()
        _attach(server)  # the cap is full: the oldest idle peer makes room
        assert time.monotonic() - t0 < 2
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_accept_loop_survives_a_thread_that_cannot_start(region, monkeypatch):
    server = _server(region)
    real_start = threading.Thread.start
    failures = []

    def start(self):
        if self.name == "blink-bs-peer" and not failures:
            failures.append(self)
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        doomed = socket.create_connection(server.address, timeout=5)
        assert _closed_within(doomed, 5)  # its connection is closed, nothing else happens
        doomed.close()
        assert failures
        assert server._thread is not None and server._thread.is_alive()
        _attach(server)
    finally:
        server.stop()
