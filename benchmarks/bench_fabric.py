"""ARK's coordination cost on real buses, and the simulator's comparison table.

    python -m benchmarks.bench_fabric [--senders 4] [--rounds 200] [--table]

1. claim latency: ``ArkAgent.choose_path`` + ``lease.release`` over the in-process bus and
   over TCP on localhost, with ``--senders`` agents (one broadcast and the acks per claim;
   every sender on one leaf with as many spines, so every claim has rivals' held claims to
   avoid). Sequential claims from one sender, then all senders claiming at once (contests).
2. ``--table``: ``python -m blink.fabric.sim`` with its defaults (ECMP / ARK / PLB / oracle at
   30/50/80% load).
Numbers on a shared machine are noisy: medians, and compare rows of one run.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

from blink.fabric.ark import ArkAgent, Transfer
from blink.fabric.bus import InProcessHub, TcpBus
from blink.fabric.ecmp import EcmpFabric, EcmpHash
from blink.fabric.topology import LeafSpine


def _agents(kind: str, n: int, fabric: EcmpFabric) -> list[ArkAgent]:
    ids = [f"s{i}" for i in range(n)]
    if kind == "inprocess":
        hub = InProcessHub()
        agents = [ArkAgent(hub.join(i), fabric) for i in ids]
    else:
        buses = [TcpBus(i, listen=("127.0.0.1", 0)) for i in ids]
        members = {b.sender_id: b.address for b in buses}
        for b in buses:
            b.set_members(members)
        agents = [ArkAgent(b, fabric) for b in buses]
        for b in buses:
            b.wait_connected()
    for a in agents:
        a.wait_peers(ids)
    return agents


def claim_latency(kind: str, senders: int, rounds: int) -> dict[str, float]:
    topo = LeafSpine(2, senders, senders)
    fabric = EcmpFabric(topo, (EcmpHash("murmur3", 1),))
    agents = _agents(kind, senders, fabric)
    try:
        seq = []
        for r in range(rounds):
            t0 = time.perf_counter()
            lease = agents[0].choose_path(Transfer(f"seq{r}", 0, senders))
            seq.append(time.perf_counter() - t0)
            lease.release()
        burst, attempts = [], []
        for r in range(max(1, rounds // 10)):
            out: list = [None] * senders
            def go(i: int) -> None:
                t0 = time.perf_counter()
                lease = agents[i].choose_path(Transfer(f"b{r}", i, senders + i))  # same id: same first pick
                out[i] = (time.perf_counter() - t0, lease)
            threads = [threading.Thread(target=go, args=(i,)) for i in range(senders)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            burst += [dt for dt, _ in out]
            attempts += [lease.attempts for _, lease in out]
            assert len({lease.spine for _, lease in out}) == senders, "ARK collision"
            for _, lease in out:
                lease.release()
            time.sleep(0.01)
        return {"seq_median_ms": statistics.median(seq) * 1e3, "seq_p99_ms": sorted(seq)[int(0.99 * len(seq))] * 1e3,
                "burst_median_ms": statistics.median(burst) * 1e3, "burst_max_ms": max(burst) * 1e3,
                "burst_mean_attempts": statistics.mean(attempts)}
    finally:
        for a in agents:
            a.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--table", action="store_true", help="also print the simulator's table")
    args = p.parse_args()
    print("| bus | senders | choose_path median ms | p99 ms | all at once: median ms | max ms | attempts/claim |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("inprocess", "tcp"):
        r = claim_latency(kind, args.senders, args.rounds)
        print(f"| {kind} | {args.senders} | {r['seq_median_ms']:.3f} | {r['seq_p99_ms']:.3f} | "
              f"{r['burst_median_ms']:.3f} | {r['burst_max_ms']:.3f} | {r['burst_mean_attempts']:.2f} |")
    if args.table:
        from blink.fabric.sim.__main__ import main as sim_main
        sim_main([])


if __name__ == "__main__":
    main()
