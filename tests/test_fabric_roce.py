"""RoCEv2 source-port control (blink/fabric/roce.py): the flow-label mapping, and honest
failure where no device can apply it (this machine has pyverbs but no RDMA device)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from blink.fabric.ecmp import ROCE_SPORT_MAX, ROCE_SPORT_MIN
from blink.fabric.roce import (
    apply_udp_sport, default_flow_label, flow_label_for_sport, probe_sport_control, set_flow_label,
    udp_sport_from_flow_label,
)


def test_flow_label_inverts_the_kernels_sport_derivation_for_every_port():
    for sport in range(ROCE_SPORT_MIN, ROCE_SPORT_MAX + 1):
        label = flow_label_for_sport(sport)
        assert 0 <= label < 1 << 20 and udp_sport_from_flow_label(label) == sport


def test_kernel_sport_derivation_folds_the_high_bits():
    # rdma_flow_label_to_udp_sport: low 14 bits xor bits 14..19, or 0xC000
    assert udp_sport_from_flow_label(0) == 0xC000
    assert udp_sport_from_flow_label(0x4000) == 0xC001
    assert udp_sport_from_flow_label(0xFFFFF) == 0xC000 | (0x3FFF ^ 0x3F)
    with pytest.raises(ValueError, match="20 bits"):
        udp_sport_from_flow_label(1 << 20)
    with pytest.raises(ValueError, match="49152..65535"):
        flow_label_for_sport(4791)


def test_default_flow_label_is_the_kernels_qpn_hash():
    v = 0x1234 * 0x5678
    v ^= v >> 20
    v ^= v >> 40
    assert default_flow_label(0x1234, 0x5678) == v & 0xFFFFF
    assert all(0 <= default_flow_label(a, b) < 1 << 20 for a in (1, 0xFFFFFF) for b in (7, 0xFFFFFF))


def _connect_attr(gid: str):
    verbs = pytest.importorskip("blink.transport.verbs")
    try:
        pv = verbs.load_pyverbs()
    except verbs.TransportError:
        pytest.skip("pyverbs is not installed")
    local = verbs.VerbsEndpoint(1, 2, 0, "fe80:0000:0000:0000:0000:0000:0000:0001", 5)
    remote = verbs.VerbsEndpoint(3, 4, 0, gid, 5)
    return verbs.qp_connect_attr(pv, 1, 0, local, remote)


def test_flow_label_lands_in_real_pyverbs_connect_attributes():
    attr = _connect_attr("fe80:0000:0000:0000:0000:0000:0000:0002")
    result = set_flow_label(attr, 0xD00D)
    assert result.applied and result.method == "flow-label"
    assert attr.ah_attr.flow_label == flow_label_for_sport(0xD00D)
    assert str(attr.ah_attr.dgid) == "fe80:0000:0000:0000:0000:0000:0000:0002"  # the rest kept


def test_lid_routed_queue_pair_cannot_be_steered_and_says_so(caplog):
    attr = _connect_attr("0000:0000:0000:0000:0000:0000:0000:0000")
    with caplog.at_level(logging.WARNING, logger="blink.fabric.roce"):
        result = set_flow_label(attr, 0xD00D)
    assert not result.applied and "LID routing" in result.reason
    assert "cannot set the RoCEv2 UDP source port 53261" in caplog.text


def test_connected_non_mlx5_queue_pair_is_refused_clearly(caplog):
    with caplog.at_level(logging.WARNING, logger="blink.fabric.roce"):
        result = apply_udp_sport(SimpleNamespace(), "rxe0", 0xC123)
    assert result.method == "none" and "set the flow label before connecting" in result.reason
    assert "does not hold" in caplog.text


def test_probe_on_a_machine_without_rdma_device_reports_none(caplog):
    pytest.importorskip("pyverbs")
    with caplog.at_level(logging.WARNING, logger="blink.fabric.roce"):
        result = probe_sport_control()
    if result.applied:  # a machine with an RDMA NIC
        assert result.method in ("mlx5dv", "flow-label")
    else:
        assert "no RDMA device" in result.reason and "cannot set" in caplog.text


def test_mlx5_call_failure_is_reported_not_faked(caplog):
    pytest.importorskip("pyverbs.providers.mlx5.mlx5dv")
    with caplog.at_level(logging.WARNING, logger="blink.fabric.roce"):
        result = apply_udp_sport(object(), "mlx5_0", 0xC123)  # not a QP: the call must fail
    assert result.method == "none" and "mlx5dv_modify_qp_udp_sport failed" in result.reason
