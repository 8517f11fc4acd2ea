"""Hostile clients at the connection level (issue 34, items 1-3): slowloris heads and bodies,
a connection flood under a low open-files limit, a client leaving mid-body, a half-closed
client, deeply nested JSON on every route. The frontend's HTTP server is
:mod:`blink.dpu.http_server` (uvicorn's h11 with deadlines and a connection cap); before it,
a partial request held its connection forever, ~1,000 of them locked every client out, a
client leaving mid-body was a logged 500 with a traceback, a half-closed client got no
answer, and /tokenize answered deeply nested JSON with a 500.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import (  # noqa: E402
    MESSAGES, MODEL, asgi_request, make_engine, serve_in_thread, tiny_tokenizer,
)
from e2e_helpers import free_port, read_metrics, wait_until  # noqa: E402

from blink.dpu.app import create_app  # noqa: E402
from blink.dpu.http_server import FD_RESERVE, ConnectionLimits  # noqa: E402

HELPERS = Path(__file__).parent / "dpu_helpers.py"


@pytest.fixture
def app():
    tok = tiny_tokenizer()
    return create_app(make_engine(tok), tok, model_name=MODEL)


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _read_all(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes (or ``timeout_s``)."""
    sock.settimeout(timeout_s)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (socket.timeout, ConnectionResetError):
        pass
    return b"".join(chunks)


def _read_response(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body) from a kept-alive connection."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _metric(base: str, name: str) -> float:
    return read_metrics(base).get(name, 0.0)


def _health(base: str, timeout_s: float = 5.0) -> int:
    """/health's status, or 0 when the server cannot be reached (yet)."""
    try:
        return httpx.get(f"{base}/health", timeout=timeout_s).status_code
    except httpx.HTTPError:
        return 0


# -- 1. deadlines and the connection cap --------------------------------------------------------


def test_partial_head_gets_408_and_idle_connection_is_closed(app):
    limits = ConnectionLimits(header_timeout_s=0.3, body_timeout_s=5)
    with serve_in_thread(app, limits) as base:
        partial = _connect(base)
        partial.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        idle = _connect(base)
        t0 = time.monotonic()
        answer = _read_all(partial)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"request_timeout" in answer and b"--http-header-timeout" in answer
        assert time.monotonic() - t0 < 3
        assert _read_all(idle) == b""  # closed without an answer: it asked nothing
        # a kept-alive connection's next request has the same deadline
        kept = _connect(base)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(kept).startswith(b"HTTP/1.1 200 ")
        kept.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _read_all(kept).startswith(b"HTTP/1.1 408 ")
        assert _metric(base, "blink:http_request_timeouts_total") == 2  # the idle one is not
        for s in (partial, idle, kept):
            s.close()


def test_slow_body_gets_408_at_the_body_deadline(app):
    limits = ConnectionLimits(header_timeout_s=5, body_timeout_s=0.3)
    with serve_in_thread(app, limits) as base:
        sock = _connect(base)
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        for _ in range(3):  # trickling keeps nothing alive past the deadline
            time.sleep(0.1)
            try:
                sock.sendall(b" ")
            except OSError:
                break
        answer = _read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"--http-body-timeout" in answer and time.monotonic() - t0 < 3
        sock.close()
        assert _metric(base, "blink:http_request_timeouts_total") == 1


def test_connections_over_the_cap_get_503_with_retry_after(app):
    limits = ConnectionLimits(header_timeout_s=5, body_timeout_s=5, max_connections=4)
    with serve_in_thread(app, limits) as base:
        held = [_connect(base) for _ in range(4)]
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")  # slowloris: never finishes its head
        time.sleep(0.2)
        r = httpx.get(f"{base}/health", timeout=5)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert r.json()["error"]["code"] == "too_many_connections"
        assert "--max-connections" in r.json()["error"]["message"]
        for s in held:
            s.close()
        wait_until(lambda: _health(base) == 200, 5)
        assert _metric(base, "blink:http_connections_refused_total") >= 1


def test_default_cap_follows_the_open_files_limit():
    limits = ConnectionLimits()
    assert limits.connection_cap(1024) == 1024 - FD_RESERVE
    assert limits.connection_cap(1 << 20) == 4096
    assert ConnectionLimits(max_connections=100).connection_cap(1 << 20) == 100
    with pytest.raises(ValueError, match="open-files limit"):
        limits.connection_cap(FD_RESERVE + 2)


def test_slowloris_flood_under_a_low_fd_limit_does_not_lock_clients_out(tmp_path):
    """A frontend process started with 100 descriptors (hard limit 160), a 1 s header
    deadline: it raises its soft limit to the hard one, and 300 connections that each send a
    partial head do not keep a well-behaved client from an answer (before: uvicorn held them
    forever and the client was never accepted)."""
    port = free_port()
    options = {"connections": {"header_timeout_s": 1.0, "body_timeout_s": 5.0}}

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 160))

    # stderr to a file: asyncio logs every refused accept() there, a pipe would fill up
    proc = subprocess.Popen([sys.executable, str(HELPERS), str(port), json.dumps(options)],
                            preexec_fn=low_fd_limit, stderr=(tmp_path / "stderr").open("w"))
    attackers: list[socket.socket] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _health(base, 1) == 200, 30, interval_s=0.1)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3:5] == ["160", "160"], line  # soft raised to the hard limit
        for _ in range(300):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                attackers.append(s)
            except OSError:
                break
        # A client retrying with a 2 s timeout, as real ones do (a connection the kernel left
        # in its full accept queue may not be taken for a while).
        t0 = time.monotonic()
        status = 0
        while not status and time.monotonic() - t0 < 8:
            status = _health(base, 2)
        assert status in (200, 503), f"no answer within {time.monotonic() - t0:.1f} s"
        # the partial heads were answered 408 and closed at their deadline
        wait_until(lambda: _health(base) == 200, 10)
    finally:
        for s in attackers:
            s.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- 2. clients that leave mid-body or half-close ---------------------------------------------


