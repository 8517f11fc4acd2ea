"""The frontend's HTTP server: uvicorn's h11 protocol with the connection-level bounds uvicorn
does not have (docs/architecture.md, "Request limits", "Connections").

uvicorn (with h11) has no deadline for a request's headers or body and accepts connections
until the process runs out of descriptors: a client that opens connections and sends a
partial request on each (slowloris) held them forever, and ~1,000 of them locked every other
client out. :class:`BoundedH11Protocol` adds, per connection:

- a **header deadline** (``--http-header-timeout``): from the connection's start, or from the
  first byte of a kept-alive connection's next request, to the end of the request head. A
  partial head at the deadline gets ``408`` and the connection is closed; a connection that
  sent nothing is closed without an answer (as nginx does).
- a **body deadline** (``--http-body-timeout``): from the end of the head to the end of the
  body. At the deadline the request ends as a client disconnect (the app sees
  ``http.disconnect``) and the client gets ``408`` if no answer had started.
- a **connection cap** (``--max-connections``; by default :data:`DEFAULT_MAX_CONNECTIONS`,
  lowered to what the descriptor limit leaves): a connection beyond it is answered
  ``503`` + ``Retry-After`` + ``Connection: close`` as soon as its request head arrives (and
  gets at most :data:`OVER_CAP_HEADER_TIMEOUT_S` to send it), so a full server refuses clearly
  instead of letting clients hang.
- a **half-closed** client (one that sends its request and then shuts down its sending side)
  still gets its answer; a client that leaves before its request is complete is a client
  disconnect (the app's :class:`blink.dpu.app.InternalErrorMiddleware` counts it in
  ``blink:http_client_disconnects_total``: no 500, no traceback).

Torch-free (the frontend's process).
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

#: seconds a client has to send a request head (nginx's client_header_timeout is 60 s, Apache's
#: mod_reqtimeout 20-40 s; a real client sends its head in one packet)
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: seconds a client has to send a request body once its head is in: 8 MiB (the default
#: --max-request-body-mb) at ~140 KB/s
DEFAULT_BODY_TIMEOUT_S = 60.0
#: connections served at once by default (each holds a descriptor and ~10 KB)
DEFAULT_MAX_CONNECTIONS = 4096
#: descriptors the frontend keeps for itself besides connections (ring, tokenizer files, the
#: bootstrap lease, logs, worker threads' files, /metrics' snapshot reads, refused connections)
FD_RESERVE = 64
#: the fewest connections a descriptor limit may leave (below it the frontend refuses to start)
MIN_CONNECTIONS = 8
#: header deadline of a connection over the cap: it only waits for a head to answer 503 to
OVER_CAP_HEADER_TIMEOUT_S = 1.0
#: Retry-After of the over-the-cap refusal
OVER_CAP_RETRY_AFTER_S = 1
#: at most one log line per this many seconds about refused connections / timeouts
_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    """The HTTP server's per-connection bounds (``blink serve`` flags of the same names)."""

    #: seconds from a connection's start (or a kept-alive connection's next request) to the
    #: end of the request head
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    #: seconds from the end of the request head to the end of its body
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    #: connections served at once (more are refused with 503); None: the default, lowered to
    #: what the descriptor limit leaves
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be positive, got {self.max_connections}")

    def connection_cap(self, open_files_limit: int | None = None) -> int:
        """Connections served at once under ``open_files_limit`` (default: this process's soft
        RLIMIT_NOFILE): the configured or default cap, lowered so that :data:`FD_RESERVE`
        descriptors stay free; ValueError if fewer than :data:`MIN_CONNECTIONS` would be left."""
        if open_files_limit is None:
            open_files_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        room = open_files_limit - FD_RESERVE if open_files_limit != resource.RLIM_INFINITY \
            else 1 << 30
        if room < MIN_CONNECTIONS:
            raise ValueError(
                f"the open-files limit ({open_files_limit}) leaves room for {max(room, 0)} "
                f"connections (the frontend keeps {FD_RESERVE} descriptors for itself); raise "
                f"it (ulimit -n, systemd LimitNOFILE=) to at least {FD_RESERVE + MIN_CONNECTIONS}")
        wanted = self.max_connections if self.max_connections is not None else DEFAULT_MAX_CONNECTIONS
        if wanted > room:
            if self.max_connections is not None:
                logger.warning("--max-connections %d: the open-files limit (%d) leaves room "
                               "for %d; serving at most %d connections", wanted,
                               open_files_limit, room, room)
            return room
        return wanted


