"""The message bus ARK's senders broadcast claims on: FIFO per pair of senders, asynchronous.

:class:`MessageBus` is what :class:`~blink.fabric.ark.ArkAgent` needs: ``send``/``broadcast``
only enqueue (they never block on a peer and never call a handler on the caller's thread),
messages from one sender reach a given receiver in the order they were sent, and the bus
reports peers joining and leaving. Two implementations:

- :class:`InProcessHub` / :class:`InProcessBus`: senders in one process (tests, the
  offline engine); every message still goes through its wire form.
- :class:`TcpBus`: one TCP connection per pair of senders (the lower id dials, the higher
  accepts), length-prefixed JSON frames (:mod:`blink.transport.framing`), a reader and a
  writer thread per connection; a dropped connection is a peer leaving, and the dialer keeps
  redialling so a restarted peer rejoins. Bind to localhost or a private control network:
  the frames carry no secret.

Every bus thread carries the OS name ``blink-ark`` (its role for the thread policy,
docs/threads.md).
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
from abc import ABC, abstractmethod
from typing import Callable

from blink.fabric.messages import Message, message_from_dict, message_to_dict
from blink.transport.base import HandshakeError
from blink.threads.roles import set_thread_name
from blink.transport.framing import recv_message, send_message

logger = logging.getLogger(__name__)

OnMessage = Callable[[Message], None]
OnPeer = Callable[[str, bool], None]  # (peer id, joined)


class MessageBus(ABC):
    """One sender's end of the bus."""

    sender_id: str

    @abstractmethod
    def start(self, on_message: OnMessage, on_peer: OnPeer) -> None:
        """Begin delivering: ``on_message`` for each message, ``on_peer`` for membership."""

    @abstractmethod
    def peers(self) -> set[str]:
        """The peers currently reachable."""

    @abstractmethod
    def send(self, peer: str, message: Message) -> None:
        """Enqueue ``message`` for ``peer`` (dropped if the peer is gone: it left)."""

    def broadcast(self, message: Message) -> None:
        for peer in sorted(self.peers()):
            self.send(peer, message)

    @abstractmethod
    def close(self) -> None:
        """Leave the bus; peers see this sender leave."""


class _Inbox:
    """A queue of deliveries and the thread that runs them, in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        self._queue.put(job)

    def _run(self) -> None:
        set_thread_name("blink-ark")
        while (job := self._queue.get()) is not None:
            try:
                job()
            except Exception:  # a handler bug must not kill delivery for everyone else
                logger.exception("ARK bus: a message handler failed")

    def stop(self) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


class InProcessHub:
    """Senders in one process. ``hub.join(id)`` gives each its :class:`InProcessBus`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, InProcessBus] = {}

    def join(self, sender_id: str) -> "InProcessBus":
        with self._lock:
            if sender_id in self._members:
                raise ValueError(f"sender id {sender_id!r} already joined this hub")
            bus = InProcessBus(self, sender_id)
            self._members[sender_id] = bus
            return bus

    def _started(self, bus: "InProcessBus") -> None:
        with self._lock:
            others = [m for m in self._members.values() if m is not bus and m.inbox is not None]
            for other in others:
                other._deliver_peer(bus.sender_id, True)
                bus._deliver_peer(other.sender_id, True)

    def _left(self, bus: "InProcessBus") -> None:
        with self._lock:
            self._members.pop(bus.sender_id, None)
            for other in self._members.values():
                other._deliver_peer(bus.sender_id, False)

    def _route(self, sender: str, peer: str, wire: dict) -> None:
        with self._lock:
            target = self._members.get(peer)
            if target is not None and target.inbox is not None and sender in target._peers:
                target.inbox.put(lambda: target._on_message(message_from_dict(wire)))


class InProcessBus(MessageBus):
    def __init__(self, hub: InProcessHub, sender_id: str) -> None:
        self.hub, self.sender_id = hub, sender_id
        self.inbox: _Inbox | None = None
        self._peers: set[str] = set()
        self._on_message: OnMessage = lambda m: None
        self._on_peer: OnPeer = lambda p, j: None

    def start(self, on_message: OnMessage, on_peer: OnPeer) -> None:
        self._on_message, self._on_peer = on_message, on_peer
        self.inbox = _Inbox(f"ark-bus-{self.sender_id}")
        self.hub._started(self)

    def _deliver_peer(self, peer: str, joined: bool) -> None:
        # membership changes when the event is queued, so messages queued after it are kept
        if joined:
            self._peers.add(peer)
        else:
            self._peers.discard(peer)
        assert self.inbox is not None
        self.inbox.put(lambda: self._on_peer(peer, joined))

    def peers(self) -> set[str]:
        return set(self._peers)

    def send(self, peer: str, message: Message) -> None:
        self.hub._route(self.sender_id, peer, message_to_dict(message))

    def close(self) -> None:
        self.hub._left(self)
        if self.inbox is not None:
            self.inbox.stop()


