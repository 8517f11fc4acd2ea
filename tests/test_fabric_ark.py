"""ARK path selection (blink/fabric/ark.py) and its buses (blink/fabric/bus.py).

The protocol is driven here without I/O, under message interleavings hypothesis chooses (per
sender pair FIFO, as both buses guarantee), and for real over the in-process and TCP buses.
"""
from __future__ import annotations

import math
import random
import threading
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.fabric.ark import ArkAgent, ArkProtocol, PathPlanner, Transfer
from blink.fabric.messages import Ack, Claim, Release, message_from_dict, message_to_dict
from blink.fabric.bus import InProcessHub, TcpBus
from blink.fabric.ecmp import ROCE_SPORT_MAX, ROCE_SPORT_MIN, EcmpFabric, EcmpHash
from blink.fabric.topology import LeafSpine


def _fabric(spines: int, algorithm: str = "murmur3", seed: int = 7, leaves: int = 4, hosts: int | None = None):
    return EcmpFabric(LeafSpine(leaves, spines, hosts or spines), (EcmpHash(algorithm, seed),))


class Network:
    """ArkProtocol instances joined by FIFO channels; ``step(rng)`` delivers one message."""

    def __init__(self, fabric: EcmpFabric, senders: list[str]) -> None:
        self.protos = {s: ArkProtocol(s, PathPlanner(fabric), senders) for s in senders}
        self.channels: dict[tuple[str, str], deque] = {}
        self.waiting: dict[str, list[str]] = {s: [] for s in senders}
        self.leases: dict[str, object] = {}

    def send(self, sender: str, out) -> None:
        for item in out:
            targets = self.protos[sender].peers if item.to is None else {item.to}
            for peer in sorted(targets):
                self.channels.setdefault((sender, peer), deque()).append(message_to_dict(item.message))

    def poll(self, sender: str) -> None:
        for lease_id in list(self.waiting[sender]):
            lease, out = self.protos[sender].poll(lease_id)
            self.send(sender, out)
            if lease is not None:
                self.waiting[sender].remove(lease_id)
                self.leases[lease_id] = lease

    def begin(self, sender: str, transfer: Transfer) -> str:
        lease_id, out = self.protos[sender].begin(transfer)
        self.send(sender, out)
        self.waiting[sender].append(lease_id)
        self.poll(sender)
        return lease_id

    def step(self, rng: random.Random) -> bool:
        busy = [k for k, q in self.channels.items() if q]
        if not busy:
            return False
        src, dst = rng.choice(busy)
        wire = self.channels[(src, dst)].popleft()
        self.send(dst, self.protos[dst].receive(message_from_dict(wire)))
        self.poll(dst)
        return True

    def settle(self, rng: random.Random) -> None:
        while self.step(rng):
            pass
        assert not any(self.waiting.values()), "a claim was never decided"


