"""Cross-check of the flow-level model against ns-3 (packet level) on small cases.

ns-3 (PyPI ``ns3``, C++ through cppyy; ``pip install 'blink-serve[fabric-ns3]'``) has no RoCE
or DCQCN in its main tree, so the packet-level side is TCP (NewReno, ns-3's default) bulk
transfers over point-to-point links with drop-tail queues: what it checks is that the
flow-level model's shares and completion times are those a real congestion control reaches
when flows collide on an uplink, not RDMA's own dynamics.

The fabric is one leaf-spine of two leaves (``hosts`` hosts each) and two spines; every
transfer goes from host i under leaf 0 to host i under leaf 1, over the spine the case names
(static host routes on leaf 0 override ns-3's global routing). The same transfers, on the
same spines, go through :class:`~blink.fabric.sim.flowsim.FlowSimulator`.

``python -m blink.fabric.sim.ns3_check`` prints both FCTs per case.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from blink.fabric.ecmp import ROCE_SPORT_MAX, ROCE_SPORT_MIN, EcmpFabric, EcmpHash
from blink.fabric.sim.flowsim import FlowSimulator
from blink.fabric.sim.workload import FlowSpec
from blink.fabric.topology import LeafSpine

# TCP/IPv4 over PPP: 1448 payload bytes per 1500-byte IP packet + 2 bytes of PPP header
# (timestamps on): the share of the line rate a bulk transfer's payload can get.
TCP_PAYLOAD_EFFICIENCY = 1448 / 1502

CASES: dict[str, tuple[int, ...]] = {  # name -> the spine of each transfer
    "apart": (0, 1),
    "collide": (0, 0),
    "two-on-one-one-alone": (0, 0, 1),
}


@dataclass(frozen=True)
class CaseResult:
    case: str
    spines: tuple[int, ...]
    ns3_fct_s: tuple[float, ...]
    flow_fct_s: tuple[float, ...]

    @property
    def worst_ratio(self) -> float:
        """max over transfers of ns-3 FCT / flow-level FCT."""
        return max(a / b for a, b in zip(self.ns3_fct_s, self.flow_fct_s))

    @property
    def best_ratio(self) -> float:
        return min(a / b for a, b in zip(self.ns3_fct_s, self.flow_fct_s))


def load_ns3():
    """The ``ns`` namespace of the ns3 wheel, or ImportError naming the fix."""
    try:
        from ns import ns
    except ImportError as exc:
        raise ImportError(f"ns-3 is not installed (pip install 'ns3==3.44.post0'): {exc}") from None
    return ns


def ns3_fcts(spines: tuple[int, ...], nbytes: int, gbps: float, *, resolution: float = 0.005,
             limit_s: float = 60.0) -> tuple[float, ...]:
    """Completion times (from the common start) of TCP bulk transfers on the given spines,
    sampled every ``resolution`` of one transfer's time alone on a link."""
    ns = load_ns3()
    step_s = resolution * nbytes * 8 / (gbps * 1e9)
    n = len(spines)
    hosts, sw = ns.NodeContainer(), ns.NodeContainer()
    hosts.Create(2 * n)  # 0..n-1 under leaf 0, n..2n-1 under leaf 1
    sw.Create(4)  # leaf 0, leaf 1, spine 0, spine 1
    p2p = ns.PointToPointHelper()
    p2p.SetDeviceAttribute("DataRate", ns.StringValue(f"{gbps}Gbps"))
    p2p.SetChannelAttribute("Delay", ns.StringValue("1us"))
    p2p.SetQueue("ns3::DropTailQueue", "MaxSize", ns.StringValue("1000p"))
    stack = ns.InternetStackHelper()
    stack.Install(hosts)
    stack.Install(sw)
    leaf0, leaf1, spine0, spine1 = (sw.Get(i) for i in range(4))
    pairs = [(hosts.Get(i), leaf0) for i in range(n)] + [(hosts.Get(n + i), leaf1) for i in range(n)]
    pairs += [(leaf0, spine0), (leaf0, spine1), (spine0, leaf1), (spine1, leaf1)]
    address = ns.Ipv4AddressHelper()
    interfaces = []
    for i, (a, b) in enumerate(pairs):
        nodes = ns.NodeContainer()
        nodes.Add(a)
        nodes.Add(b)
        address.SetBase(ns.Ipv4Address(f"10.{i}.0.0"), ns.Ipv4Mask("255.255.255.0"))
        interfaces.append(address.Assign(p2p.Install(nodes)))
    ns.Ipv4GlobalRoutingHelper.PopulateRoutingTables()
    # leaf 0's interfaces: 0 loopback, 1..n its hosts, n+1 -> spine 0, n+2 -> spine 1
    uplink = {0: (interfaces[2 * n], n + 1), 1: (interfaces[2 * n + 1], n + 2)}
    static = ns.Ipv4StaticRoutingHelper().GetStaticRouting(leaf0.GetObject[ns.Ipv4]())
    sinks = []
    for i, spine in enumerate(spines):
        dst = interfaces[n + i].GetAddress(0)
        via, ifindex = uplink[spine]
        static.AddHostRouteTo(dst, via.GetAddress(1), ifindex)
        any_addr = ns.InetSocketAddress(ns.Ipv4Address.GetAny(), 5000 + i).ConvertTo()
        sink = ns.PacketSinkHelper("ns3::TcpSocketFactory", any_addr).Install(hosts.Get(n + i))
        sink.Start(ns.Seconds(0.0))
        sinks.append(sink.Get(0))
        bulk = ns.BulkSendHelper("ns3::TcpSocketFactory", ns.InetSocketAddress(dst, 5000 + i).ConvertTo())
        bulk.SetAttribute("MaxBytes", ns.UintegerValue(nbytes))
        bulk.SetAttribute("SendSize", ns.UintegerValue(1448))
        bulk.Install(hosts.Get(i)).Start(ns.Seconds(0.0))
    done: list[float | None] = [None] * n
    t = 0.0
    try:
        while None in done and t < limit_s:
            ns.Simulator.Stop(ns.Seconds(step_s))  # relative to now
            ns.Simulator.Run()
            t = ns.Simulator.Now().GetSeconds()
            for i, sink in enumerate(sinks):
                if done[i] is None and sink.GetTotalRx() >= nbytes:
                    done[i] = t
    finally:
        ns.Simulator.Destroy()
    if None in done:
        raise RuntimeError(f"ns-3: transfers {[i for i, d in enumerate(done) if d is None]} unfinished after {limit_s} s")
    return tuple(done)  # type: ignore[arg-type]


