"""``python -m blink.fabric.sim``: the ECMP / ARK / PLB / oracle table at several loads."""
from __future__ import annotations

import argparse
import sys
import time

from blink.fabric.ecmp import HASH_ALGORITHMS, SELECTORS, EcmpHash
from dataclasses import replace

from blink.fabric.sim.compare import Scenario, format_spread, format_table, run_load
from blink.fabric.sim.workload import MODEL_KV
from blink.fabric.topology import LeafSpine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m blink.fabric.sim",
        description="Flow-level (max-min fair) simulation of KV transfers between prefill and decode "
                    "hosts on a leaf-spine fabric: ECMP vs ARK vs PLB-like re-pathing vs an oracle. "
                    "Prefill hosts sit under the first half of the leaves, decode hosts under the rest.")
    p.add_argument("--loads", default="0.3,0.5,0.8", help="offered loads, fractions of the prefill hosts' NIC "
                   "capacity (default: %(default)s)")
    p.add_argument("--flows", type=int, default=2000, help="transfers per load (default: %(default)s)")
    p.add_argument("--model", default="llama-3-8b", choices=sorted(MODEL_KV),
                   help="KV shape (from configs/*.yaml) (default: %(default)s)")
    p.add_argument("--min-tokens", type=int, default=1024, help="shortest prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8192, help="longest prompt (default: %(default)s)")
    p.add_argument("--leaves", type=int, default=8, help="leaf switches (default: %(default)s)")
    p.add_argument("--spines", type=int, default=4, help="spine switches (default: %(default)s)")
    p.add_argument("--hosts-per-leaf", type=int, default=4, help="hosts under each leaf (default: %(default)s)")
    p.add_argument("--host-gbps", type=float, default=100.0, help="host NIC rate (default: %(default)s)")
    p.add_argument("--uplink-gbps", type=float, default=100.0, help="leaf-spine link rate (default: %(default)s)")
    p.add_argument("--hash", default="crc32", choices=sorted(HASH_ALGORITHMS), help="switch hash (default: %(default)s)")
    p.add_argument("--selector", default="modulo", choices=SELECTORS, help="hash -> uplink (default: %(default)s)")
    p.add_argument("--hash-seed", type=int, default=0x5EED, help="the switches' hash seed (default: %(default)s)")
    p.add_argument("--wrong-seed", type=int, default=None,
                   help="also run ARK with this (wrong) belief about the seed")
    p.add_argument("--control-latency-us", type=float, default=10.0,
                   help="one-way latency of ARK's control messages (default: %(default)s)")
    p.add_argument("--plb-interval-ms", type=float, default=1.0, help="PLB's check period (default: %(default)s)")
    p.add_argument("--plb-rounds", type=int, default=3, help="congested checks before PLB re-paths (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run workload seeds seed..seed+N-1 and also print each policy's change against "
                        "ECMP as mean ± sd over them (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        loads = [float(x) for x in args.loads.split(",")]
        scenario = Scenario(
            LeafSpine(args.leaves, args.spines, args.hosts_per_leaf, args.host_gbps, args.uplink_gbps),
            EcmpHash(args.hash, args.hash_seed, args.selector), args.model, args.flows, args.min_tokens,
            args.max_tokens, args.control_latency_us * 1e-6, args.plb_interval_ms * 1e-3, args.plb_rounds,
            args.seed, args.wrong_seed)
    except ValueError as exc:
        p.error(str(exc))
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    per_seed = []
    t0 = time.perf_counter()
    for k in range(args.repeat):
        rows = {}
        for load in loads:
            try:
                rows[load] = run_load(replace(scenario, seed=args.seed + k), load)
            except ValueError as exc:
                p.error(str(exc))
        per_seed.append(rows)
    print(format_table(per_seed[0]))
    if args.repeat > 1:
        print()
        print(format_spread(per_seed))
    seeds = f"{args.seed}..{args.seed + args.repeat - 1}" if args.repeat > 1 else f"{args.seed}"
    print(f"\n(workload seed {seeds}: {args.flows} transfers per load, {args.leaves} leaves x {args.spines} spines x "
          f"{args.hosts_per_leaf} hosts, {args.model}, {args.hash}/{args.selector}; "
          f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
