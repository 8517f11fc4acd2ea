"""The TCP bootstrap handshake: welcome contents, version refusal on both sides, bad peers."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from blink.ring import LAYOUT_VERSION, Ring, RingConfig, RingLayout
from blink.transport import BootstrapServer, HandshakeError, LoopbackRegion, connect
from blink.threads.roles import task_ids, task_name
from blink.transport.base import get_thread_name, set_thread_name
from blink.transport.auth import engine_proof, new_nonce
from blink.transport.bootstrap import EngineInfo
from blink.transport.framing import encode_message, recv_message, send_message

SECRET = b"0123456789abcdef-test-secret"
CFG = RingConfig(n_slots=4, arena_tokens=64, stream_capacity=4, max_model_len=32)


@pytest.fixture
def server():
    region = LoopbackRegion(RingLayout(CFG).total_bytes)
    ring = Ring.create(region.buffer, CFG)
    srv = BootstrapServer(region, model_name="tiny-llama", max_model_len=32,
                          tokenizer="/models/tiny-llama", timeout_s=2.0)
    srv.start()
    yield srv, ring
    srv.stop()
    region.close()


def test_handshake_gives_everything_the_frontend_needs(server):
    srv, ring = server
    info, transport = connect(*srv.address, secret=srv.secret, timeout_s=2.0)
    try:
        assert info.layout_version == LAYOUT_VERSION
        assert info.transport == "loopback" and transport.kind == "loopback"
        assert info.total_bytes == RingLayout(CFG).total_bytes
        assert (info.model_name, info.max_model_len, info.tokenizer) == ("tiny-llama", 32, "/models/tiny-llama")
        assert info.connection["region_name"] == srv.region.name
        ring.produced[1] = 42  # the engine writes; the frontend reads it through the transport
        off = ring.layout.fields["produced"].element_offset(1)
        assert transport.read(off, 8).view("<i8")[0] == 42
    finally:
        transport.close()
    for _ in range(100):  # the counter is bumped by the peer thread just after the welcome
        if srv.accepted == 1:
            break
        time.sleep(0.01)
    assert srv.accepted == 1 and srv.refusals == []


def test_layout_version_mismatch_is_refused_on_both_sides(server):
    srv, _ = server
    with pytest.raises(HandshakeError, match="refused this frontend: ring layout version mismatch") as exc:
        connect(*srv.address, secret=srv.secret, layout_version=LAYOUT_VERSION + 1, timeout_s=2.0)
    assert f"engine speaks layout version {LAYOUT_VERSION}" in str(exc.value)
    for _ in range(100):
        if srv.refusals:
            break
        time.sleep(0.01)
    assert len(srv.refusals) == 1 and "version mismatch" in srv.refusals[0]
    assert f"frontend speaks {LAYOUT_VERSION + 1}" in srv.refusals[0]


def test_frontend_checks_the_engine_version_too():
    """An engine that (wrongly) welcomes any version is still refused by the frontend."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def fake_engine():
        conn, _ = lsock.accept()
        with conn:
            hello = recv_message(conn)
            nonce = new_nonce()
            send_message(conn, {"type": "challenge", "nonce": nonce,
                                "proof": engine_proof(SECRET, hello["nonce"], nonce)})
            recv_message(conn)
            info = EngineInfo(LAYOUT_VERSION + 7, "loopback", 4096, "m", 16, "t", {"region_name": "x"})
            send_message(conn, info.to_message())

    threading.Thread(target=fake_engine, daemon=True).start()
    with pytest.raises(HandshakeError, match=f"engine speaks layout version {LAYOUT_VERSION + 7}"):
        connect(*lsock.getsockname(), secret=SECRET, timeout_s=2.0)
    lsock.close()


def test_wrong_transport_requested(server):
    srv, _ = server
    with pytest.raises(HandshakeError, match="serves the loopback transport.*--transport verbs"):
        connect(*srv.address, secret=srv.secret, expect_transport="verbs", timeout_s=2.0)


def test_no_engine_listening():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(HandshakeError, match="no Blink engine is listening"):
        connect("127.0.0.1", port, timeout_s=1.0)


def test_silent_peer_times_out():
    lsock = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="did not answer in time"):
        connect(*lsock.getsockname(), timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
    lsock.close()


def test_garbage_and_oversized_messages_are_refused(server):
    srv, _ = server
    with socket.create_connection(srv.address, timeout=2.0) as s:
        s.sendall(struct.pack(">I", 5) + b"nope!")
        assert s.recv(1) == b""  # the engine hangs up on malformed JSON
    with socket.create_connection(srv.address, timeout=2.0) as s:
        s.sendall(struct.pack(">I", 1 << 30))
        assert s.recv(1) == b""
    with socket.create_connection(srv.address, timeout=2.0) as s:
        send_message(s, {"type": "connect"})
        reply = recv_message(s)
        assert reply["type"] == "refused" and "expected a hello" in reply["error"]
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 4) + b"[1] ")
    with pytest.raises(HandshakeError, match="without a type"):
        recv_message(b)
    a.close()
    with pytest.raises(HandshakeError, match="closed the connection"):
        recv_message(b)
    b.close()
    # the server survives all of that
    info, t = connect(*srv.address, secret=srv.secret, timeout_s=2.0)
    t.close()


def test_framing_roundtrip():
    msg = {"type": "welcome", "x": [1, 2, 3], "s": "é"}
    a, b = socket.socketpair()
    a.sendall(encode_message(msg) + encode_message({"type": "next"}))
    assert recv_message(b) == msg and recv_message(b) == {"type": "next"}
    a.close(), b.close()
    with pytest.raises(HandshakeError, match="clash"):
        EngineInfo(1, "loopback", 1, "m", 1, "t", {"model": "x"}).to_message()
    with pytest.raises(HandshakeError, match="max_model_len"):
        EngineInfo.from_message({"type": "welcome", "layout_version": 1, "transport": "loopback",
                                 "total_bytes": 1, "model": "m", "max_model_len": "big", "tokenizer": "t"})


def test_server_threads_are_named(server):
    srv, _ = server
    assert srv._thread.name == "blink-bootstrap"
    names = {}

    def probe():
        set_thread_name("blink-probe-thr")
        names["probe"] = get_thread_name()
        try:  # the kernel keeps 15 bytes: a longer name is refused, not cut
            set_thread_name("blink-probe-thread-long-name")
        except ValueError:
            names["long"] = "refused"

    t = threading.Thread(target=probe)
    t.start(), t.join()
    assert names == {"probe": "blink-probe-thr", "long": "refused"}
    # the server's accept thread shows up under its name in /proc (threads of earlier tests
    # may end while the names are read: task_name gives None for those)
    comms = {task_name(tid) for tid in task_ids()}
    assert "blink-bootstrap" in comms


def test_stop_releases_the_port(server):
    srv, _ = server
    host, port = srv.address
    srv.stop()
    with pytest.raises(HandshakeError):
        connect(host, port, secret=srv.secret, timeout_s=0.5)
    np.testing.assert_equal(srv.refusals, [])
