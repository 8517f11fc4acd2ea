"""The engine's doorbell (blink.transport.doorbell): the two ends, the bootstrap that hands the
frontend's to the engine, and the ring poller that ticks when it rings."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from blink.dpu.ring_engine_client import RingEngineClient
from blink.transport import BootstrapServer, connect
from blink.transport import doorbell as doorbells
from blink.transport.doorbell import Doorbell, DoorbellListener

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from e2e_helpers import wait_until  # noqa: E402
from test_bootstrap_hostile import region  # noqa: E402,F401 - the fixture
from test_ring_client import Setup, ticks_and_steps  # noqa: E402

pytestmark = pytest.mark.skipif(not doorbells.supported(), reason="abstract UNIX sockets are Linux's")


def test_a_bell_reaches_its_listener_and_a_gone_listener_is_no_error():
    listener = DoorbellListener()
    assert doorbells.valid_name(listener.name)
    bell = Doorbell(listener.name)
    assert listener.drain() == 0
    for _ in range(3):
        bell.ring()
    wait_until(lambda: listener.drain() > 0, 5, 0.005, "the bells")
    listener.close()
    bell.ring()  # its frontend exited: nobody to wake, nothing raised
    bell.close()
    bell.ring()  # closed (the lease ended while the loop held it): still nothing raised
    with pytest.raises(OSError):
        Doorbell(doorbells.NAME_PREFIX + "f" * 32)  # a name nobody bound


def test_a_listener_waits_for_a_bell_or_its_timeout():
    """DoorbellListener.wait (blink.llm's thread): 0 after the timeout with no bell, the count of
    the bells waiting after one came, and at once when a bell was already there."""
    listener = DoorbellListener()
    bell = Doorbell(listener.name)
    t0 = time.monotonic()
    assert listener.wait(0.05) == 0
    assert time.monotonic() - t0 >= 0.04
    bell.ring()
    bell.ring()
    t0 = time.monotonic()
    assert listener.wait(5.0) == 2
    assert time.monotonic() - t0 < 2.0
    assert listener.wait(0.0) == 0  # drained
    listener.close()
    bell.close()


@pytest.mark.parametrize("name", [None, 7, "", "blink-doorbell-", "blink-doorbell-XYZ" + "0" * 29,
                                  "other-" + "0" * 32, "blink-doorbell-" + "0" * 32 + "\n"])
def test_only_a_listeners_name_is_a_doorbell(name):
    assert not doorbells.valid_name(name)
    with pytest.raises(ValueError, match="not a doorbell name"):
        Doorbell(name)  # type: ignore[arg-type]


def start_server(region, **kw) -> BootstrapServer:
    server = BootstrapServer(region, model_name="m", max_model_len=256, tokenizer="t", timeout_s=2.0, **kw)
    server.start()
    return server


def test_the_lease_holders_doorbell_goes_to_the_engine_until_its_lease_ends(region):
    bells: list = []
    server = start_server(region, on_doorbell=bells.append)
    listener = DoorbellListener()
    try:
        info, transport = connect(*server.address, secret=server.secret, timeout_s=2.0, doorbell=listener.name)
        assert info.connection[doorbells.FIELD] is True
        assert len(bells) == 1 and bells[0].name == listener.name
        bells[0].ring()
        wait_until(lambda: listener.drain() == 1, 5, 0.005, "the engine's bell")
        # a monitor (no lease) gets no bell, whatever it asks
        monitor, monitor_transport = connect(*server.address, secret=server.secret, timeout_s=2.0,
                                             role="monitor", doorbell=DoorbellListener().name)
        monitor_transport.close()
        assert doorbells.FIELD not in monitor.connection and len(bells) == 1
        transport.close()  # the frontend goes: the engine drops its bell
        wait_until(lambda: len(bells) == 2, 5, 0.005, "the lease's end")
        assert bells[1] is None
    finally:
        server.stop()
        listener.close()


def test_no_bell_without_a_ringer_or_with_a_name_that_is_no_listeners(region):
    server = start_server(region)  # an engine that rings nothing (a device loop)
    listener = DoorbellListener()
    try:
        info, transport = connect(*server.address, secret=server.secret, timeout_s=2.0, doorbell=listener.name)
        transport.close()
        assert doorbells.FIELD not in info.connection
    finally:
        server.stop()
    bells: list = []
    server = start_server(region, on_doorbell=bells.append)
    try:
        for name in ("not-a-bell", doorbells.NAME_PREFIX + "0" * 32):  # the second: nobody bound it
            info, transport = connect(*server.address, secret=server.secret, timeout_s=2.0, doorbell=name)
            transport.close()
            assert doorbells.FIELD not in info.connection  # welcomed all the same
        wait_until(lambda: bells == [None, None], 5, 0.005, "both leases' ends")  # and never a bell
    finally:
        server.stop()
        listener.close()


def test_the_poller_ticks_on_each_bell_and_not_on_its_timers():
    """Steps of 20 ms and a fallback tick of 5 s: every token still arrives on its own (the
    bell after each step wakes the poller), in about as many ticks as steps."""
    setup = Setup()
    listener = DoorbellListener()
    setup.engine.doorbell = Doorbell(listener.name)
    setup.engine.step_sleep_s = 0.02
    setup.engine.start()

    async def main():
        client = RingEngineClient(setup.client, model_name="fake", poll_min_interval_s=1e-4,
                                  poll_max_interval_s=1e-3, doorbell=listener, doorbell_fallback_s=5.0)
        return await ticks_and_steps(setup, client, 12)

    try:
        ticks, out, steps = asyncio.run(main())
    finally:
        setup.close()
    assert sum(len(o.token_ids) for o in out) == 12
    assert len(out) >= 8  # one delta a step, give or take a bell that found two steps' tokens
    assert ticks <= 2 * steps + 4, (ticks, steps)
    assert listener.fileno() == -1  # the client closed its doorbell with itself


def test_the_fallback_tick_only_while_nothing_else_needs_the_timers():
    setup = Setup()
    try:
        listener = DoorbellListener()
        client = RingEngineClient(setup.client, model_name="fake", doorbell=listener, doorbell_fallback_s=0.5)
        assert client._poll_delay(1e-3, time.monotonic()) == 1e-3  # nothing in flight: the backoff
        setup.client.submit(1, [1], max_tokens=4)
        assert client._poll_delay(1e-3, time.monotonic()) == 0.5  # in flight: the bell's fallback
        client._line.append(object())  # a request waits for room: the timers
        assert client._poll_delay(1e-3, time.monotonic()) == 1e-3
        client._line.clear()
        client.doorbell = None  # no bell: the timers (no step cadence seen yet: the backoff)
        assert client._poll_delay(1e-3, time.monotonic()) == 1e-3
        listener.close()
    finally:
        setup.close()
