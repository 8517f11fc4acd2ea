"""Connection bootstrap: a small TCP handshake, like rdma_cm's, before any one-sided access.

Messages are JSON objects, each preceded by its length (4 bytes, big-endian). One exchange:

    frontend -> engine   {"type": "hello", "layout_version": V, "client": ..., "pid": ...,
                          "role": "frontend" | "monitor" | "kv_writer" | "kv_region",
                          "nonce": Nf[, "doorbell": name]}
    engine -> frontend   {"type": "challenge", "nonce": Ne, "proof": HMAC(secret, Nf, Ne)}
    frontend -> engine   {"type": "auth", "proof": HMAC(secret, Ne, Nf)}
    engine -> frontend   {"type": "welcome", "layout_version", "transport", "total_bytes",
                          "model", "max_model_len", "tokenizer", <transport fields>}
                      or {"type": "refused", "error": "..."}   (then the engine hangs up)

Authentication comes first (:mod:`blink.transport.auth`): both sides prove they know the
bootstrap secret with an HMAC over both fresh nonces (compared with ``hmac.compare_digest``),
so the secret never crosses the wire and a proof cannot be replayed. Until the frontend's proof
checks out the engine sends nothing but the challenge (a nonce and its own proof) or a refusal:
no region name, RDMA address or rkey, model or tokenizer path. The frontend checks the
engine's proof too, so it never writes prompts into an impostor's memory.

A frontend on the engine's host may name a doorbell in its hello (:mod:`blink.transport.doorbell`):
an engine that serves the loopback transport rings it after each step for the lease holder,
and its welcome carries ``doorbell: true``.

Transport fields: loopback ``region_name``; verbs ``addr``, ``rkey``, ``memory`` and the
engine queue pair's ``qp_num``, ``psn``, ``lid``, ``gid``, ``mtu``. Verbs then takes one more
step, because an RC queue pair needs both ends' numbers:

    frontend -> engine   {"type": "connect", "endpoint": {qp_num, psn, lid, gid, mtu}}
    engine -> frontend   {"type": "ready"}

One frontend per engine: the TCP connection of the attached frontend stays open for as long as
it is attached (both transports; over verbs the engine destroys the frontend's queue pair when
it closes) and is its lease: while it is open another ``role: frontend`` hello is refused,
because a second ring client would take the first one's requests for orphans and cancel them
(and both would hand out the same slots). When the frontend process exits or dies the kernel
closes the connection and a new frontend can attach (it adopts and drains what the old one left
in the ring). ``role: monitor`` (read-only tools such as the control-plane benchmark's probe)
authenticates the same way but holds no lease. A prefill engine (docs/disaggregation.md)
connects twice, holding no lease: ``role: kv_writer`` reaches the ring (to publish "KV ready")
and its welcome carries ``kv_layout``; ``role: kv_region`` reaches the decode engine's KV-cache
region instead of the ring, with the same transport fields and steps (loopback: a segment
name; verbs: address, rkey and a queue pair of its own). An engine without a KV region (not
``--role decode``) refuses both. Every welcome carries ``engine_role`` (and a prefill engine's ``kv_peers``). The
engine enables TCP keepalive on the lease,
so a frontend whose host vanished without closing it is noticed within about a minute.

A frontend of another ring layout version is refused, with the same message on both sides (the
engine logs it and keeps it in ``BootstrapServer.refusals``; the frontend raises it).

Before a peer has proved the secret it costs the engine little, whatever it sends: the whole
handshake has one deadline (``timeout_s``, 10 s; not per ``recv()``, so trickling bytes does
not extend it), its messages are at most :data:`PRE_AUTH_MAX_BYTES` and nested at most
:data:`blink.transport.framing.MAX_NESTING` deep (checked before parsing), and at most
``max_unauthenticated`` (:data:`MAX_UNAUTHENTICATED`) peers are in the handshake at once: a new
connection beyond them closes the oldest unauthenticated one, so a flood of idle or trickling
peers never keeps a legitimate frontend out (its handshake takes milliseconds). The accept loop
survives everything a connection can cause (a thread that cannot start, a descriptor limit).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from blink.ring import LAYOUT_VERSION
from blink.transport import doorbell as doorbells
from blink.transport.framing import recv_message, send_message
from blink.transport.auth import (
    check_secret,
    engine_proof,
    frontend_proof,
    generate_secret,
    new_nonce,
    proofs_equal,
)
from blink.transport.base import (
    HandshakeError,
    Region,
    Transport,
    TransportError,
    set_thread_name,
    socket_peer_open,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
#: peers in the handshake (not yet authenticated) at once; a new one closes the oldest
MAX_UNAUTHENTICATED = 64
#: largest message before authentication (a hello or an auth answer is ~200 bytes)
PRE_AUTH_MAX_BYTES = 4096
#: seconds between two log lines about the accept loop's own trouble
_ACCEPT_LOG_EVERY_S = 10.0
TRANSPORT_KINDS = ("loopback", "verbs")
ROLES = ("frontend", "monitor", "kv_writer", "kv_region")
#: the one refusal an unauthenticated peer gets (the same whatever was wrong, so it learns nothing)
AUTH_REFUSAL = ("authentication failed: this engine requires the bootstrap secret "
                "(--bootstrap-secret-file) and the peer did not prove it knows it")
#: how long a new frontend waits for the lease of one that just went away to be released
LEASE_RELEASE_WAIT_S = 1.0


# -- what the engine tells the frontend -------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """The welcome message: everything the frontend needs before touching the ring."""

    layout_version: int
    transport: str
    total_bytes: int
    model_name: str
    max_model_len: int
    #: where the frontend loads the tokenizer files from (model path or name)
    tokenizer: str
    #: transport-specific fields (loopback: region_name; verbs: addr, rkey, qp_num, ...)
    connection: dict[str, Any] = field(default_factory=dict)

    _CORE = {
        "layout_version": int, "transport": str, "total_bytes": int,
        "model": str, "max_model_len": int, "tokenizer": str,
    }

    def to_message(self) -> dict[str, Any]:
        clash = set(self.connection) & (set(self._CORE) | {"type"})
        if clash:
            raise HandshakeError(f"bootstrap: transport fields {sorted(clash)} clash with the welcome")
        return {
            "type": "welcome",
            "layout_version": self.layout_version,
            "transport": self.transport,
            "total_bytes": self.total_bytes,
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "tokenizer": self.tokenizer,
            **self.connection,
        }

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> "EngineInfo":
        for key, kind in cls._CORE.items():
            value = msg.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise HandshakeError(
                    f"bootstrap: the engine's welcome has no valid {key!r} (got {value!r})"
                )
        connection = {k: v for k, v in msg.items() if k not in cls._CORE and k != "type"}
        return cls(
            layout_version=msg["layout_version"], transport=msg["transport"],
            total_bytes=msg["total_bytes"], model_name=msg["model"],
            max_model_len=msg["max_model_len"], tokenizer=msg["tokenizer"], connection=connection,
        )


def version_mismatch_message(engine_version: int, frontend_version: Any) -> str:
    return (
        f"ring layout version mismatch: the engine speaks layout version {engine_version}, the "
        f"frontend speaks {frontend_version}; run the frontend and the engine from the same "
        f"Blink release"
    )


# -- engine side ------------------------------------------------------------------------------


class BootstrapServer:
    """Serves the handshake for ``region`` on ``host:port`` from a background thread
    (``blink-bootstrap``; one short-lived ``blink-bs-peer`` thread per connection)."""

    def __init__(
        self,
        region: Region,
        *,
        model_name: str,
        max_model_len: int,
        tokenizer: str,
        host: str = "127.0.0.1",
        port: int = 0,
        layout_version: int = LAYOUT_VERSION,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        secret: bytes | None = None,
        kv_region: Region | None = None,
        kv_layout: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        on_doorbell: Callable[[doorbells.Doorbell | None], None] | None = None,
    ) -> None:
        """``secret``: the bootstrap secret peers must prove they know; None generates one
        (read it back from :attr:`secret`), so a server is never open to everyone.
        ``timeout_s``: the deadline of a whole handshake; ``max_unauthenticated``: peers in
        the handshake at once (a new one closes the oldest).
        ``kv_region``/``kv_layout``: a decode engine's KV-cache region, offered to ``kv_writer``
        peers (prefill engines). ``extra``: fields every welcome carries (``engine_role``...).
        ``on_doorbell``: given the lease holder's :class:`~blink.transport.doorbell.Doorbell`
        when a frontend on this host asks for one (loopback only), and None when its lease
        ends; None: no doorbell is offered."""
        self.kv_region = kv_region
        self.kv_layout = kv_layout or {}
        self.extra = dict(extra or {})
        self.secret = check_secret(secret, "BootstrapServer") if secret is not None else generate_secret()
        self.region = region
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.host, self.port = host, port
        self.layout_version = layout_version
        self.timeout_s = timeout_s
        if max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated must be positive, got {max_unauthenticated}")
        self.max_unauthenticated = max_unauthenticated
        #: unauthenticated connections, oldest first (dict order), and how many were dropped
        #: to make room for newer ones
        self._unauthenticated: dict[socket.socket, str] = {}
        self.dropped_unauthenticated = 0
        self._accept_trouble_logged = -_ACCEPT_LOG_EVERY_S
        #: messages of refused handshakes, newest last (diagnostics and tests)
        self.refusals: list[str] = []
        #: number of completed handshakes
        self.accepted = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._peers: set[socket.socket] = set()
        self._lock = threading.Lock()
        #: the attached frontend's lease: (connection, "addr (pid N)") while one is attached
        self._lease: tuple[socket.socket, str] | None = None
        self.on_doorbell = on_doorbell

    @property
    def attached(self) -> str | None:
        """Who holds the frontend lease ("addr (pid N)"), or None."""
        lease = self._lease
        return lease[1] if lease is not None else None

    def frontend_attached(self) -> bool:
        """Whether a frontend holds the lease and its connection is still open: someone reads
        what the engine writes (a stopping engine drains in-flight requests only then)."""
        lease = self._lease
        return lease is not None and socket_peer_open(lease[0])

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound (port 0 picks a free one)."""
        if self._sock is None:
            raise TransportError("bootstrap server is not started")
        host, port = self._sock.getsockname()[:2]
        return host, port

    def start(self) -> tuple[str, int]:
        if self._sock is not None:
            return self.address
        try:
            sock = socket.create_server((self.host, self.port), reuse_port=False)
        except OSError as exc:
            raise TransportError(
                f"bootstrap: cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        sock.settimeout(0.2)  # lets the accept loop notice stop()
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="blink-bootstrap", daemon=True)
        self._thread.start()
        logger.info("bootstrap: listening on %s:%d (%s transport)", *self.address, self.region.kind)
        return self.address

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            peers = list(self._peers)
        for conn in peers:  # unblock peer threads waiting for their frontend to hang up
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> "BootstrapServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        set_thread_name("blink-bootstrap")
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                # EMFILE/ENFILE/ENOBUFS...: the connection waits in the backlog; try again
                self._accept_trouble(f"accept() failed: {exc}")
                time.sleep(0.1)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            self._admit_unauthenticated(conn, peer)
            try:
                threading.Thread(
                    target=self._serve_peer, args=(conn, peer), name="blink-bs-peer", daemon=True
                ).start()
            except (RuntimeError, OSError, MemoryError) as exc:  # can't start new thread
                self._accept_trouble(f"no thread for {peer} ({exc}); its connection is closed")
                with self._lock:
                    self._unauthenticated.pop(conn, None)
                conn.close()

    def _accept_trouble(self, message: str) -> None:
        """One log line per ``_ACCEPT_LOG_EVERY_S`` about trouble the accept loop survives."""
        now = time.monotonic()
        if now - self._accept_trouble_logged >= _ACCEPT_LOG_EVERY_S:
            self._accept_trouble_logged = now
            logger.error("bootstrap: %s", message)

    def _admit_unauthenticated(self, conn: socket.socket, peer: str) -> None:
        """Count ``conn`` as unauthenticated; at the cap, close the oldest such connection
        first (its thread sees the shutdown and ends)."""
        with self._lock:
            while len(self._unauthenticated) >= self.max_unauthenticated:
                oldest, who = next(iter(self._unauthenticated.items()))
                del self._unauthenticated[oldest]
                self.dropped_unauthenticated += 1
                try:
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                logger.warning("bootstrap: %d peers in the handshake (the most at once); closed "
                               "the oldest, %s", self.max_unauthenticated, who)
            self._unauthenticated[conn] = peer

    def _refuse(self, conn: socket.socket, peer: str, message: str) -> None:
        logger.error("bootstrap: refused frontend %s: %s", peer, message)
        self.refusals.append(message)
        try:
            conn.settimeout(1.0)  # best effort: a peer that does not read gets nothing
            send_message(conn, {"type": "refused", "error": message})
        except (OSError, HandshakeError):
            pass

    def _authenticate(self, conn: socket.socket, peer: str, hello: dict[str, Any],
                      deadline: float) -> bool:
        """Challenge–response: True if the peer proved it knows the secret (and the engine
        proved it to the peer); otherwise the peer got :data:`AUTH_REFUSAL` and nothing else."""
        frontend_nonce = hello.get("nonce")
        if not isinstance(frontend_nonce, str) or not 16 <= len(frontend_nonce) <= 256:
            self._refuse(conn, peer, AUTH_REFUSAL)
            return False
        engine_nonce = new_nonce()
        send_message(conn, {"type": "challenge", "nonce": engine_nonce,
                            "proof": engine_proof(self.secret, frontend_nonce, engine_nonce)},
                     deadline=deadline, peer=f"frontend {peer}")
        answer = recv_message(conn, f"frontend {peer}", deadline=deadline,
                              max_bytes=PRE_AUTH_MAX_BYTES)
        expected = frontend_proof(self.secret, engine_nonce, frontend_nonce)
        if answer["type"] != "auth" or not proofs_equal(expected, answer.get("proof")):
            self._refuse(conn, peer, AUTH_REFUSAL)
            return False
        return True

    def _take_lease(self, conn: socket.socket, who: str) -> str | None:
        """Make ``conn`` the frontend lease; the holder's description if another live one holds
        it. A holder whose connection is already closed (its frontend just died; its thread is
        about to see the EOF) does not count."""
        deadline = time.monotonic() + LEASE_RELEASE_WAIT_S
        while True:
            with self._lock:
                if self._lease is None or time.monotonic() >= deadline:
                    if self._lease is not None:
                        logger.warning("bootstrap: taking over the lease of %s (closed)", self._lease[1])
                    self._lease = (conn, who)
                    return None
                holder_conn, holder = self._lease
            if socket_peer_open(holder_conn):
                return holder
            time.sleep(0.01)

    def _release_lease(self, conn: socket.socket) -> None:
        with self._lock:
            held = self._lease is not None and self._lease[0] is conn
            if held:
                self._lease = None
        if held and self.on_doorbell is not None:
            self.on_doorbell(None)  # nobody left to wake

    def _doorbell_for(self, hello: dict[str, Any], who: str) -> bool:
        """Hand the engine the lease holder's doorbell, if it asked for one and it can have
        one (this host's frontend: the loopback transport). Whether it got it (the welcome
        says so); a name that is not a listener's is said in the log and ignored."""
        name = hello.get(doorbells.FIELD)
        if name is None or self.on_doorbell is None or self.region.kind != "loopback":
            return False
        if not doorbells.valid_name(name):
            logger.warning("bootstrap: frontend %s sent %r as its doorbell, which is no doorbell's "
                           "name; its ring poller keeps its timers", who, name)
            return False
        try:
            bell = doorbells.Doorbell(name)
        except OSError as exc:
            logger.warning("bootstrap: cannot reach frontend %s's doorbell (%s); its ring poller "
                           "keeps its timers", who, exc)
            return False
        self.on_doorbell(bell)
        return True

    def _serve_peer(self, conn: socket.socket, peer: str) -> None:
        set_thread_name("blink-bs-peer")
        session: Any = None
        role = "frontend"
        rung = False
        with self._lock:
            self._peers.add(conn)
        # One deadline for the whole handshake, whatever the peer trickles.
        deadline = time.monotonic() + self.timeout_s
        try:
            hello = recv_message(conn, f"frontend {peer}", deadline=deadline,
                                 max_bytes=PRE_AUTH_MAX_BYTES)
            if hello["type"] != "hello":
                self._refuse(conn, peer, f"expected a hello message, got {hello['type']!r}")
                return
            if not self._authenticate(conn, peer, hello, deadline):
                return
            with self._lock:
                self._unauthenticated.pop(conn, None)  # proved the secret: no longer capped
            version = hello.get("layout_version")
            if version != self.layout_version:
                self._refuse(conn, peer, version_mismatch_message(self.layout_version, version))
                return
            role = hello.get("role", "frontend")
            if role not in ROLES:
                self._refuse(conn, peer, f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
                return
            who = f"{peer} (pid {hello.get('pid')})"
            if role == "frontend":
                holder = self._take_lease(conn, who)
                if holder is not None:
                    self._refuse(conn, peer, (
                        f"another frontend, {holder}, is attached to this engine; an engine serves "
                        f"one frontend at a time (stop that one first: a new frontend can attach "
                        f"as soon as its connection closes)"))
                    return
                _enable_keepalive(conn)
            if role in ("kv_writer", "kv_region") and self.kv_region is None:
                self._refuse(conn, peer, "this engine has no KV region to write into (it was not "
                                         "started with --role decode)")
                return
            region = self.kv_region if role == "kv_region" else self.region
            assert region is not None
            offer, session = region.session_offer(hello)
            offer = {**self.extra, **offer}
            rung = role == "frontend" and self._doorbell_for(hello, who)
            if rung:
                offer[doorbells.FIELD] = True
            if role in ("kv_writer", "kv_region"):
                offer["kv_layout"] = self.kv_layout
            info = EngineInfo(
                layout_version=self.layout_version, transport=region.kind,
                total_bytes=region.total_bytes, model_name=self.model_name,
                max_model_len=self.max_model_len, tokenizer=self.tokenizer, connection=offer,
            )
            send_message(conn, info.to_message(), deadline=deadline, peer=f"frontend {peer}")
            if session is not None:
                msg = recv_message(conn, f"frontend {peer}", deadline=deadline)
                if msg["type"] != "connect":
                    self._refuse(conn, peer, f"expected a connect message, got {msg['type']!r}")
                    return
                reply = region.session_complete(session, msg)
                send_message(conn, {"type": "ready", **reply}, deadline=deadline,
                             peer=f"frontend {peer}")
            with self._lock:
                self.accepted += 1
            logger.info("bootstrap: %s %s attached%s", role, who,
                        ", its doorbell rung after each step" if rung else "")
            if role != "frontend" and session is None:
                return
            # The lease (and a verbs session) lives as long as the connection: wait for the
            # frontend to hang up.
            conn.settimeout(None)
            while not self._stop.is_set() and conn.recv(4096):
                pass
            logger.info("bootstrap: %s %s detached", role, who)
        except (HandshakeError, TransportError) as exc:
            logger.warning("bootstrap: handshake with %s failed: %s", peer, exc)
            if isinstance(exc, TransportError) and not isinstance(exc, HandshakeError):
                self._refuse(conn, peer, str(exc))
        except OSError as exc:
            logger.warning("bootstrap: connection to %s failed: %s", peer, exc)
        except Exception as exc:  # a peer thread never dies with a traceback nobody reads
            logger.error("bootstrap: handshake with %s failed: %s: %s", peer,
                         type(exc).__name__, exc)
        finally:
            self._release_lease(conn)
            if session is not None:
                (self.kv_region if role == "kv_region" else self.region).session_close(session)
            with self._lock:
                self._peers.discard(conn)
                self._unauthenticated.pop(conn, None)
            conn.close()


def _enable_keepalive(conn: socket.socket) -> None:
    """TCP keepalive on a lease: a frontend whose machine vanished (no FIN) is noticed in
    about a minute instead of the kernel's two hours."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:  # pragma: no cover - not fatal
        pass


# -- frontend side ----------------------------------------------------------------------------


def connect(
    host: str,
    port: int,
    *,
    secret: bytes | None = None,
    role: str = "frontend",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    layout_version: int = LAYOUT_VERSION,
    expect_transport: str | None = None,
    doorbell: str | None = None,
    **transport_options: Any,
) -> tuple[EngineInfo, Transport]:
    """Handshake with the engine at ``host:port`` and open the transport it offers.

    ``secret``: the bootstrap secret (without it every engine refuses, with a message that
    says how to pass it). ``role``: "frontend" (holds the engine's one frontend lease for as
    long as the transport is open), "monitor" (read-only tools; no lease), or a prefill
    engine's "kv_writer" (the ring, no lease) and "kv_region" (the decode engine's KV region
    instead of its ring, no lease).
    ``expect_transport`` ("loopback"/"verbs"), when given, must match what the engine serves.
    ``doorbell``: a :class:`~blink.transport.doorbell.DoorbellListener`'s name for the engine
    to ring after each step (a frontend on the engine's host; the welcome's ``doorbell`` says
    whether it will).
    ``transport_options`` go to the verbs transport (device, port, gid_index).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        raise HandshakeError(
            f"no Blink engine is listening at {where} (connection refused): start the engine "
            f"first, or check --engine-host/--engine-port"
        ) from None
    except (socket.timeout, OSError) as exc:
        raise HandshakeError(f"cannot reach the engine at {where}: {exc}") from None
    keep_open = False
    deadline = time.monotonic() + timeout_s  # the whole handshake, as on the engine's side
    try:
        nonce = new_nonce()
        send_message(sock, {
            "type": "hello", "layout_version": layout_version,
            "client": "blink-frontend", "pid": os.getpid(), "role": role, "nonce": nonce,
            **({doorbells.FIELD: doorbell} if doorbell is not None else {}),
        })
        reply = recv_message(sock, f"engine {where}", deadline=deadline)
        if reply["type"] == "refused":
            raise HandshakeError(f"the engine at {where} refused this frontend: {reply.get('error')}")
        if reply["type"] != "challenge":
            raise HandshakeError(f"bootstrap: engine {where} answered {reply['type']!r}, not a "
                                 f"challenge (an engine of an older Blink release?)")
        if secret is None:
            raise HandshakeError(
                f"the engine at {where} requires the bootstrap secret: pass "
                f"--bootstrap-secret-file FILE (the file 'blink engine' printed at start)"
            )
        engine_nonce = reply.get("nonce")
        if not isinstance(engine_nonce, str) or not proofs_equal(
                engine_proof(secret, nonce, engine_nonce), reply.get("proof")):
            raise HandshakeError(
                f"the endpoint at {where} could not prove it knows the bootstrap secret: it is "
                f"not this secret's engine (a different --bootstrap-secret-file?)"
            )
        send_message(sock, {"type": "auth", "proof": frontend_proof(secret, engine_nonce, nonce)})
        reply = recv_message(sock, f"engine {where}", deadline=deadline)
        if reply["type"] == "refused":
            raise HandshakeError(f"the engine at {where} refused this frontend: {reply.get('error')}")
        if reply["type"] != "welcome":
            raise HandshakeError(f"bootstrap: engine {where} answered {reply['type']!r}, not welcome")
        info = EngineInfo.from_message(reply)
        sock.settimeout(timeout_s)  # what the transport keeps using (the deadline changed it)
        if info.layout_version != layout_version:
            raise HandshakeError(version_mismatch_message(info.layout_version, layout_version))
        if expect_transport is not None and info.transport != expect_transport:
            raise HandshakeError(
                f"the engine at {where} serves the {info.transport} transport, but this frontend "
                f"was asked for --transport {expect_transport}"
            )
        if info.transport == "loopback":
            from blink.transport.loopback import LoopbackTransport

            region_name = info.connection.get("region_name")
            if not isinstance(region_name, str):
                raise HandshakeError("bootstrap: loopback welcome without a region_name")
            transport = LoopbackTransport(region_name, info.total_bytes,
                                          lease=sock if role == "frontend" else None)
            keep_open = role == "frontend"  # the connection is our lease on the engine
            return info, transport
        if info.transport == "verbs":
            from blink.transport.verbs import VerbsTransport

            transport = VerbsTransport(sock, info.connection, info.total_bytes, timeout_s=timeout_s,
                                       **transport_options)
            keep_open = True  # the engine keeps our queue pair while this connection lives
            return info, transport
        raise HandshakeError(
            f"the engine at {where} offers an unknown transport {info.transport!r} "
            f"(this frontend knows {', '.join(TRANSPORT_KINDS)})"
        )
    except OSError as exc:
        raise HandshakeError(f"bootstrap with the engine at {where} failed: {exc}") from None
    finally:
        if not keep_open:
            sock.close()
