"""Healing without processes (issue 13, defect 7): the frontend's ReconnectingEngineClient
re-bootstraps to a new engine on the same port after the first one failed, refusing with 503 +
Retry-After meanwhile; it does not attach an engine serving another model; and the
supervisor's restart policy (back-off, restarts-in-window)."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_ring_fake_engine import FakeEngine  # noqa: E402

from blink.dpu.engine_client import EngineDeadError  # noqa: E402
from blink.dpu.engine_health import EngineHealth  # noqa: E402
from blink.dpu.ring_engine_client import ReconnectingEngineClient, RingEngineClient  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.launcher import RESTART_BACKOFF_MAX_S, RESTART_STABLE_S, RestartPolicy  # noqa: E402
from blink.ring import ENGINE_FAILED, Ring, RingConfig, RingLayout  # noqa: E402
from blink.transport import BootstrapServer, LoopbackRegion  # noqa: E402

SECRET = b"reconnect-test-secret-0123456789"
CFG = RingConfig(n_slots=4, arena_tokens=128, stream_capacity=8, max_model_len=128)


class Engine:
    """A fake engine process in this process: region, ring, loop thread, bootstrap server."""

    def __init__(self, port: int = 0, model: str = "fake") -> None:
        self.region = LoopbackRegion(RingLayout(CFG).total_bytes)
        self.ring = Ring.create(self.region.buffer, CFG)
        self.fake = FakeEngine(self.ring, step_sleep_s=5e-4).start()
        self.server = BootstrapServer(self.region, model_name=model, max_model_len=128,
                                      tokenizer="tok", port=port, secret=SECRET)
        self.port = self.server.start()[1]

    def die(self) -> None:
        """As a crashed engine looks from the frontend: FAILED, lease closed, port free."""
        self.fake.stop(ENGINE_FAILED)
        self.server.stop()
        self.region.close()


async def _collect(agen) -> list:
    return [o async for o in agen]


def test_reconnects_to_a_restarted_engine_on_the_same_port():
    first = Engine()

    async def main() -> None:
        async def attach() -> RingEngineClient:
            return await RingEngineClient.connect("127.0.0.1", first.port, secret=SECRET)

        client = ReconnectingEngineClient(await attach(), attach, where="test", min_interval_s=0.02)
        client.start()
        assert client.ring.config.n_slots == CFG.n_slots  # what the HTTP layer sizes fan-out by
        out = await _collect(client.generate("a", [1, 2], SamplingParams(max_tokens=4)))
        assert [t for o in out for t in o.token_ids] == [1, 2, 1, 2]
        old = client.client
        agen = client.generate("inflight", [3], SamplingParams(max_tokens=100_000))
        await agen.__anext__()
        first.die()
        with pytest.raises(EngineDeadError):  # the in-flight request ends with a clear error
            async for _ in agen:
                pass
        t0 = time.monotonic()
        while client.client is not None and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        # down: refused, with a retry hint; nothing mapped of the old region any more
        assert not client.is_accepting() and not client.is_healthy()
        assert client.health is EngineHealth.RESTARTING
        assert client.unavailable_retry_after_s() == client.retry_after_s
        with pytest.raises(EngineDeadError, match="restarting") as exc:
            await _collect(client.generate("b", [1], SamplingParams(max_tokens=1)))
        assert exc.value.retry_after_s == client.retry_after_s
        assert client.stats()["running"] == 0
        t0 = time.monotonic()
        while old.ring.transport._view is not None:  # the old region gets unmapped
            assert time.monotonic() - t0 < 5, "the dead engine's region stayed mapped"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # a few refused reconnects
        second = Engine(port=first.port)
        try:
            t0 = time.monotonic()
            while not client.is_accepting():
                assert time.monotonic() - t0 < 10, "did not reconnect"
                await asyncio.sleep(0.01)
            assert client.reconnects == 1 and client.unavailable_retry_after_s() is None
            assert client.health is EngineHealth.HEALTHY
            assert second.server.attached is not None
            out = await _collect(client.generate("c", [5, 6], SamplingParams(max_tokens=4)))
            assert [t for o in out for t in o.token_ids] == [5, 6, 5, 6]
            await client.close()
            assert client.health is EngineHealth.CLOSED and client.unavailable_retry_after_s() is None
            assert second.server.attached is None or _wait_detached(second.server)
        finally:
            second.die()

    asyncio.run(main())


def _wait_detached(server: BootstrapServer) -> bool:
    deadline = time.monotonic() + 2
    while server.attached is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.attached is None


def test_an_engine_serving_another_model_is_not_attached(caplog):
    first = Engine()

    async def main() -> None:
        async def attach() -> RingEngineClient:
            return await RingEngineClient.connect("127.0.0.1", first.port, secret=SECRET)

        client = ReconnectingEngineClient(await attach(), attach, where="test", min_interval_s=0.02,
                                          max_interval_s=0.05)
        client.start()
        first.die()
        other = Engine(port=first.port, model="another-model")
        try:
            await asyncio.sleep(1.0)
            assert client.client is None and not client.is_accepting()
            assert "now serves model 'another-model' instead of 'fake'" in caplog.text
        finally:
            await client.close()
            other.die()

    asyncio.run(main())


def test_restart_policy_backs_off_and_gives_up():
    p = RestartPolicy(max_restarts=4, window_s=100.0)
    delays = [p.next_delay(t, engine_lived_s=1.0) for t in (0.0, 1.0, 2.0, 3.0)]
    assert delays == [1.0, 2.0, 4.0, 8.0]
    assert p.next_delay(4.0, engine_lived_s=1.0) is None  # a 5th within the window
    assert p.next_delay(101.5, engine_lived_s=1.0) == 16.0  # the first one left the window
    # an engine that lived long enough resets the back-off
    assert p.next_delay(250.0, engine_lived_s=RESTART_STABLE_S) == 1.0
    q = RestartPolicy(max_restarts=100, window_s=1e9)
    assert max(q.next_delay(float(i), 0.0) for i in range(20)) == RESTART_BACKOFF_MAX_S
    assert RestartPolicy(0, 10.0).next_delay(0.0, 0.0) is None  # max 0: never restart


def test_flags_are_explained_and_take_config_file_keys(tmp_path):
    from blink.cli import build_parser, parse_args

    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    serve_help = " ".join(sub["serve"].format_help().split())
    engine_help = " ".join(sub["engine"].format_help().split())
    for flag in ("--no-engine-restart", "--max-engine-restarts", "--engine-restart-window",
                 "--bootstrap-secret-file"):
        assert flag in serve_help
    assert "back-off" in serve_help and "Retry-After" in serve_help
    assert "--bootstrap-secret-file" in engine_help and "0600" in engine_help
    args = parse_args(["serve"])
    assert (args.no_engine_restart, args.max_engine_restarts, args.engine_restart_window) == (False, 5, 300.0)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("no_engine_restart: true\nmax-engine-restarts: 2\nbootstrap_secret_file: /x/s\n")
    args = parse_args(["serve", "--config", str(cfg)])
    assert args.no_engine_restart is True and args.max_engine_restarts == 2
    assert str(args.bootstrap_secret_file) == "/x/s"
