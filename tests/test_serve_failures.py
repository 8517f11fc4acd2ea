"""End to end, when things go wrong: ``blink engine`` and ``blink serve --frontend-only`` run
apart (as on a DPU), with only 2 request slots, so that the ring fills up.

In order (one engine for the module; the tests share it and run in file order):
overload → 503 + Retry-After; a client that disconnects mid-stream, or during prefill of a
non-streaming request, leaves the engine idle (no slot, no KV block); a frontend of another
ring layout version is refused; SIGKILL of the engine mid-stream → the stream ends with an SSE
error event promptly (the frontend sees the engine process is gone, without waiting out the
heartbeat limits), /health turns 503; the next engine start leaves no segment of the killed
one; and a SIGINT of ``blink serve`` (null model, quick to start) stops both children and
leaves nothing behind.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from e2e_helpers import (  # noqa: E402
    EngineProcess,
    FrontendProcess,
    ServeProcess,
    assert_error_shape,
    child_pids,
    wait_engine_idle,
    pid_alive,
    read_metrics,
    segments_of,
    wait_until,
)

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
# Held streams must outlast the ring-full test's 2 s wait for a slot (and the reads after it)
# at any decode speed: 400 tokens once took ~1.8 s on a fast minute, and a stream ended first.
LONG = {"model": MODEL, "prompt": "Tell me a very long story about a dragon.",
        "max_tokens": 1900, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def apart():
    # Small steps (chunked prefill of 64 tokens) keep the heartbeat lively on a busy machine
    # (the frontend reports a stall on /health after 5 s without one, and gives requests up
    # after 60 s).
    engine = EngineProcess("--max-num-seqs", "2", "--max-model-len", "2048",
                           "--kv-cache-tokens", "4096", "--max-num-batched-tokens", "64",
                           name="fail-engine")
    frontend = None
    try:
        engine.wait_ready()
        frontend = FrontendProcess(engine.address, name="fail-frontend",
                                   secret_file=engine.secret_file).wait_ready()
        yield engine, frontend
    finally:
        if frontend is not None:
            frontend.stop()
        engine.stop()


@pytest.fixture(scope="module")
def frontend(apart):
    return apart[1]


@pytest.fixture(scope="module")
def engine(apart):
    return apart[0]


def _open_stream(client: httpx.Client, body: dict) -> httpx.Response:
    """Start a streaming request and return once its first event arrived."""
    r = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    while not next(lines).startswith("data: "):
        pass
    r.lines = lines  # type: ignore[attr-defined]
    return r


def test_engine_and_frontend_apart(engine, frontend):
    assert httpx.get(f"{frontend.base_url}/health").status_code == 200
    r = httpx.post(f"{frontend.base_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert engine.address in frontend.log()


def test_frontend_of_another_layout_version_is_refused(engine, frontend):
    # The same CLI entry point, but speaking ring layout version 99.
    code = ("import sys, blink.ring; blink.ring.LAYOUT_VERSION = 99\n"
            "from blink.cli import main\n"
            f"sys.exit(main(['serve', '--frontend-only', '--engine', {engine.address!r}, "
            f"'--bootstrap-secret-file', {engine.secret_file!r}, '--port', '1']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert "layout version mismatch" in p.stderr and "99" in p.stderr, p.stderr
    assert httpx.get(f"{frontend.base_url}/health").status_code == 200  # nothing else broke


def test_ring_full_is_503_with_retry_after(frontend):
    url = frontend.base_url
    with httpx.Client(base_url=url, timeout=120) as c1, httpx.Client(base_url=url, timeout=120) as c2:
        held = [_open_stream(c1, LONG), _open_stream(c2, LONG)]  # both slots taken
        try:
            def overflow(stream: bool) -> httpx.Response:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": stream}
                return httpx.post(f"{url}/v1/completions", json=body, timeout=60)

            t0 = time.monotonic()
            with cf.ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(overflow, [False, True, False, True]))
            waited = time.monotonic() - t0
            for r in answers:
                assert_error_shape(r, 503, type="overloaded_error", code="engine_overloaded")
                assert int(r.headers["retry-after"]) >= 1
            assert waited < 30  # a bounded wait, not a hang
            assert read_metrics(url)["blink:num_requests_running"] == 2
            assert httpx.get(f"{url}/health").status_code == 200  # overloaded is not unhealthy
        finally:
            for r in held:
                r.close()
    # the held streams' clients went away: their slots and KV blocks come back
    wait_engine_idle(url, 30, "after the held streams' clients left", frontend.tail)


def test_disconnect_mid_stream_frees_slot_and_kv(frontend):
    url = frontend.base_url
    with httpx.Client(base_url=url, timeout=120) as client:
        r = _open_stream(client, {**LONG, "stream_options": {"include_usage": True}})
        for _ in range(3):  # a few tokens in
            next(r.lines)  # type: ignore[attr-defined]
        m = read_metrics(url)
        assert m["blink:num_requests_running"] == 1 and m["blink:kv_cache_usage_perc"] > 0
        r.close()
    wait_engine_idle(url, 30, "after the client left mid-stream", frontend.tail)
    # and the server still serves
    ok = httpx.post(f"{url}/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_nonstreaming_request_closed_during_prefill(frontend):
    url = frontend.base_url
    # a prefill long enough to still be running when we leave at 0.3 s: ~1,800 tokens in
    # 64-token chunks (--max-num-batched-tokens), ~2 s on two Zen 5 cores, where 450 tokens
    # and 40 more decoded took 0.30 s, the timeout's own length (CI failed on it once)
    prompt = "word " * 1800
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", timeout=httpx.Timeout(60, read=0.3),
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 40,
                         "ignore_eos": True})
    wait_engine_idle(url, 30, "after a non-streaming client left during prefill", frontend.tail)
    # the aborted request did not count as a success
    m = read_metrics(url)
    assert m["blink:num_requests_running"] == 0 and m["blink:kv_cache_usage_perc"] == 0


def test_engine_killed_mid_stream(engine, frontend):
    url = frontend.base_url
    with httpx.Client(base_url=url, timeout=120) as client:
        r = _open_stream(client, LONG)
        next(r.lines)  # type: ignore[attr-defined]
        engine.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        events = []
        for line in r.lines:  # type: ignore[attr-defined]
            if line.startswith("data: "):
                events.append(line[6:])
        elapsed = time.monotonic() - t0
        r.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["object"] == "error"
    assert error["error"]["type"] == "service_unavailable_error"
    assert error["error"]["code"] == "engine_unavailable"
    assert elapsed < 20, f"the stream took {elapsed:.1f} s to report the dead engine"
    engine.proc.wait(10)

    health = wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 20,
                        what="/health to turn 503")
    assert health
    assert_error_shape(httpx.get(f"{url}/health"), 503, code="engine_unavailable")
    r = httpx.post(f"{url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert_error_shape(r, 503, type="service_unavailable_error")
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "max_tokens": 2, "stream": True,
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert_error_shape(r, 503)
    # the orphaned frontend still stops promptly (uvicorn re-raises SIGTERM after its graceful
    # shutdown, so the process ends "killed by SIGTERM", as its parent expects)
    t0 = time.monotonic()
    assert frontend.stop(signal.SIGTERM, timeout_s=30) in (0, -signal.SIGTERM), frontend.tail()
    assert time.monotonic() - t0 < 15
    assert "Traceback" not in frontend.log(), frontend.tail()


def test_next_start_leaves_no_segment_and_sigint_stops_serve(engine):
    """After the SIGKILL above, a new engine start leaves no segment of the dead engine; then
    Ctrl-C (SIGINT) of ``blink serve`` stops both children and leaves nothing behind."""
    dead = engine.pid
    if pid_alive(dead):  # pytest -n: the test above ran in another worker, with its own engine
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(10)
    assert not pid_alive(dead)
    server = ServeProcess("--model", "null", "--max-model-len", "256", "--max-num-seqs", "8",
                          "--kv-cache-tokens", "4096", name="null-serve")
    try:
        server.wait_ready()
        assert segments_of(dead) == [], "a segment of the killed engine survived the next start"
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                       json={"model": "null", "prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " the" * 5
        engine_pid, frontend_pid = server.engine_pid, server.frontend_pid
        assert segments_of(engine_pid)
        server.send(signal.SIGINT)
        assert server.wait(60) == 0, server.tail()
        wait_until(lambda: not pid_alive(engine_pid) and not pid_alive(frontend_pid), 10,
                   what="both children to exit")
        assert child_pids(server.pid) == []
        assert segments_of(engine_pid) == []
        assert "Traceback" not in server.log(), server.tail()
    finally:
        server.stop()

