"""The flow-level fabric simulator (blink/fabric/sim): max-min rates, the event loop, the
workload, the policies, and the CLI. Small fabrics and short runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from blink.fabric.ecmp import EcmpFabric, EcmpHash
from blink.fabric.sim.__main__ import main
from blink.fabric.sim.compare import Scenario, run_load
from blink.fabric.sim.flowsim import Flow, FlowSimulator, max_min_rates, summarize
from blink.fabric.sim.workload import MODEL_KV, FlowSpec, poisson_pd_workload
from blink.fabric.topology import LeafSpine, Link

ROOT = Path(__file__).resolve().parents[1]


def _flow(links, nbytes=1.0):
    f = Flow(FlowSpec(0, 0.0, 0, 1, 1, int(nbytes), 0.0), nbytes)
    f.links = tuple(links)
    return f


def test_max_min_textbook_case():
    # link A (cap 10) carries flows 1, 2; link B (cap 4) carries flows 2, 3:
    # B is the bottleneck (2 each), then flow 1 gets the rest of A (8)
    a, b = Link("up", 0, 0), Link("up", 0, 1)
    f1, f2, f3 = _flow([a]), _flow([a, b]), _flow([b])
    max_min_rates([f1, f2, f3], {a: 10.0, b: 4.0})
    assert (f1.rate, f2.rate, f3.rate) == (8.0, 2.0, 2.0)
    assert f2.bottleneck == b and f1.bottleneck == a


def _two_flow_sim(sports, policy="ecmp"):
    topo = LeafSpine(2, 2, 2, host_gbps=8, uplink_gbps=8)  # 1e9 bytes/s everywhere
    truth = EcmpFabric(topo, (EcmpHash("murmur3", 3),))
    specs = [FlowSpec(0, 0.0, 0, 2, 1, 10**9, 0.0), FlowSpec(1, 0.0, 1, 3, 1, 10**9, 0.0)]
    sim = FlowSimulator(truth, policy, specs)
    ports = iter(sports)
    sim._random_sport = lambda: next(ports)
    return truth, sim.run()


def _ports_to(truth, src, dst, spine, n=1):
    found = [p for p in range(0xC000, 0x10000) if truth.spine_for(src, dst, p) == spine]
    return found[:n]


def test_collision_doubles_fct_and_distinct_spines_do_not():
    truth, _ = _two_flow_sim([0xC000, 0xC000])
    same = [_ports_to(truth, 0, 2, 0)[0], _ports_to(truth, 1, 3, 0)[0]]
    apart = [_ports_to(truth, 0, 2, 0)[0], _ports_to(truth, 1, 3, 1)[0]]
    _, collided = _two_flow_sim(same)
    _, spread = _two_flow_sim(apart)
    assert [r.fct for r in collided] == pytest.approx([2.0, 2.0])  # 1 GB each at half of 1 GB/s
    assert [r.fct for r in spread] == pytest.approx([1.0, 1.0])
    _, ark = _two_flow_sim([], policy="ark")
    assert [r.fct for r in ark] == pytest.approx([1.0, 1.0], abs=1e-4)  # + the control round trips
    assert ark[0].spine != ark[1].spine


def test_plb_repaths_a_collided_flow():
    truth, _ = _two_flow_sim([0xC000, 0xC000])
    s0 = _ports_to(truth, 0, 2, 0)[0]
    ports = [s0, _ports_to(truth, 1, 3, 0)[0], *range(0xC000, 0xC000 + 100)]
    # both start on spine 0; every 3 congested 1 ms checks one re-hashes (a coin flip per try)
    _, results = _two_flow_sim(ports, policy="plb")
    assert sum(r.repaths for r in results) >= 1
    assert max(r.fct for r in results) < 1.1  # a few ms at half rate, then full rate


def test_kv_shapes_match_the_config_files():
    for stem, shape in MODEL_KV.items():
        text = (ROOT / "configs" / f"{stem}.yaml").read_text()
        m = re.search(r"(\d+) layers x (\d+) KV heads x (\d+)", text)
        assert m, f"configs/{stem}.yaml documents no KV shape"
        assert (shape.layers, shape.kv_heads, shape.head_dim) == tuple(map(int, m.groups())), stem
    assert MODEL_KV["llama-3-8b"].kv_bytes(1) == 128 * 1024  # 128 KiB/token, as the config says


def test_workload_offers_the_requested_load():
    topo = LeafSpine(4, 2, 2)
    specs = poisson_pd_workload(topo, "llama-3-8b", 0.5, 4000, seed=3)
    duration = specs[-1].arrival
    offered = sum(s.nbytes for s in specs) / duration
    capacity = 4 * topo.capacity(Link("host-up", 0))  # 2 prefill leaves x 2 hosts
    assert offered / capacity == pytest.approx(0.5, rel=0.06)
    assert all(topo.leaf_of(s.src) < 2 <= topo.leaf_of(s.dst) for s in specs)
    with pytest.raises(ValueError, match="unknown model"):
        poisson_pd_workload(topo, "gpt-5", 0.5, 10)
    with pytest.raises(ValueError, match="load"):
        poisson_pd_workload(topo, "llama-3-8b", 1.2, 10)


def test_policies_order_on_a_small_fabric():
    scenario = Scenario(LeafSpine(4, 4, 4), EcmpHash("murmur3", 11), num_flows=250, seed=5, wrong_seed=12345)
    rows = {s.policy: s for s in run_load(scenario, 0.5)}
    assert rows["ark"].mean_fct < rows["ecmp"].mean_fct
    assert rows["oracle"].mean_fct < rows["ecmp"].mean_fct
    assert rows["plb"].mean_fct < rows["ecmp"].mean_fct and rows["plb"].repaths > 0
    # a wrong seed makes ARK's placement random: about ECMP, clearly worse than exact ARK
    assert rows["ark-wrong-seed"].mean_fct > rows["ark"].mean_fct
    assert rows["ark-wrong-seed"].mean_fct < 1.25 * rows["ecmp"].mean_fct
    for s in rows.values():
        assert s.flows == 225 and s.mean_slowdown >= 1.0 and s.p99_fct >= s.p95_fct >= 0


def test_every_flow_finishes_and_bytes_are_conserved():
    topo = LeafSpine(4, 2, 2)
    specs = poisson_pd_workload(topo, "smollm2-135m", 0.8, 120, seed=1)
    for policy in ("ecmp", "ark", "plb", "oracle"):
        results = FlowSimulator(EcmpFabric(topo), policy, specs).run()
        assert sorted(r.fid for r in results) == list(range(120))
        nic = topo.capacity(Link("host-up", 0))
        # no flow beats its NIC
        assert all(r.finish - r.start >= r.nbytes / nic * (1 - 1e-9) for r in results), policy
        summarize(policy, results, nic)


def test_cli_prints_the_table(capsys):
    assert main(["--flows", "60", "--loads", "0.3,0.8", "--leaves", "4", "--spines", "2",
                 "--hosts-per-leaf", "2", "--wrong-seed", "5", "--hash", "murmur3"]) == 0
    out = capsys.readouterr().out
    for policy in ("ecmp", "ark", "plb", "oracle", "ark-wrong-seed"):
        assert f"| 30% | {policy} |" in out and f"| 80% | {policy} |" in out


def test_cli_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--loads", "1.5", "--flows", "10"])
    assert "load must be in (0, 1)" in capsys.readouterr().err


def test_cli_repeat_prints_the_spread_over_seeds(capsys):
    assert main(["--flows", "40", "--loads", "0.5", "--leaves", "4", "--spines", "2", "--hosts-per-leaf", "2",
                 "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "mean ± sd over 2 workload seeds" in out
    assert re.search(r"\| 50% \| ark \| [+-]\d+\.\d% ± \d+\.\d \|", out)
