"""ARK path selection: put concurrent KV transfers from one leaf on distinct spines.

A KV transfer between a prefill and a decode engine is an elephant flow (hundreds of MB, for
hundreds of milliseconds); two of them hashed onto the same leaf uplink each get half of it
while another uplink idles. ARK's observation is that such flows live long enough to pay for a
little coordination:

1. **Predict.** The sender knows (or believes it knows) its leaf's ECMP hash, so for every
   RoCEv2 UDP source port it can compute the spine the flow will cross
   (:class:`~blink.fabric.ecmp.EcmpFabric`).
2. **Choose.** :class:`PathPlanner` ranks the spines by how many known claims from the same
   source leaf hold them (then by claims on the spine's downlink to the destination leaf),
   and searches the port range for a port the hash sends to the best one.
3. **Reserve.** :class:`ArkProtocol` broadcasts a :class:`Claim` to every other sender and
   waits for each one's :class:`Ack`. Claims are stamped with a Lamport clock; when two
   claims for the same (leaf, spine) overlap, the one with the lower ``(stamp, sender,
   lease)`` key wins, a claim already held beats any pending one, and the loser withdraws
   and re-picks. Channels are FIFO, so once every ack is in, every claim that could beat
   this one is known: a rival sent before seeing ours arrives before its ack; a rival sent
   after seeing ours has a higher stamp (Lamport) and loses.
4. **Release.** When the transfer completes, :meth:`PathLease.release` broadcasts a
   :class:`Release`.

If every spine of the leaf is already held (more concurrent transfers than spines), the
transfer shares the least-held one without a contest (``PathLease.shared``).

:class:`ArkProtocol` does no I/O (messages in, messages out), so the same code runs over a
real bus (:class:`ArkAgent` with :mod:`blink.fabric.bus`) and inside the simulator. The KV
transfer side calls ``agent.choose_path(transfer) -> PathLease``, puts
``lease.udp_sport`` on its queue pair (:mod:`blink.fabric.roce`) and calls
``lease.release()`` when the last block is written.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable

from blink.fabric.ecmp import ROCE_SPORT_MAX, ROCE_SPORT_MIN, EcmpFabric
from blink.fabric.messages import Ack, Claim, Message, Release

if TYPE_CHECKING:
    from blink.fabric.bus import MessageBus

logger = logging.getLogger(__name__)

NUM_SPORTS = ROCE_SPORT_MAX - ROCE_SPORT_MIN + 1


class PathSelectionError(RuntimeError):
    """No path could be chosen or reserved (the message says why)."""


@dataclass(frozen=True)
class Transfer:
    """One KV transfer: from the prefill host to the decode host, ``nbytes`` long."""

    transfer_id: str
    src_host: int
    dst_host: int
    nbytes: int = 0


@dataclass(frozen=True)
class Outgoing:
    """A message to send: to one peer, or to every peer when ``to`` is ``None``."""

    to: str | None
    message: Message


# -- choosing a spine and a port -----------------------------------------------------------------


class PathPlanner:
    """Spine ranking and source-port search over the sender's belief about the fabric."""

    def __init__(self, belief: EcmpFabric) -> None:
        self.belief = belief

    def rank_spines(self, transfer: Transfer, claims: Iterable[Claim]) -> list[tuple[int, int, int]]:
        """``(uplink claims, downlink claims, spine)`` for every spine, best first.

        Ties rotate by the transfer id, so simultaneous claimers rarely pick the same spine.
        """
        topo = self.belief.topology
        src_leaf, dst_leaf = topo.leaf_of(transfer.src_host), topo.leaf_of(transfer.dst_host)
        up: Counter[int] = Counter()
        down: Counter[int] = Counter()
        for c in claims:
            if c.src_leaf == src_leaf:
                up[c.spine] += 1
            if c.dst_leaf == dst_leaf:
                down[c.spine] += 1
        offset = zlib.crc32(transfer.transfer_id.encode()) % topo.num_spines
        order = sorted(range(topo.num_spines),
                       key=lambda s: (up[s], down[s], (s - offset) % topo.num_spines))
        return [(up[s], down[s], s) for s in order]

    def source_port(self, transfer: Transfer, spine: int | None) -> int:
        """A RoCEv2 source port the (believed) hash sends this transfer to ``spine`` with."""
        start = zlib.crc32(transfer.transfer_id.encode()) % NUM_SPORTS
        if spine is None:
            return ROCE_SPORT_MIN + start
        for i in range(NUM_SPORTS):
            sport = ROCE_SPORT_MIN + (start + i) % NUM_SPORTS
            if self.belief.spine_for(transfer.src_host, transfer.dst_host, sport) == spine:
                return sport
        raise PathSelectionError(f"no RoCEv2 source port hashes to spine {spine} for {transfer}")


