"""Run every policy on the same workload at several loads and tabulate the results."""
from __future__ import annotations

from dataclasses import dataclass

from blink.fabric.ecmp import EcmpFabric, EcmpHash
from blink.fabric.sim.flowsim import FlowSimulator, Summary, summarize
from blink.fabric.sim.workload import poisson_pd_workload
from blink.fabric.topology import LeafSpine


@dataclass(frozen=True)
class Scenario:
    topology: LeafSpine
    switch_hash: EcmpHash
    model: str = "llama-3-8b"
    num_flows: int = 2000
    min_tokens: int = 1024
    max_tokens: int = 8192
    control_latency_s: float = 10e-6
    plb_interval_s: float = 1e-3
    plb_rounds: int = 3
    seed: int = 0
    wrong_seed: int | None = None  # also run ARK believing this seed


def run_load(scenario: Scenario, load: float) -> list[Summary]:
    """Every policy on one workload (the same transfers, the same arrival times)."""
    topo = scenario.topology
    truth = EcmpFabric(topo, (scenario.switch_hash,))
    specs = poisson_pd_workload(topo, scenario.model, load, scenario.num_flows, min_tokens=scenario.min_tokens,
                                max_tokens=scenario.max_tokens, seed=scenario.seed)
    nic = topo.host_gbps * 1e9 / 8
    runs: list[tuple[str, str, EcmpFabric]] = [(p, p, truth) for p in ("ecmp", "ark", "plb", "oracle")]
    if scenario.wrong_seed is not None:
        wrong = EcmpFabric(topo, (EcmpHash(scenario.switch_hash.algorithm, scenario.wrong_seed,
                                           scenario.switch_hash.selector),))
        runs.append(("ark-wrong-seed", "ark", wrong))
    out = []
    for label, policy, belief in runs:
        sim = FlowSimulator(truth, policy, specs, belief=belief, control_latency_s=scenario.control_latency_s,
                            plb_interval_s=scenario.plb_interval_s, plb_rounds=scenario.plb_rounds,
                            seed=scenario.seed + 1)
        summary = summarize(label, sim.run(), nic)
        out.append(summary)
    return out


def format_table(rows: dict[float, list[Summary]]) -> str:
    """Markdown: one line per (load, policy), times in ms, reductions against ECMP."""
    lines = ["| load | policy | mean FCT ms | P95 FCT ms | P99 FCT ms | mean TTFT ms | slowdown | "
             "mean FCT vs ECMP | P95 vs ECMP | P99 vs ECMP | TTFT vs ECMP | re-paths |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for load, summaries in rows.items():
        base = next(s for s in summaries if s.policy == "ecmp")
        for s in summaries:
            def rel(a: float, b: float) -> str:
                return "—" if s is base else f"{(a - b) / b * 100:+.1f}%"
            lines.append(
                f"| {load:.0%} | {s.policy} | {s.mean_fct * 1e3:.1f} | {s.p95_fct * 1e3:.1f} | {s.p99_fct * 1e3:.1f} | "
                f"{s.mean_ttft * 1e3:.1f} | {s.mean_slowdown:.2f} | {rel(s.mean_fct, base.mean_fct)} | "
                f"{rel(s.p95_fct, base.p95_fct)} | {rel(s.p99_fct, base.p99_fct)} | "
                f"{rel(s.mean_ttft, base.mean_ttft)} | {s.repaths} |")
    return "\n".join(lines)


def format_spread(per_seed: list[dict[float, list[Summary]]]) -> str:
    """Markdown: each policy's change against ECMP, mean ± standard deviation over workload
    seeds (one ECMP baseline per seed), so one lucky draw does not make the table."""
    import statistics

    lines = [f"Change against ECMP, mean ± sd over {len(per_seed)} workload seeds:", "",
             "| load | policy | mean FCT vs ECMP | P95 vs ECMP | P99 vs ECMP | TTFT vs ECMP |",
             "|---|---|---|---|---|---|"]
    for load in per_seed[0]:
        policies = [s.policy for s in per_seed[0][load] if s.policy != "ecmp"]
        for policy in policies:
            cells = []
            for attr in ("mean_fct", "p95_fct", "p99_fct", "mean_ttft"):
                changes = []
                for rows in per_seed:
                    base = next(s for s in rows[load] if s.policy == "ecmp")
                    mine = next(s for s in rows[load] if s.policy == policy)
                    changes.append((getattr(mine, attr) - getattr(base, attr)) / getattr(base, attr) * 100)
                sd = statistics.stdev(changes) if len(changes) > 1 else 0.0
                cells.append(f"{statistics.mean(changes):+.1f}% ± {sd:.1f}")
            lines.append(f"| {load:.0%} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