def test_client_leaving_mid_body_is_counted_not_a_500(app, caplog):
    with serve_in_thread(app, ConnectionLimits()) as base:
        with caplog.at_level(logging.DEBUG, logger="blink"):
            sock = _connect(base)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"hi")
            time.sleep(0.2)
            sock.close()
            wait_until(lambda: _metric(base, "blink:http_client_disconnects_total") == 1, 5)
        problems = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
        assert not problems, [r.getMessage() for r in problems]
        assert any("client left before its request body was read" in r.getMessage()
                   for r in caplog.records)
        assert any('"POST /v1/completions HTTP/1.1" 499' in r.getMessage()
                   for r in caplog.records if r.name == "blink.access")


@pytest.mark.parametrize("path, body, key", [
    ("/v1/completions", {"prompt": "Say hello", "max_tokens": 4}, b'"choices"'),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}, b'"choices"'),
    ("/tokenize", {"prompt": "Say hello"}, b'"tokens"'),
])
def test_half_closed_client_gets_its_answer(app, path, body, key):
    with serve_in_thread(app, ConnectionLimits()) as base:
        data = json.dumps(body).encode()
        sock = _connect(base)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        sock.shutdown(socket.SHUT_WR)  # as `nc -N` and HTTP/1.0-style clients do
        answer = _read_all(sock)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert key in answer
        sock.close()


# -- 3. deeply nested JSON: 400 on every route ----------------------------------------------


def _nested_bodies(path: str) -> list[str]:
    deep = "[" * 20_000 + "]" * 20_000  # under 64 KiB: parsed on the event loop
    bodies = [deep, json.dumps({"model": MODEL})[:-1] + f', "x": {deep}}}']
    field = {"/tokenize": "prompt", "/detokenize": "tokens", "/v1/completions": "prompt",
             "/v1/chat/completions": "messages", "/v1/responses": "input"}.get(path)
    if field is not None:
        bodies.append(f'{{"{field}": {deep}}}')
    if path in ("/tokenize", "/v1/chat/completions"):
        bodies.append(f'{{"messages": {deep}}}')
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
        bodies.append(json.dumps({"messages": [
            *MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "user", "content": "more"}]}))
        # a tool schema just under the JSON parser's depth limit: deep for the meta-schema check
        schema = ('{"type": "object", "properties": {"a": ' + '{"type": "array", "items": ' * 190
                  + "{}" + "}" * 190 + "}}")
        bodies.append('{"messages": %s, "tools": [{"type": "function", "function": '
                      '{"name": "f", "parameters": %s}}]}' % (json.dumps(MESSAGES), schema))
    return bodies


def test_deeply_nested_json_is_a_400_on_every_route(app):
    posts = sorted(r.path for r in app.routes if "POST" in (getattr(r, "methods", None) or ())
                   and r.path != "/ping")  # SageMaker's health probe reads no body
    assert {"/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions",
            "/v1/responses"} <= set(posts)

    async def run() -> list[tuple[str, int, str]]:
        out = []
        for path in posts:
            for body in _nested_bodies(path):
                r = await asgi_request(app, "POST", path, content=body,
                                       headers={"content-type": "application/json"})
                out.append((path, r.status_code, r.text[:200]))
        return out

    for path, status, text in asyncio.run(run()):
        assert status == 400, (path, status, text)
        assert '"invalid_request_error"' in text, (path, text)


# -- the flags ------------------------------------------------------------------------------


def test_connection_flags_reach_the_frontend_and_bad_values_are_refused():
    from blink.cli import parse_args
    from blink.cli_args import check_frontend_flags, connection_limits
    from blink.errors import BlinkError
    from blink.launcher import frontend_args

    args = parse_args(["serve", "--model", "null", "--http-header-timeout", "3",
                       "--http-body-timeout", "20", "--max-connections", "77"])
    argv = frontend_args(args, "127.0.0.1:1")
    for flag, value in (("--http-header-timeout", "3.0"), ("--http-body-timeout", "20.0"),
                        ("--max-connections", "77")):
        assert argv[argv.index(flag) + 1] == value
    frontend = parse_args(argv)
    assert connection_limits(frontend) == ConnectionLimits(3.0, 20.0, 77)
    for bad, flag in ((["--http-header-timeout", "0"], "--http-header-timeout"),
                      (["--http-body-timeout", "-1"], "--http-body-timeout"),
                      (["--max-connections", "0"], "--max-connections")):
        with pytest.raises(BlinkError, match=flag):
            check_frontend_flags(parse_args(["serve", "--model", "null", *bad]))