@dataclass
class PathLease:
    """A reserved path for one transfer. ``release()`` when the transfer is done (idempotent)."""

    lease_id: str
    transfer: Transfer
    spine: int | None
    udp_sport: int
    shared: bool = False
    attempts: int = 1
    _release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        callback, self._release = self._release, None
        if callback is not None:
            callback()


@dataclass
class _Pending:
    transfer: Transfer
    claim: Claim
    waiting: set[str]
    attempts: int = 1


class ArkProtocol:
    """One sender's side of ARK's reservation protocol, without I/O.

    Every method returns the :class:`Outgoing` messages the caller must send, in order, before
    it sends anything the next call returns (that order is what makes resolution sound).
    """

    def __init__(self, sender_id: str, planner: PathPlanner, peers: Iterable[str] = ()) -> None:
        self.sender_id = sender_id
        self.planner = planner
        self.peers: set[str] = set(peers) - {sender_id}
        self.clock = 0
        self.claims: dict[str, Claim] = {}  # every claim this sender knows of, its own included
        self._pending: dict[str, _Pending] = {}
        self._held: dict[str, PathLease] = {}
        self._ids = itertools.count()

    # membership

    def add_peer(self, peer: str) -> list[Outgoing]:
        """A sender joined: it gets our claims before anything else we send it."""
        if peer == self.sender_id or peer in self.peers:
            return []
        self.peers.add(peer)
        return [Outgoing(peer, c) for c in self.claims.values() if c.sender == self.sender_id]

    def remove_peer(self, peer: str) -> None:
        """A sender is gone: its claims go with it and nobody waits for its acks."""
        self.peers.discard(peer)
        for lease_id in [k for k, c in self.claims.items() if c.sender == peer]:
            del self.claims[lease_id]
        for pending in self._pending.values():
            pending.waiting.discard(peer)

    # the claimer's side

    def begin(self, transfer: Transfer) -> tuple[str, list[Outgoing]]:
        lease_id = f"{self.sender_id}/{next(self._ids)}"
        topo = self.planner.belief.topology
        if not topo.crosses_spine(transfer.src_host, transfer.dst_host):
            # within one leaf: no spine to reserve
            lease = PathLease(lease_id, transfer, None, self.planner.source_port(transfer, None))
            self._held[lease_id] = lease
            return lease_id, []
        pending = _Pending(transfer, None, set())  # type: ignore[arg-type]
        self._pending[lease_id] = pending
        return lease_id, self._claim(lease_id, pending)

    def _claim(self, lease_id: str, pending: _Pending) -> list[Outgoing]:
        transfer, topo = pending.transfer, self.planner.belief.topology
        others = [c for k, c in self.claims.items() if k != lease_id]
        uplink_claims, _, spine = self.planner.rank_spines(transfer, others)[0]
        self.clock += 1
        shared = uplink_claims > 0
        claim = Claim(lease_id, self.sender_id, self.clock, topo.leaf_of(transfer.src_host),
                      topo.leaf_of(transfer.dst_host), spine, held=shared, shared=shared)
        pending.claim = claim
        pending.waiting = set() if shared else set(self.peers)
        self.claims[lease_id] = claim
        return [Outgoing(None, claim)]

    def poll(self, lease_id: str) -> tuple[PathLease | None, list[Outgoing]]:
        """The lease once the claim is decided and won; else ``None`` and what to send."""
        if lease_id in self._held:
            return self._held[lease_id], []
        pending = self._pending.get(lease_id)
        if pending is None:
            raise PathSelectionError(f"unknown or released lease {lease_id!r}")
        if pending.waiting:
            return None, []
        own = pending.claim
        if not own.shared and self._beaten(own):
            # lost: withdraw, then claim again (the winner's claim now counts as held)
            self.clock += 1
            del self.claims[lease_id]
            out = [Outgoing(None, Release(lease_id, self.sender_id, self.clock))]
            pending.attempts += 1
            return None, out + self._claim(lease_id, pending)
        del self._pending[lease_id]
        out: list[Outgoing] = []
        if not own.held:
            self.clock += 1
            own = replace(own, held=True)
            self.claims[lease_id] = own
            out.append(Outgoing(None, own))
        lease = PathLease(lease_id, pending.transfer, own.spine,
                          self.planner.source_port(pending.transfer, own.spine),
                          shared=own.shared, attempts=pending.attempts)
        self._held[lease_id] = lease
        return lease, out

    def _beaten(self, own: Claim) -> bool:
        for c in self.claims.values():
            if (c.lease_id != own.lease_id and not c.shared and c.src_leaf == own.src_leaf
                    and c.spine == own.spine and (c.held or c.key < own.key)):
                return True
        return False

    def release(self, lease_id: str) -> list[Outgoing]:
        """The transfer is done (or abandoned): forget the claim and tell everyone."""
        self._held.pop(lease_id, None)
        self._pending.pop(lease_id, None)
        if self.claims.pop(lease_id, None) is None:
            return []
        self.clock += 1
        return [Outgoing(None, Release(lease_id, self.sender_id, self.clock))]

    # the receiver's side

    def receive(self, message: Message) -> list[Outgoing]:
        self.clock = max(self.clock, message.stamp) + 1
        if isinstance(message, Claim):
            if message.sender != self.sender_id:
                self.claims[message.lease_id] = message
            self.clock += 1
            return [Outgoing(message.sender, Ack(message.lease_id, self.sender_id, self.clock))]
        if isinstance(message, Release):
            claim = self.claims.get(message.lease_id)
            if claim is not None and claim.sender == message.sender:
                del self.claims[message.lease_id]
            return []
        pending = self._pending.get(message.lease_id)
        if pending is not None:
            pending.waiting.discard(message.sender)
        return []

    def waiting_on(self, lease_id: str) -> set[str]:
        """The peers whose ack this pending claim still waits for."""
        pending = self._pending.get(lease_id)
        return set(pending.waiting) if pending is not None else set()

    def held_leases(self) -> list[PathLease]:
        return list(self._held.values())


