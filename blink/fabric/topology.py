"""A two-tier leaf-spine (Clos) fabric: hosts under leaves, every leaf wired to every spine.

A path between hosts under different leaves is host -> leaf -> spine -> leaf -> host, so the
only choice on it is the spine, made by the source leaf's ECMP hash (the spine has a single
downlink to the destination leaf). Hosts under the same leaf meet in the leaf and never use a
spine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


class Link(NamedTuple):
    """One direction of one cable. ``kind`` is ``host-up`` (host -> its leaf), ``up`` (leaf a ->
    spine b), ``down`` (spine a -> leaf b) or ``host-down`` (leaf -> host a)."""

    kind: str
    a: int
    b: int = 0


@dataclass(frozen=True)
class LeafSpine:
    """``num_leaves`` leaves of ``hosts_per_leaf`` hosts each, ``num_spines`` spines.

    Hosts are numbered leaf-major (host ``h`` sits under leaf ``h // hosts_per_leaf``). With
    ``hosts_per_leaf * host_gbps == num_spines * uplink_gbps`` the fabric is non-blocking: only
    an unlucky spread of flows over the uplinks can slow a transfer below its NIC rate.
    """

    num_leaves: int
    num_spines: int
    hosts_per_leaf: int
    host_gbps: float = 100.0
    uplink_gbps: float = 100.0

    def __post_init__(self) -> None:
        for name in ("num_leaves", "num_spines", "hosts_per_leaf"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LeafSpine.{name} must be a positive integer, got {value!r}")
        for name in ("host_gbps", "uplink_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LeafSpine.{name} must be positive, got {getattr(self, name)!r}")

    @property
    def num_hosts(self) -> int:
        return self.num_leaves * self.hosts_per_leaf

    def leaf_of(self, host: int) -> int:
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host {host} is not in this fabric (0..{self.num_hosts - 1})")
        return host // self.hosts_per_leaf

    def host_ip(self, host: int) -> int:
        """The host's IPv4 address as an integer: 10.<leaf>.<index under the leaf>.1."""
        leaf = self.leaf_of(host)
        return (10 << 24) | (leaf << 16) | ((host % self.hosts_per_leaf) << 8) | 1

    def crosses_spine(self, src: int, dst: int) -> bool:
        return self.leaf_of(src) != self.leaf_of(dst)

    def path(self, src: int, dst: int, spine: int | None) -> tuple[Link, ...]:
        """The links from ``src`` to ``dst`` through ``spine`` (``None`` within one leaf)."""
        src_leaf, dst_leaf = self.leaf_of(src), self.leaf_of(dst)
        if src_leaf == dst_leaf:
            return (Link("host-up", src), Link("host-down", dst))
        if spine is None or not 0 <= spine < self.num_spines:
            raise ValueError(f"a path from leaf {src_leaf} to leaf {dst_leaf} needs a spine, got {spine!r}")
        return (Link("host-up", src), Link("up", src_leaf, spine), Link("down", spine, dst_leaf),
                Link("host-down", dst))

    def capacity(self, link: Link) -> float:
        """The link's rate in bytes per second."""
        gbps = self.host_gbps if link.kind in ("host-up", "host-down") else self.uplink_gbps
        return gbps * GBPS
