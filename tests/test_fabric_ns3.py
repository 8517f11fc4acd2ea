"""The flow-level model against ns-3 (packet level, TCP) on two small cases.

Needs the optional ns-3 wheel (``pip install 'blink-serve[fabric-ns3]'``); skipped without it.
ns-3's import alone takes ~10 s here (cppyy parses its headers)."""
from __future__ import annotations

import pytest

pytest.importorskip("ns", reason="ns-3 (the optional fabric-ns3 extra) is not installed")

from blink.fabric.sim.ns3_check import cross_check  # noqa: E402


def test_flow_model_matches_ns3_on_apart_and_collided_transfers():
    results = {r.case: r for r in cross_check({"apart": (0, 1), "collide": (0, 0)}, nbytes=1_000_000)}
    apart, collide = results["apart"], results["collide"]
    for r in (apart, collide):
        # TCP's slow start and ack clocking cost a few percent over the fluid model
        assert 1.0 <= r.best_ratio and r.worst_ratio < 1.15, r
    # the effect ARK removes: a collision doubles the completion time, in both models
    ns3_slowdown = collide.ns3_fct_s[0] / apart.ns3_fct_s[0]
    flow_slowdown = collide.flow_fct_s[0] / apart.flow_fct_s[0]
    assert flow_slowdown == pytest.approx(2.0)
    assert ns3_slowdown == pytest.approx(flow_slowdown, rel=0.06)