def _error_bytes(status: int, reason: str, message: str, code: str,
                 headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A complete ``Connection: close`` answer with an OpenAI-style error body, as bytes (it
    is written straight to the socket: no request cycle exists, or none may answer)."""
    body = json.dumps({"object": "error", "error": {
        "message": message, "type": "invalid_request_error" if status < 500 else "server_error",
        "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close",
            *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _RateLimitedLog:
    """One warning per ``_LOG_EVERY_S`` for a recurring event, with the count since the last."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.count = 0
        self.last = -_LOG_EVERY_S

    def __call__(self, detail: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= _LOG_EVERY_S:
            logger.warning("%s (%s; %d since the last such line)", self.text, detail, self.count)
            self.last, self.count = now, 0


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body deadlines, a connection cap and half-close
    support (module docstring). Subclassed per server by :func:`protocol_class`, which sets
    the class attributes."""

    limits: ConnectionLimits = ConnectionLimits()
    cap: int = DEFAULT_MAX_CONNECTIONS
    metrics: Any = None  # blink.dpu.metrics.FrontendMetrics, or None
    _refusal_log = _RateLimitedLog("connections over --max-connections refused with 503")
    _timeout_log = _RateLimitedLog("HTTP requests timed out (--http-header-timeout / "
                                   "--http-body-timeout)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "header" or "body" while a deadline runs
        self._head_bytes = False  # some of the current request head has arrived
        self._counted = False

    # -- connections -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._counted = True
        if self.metrics is not None:
            self.metrics.http_connections.inc()
        if len(self.connections) > self.cap:
            # Over the cap: answer the request head with 503, then close. self.app is what
            # the next request runs (uvicorn reads it per request).
            self.app = self._refuse_over_cap
            self._refusal_log(f"{len(self.connections) - 1} open, cap {self.cap}")
            if self.metrics is not None:
                self.metrics.http_connections_refused.inc()
            self._arm("header", min(OVER_CAP_HEADER_TIMEOUT_S, self.limits.header_timeout_s))
        else:
            self._arm("header", self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            if self.metrics is not None:
                self.metrics.http_connections.dec()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client shut down its sending side. With a whole request in and its answer not
        yet sent, keep the connection open for the answer (then close it); otherwise (idle,
        or the request incomplete: a client that left mid-request) close now."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body \
                and self.conn.their_state is h11.DONE:
            cycle.keep_alive = False  # no further request can come: close after the answer
            return True
        return None

    # -- deadlines ---------------------------------------------------------------------
    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = None

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            if self._phase is None:  # a kept-alive connection's next request begins
                self._arm("header", self.limits.header_timeout_s)
            self._head_bytes = True
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def _follow_request(self) -> None:
        """Move the deadline along with the request: head → body → none."""
        state = self.conn.their_state
        if self.transport.is_closing():
            self._disarm()
        elif self._phase == "header" and state is not h11.IDLE:
            self._head_bytes = False
            if state is h11.SEND_BODY:
                self._arm("body", self.limits.body_timeout_s)
            else:
                self._disarm()
        elif self._phase == "body" and state is not h11.SEND_BODY:
            self._disarm()

    def _expired(self, phase: str) -> None:
        self._deadline = None
        self._phase = None
        if self.transport.is_closing():
            return
        limit = self.limits.header_timeout_s if phase == "header" else self.limits.body_timeout_s
        if phase == "header" and not self._head_bytes:
            self.transport.close()  # an idle connection: nothing to answer (as nginx does)
            return
        if self.metrics is not None:
            self.metrics.http_request_timeouts.labels(phase).inc()
        where = "%s:%d" % self.client if self.client else "-"
        self._timeout_log(f"the latest from {where}: request {phase} not complete after {limit:g} s")
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_error_bytes(
                408, "Request Timeout",
                f"The request {phase} did not arrive within {limit:g} s "
                f"(--http-{phase}-timeout).", "request_timeout"))
        if cycle is not None:  # the app waiting for the body sees the client leave
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    # -- the over-the-cap answer ---------------------------------------------------------
    async def _refuse_over_cap(self, scope: Any, receive: Any, send: Any) -> None:
        data = _error_bytes(
            503, "Service Unavailable",
            f"This server is serving its maximum of {self.cap} connections "
            f"(--max-connections); retry shortly.", "too_many_connections",
            (("retry-after", str(OVER_CAP_RETRY_AFTER_S)),))
        head, _, body = data.partition(b"\r\n\r\n")
        headers = [tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:]]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def protocol_class(limits: ConnectionLimits, cap: int, metrics: Any = None) -> type[BoundedH11Protocol]:
    """A :class:`BoundedH11Protocol` for one server: ``limits``, the connection ``cap`` and
    the app's :class:`blink.dpu.metrics.FrontendMetrics` (or None)."""
    return type("BlinkH11Protocol", (BoundedH11Protocol,),
                {"limits": limits, "cap": cap, "metrics": metrics})


def uvicorn_config(app: Any, limits: ConnectionLimits, **kwargs: Any) -> uvicorn.Config:
    """The frontend's ``uvicorn.Config``: ``kwargs`` as uvicorn takes them, HTTP/1.1 by h11
    with ``limits`` (the cap from this process's descriptor limit; ValueError if it leaves too
    few), the metrics of ``app.state.metrics`` when the app has them."""
    cap = limits.connection_cap()
    metrics = getattr(getattr(app, "state", None), "metrics", None)
    return uvicorn.Config(app, http=protocol_class(limits, cap, metrics), **kwargs)
