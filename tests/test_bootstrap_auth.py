"""The bootstrap secret and the one-frontend lease (issue 13, defect 2), in one process with the
fake engine: a peer without the secret (or with a wrong one, or replaying the engine's proof)
learns nothing but a refusal; the frontend refuses an engine that cannot prove the secret; a
second frontend cannot disturb the first; a frontend that reattaches after the first went away
works; the secret file helpers and where ``blink engine`` keeps its secret."""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_ring_fake_engine import FakeEngine  # noqa: E402

from blink.dpu.ring_engine_client import RingEngineClient  # noqa: E402
from blink.dpu.ring_protocol import RingClient, RingProtocolError  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.ring import SLOT_FREE, Ring, RingConfig, RingLayout  # noqa: E402
from blink.transport import BootstrapServer, HandshakeError, LoopbackRegion, connect  # noqa: E402
from blink.transport import auth  # noqa: E402
from blink.transport.bootstrap import AUTH_REFUSAL, recv_message, send_message  # noqa: E402

SECRET = b"s3cret-for-the-bootstrap-tests-0123456789"
TOKENIZER = "/very/private/tokenizer/path"
CFG = RingConfig(n_slots=8, arena_tokens=512, stream_capacity=8, max_model_len=512)


@pytest.fixture
def engine():
    region = LoopbackRegion(RingLayout(CFG).total_bytes)
    ring = Ring.create(region.buffer, CFG)
    fake = FakeEngine(ring, step_sleep_s=5e-4).start()
    server = BootstrapServer(region, model_name="private-model", max_model_len=512,
                             tokenizer=TOKENIZER, secret=SECRET, timeout_s=2.0)
    server.start()
    yield server, ring, fake
    server.stop()
    fake.stop()
    region.close()


def _read_all(sock: socket.socket) -> bytes:
    """Everything the engine sends until it hangs up."""
    out = b""
    sock.settimeout(3.0)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk


def _assert_learned_nothing(raw: bytes, server: BootstrapServer) -> None:
    for secret_thing in (server.region.name, TOKENIZER, "private-model", "welcome",
                         "region_name", SECRET.decode()):
        assert secret_thing.encode() not in raw, (secret_thing, raw)


@pytest.mark.parametrize("how", ["no-nonce", "wrong-proof", "replayed-proof", "no-auth-message"])
def test_a_peer_without_the_secret_learns_nothing(engine, how):
    server, _, _ = engine
    with socket.create_connection(server.address, timeout=3.0) as s:
        hello = {"type": "hello", "layout_version": 1, "pid": 1}
        if how != "no-nonce":
            hello["nonce"] = auth.new_nonce()
        send_message(s, hello)
        if how == "no-nonce":
            reply = recv_message(s)
            assert reply == {"type": "refused", "error": AUTH_REFUSAL}
            rest = _read_all(s)
        else:
            challenge = recv_message(s)
            assert set(challenge) == {"type", "nonce", "proof"} and challenge["type"] == "challenge"
            if how == "wrong-proof":
                proof = auth.frontend_proof(b"not-the-secret-but-long-enough", challenge["nonce"],
                                            hello["nonce"])
                send_message(s, {"type": "auth", "proof": proof})
            elif how == "replayed-proof":  # the engine's own proof sent back
                send_message(s, {"type": "auth", "proof": challenge["proof"]})
            else:
                send_message(s, {"type": "connect", "endpoint": {}})
            rest = _read_all(s)
            assert recv_message_from(rest) == {"type": "refused", "error": AUTH_REFUSAL}
            _assert_learned_nothing(str(challenge).encode(), server)
        _assert_learned_nothing(rest, server)
    assert server.accepted == 0 and server.attached is None


def recv_message_from(raw: bytes) -> dict:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(raw)
        return recv_message(b)


def test_connect_with_a_wrong_or_missing_secret_is_a_clear_error(engine):
    server, _, _ = engine
    with pytest.raises(HandshakeError, match="could not prove it knows the bootstrap secret"):
        connect(*server.address, secret=b"a-wrong-secret-of-enough-length", timeout_s=2.0)
    with pytest.raises(HandshakeError, match="requires the bootstrap secret: pass --bootstrap-secret-file"):
        connect(*server.address, secret=None, timeout_s=2.0)
    assert server.accepted == 0
    info, transport = connect(*server.address, secret=SECRET, timeout_s=2.0)
    transport.close()
    assert info.tokenizer == TOKENIZER


def test_the_frontend_refuses_an_engine_that_cannot_prove_the_secret():
    """An impostor on the bootstrap port gets neither our proof nor a single prompt."""
    lsock = socket.create_server(("127.0.0.1", 0))
    got: list = []

    def impostor() -> None:
        conn, _ = lsock.accept()
        with conn:
            recv_message(conn)
            send_message(conn, {"type": "challenge", "nonce": auth.new_nonce(), "proof": "00" * 32})
            conn.settimeout(3.0)
            got.append(conn.recv(65536))  # b"": the frontend hung up without answering

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with pytest.raises(HandshakeError, match="could not prove"):
        connect(*lsock.getsockname(), secret=SECRET, timeout_s=2.0)
    t.join(5)
    lsock.close()
    assert got == [b""]


