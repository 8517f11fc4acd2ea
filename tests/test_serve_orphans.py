"""Orphans (issue 13, defect 8): when the ``blink serve`` supervisor itself is killed outright
(SIGKILL, as the OOM killer does), its engine and frontend die with it within a few seconds,
the HTTP port, the bootstrap port and the shared-memory segment are freed, and the next start
on the same ports succeeds."""
from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from e2e_helpers import (  # noqa: E402
    ServeProcess,
    free_port,
    pid_alive,
    segments_of,
    wait_until,
)

pytestmark = pytest.mark.slow

FLAGS = ("--model", "null", "--max-model-len", "256", "--max-num-seqs", "4",
         "--kv-cache-tokens", "2048")


def _port_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (SO_REUSEADDR, as uvicorn and the
    bootstrap server bind: connections left in TIME_WAIT do not count, a listener does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_children_die_with_a_killed_supervisor():
    http_port, engine_port = free_port(), free_port()
    flags = (*FLAGS, "--engine-port", str(engine_port))
    first = ServeProcess(*flags, port=http_port, name="orphan-serve")
    second = None
    try:
        first.wait_ready()
        engine, frontend = first.engine_pid, first.frontend_pid
        assert segments_of(engine)
        # a stream in flight when the supervisor dies
        client = httpx.Client(timeout=60)
        r = client.send(client.build_request(
            "POST", f"{first.base_url}/v1/completions",
            json={"model": "null", "prompt": "Hi", "max_tokens": 200, "stream": True}), stream=True)
        assert r.status_code == 200
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: not pid_alive(engine) and not pid_alive(frontend), 10, 0.1,
                   what="the engine and the frontend to die with their supervisor")
        r.close()
        client.close()
        wait_until(lambda: _port_free(http_port) and _port_free(engine_port), 5,
                   what="the HTTP and bootstrap ports to be free")
        assert segments_of(engine) == []
        # the next start on the same ports works
        second = ServeProcess(*flags, port=http_port, name="orphan-serve-2").wait_ready()
        r = httpx.post(f"{second.base_url}/v1/completions", timeout=60,
                       json={"model": "null", "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " the" * 3
        assert f"127.0.0.1:{engine_port}" in second.log()
    finally:
        first.stop()
        if second is not None:
            second.stop()