def uplink_collisions(leases, truth: EcmpFabric) -> int:
    """Pairs of held leases from one leaf whose *actual* spine (the switch's hash) is the same."""
    seen: dict[tuple[int, int], int] = {}
    for lease in leases:
        t = lease.transfer
        key = (truth.topology.leaf_of(t.src_host), truth.spine_for(t.src_host, t.dst_host, lease.udp_sport))
        seen[key] = seen.get(key, 0) + 1
    return sum(n * (n - 1) // 2 for n in seen.values())


@settings(max_examples=60, deadline=None)
@given(spines=st.integers(2, 6), algorithm=st.sampled_from(["crc32", "murmur3"]), data=st.data())
def test_exact_hash_and_at_most_s_flows_per_leaf_give_zero_uplink_collisions(spines, algorithm, data):
    fabric = _fabric(spines, algorithm, seed=data.draw(st.integers(0, 2**32 - 1)), leaves=4, hosts=spines)
    senders = [f"h{h}" for h in range(2 * spines)]  # every host of leaves 0 and 1 sends
    per_leaf = data.draw(st.lists(st.integers(0, spines), min_size=2, max_size=2))
    transfers = []
    for leaf, count in enumerate(per_leaf):
        hosts = data.draw(st.lists(st.integers(0, spines - 1), min_size=count, max_size=count))
        for i, h in enumerate(hosts):
            src = leaf * spines + h
            dst = data.draw(st.integers(2 * spines, 4 * spines - 1))
            transfers.append(Transfer(f"t{leaf}.{i}", src, dst))
    rng = random.Random(data.draw(st.integers(0, 2**31)))
    net = Network(fabric, senders)
    order = list(transfers)
    rng.shuffle(order)
    for transfer in order:  # claims start while earlier ones are still in flight
        net.begin(f"h{transfer.src_host}", transfer)
        for _ in range(rng.randrange(4)):
            net.step(rng)
    net.settle(rng)
    assert len(net.leases) == len(transfers)
    assert not any(lease.shared for lease in net.leases.values())
    assert uplink_collisions(net.leases.values(), fabric) == 0
    for lease in net.leases.values():  # the predicted spine is where the switch sends it
        t = lease.transfer
        assert fabric.spine_for(t.src_host, t.dst_host, lease.udp_sport) == lease.spine
        assert ROCE_SPORT_MIN <= lease.udp_sport <= ROCE_SPORT_MAX


def test_simultaneous_claims_lowest_stamp_then_sender_wins_and_the_loser_repicks():
    fabric = _fabric(2, leaves=2, hosts=2)
    net = Network(fabric, ["h0", "h1"])
    # same transfer id -> same tie-break rotation -> both pick the same spine before hearing each other
    a = net.begin("h0", Transfer("same", 0, 2))
    b = net.begin("h1", Transfer("same", 1, 3))
    claim_a, claim_b = net.protos["h0"].claims[a], net.protos["h1"].claims[b]
    assert claim_a.spine == claim_b.spine and claim_a.stamp == claim_b.stamp
    net.settle(random.Random(0))
    lease_a, lease_b = net.leases[a], net.leases[b]
    assert (lease_a.attempts, lease_b.attempts) == (1, 2)  # equal stamps: sender "h0" < "h1"
    assert lease_a.spine == claim_a.spine != lease_b.spine
    # everyone agrees on the table: two held claims
    for proto in net.protos.values():
        assert sorted((c.sender, c.spine, c.held) for c in proto.claims.values()) == [
            ("h0", lease_a.spine, True), ("h1", lease_b.spine, True)]


def test_release_frees_the_spine_for_the_next_transfer():
    fabric = _fabric(2, leaves=2, hosts=2)
    net = Network(fabric, ["h0", "h1"])
    first = net.begin("h0", Transfer("x", 0, 2))
    net.settle(random.Random(0))
    spine = net.leases[first].spine
    net.send("h0", net.protos["h0"].release(first))
    net.settle(random.Random(0))
    assert net.protos["h1"].claims == {} and net.protos["h0"].claims == {}
    # with h0's spine free again, h1 may take it; with it held h1 would have to avoid it
    held = net.begin("h0", Transfer("y", 0, 2))
    net.settle(random.Random(0))
    other = net.begin("h1", Transfer("z", 1, 3))
    net.settle(random.Random(0))
    assert net.leases[other].spine != net.leases[held].spine
    assert spine in (0, 1)


def test_more_flows_than_spines_share_without_contest():
    fabric = _fabric(2, leaves=2, hosts=3)
    net = Network(fabric, ["h0"])
    ids = [net.begin("h0", Transfer(f"t{i}", 0, 3)) for i in range(3)]
    net.settle(random.Random(0))
    leases = [net.leases[i] for i in ids]
    assert sorted(lease.spine for lease in leases[:2]) == [0, 1]
    assert leases[2].shared and not leases[0].shared


def test_same_leaf_transfer_needs_no_spine():
    fabric = _fabric(4)
    net = Network(fabric, ["h0", "h1"])
    lease_id = net.begin("h0", Transfer("local", 0, 1))
    assert net.leases[lease_id].spine is None and not net.channels


def test_a_late_joiner_learns_existing_claims_before_claiming():
    fabric = _fabric(2, leaves=2, hosts=2)
    a = ArkProtocol("h0", PathPlanner(fabric))
    lease_id, _ = a.begin(Transfer("early", 0, 2))
    lease, _ = a.poll(lease_id)  # no peers yet: decided at once
    b = ArkProtocol("h1", PathPlanner(fabric))
    out = a.add_peer("h1")
    assert [o.message for o in out] == [a.claims[lease_id]] and a.claims[lease_id].held
    for o in out:
        b.receive(o.message)
    b_id, _ = b.begin(Transfer("late", 1, 3))
    assert b.claims[b_id].spine != lease.spine


def test_messages_round_trip_and_malformed_ones_are_refused():
    for m in (Claim("a/1", "a", 3, 0, 1, 2, held=True), Ack("a/1", "b", 4), Release("a/1", "a", 5)):
        assert message_from_dict(message_to_dict(m)) == m
    with pytest.raises(ValueError, match="unknown or missing type"):
        message_from_dict({"type": "nope"})
    with pytest.raises(ValueError, match="missing field 'stamp'"):
        message_from_dict({"type": "ark.ack", "lease_id": "x", "sender": "b"})
    with pytest.raises(ValueError, match="stamp must be int"):
        message_from_dict({"type": "ark.ack", "lease_id": "x", "sender": "b", "stamp": "1"})
    with pytest.raises(ValueError, match="held must be bool"):
        message_from_dict({"type": "ark.claim", "lease_id": "x", "sender": "b", "stamp": 1, "src_leaf": 0,
                           "dst_leaf": 1, "spine": 0, "held": 1})


# -- ECMP's collisions: the birthday bound; ARK with a wrong seed ------------------------------


def _collision_rate(truth: EcmpFabric, belief: EcmpFabric | None, k: int, trials: int, seed: int) -> float:
    """Share of trials in which k concurrent transfers from leaf 0 put two on one uplink.
    ``belief=None``: ECMP (random source ports); else ARK steering by ``belief``."""
    rng = random.Random(seed)
    spines = truth.topology.num_spines
    planner = PathPlanner(belief) if belief is not None else None
    hits = 0
    for trial in range(trials):
        used = []
        for i in range(k):
            t = Transfer(f"{seed}.{trial}.{i}", i % truth.topology.hosts_per_leaf,
                         truth.topology.hosts_per_leaf + rng.randrange(truth.topology.hosts_per_leaf))
            sport = rng.randint(ROCE_SPORT_MIN, ROCE_SPORT_MAX) if planner is None else planner.source_port(t, i % spines)
            used.append(truth.spine_for(t.src_host, t.dst_host, sport))
        hits += len(set(used)) < k
    return hits / trials


def birthday(k: int, spines: int) -> float:
    return 1 - math.perm(spines, k) / spines**k


@pytest.mark.parametrize("algorithm", ["crc32", "murmur3"])
@pytest.mark.parametrize("spines, k", [(4, 2), (4, 4), (8, 3)])
def test_ecmp_collision_rate_matches_the_birthday_bound(algorithm, spines, k):
    truth = _fabric(spines, algorithm, seed=99, leaves=2, hosts=8)
    trials = 600
    rate = _collision_rate(truth, None, k, trials, seed=spines * 10 + k)
    p = birthday(k, spines)
    sigma = math.sqrt(p * (1 - p) / trials)
    assert abs(rate - p) < 5 * sigma + 1e-9, (rate, p)  # fixed seeds: deterministic


@pytest.mark.parametrize("spines", [3, 4, 6])
def test_ark_with_a_wrong_murmur_seed_degrades_to_ecmp_not_worse(spines):
    truth = _fabric(spines, "murmur3", seed=99, leaves=2, hosts=spines)
    wrong = _fabric(spines, "murmur3", seed=12345, leaves=2, hosts=spines)
    trials = 400
    exact = _collision_rate(truth, truth, spines, trials, seed=1)
    wrong_rate = _collision_rate(truth, wrong, spines, trials, seed=1)
    p = birthday(spines, spines)
    sigma = math.sqrt(p * (1 - p) / trials)
    assert exact == 0.0
    assert wrong_rate > 0.5 * p  # it does lose its advantage...
    assert wrong_rate < p + 5 * sigma  # ...but is no worse than random placement


def test_crc_seed_is_a_relabelling_for_power_of_two_groups():
    # CRC is affine in its initial register: a wrong seed XORs one constant into every hash of
    # a same-length key, so with 2**n uplinks it permutes them and ARK still never collides;
    # with 3 or 6 uplinks (mod is not compatible with XOR) it degrades like murmur.
    for spines, expect_zero in ((4, True), (8, True), (3, False), (6, False)):
        truth = _fabric(spines, "crc32", seed=99, leaves=2, hosts=spines)
        wrong = _fabric(spines, "crc32", seed=12345, leaves=2, hosts=spines)
        rate = _collision_rate(truth, wrong, spines, 200, seed=2)
        assert (rate == 0.0) == expect_zero, (spines, rate)


# -- the blocking agent over real buses ------------------------------------------------------


def _concurrent_choose(agents, transfers):
    leases = [None] * len(transfers)
    def go(i):
        leases[i] = agents[i].choose_path(transfers[i])
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(transfers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert all(lease is not None for lease in leases)
    return leases


def test_agents_over_the_in_process_bus():
    fabric = _fabric(4, "crc32", leaves=2, hosts=4)
    hub = InProcessHub()
    ids = [f"h{i}" for i in range(4)]
    agents = [ArkAgent(hub.join(i), fabric) for i in ids]
    try:
        for a in agents:
            a.wait_peers(ids)
        leases = _concurrent_choose(agents, [Transfer("same", i, 4 + i) for i in range(4)])
        assert sorted(lease.spine for lease in leases) == [0, 1, 2, 3]
        assert uplink_collisions(leases, fabric) == 0
        for lease in leases:
            lease.release()
            lease.release()  # idempotent
        deadline = threading.Event()
        for _ in range(100):
            if not any(a.known_claims() for a in agents):
                break
            deadline.wait(0.02)
        assert not any(a.known_claims() for a in agents)
    finally:
        for a in agents:
            a.close()


def test_agents_over_tcp_and_a_lost_peer_does_not_block_the_rest():
    fabric = _fabric(4, "murmur3", leaves=2, hosts=4)
    ids = [f"h{i}" for i in range(4)]
    buses = [TcpBus(i, listen=("127.0.0.1", 0)) for i in ids]
    members = {b.sender_id: b.address for b in buses}
    for b in buses:
        b.set_members(members)
    agents = [ArkAgent(b, fabric, ack_timeout_s=5.0) for b in buses]
    try:
        for b in buses:
            b.wait_connected()
        for a in agents:
            a.wait_peers(ids)
        leases = _concurrent_choose(agents, [Transfer(f"t{i}", i, 4 + i) for i in range(4)])
        assert uplink_collisions(leases, fabric) == 0
        agents[3].close()
        for _ in range(100):
            if "h3" not in agents[0]._protocol.peers:
                break
            threading.Event().wait(0.02)
        assert "h3" not in agents[0]._protocol.peers
        assert all(c.sender != "h3" for c in agents[0].known_claims())  # its claims went with it
        leases[0].release()
        lease = agents[0].choose_path(Transfer("after", 0, 5))  # would wait 5 s if h3 were awaited
        assert lease.spine != leases[1].spine and lease.spine != leases[2].spine
    finally:
        for a in agents[:3]:
            a.close()


def test_a_held_claim_beats_a_pending_one_with_a_lower_stamp():
    # a joiner's clock starts low: its claim must still lose to a transfer already running
    fabric = _fabric(2, leaves=2, hosts=2)
    old = ArkProtocol("z", PathPlanner(fabric))
    for i in range(5):  # run the clock up
        old.release(old.begin(Transfer(f"warm{i}", 0, 2))[0])
    held_id, _ = old.begin(Transfer("same", 0, 2))
    held, _ = old.poll(held_id)
    joiner = ArkProtocol("a", PathPlanner(fabric))
    new_id, claim_out = joiner.begin(Transfer("same", 1, 3))  # not yet heard of z: same spine
    assert joiner.claims[new_id].spine == held.spine and joiner.claims[new_id].stamp < old.claims[held_id].stamp
    joiner.add_peer("z")
    for o in old.add_peer("a"):  # state transfer, then z's ack of the joiner's claim
        joiner.receive(o.message)
    for o in claim_out:
        for reply in old.receive(o.message):
            joiner.receive(reply.message)
    lease, out = joiner.poll(new_id)
    assert lease is None and any(isinstance(o.message, Release) for o in out)  # lost, re-claimed
    assert joiner.claims[new_id].spine != held.spine


def test_a_silent_peer_is_dropped_after_the_ack_timeout(caplog):
    # a member that joined the bus but never answers (hung process): the claim goes ahead
    fabric = _fabric(2, leaves=2, hosts=2)
    hub = InProcessHub()
    agent = ArkAgent(hub.join("h0"), fabric, ack_timeout_s=0.2)
    silent = hub.join("h1")
    silent.start(lambda m: None, lambda p, j: None)  # receives, never acks
    try:
        agent.wait_peers(["h1"])
        with caplog.at_level("WARNING", logger="blink.fabric.ark"):
            lease = agent.choose_path(Transfer("t", 0, 2))
        assert lease.spine in (0, 1) and "no ack from h1 within 0.2 s" in caplog.text
        assert "h1" not in agent._protocol.peers
    finally:
        agent.close()
        silent.close()
