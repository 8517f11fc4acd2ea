"""A dead frontend under ``blink serve`` (issue 34, item 5; null model, 4 slots): SIGKILLed
with streams in flight, it is restarted on the same HTTP port while the engine keeps running
(same pid), and the new frontend gets every slot back (the dead one's requests are taken over
and freed, as on any new attach). With ``--no-frontend-restart`` the server stops at once: the
engine, which nobody reads any more, stops without draining. Before: the supervisor stopped
everything, and the engine drained for 30 s requests nobody could read.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from e2e_helpers import ServeProcess, child_pids, cmdline, pid_alive, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

SLOTS = 4
FLAGS = ("--model", "null", "--max-model-len", "2048", "--max-num-seqs", str(SLOTS),
         "--kv-cache-tokens", "8192")


def _hold_streams(url: str, count: int) -> tuple[list[httpx.Response], list[httpx.Client]]:
    """``count`` long streams whose first bytes arrived and which are then not read: their
    rows stay in the ring (their output streams fill up)."""
    clients, responses = [], []
    for _ in range(count):
        client = httpx.Client(timeout=30)
        body = {"model": "null", "prompt": "Hello there", "max_tokens": 2000, "stream": True}
        r = client.send(client.build_request("POST", f"{url}/v1/completions", json=body),
                        stream=True)
        assert r.status_code == 200
        next(r.iter_raw())
        clients.append(client)
        responses.append(r)
    return responses, clients


def _frontend_pid(server: ServeProcess) -> int | None:
    for pid in child_pids(server.pid):
        if "--frontend-only" in cmdline(pid):
            return pid
    return None


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _complete(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "null", "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_killed_frontend_is_restarted_then_the_server_stops_without_draining():
    """One server, ``--max-frontend-restarts 1``: the first SIGKILL is healed, the second is
    one too many, and the server then stops within seconds (the engine does not drain)."""
    server = ServeProcess(*FLAGS, "--max-frontend-restarts", "1", name="fe-restart-serve")
    clients: list[httpx.Client] = []
    try:
        server.wait_ready()
        url, engine, frontend = server.base_url, server.engine_pid, server.frontend_pid
        _, clients = _hold_streams(url, 2)
        os.kill(frontend, signal.SIGKILL)
        server.frontend_pid = None
        wait_until(lambda: _health(url) == 200, 60, 0.1, what="a new frontend")
        new_frontend = _frontend_pid(server)
        assert new_frontend and new_frontend != frontend
        server.frontend_pid = new_frontend
        assert pid_alive(engine) and engine in child_pids(server.pid)  # the same engine
        assert "restarting it in" in server.log()
        # every slot is free again: SLOTS requests at once all complete
        with cf.ThreadPoolExecutor(SLOTS) as pool:
            texts = list(pool.map(lambda _: _complete(url), range(SLOTS)))
        assert texts == [" the" * 3] * SLOTS

        # the second death is over --max-frontend-restarts: the server stops, fast
        for c in clients:
            c.close()
        _, clients = _hold_streams(url, 2)
        t0 = time.monotonic()
        os.kill(new_frontend, signal.SIGKILL)
        status = server.wait(25)
        took = time.monotonic() - t0
        assert status != 0
        assert took < 10, f"blink serve took {took:.1f} s to stop (an engine drain?)"
        assert "--max-frontend-restarts" in server.log()
        assert "stopping without draining" in server.log()
    finally:
        for c in clients:
            c.close()
        server.stop()