class _Connection:
    """One TCP connection to one peer: a writer thread draining a queue, a reader thread."""

    def __init__(self, bus: "TcpBus", peer: str, sock: socket.socket) -> None:
        self.bus, self.peer, self.sock = bus, peer, sock
        self.outbox: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self.closed = threading.Event()

    def start(self) -> None:
        bus, peer = self.bus, self.peer
        threading.Thread(target=self._write_loop, name=f"ark-tx-{bus.sender_id}-{peer}", daemon=True).start()
        threading.Thread(target=self._read_loop, name=f"ark-rx-{bus.sender_id}-{peer}", daemon=True).start()

    def _write_loop(self) -> None:
        set_thread_name("blink-ark")
        while (wire := self.outbox.get()) is not None:
            try:
                send_message(self.sock, wire)
            except OSError:
                break
        self.shutdown()

    def _read_loop(self) -> None:
        set_thread_name("blink-ark")
        try:
            while True:
                wire = recv_message(self.sock, f"ARK peer {self.peer}")
                message = message_from_dict(wire)
                self.bus._inbox.put(lambda m=message: self.bus._on_message(m))
        except (HandshakeError, OSError, ValueError) as exc:
            if not self.closed.is_set() and not self.bus._closing.is_set():
                logger.warning("ARK bus %s: peer %s left (its connection closed or broke: %s); its claims are dropped",
                               self.bus.sender_id, self.peer, exc)
        self.shutdown()
        self.bus._connection_lost(self)

    def shutdown(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpBus(MessageBus):
    """The bus over TCP among a fixed set of senders (``members``: id -> (host, port)).

    Each member listens on its own address; :meth:`wait_connected` blocks until every other
    member is connected (start-up), after which a member that drops is reported as leaving
    and, when it comes back, as joining again.
    """

    def __init__(self, sender_id: str, members: dict[str, tuple[str, int]] | None = None, *,
                 listen: tuple[str, int] | None = None, redial_s: float = 0.2) -> None:
        self.sender_id, self.redial_s = sender_id, redial_s
        self.members: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._connections: dict[str, _Connection] = {}
        self._connected = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._on_message: OnMessage = lambda m: None
        self._on_peer: OnPeer = lambda p, j: None
        if listen is None:
            if members is None or sender_id not in members:
                raise ValueError(f"TcpBus {sender_id!r}: give its listen address, or members that include it")
            listen = members[sender_id]
        self._listener = socket.create_server(listen)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        if members is not None:
            self.set_members(members)
        self._inbox = _Inbox(f"ark-bus-{sender_id}")

    def set_members(self, members: dict[str, tuple[str, int]]) -> None:
        """Every sender's listen address (this one's included); before :meth:`start`."""
        if self.sender_id not in members:
            raise ValueError(f"sender id {self.sender_id!r} is not among the members {sorted(members)}")
        self.members = {**members, self.sender_id: self.address}

    def start(self, on_message: OnMessage, on_peer: OnPeer) -> None:
        self._on_message, self._on_peer = on_message, on_peer
        threading.Thread(target=self._accept_loop, name=f"ark-accept-{self.sender_id}", daemon=True).start()
        for peer in self.members:
            if peer > self.sender_id:
                threading.Thread(target=self._dial_loop, args=(peer,), name=f"ark-dial-{self.sender_id}-{peer}",
                                 daemon=True).start()

    def _accept_loop(self) -> None:
        set_thread_name("blink-ark")
        while not self._closing.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            try:
                sock.settimeout(5.0)
                hello = recv_message(sock, "ARK peer")
                peer = hello.get("sender")
                if hello.get("type") != "ark.hello" or peer not in self.members or not peer < self.sender_id:
                    raise HandshakeError(f"unexpected hello {hello!r:.200}")
                sock.settimeout(None)
            except (HandshakeError, OSError) as exc:
                logger.warning("ARK bus %s: refused a connection (%s)", self.sender_id, exc)
                sock.close()
                continue
            self._add(peer, sock)

    def _dial_loop(self, peer: str) -> None:
        set_thread_name("blink-ark")
        while not self._closing.is_set():
            with self._lock:
                up = peer in self._connections
            if not up:
                try:
                    sock = socket.create_connection(self.members[peer], timeout=5.0)
                    send_message(sock, {"type": "ark.hello", "sender": self.sender_id})
                    sock.settimeout(None)
                    self._add(peer, sock)
                except OSError:
                    pass
            self._closing.wait(self.redial_s)

    def _add(self, peer: str, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closing.is_set():
                sock.close()
                return
            old = self._connections.get(peer)
            if old is not None:
                old.shutdown()
            conn = self._connections[peer] = _Connection(self, peer, sock)
            # the join is queued before the reader starts: it precedes this peer's messages
            self._inbox.put(lambda: self._on_peer(peer, True))
            conn.start()
            self._connected.notify_all()

    def _connection_lost(self, conn: _Connection) -> None:
        with self._lock:
            if self._connections.get(conn.peer) is not conn:
                return
            del self._connections[conn.peer]
        self._inbox.put(lambda: self._on_peer(conn.peer, False))

    def wait_connected(self, timeout_s: float = 10.0) -> None:
        """Block until every member is connected; ``TimeoutError`` naming the missing ones."""
        others = set(self.members) - {self.sender_id}
        with self._connected:
            if not self._connected.wait_for(lambda: others <= set(self._connections), timeout_s):
                missing = sorted(others - set(self._connections))
                raise TimeoutError(f"ARK bus {self.sender_id}: no connection to {', '.join(missing)} "
                                   f"after {timeout_s:.0f} s")

    def peers(self) -> set[str]:
        with self._lock:
            return set(self._connections)

    def send(self, peer: str, message: Message) -> None:
        with self._lock:
            conn = self._connections.get(peer)
        if conn is not None:
            conn.outbox.put(message_to_dict(message))

    def close(self) -> None:
        self._closing.set()
        try:  # wakes the accept thread (close alone leaves the socket listening on Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._connections.values())
            self._connections.clear()
        for conn in conns:
            conn.shutdown()
        self._inbox.stop()
