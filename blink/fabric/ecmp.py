"""ECMP hash models: how a switch turns a packet's 5-tuple into one of its equal-cost next hops.

A switch hashes the header fields (here the RoCEv2 5-tuple: source and destination IPv4, UDP
source port, UDP destination port 4791, protocol 17) with a seeded hash and maps the hash to
a member of the ECMP group. Real ASICs offer CRC variants (CRC16/CRC32 with a configurable
seed) and, on newer parts, stronger mixes; the two models here are a seeded CRC32 (zlib's, the
seed as the initial register) and Murmur3 x86_32 (the seed as its seed). The member is picked
either by ``modulo`` (hash mod group size) or by ``fold16`` (xor of the hash's halves, then
mod: what 16-bit hash datapaths do).

For RoCEv2 only the UDP source port is free to choose per flow (the destination port is fixed
by the protocol and the addresses by the hosts), which is what ARK exploits: knowing the hash
lets a sender pick the port that lands on the spine it wants.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Callable

from blink.fabric.topology import LeafSpine

ROCE_V2_UDP_DPORT = 4791
# RoCEv2 source ports are taken from the dynamic range (the kernel's
# IB_ROCE_UDP_ENCAP_VALID_PORT_MIN..MAX): 16384 choices per flow.
ROCE_SPORT_MIN = 0xC000
ROCE_SPORT_MAX = 0xFFFF
UDP = 17
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class FiveTuple:
    """The header fields a switch hashes, as integers."""

    src_ip: int
    dst_ip: int
    src_port: int
    dst_port: int = ROCE_V2_UDP_DPORT
    protocol: int = UDP

    def key_bytes(self) -> bytes:
        """The fields in network byte order, as the switch's hash datapath sees them."""
        return struct.pack(">IIHHB", self.src_ip, self.dst_ip, self.src_port, self.dst_port,
                           self.protocol)


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3 x86_32 (Austin Appleby's reference), seed taken mod 2**32."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed & _MASK32
    nblocks = len(data) // 4
    for (k,) in struct.iter_unpack("<I", data[: nblocks * 4]):
        k = _rotl32((k * c1) & _MASK32, 15)
        h ^= (k * c2) & _MASK32
        h = (_rotl32(h, 13) * 5 + 0xE6546B64) & _MASK32
    tail = data[nblocks * 4:]
    if tail:
        k = int.from_bytes(tail, "little")
        k = _rotl32((k * c1) & _MASK32, 15)
        h ^= (k * c2) & _MASK32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def crc32_seeded(data: bytes, seed: int = 0) -> int:
    """CRC32 (IEEE 802.3 polynomial, zlib) with ``seed`` as the initial register value."""
    return zlib.crc32(data, seed & _MASK32)


HASH_ALGORITHMS: dict[str, Callable[[bytes, int], int]] = {
    "crc32": crc32_seeded,
    "murmur3": murmur3_32,
}
SELECTORS = ("modulo", "fold16")


@dataclass(frozen=True)
class EcmpHash:
    """One switch's ECMP hash: algorithm, seed and how the hash picks a group member."""

    algorithm: str = "crc32"
    seed: int = 0
    selector: str = "modulo"

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"EcmpHash.algorithm must be one of {sorted(HASH_ALGORITHMS)}, got {self.algorithm!r}")
        if self.selector not in SELECTORS:
            raise ValueError(f"EcmpHash.selector must be one of {list(SELECTORS)}, got {self.selector!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= _MASK32:
            raise ValueError(f"EcmpHash.seed must be a 32-bit unsigned integer, got {self.seed!r}")

    def hash(self, flow: FiveTuple) -> int:
        return HASH_ALGORITHMS[self.algorithm](flow.key_bytes(), self.seed)

    def select(self, flow: FiveTuple, group_size: int) -> int:
        """The index of the group member (here: the uplink, i.e. the spine) ``flow`` takes."""
        if group_size < 1:
            raise ValueError(f"an ECMP group needs at least one member, got {group_size}")
        h = self.hash(flow)
        if self.selector == "fold16":
            h = (h ^ (h >> 16)) & 0xFFFF
        return h % group_size


@dataclass(frozen=True)
class EcmpFabric:
    """A leaf-spine fabric with one ECMP hash per leaf: where a RoCEv2 flow actually goes.

    ``leaf_hashes`` has one entry per leaf, or a single entry every leaf uses (switches
    shipped with the same default seed). Used twice: as the switches' truth, and as a
    sender's belief about it (ARK's hash model), which is right only if the seed is.
    """

    topology: LeafSpine
    leaf_hashes: tuple[EcmpHash, ...] = (EcmpHash(),)

    def __post_init__(self) -> None:
        n = len(self.leaf_hashes)
        if n not in (1, self.topology.num_leaves):
            raise ValueError(
                f"EcmpFabric needs one hash for all leaves or one per leaf ({self.topology.num_leaves}), got {n}"
            )

    def hash_of_leaf(self, leaf: int) -> EcmpHash:
        return self.leaf_hashes[0 if len(self.leaf_hashes) == 1 else leaf]

    def flow(self, src: int, dst: int, sport: int) -> FiveTuple:
        if not ROCE_SPORT_MIN <= sport <= ROCE_SPORT_MAX:
            raise ValueError(f"RoCEv2 UDP source port must be in {ROCE_SPORT_MIN}..{ROCE_SPORT_MAX}, got {sport}")
        return FiveTuple(self.topology.host_ip(src), self.topology.host_ip(dst), sport)

    def spine_for(self, src: int, dst: int, sport: int) -> int | None:
        """The spine the source leaf hashes this flow to (``None``: same leaf, no spine)."""
        topo = self.topology
        if not topo.crosses_spine(src, dst):
            return None
        leaf_hash = self.hash_of_leaf(topo.leaf_of(src))
        return leaf_hash.select(self.flow(src, dst, sport), topo.num_spines)

