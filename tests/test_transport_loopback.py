"""The loopback transport across real processes, and that no /dev/shm segment outlives them.

The engine side runs in a fresh interpreter (``python -c``, like a multiprocessing spawn child):
a loopback region, a ring, the fake engine thread and the bootstrap server. The test process is
the frontend and knows only the bootstrap address.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from blink.dpu.engine_client import EngineDeadError
from blink.dpu.ring_engine_client import RingEngineClient
from blink.dpu.ring_protocol import RingClient
from blink.shared.sampling_params import SamplingParams
from blink.ring import SLOT_FREE, Ring, RingConfig, RingLayout
from blink.transport import BootstrapServer, LoopbackRegion, TransportError, connect
from blink.transport.loopback import (
    SHM_DIR,
    LoopbackTransport,
    _proc_start_time,
    _shm_open,
    cleanup_stale_segments,
    segment_name,
)

HERE = Path(__file__).parent
FAKE_ENGINE = HERE / "test_ring_fake_engine.py"
CFG = dict(n_slots=8, arena_tokens=256, stream_capacity=8, max_logprobs=4, max_stop_ids=4,
           max_logit_bias=4, max_model_len=128)

ENGINE_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, select, sys
    if "--no-tracker" in sys.argv:  # take the resource tracker's backstop away
        from multiprocessing import resource_tracker
        resource_tracker.register = resource_tracker.unregister = lambda *a: None
    spec = importlib.util.spec_from_file_location("fake_engine_child", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from blink.ring import Ring, RingConfig, RingLayout
    from blink.transport import BootstrapServer, LoopbackRegion
    cfg = RingConfig(**json.loads(sys.argv[2]))
    region = LoopbackRegion(RingLayout(cfg).total_bytes)
    ring = Ring.create(region.buffer, cfg)
    engine = mod.FakeEngine(ring, step_sleep_s=5e-4).start()
    server = BootstrapServer(region, model_name="fake", max_model_len=cfg.max_model_len,
                             tokenizer="fake-tok")
    host, port = server.start()
    print(json.dumps({"port": port, "region": region.name, "secret": server.secret.decode()}),
          flush=True)
    if "--signals-to-other-threads" in sys.argv:  # what a loaded machine does now and then
        import signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # Serve until the parent closes our stdin, waking every 0.2 s as `blink engine`'s
    # stop.wait(0.2) does: a SIGTERM the kernel hands to another thread only sets CPython's
    # flag, and a main thread asleep in read() would never run the Python handler.
    while not select.select([sys.stdin], [], [], 0.2)[0]:
        pass
    sys.stdin.read()
    engine.stop()
""")


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


