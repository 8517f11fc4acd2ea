"""Putting ARK's chosen UDP source port on a RoCEv2 queue pair.

RoCEv2 packets are UDP datagrams to port 4791; the source port is the only per-flow field a
sender controls, and NICs derive it per queue pair. Two ways to set it:

- **mlx5dv** (NVIDIA ConnectX/BlueField): ``mlx5dv_modify_qp_udp_sport`` sets it directly on
  an RC queue pair past RTR (pyverbs: ``Mlx5QP.modify_udp_sport``).
- **flow label**: Linux computes the source port from the GRH flow label
  (``rdma_flow_label_to_udp_sport``: ``(fl & 0x3fff) ^ ((fl & 0xfc000) >> 14) | 0xc000``), and
  NICs whose drivers use it (mlx5, and others following the kernel helper) honour a flow label
  given at INIT -> RTR. :func:`flow_label_for_sport` inverts the helper exactly.

:func:`apply_udp_sport` tries mlx5dv on mlx5 devices, else sets the flow label in the
connect attributes, and returns what it did (:class:`SportControl`). Where neither is
possible (no pyverbs, no RDMA device, an InfiniBand route without a GRH) it says so in the
log and in the result: the transfer then goes wherever the NIC's default hash sends it, and
ARK's prediction for it is void.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from blink.fabric.ecmp import ROCE_SPORT_MAX, ROCE_SPORT_MIN

logger = logging.getLogger(__name__)

FLOW_LABEL_MASK = 0xFFFFF  # 20 bits (IB_GRH_FLOWLABEL_MASK)


def udp_sport_from_flow_label(flow_label: int) -> int:
    """The UDP source port Linux derives from a GRH flow label (``rdma_flow_label_to_udp_sport``)."""
    if not 0 <= flow_label <= FLOW_LABEL_MASK:
        raise ValueError(f"a flow label is 20 bits, got {flow_label:#x}")
    low, high = flow_label & 0x03FFF, flow_label & 0xFC000
    return (low ^ (high >> 14)) | ROCE_SPORT_MIN


def flow_label_for_sport(sport: int) -> int:
    """A flow label that makes Linux pick ``sport`` (the high bits left zero)."""
    if not ROCE_SPORT_MIN <= sport <= ROCE_SPORT_MAX:
        raise ValueError(f"RoCEv2 UDP source ports are {ROCE_SPORT_MIN}..{ROCE_SPORT_MAX}, got {sport}")
    return sport & 0x3FFF


def default_flow_label(local_qpn: int, remote_qpn: int) -> int:
    """The flow label Linux uses when none is given (``rdma_calc_flow_label``): what ECMP sees
    for a queue pair nobody steered."""
    v = (local_qpn * remote_qpn) & 0xFFFFFFFFFFFFFFFF
    v ^= v >> 20
    v ^= v >> 40
    return v & FLOW_LABEL_MASK


@dataclass(frozen=True)
class SportControl:
    """How (or whether) a queue pair's UDP source port was set."""

    method: str  # "mlx5dv", "flow-label" or "none"
    sport: int
    reason: str = ""

    @property
    def applied(self) -> bool:
        return self.method != "none"


def _unavailable(sport: int, reason: str) -> SportControl:
    logger.warning("ARK: cannot set the RoCEv2 UDP source port %d (%s); this transfer takes the "
                   "NIC's default path and ARK's reservation for it does not hold", sport, reason)
    return SportControl("none", sport, reason)


def set_flow_label(connect_attr: Any, sport: int) -> SportControl:
    """Set the flow label on INIT -> RTR attributes (``blink.transport.verbs.qp_connect_attr``'s
    result) so the NIC derives ``sport``; call before ``QP.to_rts``."""
    ah = getattr(connect_attr, "ah_attr", None)
    if ah is None or not getattr(ah, "is_global", 0):
        return _unavailable(sport, "the route has no global route header (InfiniBand LID routing: "
                                   "no UDP, no source port)")
    label = flow_label_for_sport(sport)
    # pyverbs hands out a copy of ah_attr: set the label on it and assign it back, then check
    ah.flow_label = label
    connect_attr.ah_attr = ah
    if connect_attr.ah_attr.flow_label != label:
        return _unavailable(sport, "the flow label did not stick on the connect attributes")
    return SportControl("flow-label", sport)


def apply_udp_sport(qp: Any, device_name: str, sport: int, connect_attr: Any | None = None) -> SportControl:
    """Give ``qp`` the UDP source port ``sport``.

    On an mlx5 device with the QP past RTR: ``Mlx5QP.modify_udp_sport``. Otherwise, when the
    connect attributes are given (the QP is not connected yet): the flow label. Otherwise (or
    when pyverbs is missing, or the call fails) a clear warning and ``method == "none"``.
    """
    if device_name.startswith("mlx5") and connect_attr is None:
        try:
            from pyverbs.providers.mlx5.mlx5dv import Mlx5QP
        except ImportError as exc:
            return _unavailable(sport, f"pyverbs' mlx5 provider is not importable: {exc}")
        try:
            Mlx5QP.modify_udp_sport(qp, sport)
        except Exception as exc:  # PyverbsRDMAError and friends: the device refused
            return _unavailable(sport, f"mlx5dv_modify_qp_udp_sport failed on {device_name}: {exc}")
        return SportControl("mlx5dv", sport)
    if connect_attr is not None:
        return set_flow_label(connect_attr, sport)
    return _unavailable(sport, f"device {device_name!r} has no UDP source port call and the queue pair "
                               "is already connected (set the flow label before connecting)")


def probe_sport_control(device: str | None = None) -> SportControl:
    """Whether this machine can steer RoCEv2 source ports at all (for start-up logs and
    ``--help``-level diagnostics); probes like :mod:`blink.transport.verbs`."""
    from blink.transport.base import TransportError
    from blink.transport.verbs import list_devices

    try:
        names = list_devices()
    except TransportError as exc:
        return _unavailable(ROCE_SPORT_MIN, str(exc))
    name = device or names[0]
    if name not in names:
        return _unavailable(ROCE_SPORT_MIN, f"no RDMA device {name!r} (found: {', '.join(names)})")
    method = "mlx5dv" if name.startswith("mlx5") else "flow-label"
    return SportControl(method, ROCE_SPORT_MIN, f"device {name}")
