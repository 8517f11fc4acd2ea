"""An event-driven flow-level simulator of a leaf-spine fabric: max-min fair rates.

Between two events every active flow sends at a constant rate; the rates are the max-min fair
allocation over the links the flows cross (progressive filling: raise all rates together, and
freeze the flows of a link when it fills). Events are flow arrivals, flow completions, ARK
control messages (delivered after ``control_latency_s``) and PLB's periodic checks. This is
the fluid model of well-behaved congestion control (DCQCN converging to fair shares): it has
no queues, no packet loss, no PFC pauses, no slow start, so it shows the effect of *where*
flows go, not of how RDMA reacts at the packet level.

Path policies (:class:`Policy`):

- ``ecmp``: a random RoCEv2 source port per transfer (what a queue pair gets by default);
  the switches' hash places it.
- ``ark``: :class:`~blink.fabric.ark.ArkProtocol` per prefill host (the real protocol code),
  its messages delayed by ``control_latency_s``; the transfer starts when its claim is decided.
  ``belief`` is ARK's model of the switch hash (a wrong seed makes its predictions wrong).
- ``plb``: ECMP, then every ``plb_interval_s`` a flow whose bottleneck is a fabric link
  shared with another flow counts a congested round; after ``plb_rounds`` in a row it takes a
  new random source port (re-hash), like Google's PLB re-pathing on persistent ECN marks.
- ``oracle``: global knowledge: each transfer takes the spine with the fewest flows on its
  uplink and downlink (ties: fewer on both together), instantly.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from blink.fabric.ark import ArkProtocol, Outgoing, PathPlanner, Transfer
from blink.fabric.messages import Message
from blink.fabric.ecmp import ROCE_SPORT_MAX, ROCE_SPORT_MIN, EcmpFabric
from blink.fabric.sim.workload import FlowSpec
from blink.fabric.topology import Link

POLICIES = ("ecmp", "ark", "plb", "oracle")


@dataclass
class Flow:
    spec: FlowSpec
    remaining: float
    spine: int | None = None
    sport: int = 0
    links: tuple[Link, ...] = ()
    rate: float = 0.0
    start: float = math.nan
    finish: float = math.nan
    bottleneck: Link | None = None
    congested_rounds: int = 0
    repaths: int = 0
    lease_id: str = ""


@dataclass(frozen=True)
class FlowResult:
    fid: int
    nbytes: int
    arrival: float
    start: float  # when bytes began to move (ARK: after its claim was decided)
    finish: float
    spine: int | None
    repaths: int
    prefill_s: float

    @property
    def fct(self) -> float:
        """Flow completion time, from when the transfer could start."""
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        """Prefill compute + the transfer: the time to first token the decode side sees."""
        return self.prefill_s + self.fct


def max_min_rates(flows: list[Flow], capacity: dict[Link, float]) -> None:
    """Set ``rate`` and ``bottleneck`` of every flow to the max-min fair allocation."""
    left = dict(capacity)
    on_link: dict[Link, list[Flow]] = {}
    for f in flows:
        f.rate, f.bottleneck = 0.0, None
        for link in f.links:
            on_link.setdefault(link, []).append(f)
    unfrozen = {id(f) for f in flows}
    counts = {link: len(fs) for link, fs in on_link.items()}
    while unfrozen:
        link = min((lk for lk, n in counts.items() if n > 0), key=lambda lk: left[lk] / counts[lk])
        share = left[link] / counts[link]
        for f in on_link[link]:
            if id(f) not in unfrozen:
                continue
            unfrozen.discard(id(f))
            f.rate, f.bottleneck = share, link
            for other in f.links:
                left[other] -= share
                counts[other] -= 1


class FlowSimulator:
    def __init__(self, truth: EcmpFabric, policy: str, specs: list[FlowSpec], *, belief: EcmpFabric | None = None,
                 control_latency_s: float = 10e-6, plb_interval_s: float = 1e-3, plb_rounds: int = 3,
                 seed: int = 1, ecmp_sport: Callable[[FlowSpec], int] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.truth, self.topology, self.policy = truth, truth.topology, policy
        self.specs = sorted(specs, key=lambda s: s.arrival)
        self.control_latency_s = control_latency_s
        self.plb_interval_s, self.plb_rounds = plb_interval_s, plb_rounds
        self.rng = np.random.default_rng(seed)
        # the source port a queue pair gets without ARK (default: uniformly random)
        self.ecmp_sport = ecmp_sport or (lambda spec: self._random_sport())
        self.now = 0.0
        self.active: list[Flow] = []
        self.done: list[Flow] = []
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._capacity: dict[Link, float] = {}
        self._dirty = False
        self.control_messages = 0
        if policy == "ark":
            planner = PathPlanner(belief or truth)
            senders = sorted({s.src for s in specs})
            self._ark = {h: ArkProtocol(f"h{h}", planner, (f"h{p}" for p in senders)) for h in senders}
            self._ark_waiting: dict[str, Flow] = {}

    # events

    def _push(self, t: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def run(self) -> list[FlowResult]:
        for spec in self.specs:
            self._push(spec.arrival, "arrival", spec)
        if self.policy == "plb":
            self._push(self.plb_interval_s, "plb", None)
        while self._events or self.active:
            t_event = self._events[0][0] if self._events else math.inf
            t_done = min((self.now + f.remaining / f.rate for f in self.active if f.rate > 0), default=math.inf)
            if t_event == math.inf and t_done == math.inf:
                raise RuntimeError("flow simulator: active flows but none can progress")
            t = min(t_event, t_done)
            for f in self.active:
                f.remaining -= f.rate * (t - self.now)
            self.now = t
            if t_done <= t_event:
                self._complete()
            else:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "plb" and not self.active and not any(k != "plb" for _, _, k, _ in self._events):
                    continue  # nothing left to watch
                getattr(self, f"_on_{kind}")(payload)
            if self._dirty:
                max_min_rates(self.active, self._capacity)
                self._dirty = False
        return [FlowResult(f.spec.fid, f.spec.nbytes, f.spec.arrival, f.start, f.finish, f.spine, f.repaths,
                           f.spec.prefill_s) for f in sorted(self.done, key=lambda f: f.spec.fid)]

    def _complete(self) -> None:
        # a flow is done when what is left would take under a nanosecond (float drift)
        finished = [f for f in self.active if f.rate > 0 and f.remaining <= f.rate * 1e-9]
        for f in finished:
            self.active.remove(f)
            f.finish, f.remaining = self.now, 0.0
            self.done.append(f)
            if self.policy == "ark":
                self._ark_send(f.spec.src, self._ark[f.spec.src].release(f.lease_id))
        self._dirty = True

    def _start(self, flow: Flow, sport: int) -> None:
        flow.sport = sport
        flow.spine = self.truth.spine_for(flow.spec.src, flow.spec.dst, sport)
        flow.links = self.topology.path(flow.spec.src, flow.spec.dst, flow.spine)
        for link in flow.links:
            self._capacity.setdefault(link, self.topology.capacity(link))
        flow.start = self.now
        self.active.append(flow)
        self._dirty = True

    def _random_sport(self) -> int:
        return int(self.rng.integers(ROCE_SPORT_MIN, ROCE_SPORT_MAX + 1))

    def _on_arrival(self, spec: FlowSpec) -> None:
        flow = Flow(spec, float(spec.nbytes))
        if self.policy in ("ecmp", "plb"):
            self._start(flow, self.ecmp_sport(spec))
        elif self.policy == "oracle":
            self._start(flow, self._oracle_sport(spec))
        else:
            proto = self._ark[spec.src]
            lease_id, out = proto.begin(Transfer(f"f{spec.fid}", spec.src, spec.dst, spec.nbytes))
            flow.lease_id = lease_id
            self._ark_waiting[lease_id] = flow
            self._ark_send(spec.src, out)
            self._ark_poll(spec.src, lease_id)

    # oracle

    def _oracle_sport(self, spec: FlowSpec) -> int:
        topo = self.topology
        src_leaf, dst_leaf = topo.leaf_of(spec.src), topo.leaf_of(spec.dst)
        up = [0] * topo.num_spines
        down = [0] * topo.num_spines
        for f in self.active:
            if f.spine is None:
                continue
            if topo.leaf_of(f.spec.src) == src_leaf:
                up[f.spine] += 1
            if topo.leaf_of(f.spec.dst) == dst_leaf:
                down[f.spine] += 1
        spine = min(range(topo.num_spines), key=lambda s: (max(up[s], down[s]), up[s] + down[s], s))
        planner = PathPlanner(self.truth)
        return planner.source_port(Transfer(f"f{spec.fid}", spec.src, spec.dst), spine)

    # PLB

    def _on_plb(self, _: Any) -> None:
        fabric_kinds = ("up", "down")
        shared: dict[Link, int] = {}
        for f in self.active:
            for link in f.links:
                shared[link] = shared.get(link, 0) + 1
        for f in list(self.active):
            b = f.bottleneck
            if b is not None and b.kind in fabric_kinds and shared[b] > 1:
                f.congested_rounds += 1
            else:
                f.congested_rounds = 0
            if f.congested_rounds >= self.plb_rounds:
                f.congested_rounds = 0
                f.repaths += 1
                self.active.remove(f)
                self._start_keep(f, self._random_sport())
        self._push(self.now + self.plb_interval_s, "plb", None)

    def _start_keep(self, flow: Flow, sport: int) -> None:
        start = flow.start
        self._start(flow, sport)
        flow.start = start

    # ARK: the real protocol, messages delayed by the control latency

    def _ark_send(self, src: int, out: list[Outgoing]) -> None:
        sender = f"h{src}"
        for item in out:
            targets = self._ark[src].peers if item.to is None else {item.to}
            for peer in sorted(targets):
                self.control_messages += 1
                self._push(self.now + self.control_latency_s, "message", (sender, peer, item.message))

    def _on_message(self, payload: tuple[str, str, Message]) -> None:
        _, peer, message = payload
        host = int(peer[1:])
        proto = self._ark[host]
        self._ark_send(host, proto.receive(message))
        for lease_id in [k for k, f in self._ark_waiting.items() if f.spec.src == host]:
            self._ark_poll(host, lease_id)

    def _ark_poll(self, src: int, lease_id: str) -> None:
        lease, out = self._ark[src].poll(lease_id)
        self._ark_send(src, out)
        if lease is not None:
            flow = self._ark_waiting.pop(lease_id)
            self._start(flow, lease.udp_sport)


@dataclass(frozen=True)
class Summary:
    policy: str
    flows: int
    mean_fct: float
    p95_fct: float
    p99_fct: float
    mean_ttft: float
    mean_slowdown: float  # FCT / (bytes at NIC rate): 1.0 means never slowed by the fabric
    repaths: int = 0
    extra: dict = field(default_factory=dict)


def summarize(policy: str, results: list[FlowResult], nic_bytes_per_s: float, warmup_fraction: float = 0.1) -> Summary:
    """FCT / TTFT statistics over the flows after the first ``warmup_fraction`` of arrivals."""
    kept = sorted(results, key=lambda r: r.arrival)[int(len(results) * warmup_fraction):]
    fct = np.array([r.fct for r in kept])
    ideal = np.array([r.nbytes / nic_bytes_per_s for r in kept])
    return Summary(policy, len(kept), float(fct.mean()), float(np.percentile(fct, 95)),
                   float(np.percentile(fct, 99)), float(np.mean([r.ttft for r in kept])),
                   float(np.mean(fct / ideal)), sum(r.repaths for r in kept))