class EngineProcess:
    def __init__(self, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE_SCRIPT, str(FAKE_ENGINE), json.dumps(CFG), *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"engine process failed: {self.proc.stderr.read()}")
        hello = json.loads(line)
        self.port, self.region = hello["port"], hello["region"]
        self.secret = hello["secret"].encode()

    def exit(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(timeout=10)

    def kill(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            # Seen once in a full run on a loaded machine, never alone: say what the child's
            # signal state was (blocked? pending? caught?) and its threads, then fail.
            status = self._proc_status()
            raise AssertionError(f"the engine process outlived signal {sig} by 20 s:\n{status}") from None

    def _proc_status(self) -> str:
        try:
            lines = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
            tasks = sorted(os.listdir(f"/proc/{self.proc.pid}/task"))
        except OSError as e:
            return f"(no /proc status: {e})"
        keep = ("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
        blocked_here = sorted(sig.name for sig in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return "\n".join([*(ln for ln in lines if ln.split(":")[0] in keep), f"tasks: {tasks}",
                          *(self._task_status(t) for t in tasks),
                          f"signals blocked in the test's thread (children inherit them): "
                          f"{blocked_here}"])

    def _task_status(self, tid: str) -> str:
        """One thread of the child: its name, state, where it sleeps, its own mask and pending
        signals (the mask is per thread: a signal blocked in the main thread goes to another,
        and Python runs handlers only in the main thread, which a read() keeps asleep)."""
        base = f"/proc/{self.proc.pid}/task/{tid}"
        try:
            fields = dict(ln.split(":", 1) for ln in Path(f"{base}/status").read_text().splitlines()
                          if ":" in ln)
            wchan = Path(f"{base}/wchan").read_text().strip()
        except OSError as e:
            return f"  task {tid}: (gone: {e})"
        return (f"  task {tid} {fields.get('Name', '').strip()}: {fields.get('State', '').strip()}, "
                f"wchan {wchan or '-'}, SigBlk {fields.get('SigBlk', '').strip()}, "
                f"SigPnd {fields.get('SigPnd', '').strip()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()


@pytest.fixture
def engine_process():
    procs = []

    def start(*flags):
        p = EngineProcess(*flags)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.close()
    cleanup_stale_segments()


def test_generate_across_processes_and_clean_exit(engine_process):
    eng = engine_process()
    assert segment_exists(eng.region)

    async def main():
        client = await RingEngineClient.connect("127.0.0.1", eng.port, secret=eng.secret,
                                                expect_transport="loopback",
                                                heartbeat_timeout_s=2.0)
        assert client.model_name == "fake" and client.info.tokenizer == "fake-tok"
        assert client.is_healthy()
        outs = await asyncio.gather(*(
            _collect(client.generate(f"r{i}", [i + 1, 100 + i], SamplingParams(max_tokens=20)))
            for i in range(12)
        ))
        for i, out in enumerate(outs):
            assert [t for o in out for t in o.token_ids] == [i + 1, 100 + i] * 10
            assert out[-1].finish_reason == "length"
        await client.close()

    asyncio.run(main())
    assert eng.exit() == 0
    assert not segment_exists(eng.region)  # unlinked at exit by its creator


async def _collect(agen):
    return [o async for o in agen]


@pytest.mark.parametrize("flags", [(), ("--no-tracker",)], ids=["tracker", "no-tracker"])
def test_engine_sigkill_ends_streams_and_leaves_no_segment(engine_process, flags):
    eng = engine_process(*flags)

    async def main():
        # Long heartbeat limits: the exited process itself is noticed (pid + start time).
        client = await RingEngineClient.connect("127.0.0.1", eng.port, secret=eng.secret,
                                                heartbeat_timeout_s=20.0,
                                                engine_dead_timeout_s=30.0)
        agen = client.generate("long", [1, 2, 3], SamplingParams(max_tokens=100_000))
        await agen.__anext__()
        assert client.ring.transport.peer_alive() is True
        assert eng.kill(signal.SIGKILL) == -signal.SIGKILL
        if flags:  # nothing cleaned up after the crash: the next engine start does it. Looked at
            # at once: any LoopbackRegion made meanwhile (another xdist worker's engine) cleans it
            assert segment_exists(eng.region)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine process has exited"):
            async for _ in agen:
                pass
        assert time.monotonic() - t0 < 3.0
        assert client.ring.transport.peer_alive() is False
        assert not client.is_healthy() and not client.is_accepting()
        await client.close()

    asyncio.run(main())
    cleanup_stale_segments()  # what every new LoopbackRegion runs first
    assert not segment_exists(eng.region)


def test_stopped_engine_process_is_stalled_not_dead(engine_process):
    """SIGSTOP the engine process (as a CPU hog or a long step would stall it): its heartbeat
    stops but the process exists, so the stream is kept; after SIGCONT it completes."""
    eng = engine_process()

    async def main():
        client = await RingEngineClient.connect("127.0.0.1", eng.port, secret=eng.secret,
                                                heartbeat_timeout_s=0.3,
                                                engine_dead_timeout_s=30.0)
        agen = client.generate("s", [5, 6], SamplingParams(max_tokens=2000))
        outs = [await agen.__anext__()]
        eng.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while not client.stalled:
                assert time.monotonic() - t0 < 10, "the stall was not noticed"
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.0)  # well past the heartbeat timeout
            assert client.stalled and not client.is_healthy() and client.is_accepting()
            assert client.ring.transport.peer_alive() is True
        finally:
            eng.proc.send_signal(signal.SIGCONT)
        outs += [o async for o in agen]
        assert [t for o in outs for t in o.token_ids] == [5, 6] * 1000
        assert outs[-1].finish_reason == "length"
        assert client.is_healthy()
        await client.close()

    asyncio.run(main())
    assert eng.exit() == 0


@pytest.mark.parametrize("flags", [(), ("--no-tracker",), ("--signals-to-other-threads",)],
                         ids=["tracker", "no-tracker", "taken-by-another-thread"])
def test_engine_sigterm_unlinks_through_the_signal_handler(engine_process, flags):
    eng = engine_process(*flags)
    assert eng.kill(signal.SIGTERM) == -signal.SIGTERM  # still dies of SIGTERM
    assert not segment_exists(eng.region)
    stderr = eng.proc.stderr.read()  # EOF once the resource tracker has exited as well
    assert "leaked" not in stderr and "Traceback" not in stderr, stderr


FRONTEND_SCRIPT = textwrap.dedent("""
    import sys, time
    from blink.dpu.ring_protocol import RingClient
    from blink.transport import connect
    from blink.transport.auth import secret_from_env
    info, transport = connect("127.0.0.1", int(sys.argv[1]), secret=secret_from_env())
    client = RingClient(transport)
    client.submit(7, [1, 2, 3], max_tokens=1_000_000)
    print("submitted", flush=True)
    if sys.argv[2] == "hang":
        time.sleep(60)
""")


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_frontend_crash_or_exit_leaves_the_engine_region_alone(how):
    cfg = RingConfig(**CFG)
    sys.path.insert(0, str(HERE))
    from test_ring_fake_engine import FakeEngine

    region = LoopbackRegion(RingLayout(cfg).total_bytes)
    ring = Ring.create(region.buffer, cfg)
    engine = FakeEngine(ring).start()
    server = BootstrapServer(region, model_name="fake", max_model_len=128, tokenizer="t")
    _, port = server.start()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", FRONTEND_SCRIPT, str(port), "hang" if how == "sigkill" else "exit"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "BLINK_BOOTSTRAP_SECRET": server.secret.decode()},
        )
        assert child.stdout.readline().strip() == "submitted", child.stderr.read()
        if how == "sigkill":
            child.kill()
        child.wait(timeout=10)
        child.stdout.close(), child.stderr.close()
        time.sleep(0.2)  # give a (wrong) resource tracker time to act
        assert segment_exists(region.name)  # the frontend's exit did not unlink it
        # A new frontend attaches, cancels the orphaned request and drains it.
        _, transport = connect("127.0.0.1", port, secret=server.secret)
        client = RingClient(transport)
        assert len(client.active) == 1
        for _ in range(500):
            client.poll_many()
            if not client.active:
                break
            time.sleep(0.002)
        assert client.active == [] and (ring.state == SLOT_FREE).all()
        client.close()
    finally:
        engine.stop()
        server.stop()
        region.close()
    assert not segment_exists(region.name)


def test_cleanup_removes_only_segments_of_dead_creators():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    me, my_start = os.getpid(), _proc_start_time(os.getpid())
    names = {
        "dead": f"blink-{dead_pid}-12345-0badcafe",
        "reused_pid": f"blink-{me}-{my_start + 1}-0badcafe",  # our pid, another process's start
        "alive": segment_name(),
        "foreign": f"blink-notours-{me}",
    }
    for name in names.values():
        os.close(_shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        removed = cleanup_stale_segments()
        assert names["dead"] in removed and names["reused_pid"] in removed
        assert segment_exists(names["alive"]) and segment_exists(names["foreign"])
        assert not segment_exists(names["dead"]) and not segment_exists(names["reused_pid"])
    finally:
        for name in names.values():
            if segment_exists(name):
                os.unlink(os.path.join(SHM_DIR, name))


def test_region_and_transport_basics():
    with LoopbackRegion(4096) as region:
        assert region.name.startswith(f"blink-{os.getpid()}-")
        mem = np.frombuffer(region.buffer, dtype=np.uint8)
        with LoopbackTransport(region.name, 4096) as t:
            t.write(10, b"\x01\x02\x03")
            t.write(100, np.array([7, 8], dtype="<i4"))
            t.fence()
            assert mem[10:13].tolist() == [1, 2, 3]
            mem[200] = 9
            assert t.read(199, 3).tolist() == [0, 9, 0]
            got = t.read(100, 8)
            mem[100] = 0
            assert got.view("<i4").tolist() == [7, 8]  # read returns a copy
            with pytest.raises(TransportError, match="outside the 4096-byte region"):
                t.write(4095, b"ab")
            with pytest.raises(TransportError, match="outside"):
                t.read(-1, 1)
        with pytest.raises(TransportError, match="closed"):
            t.read(0, 1)
        with pytest.raises(TransportError, match="announced 8192"):
            LoopbackTransport(region.name, 8192)
        del mem
    assert not segment_exists(region.name)
    with pytest.raises(TransportError, match="does not exist"):
        LoopbackTransport(region.name)
    with pytest.raises(TransportError, match="not a Blink segment name"):
        LoopbackTransport("../etc/passwd")