async def _collect(agen) -> list:
    return [o async for o in agen]


def test_a_second_frontend_cannot_disturb_the_first(engine):
    server, ring, fake = engine

    async def main() -> None:
        first = await RingEngineClient.connect(*server.address, secret=SECRET,
                                               heartbeat_timeout_s=5.0)
        first.start()
        jobs = [asyncio.ensure_future(_collect(first.generate(
            f"r{i}", [i + 1, 50 + i], SamplingParams(max_tokens=300)))) for i in range(6)]
        while len(fake.claimed) < 6:  # all six are running in the engine
            await asyncio.sleep(0.005)
        # A second frontend, even with the right secret, is refused while the first is attached;
        # had it attached, its RingClient would have cancelled the first one's requests as
        # orphans and reused their slots (RingProtocolError: "the engine's stream serves...").
        for _ in range(3):
            with pytest.raises(HandshakeError, match="another frontend.*is attached"):
                await asyncio.to_thread(connect, *server.address, secret=SECRET, timeout_s=2.0)
        # A monitor (read-only tools) may look.
        _, probe = await asyncio.to_thread(connect, *server.address, secret=SECRET,
                                           role="monitor", timeout_s=2.0)
        probe.close()
        outs = await asyncio.gather(*jobs)
        for i, out in enumerate(outs):
            assert not any(isinstance(o, RingProtocolError) for o in out)
            assert [t for o in out for t in o.token_ids] == [i + 1, 50 + i] * 150
            assert out[-1].finish_reason == "length"
        assert first.is_healthy()
        await first.close()

        # The first is gone: a new frontend attaches and is served.
        second = await RingEngineClient.connect(*server.address, secret=SECRET)
        out = await _collect(second.generate("again", [7, 8], SamplingParams(max_tokens=4)))
        assert [t for o in out for t in o.token_ids] == [7, 8, 7, 8]
        await second.close()

    asyncio.run(main())
    assert (ring.state == SLOT_FREE).all()


def test_a_frontend_that_died_leaves_the_lease_for_the_next(engine):
    """The lease is the bootstrap connection: when a frontend dies the kernel closes it, and a
    new frontend attaches at once (even before the engine's peer thread has noticed), adopting
    and draining what the dead one left in the ring."""
    server, ring, fake = engine
    _, transport = connect(*server.address, secret=SECRET, timeout_s=2.0)
    client = RingClient(transport)
    client.submit(client.new_request_id(), [1, 2, 3], max_tokens=1_000_000)
    assert server.attached is not None
    transport._lease.close()  # what the kernel does when the frontend process dies
    transport._lease = None
    _, transport2 = connect(*server.address, secret=SECRET, timeout_s=2.0)
    client2 = RingClient(transport2)
    assert len(client2.active) == 1  # the dead one's request, being cancelled
    deadline = time.monotonic() + 5
    while client2.active and time.monotonic() < deadline:
        client2.poll_many()
        time.sleep(0.002)
    assert client2.active == [] and (ring.state == SLOT_FREE).all()
    client2.close()
    transport.close()


# -- the secret's sources -----------------------------------------------------------------------


def test_secret_files(tmp_path):
    path = tmp_path / "sub" / "bootstrap.secret"
    secret, created = auth.load_or_create_secret_file(path)
    assert created and len(secret) == 2 * auth.SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert auth.load_or_create_secret_file(path) == (secret, False)
    path.chmod(0o644)
    with pytest.raises(auth.SecretError, match="chmod 600"):
        auth.load_secret_file(path)
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(auth.SecretError, match="at least 16 bytes"):
        auth.load_secret_file(short)
    with pytest.raises(auth.SecretError, match="does not exist"):
        auth.load_secret_file(tmp_path / "missing")


def test_where_blink_engine_and_the_frontend_take_the_secret_from(tmp_path, monkeypatch):
    from blink.frontend_main import frontend_secret
    from blink.launcher import engine_secret

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert auth.default_secret_path(7000) == tmp_path / "blink" / "bootstrap-7000.secret"
    # standalone, no flag: a fresh secret (written by run_engine once the port is bound)
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    secret, path, created = engine_secret(argparse.Namespace(bootstrap_secret_file=None))
    assert path is None and created and len(secret) >= auth.MIN_SECRET_BYTES
    # under blink serve: from the environment, which is then cleared (children do not inherit it)
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.decode())
    assert engine_secret(argparse.Namespace(bootstrap_secret_file=None)) == (SECRET, None, False)
    assert auth.SECRET_ENV not in os.environ
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.decode())
    assert frontend_secret(argparse.Namespace(bootstrap_secret_file=None)) == SECRET
    assert auth.SECRET_ENV not in os.environ
    # a file given: created if missing, then the same for both halves
    f = tmp_path / "engine.secret"
    secret, path, created = engine_secret(argparse.Namespace(bootstrap_secret_file=f))
    assert created and path == f
    assert frontend_secret(argparse.Namespace(bootstrap_secret_file=f)) == secret