class ArkAgent:
    """ARK for one sender over a :class:`~blink.fabric.bus.MessageBus`: blocking calls.

    ``choose_path`` returns once the claim is decided (one broadcast and the acks: a
    round trip among the senders, amortised over a transfer of many milliseconds). A peer that
    does not answer within ``ack_timeout_s`` is logged and dropped from the peer set (its
    claims with it), so a crashed sender never blocks the others.
    """

    def __init__(self, bus: "MessageBus", belief: EcmpFabric, *, ack_timeout_s: float = 2.0) -> None:
        self.bus = bus
        self.ack_timeout_s = ack_timeout_s
        self._cond = threading.Condition()
        self._protocol = ArkProtocol(bus.sender_id, PathPlanner(belief), ())
        bus.start(self._on_message, self._on_peer)

    @property
    def sender_id(self) -> str:
        return self._protocol.sender_id

    def _send(self, out: list[Outgoing]) -> None:
        # called with the lock held: the bus only enqueues, and the order is the protocol's
        for item in out:
            if item.to is None:
                self.bus.broadcast(item.message)
            else:
                self.bus.send(item.to, item.message)

    def _on_message(self, message: Message) -> None:
        with self._cond:
            self._send(self._protocol.receive(message))
            self._cond.notify_all()

    def _on_peer(self, peer: str, joined: bool) -> None:
        with self._cond:
            if joined:
                self._send(self._protocol.add_peer(peer))
            else:
                self._protocol.remove_peer(peer)
            self._cond.notify_all()

    def choose_path(self, transfer: Transfer) -> PathLease:
        """Reserve a path for ``transfer``; see the module docstring."""
        with self._cond:
            lease_id, out = self._protocol.begin(transfer)
            self._send(out)
            deadline = time.monotonic() + self.ack_timeout_s
            while True:
                lease, out = self._protocol.poll(lease_id)
                self._send(out)
                if lease is not None:
                    lease._release = lambda: self._release(lease_id)
                    return lease
                if out:  # lost and re-claimed: a fresh round of acks
                    deadline = time.monotonic() + self.ack_timeout_s
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    silent = self._protocol.waiting_on(lease_id)
                    logger.warning("ARK %s: no ack from %s within %.1f s for %s; dropping them from the peer set",
                                   self.sender_id, ", ".join(sorted(silent)), self.ack_timeout_s, lease_id)
                    for peer in silent:
                        self._protocol.remove_peer(peer)
                    continue
                self._cond.wait(left)

    def _release(self, lease_id: str) -> None:
        with self._cond:
            self._send(self._protocol.release(lease_id))

    def wait_peers(self, peers: Iterable[str], timeout_s: float = 10.0) -> None:
        """Block until the protocol knows every sender in ``peers`` (start-up)."""
        want = set(peers) - {self.sender_id}
        with self._cond:
            if not self._cond.wait_for(lambda: want <= self._protocol.peers, timeout_s):
                missing = sorted(want - self._protocol.peers)
                raise TimeoutError(f"ARK {self.sender_id}: peers {', '.join(missing)} not joined after {timeout_s:.0f} s")

    def known_claims(self) -> list[Claim]:
        with self._cond:
            return list(self._protocol.claims.values())

    def close(self) -> None:
        self.bus.close()