def flow_fcts(spines: tuple[int, ...], nbytes: int, gbps: float) -> tuple[float, ...]:
    """The same transfers in the flow-level model (rates scaled to TCP's payload share)."""
    n = len(spines)
    rate = gbps * TCP_PAYLOAD_EFFICIENCY
    topo = LeafSpine(2, 2, n, host_gbps=rate, uplink_gbps=rate)
    truth = EcmpFabric(topo, (EcmpHash("murmur3", 1),))
    specs = [FlowSpec(i, 0.0, i, n + i, 1, nbytes, 0.0) for i in range(n)]

    def port_to(spec: FlowSpec) -> int:
        want = spines[spec.fid]
        return next(p for p in range(ROCE_SPORT_MIN, ROCE_SPORT_MAX + 1)
                    if truth.spine_for(spec.src, spec.dst, p) == want)

    results = FlowSimulator(truth, "ecmp", specs, ecmp_sport=port_to).run()
    return tuple(r.fct for r in results)


def cross_check(cases: dict[str, tuple[int, ...]] = CASES, nbytes: int = 2_000_000, gbps: float = 1.0) -> list[CaseResult]:
    return [CaseResult(name, spines, ns3_fcts(spines, nbytes, gbps), flow_fcts(spines, nbytes, gbps))
            for name, spines in cases.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blink.fabric.sim.ns3_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=2_000_000, help="bytes per transfer (default: %(default)s)")
    p.add_argument("--gbps", type=float, default=1.0, help="every link's rate (default: %(default)s)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        results = cross_check(nbytes=args.bytes, gbps=args.gbps)
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("| case | spines | ns-3 FCT ms | flow-level FCT ms | ns-3 / flow |")
    print("|---|---|---|---|---|")
    for r in results:
        ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(r.ns3_fct_s, r.flow_fct_s))
        print(f"| {r.case} | {r.spines} | {', '.join(f'{x * 1e3:.2f}' for x in r.ns3_fct_s)} | "
              f"{', '.join(f'{x * 1e3:.2f}' for x in r.flow_fct_s)} | {ratios} |")
    print(f"\n({args.bytes} bytes per transfer, {args.gbps} Gbit/s links; {time.perf_counter() - t0:.1f} s "
          f"with ns-3's import)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
