"""ECMP hash models (blink/fabric/ecmp.py) and the leaf-spine topology."""
from __future__ import annotations

import zlib

import pytest

from blink.fabric.ecmp import ROCE_SPORT_MIN, EcmpFabric, EcmpHash, FiveTuple, crc32_seeded, murmur3_32
from blink.fabric.topology import LeafSpine, Link


@pytest.mark.parametrize("data, seed, expected", [
    (b"", 0, 0x00000000),
    (b"", 1, 0x514E28B7),
    (b"", 0xFFFFFFFF, 0x81F16F39),
    (b"\0\0\0\0", 0, 0x2362F9DE),
    (b"aaaa", 0x9747B28C, 0x5A97808A),
    (b"Hello, world!", 0x9747B28C, 0x24884CBA),
    (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
])
def test_murmur3_matches_reference_vectors(data, seed, expected):
    assert murmur3_32(data, seed) == expected


def test_crc32_is_zlib_with_the_seed_as_initial_register():
    assert crc32_seeded(b"123456789") == 0xCBF43926  # the CRC-32 check value
    assert crc32_seeded(b"abc", 77) == zlib.crc32(b"abc", 77) != crc32_seeded(b"abc", 78)


def test_five_tuple_bytes_are_network_order():
    ft = FiveTuple(0x0A000001, 0x0A010001, 0xC001)
    assert ft.key_bytes() == bytes.fromhex("0a000001" "0a010001" "c001" "12b7" "11")


@pytest.mark.parametrize("algorithm", ["crc32", "murmur3"])
@pytest.mark.parametrize("selector", ["modulo", "fold16"])
def test_select_spreads_ports_over_every_member(algorithm, selector):
    h = EcmpHash(algorithm, 1234, selector)
    counts = [0] * 6
    for sport in range(ROCE_SPORT_MIN, ROCE_SPORT_MIN + 6000):
        counts[h.select(FiveTuple(0x0A000001, 0x0A040001, sport), 6)] += 1
    assert min(counts) > 850 and max(counts) < 1150  # 1000 each if uniform


def test_seed_changes_murmur_placement():
    a, b = EcmpHash("murmur3", 1), EcmpHash("murmur3", 2)
    flows = [FiveTuple(0x0A000001, 0x0A040001, p) for p in range(ROCE_SPORT_MIN, ROCE_SPORT_MIN + 200)]
    assert sum(a.select(f, 4) != b.select(f, 4) for f in flows) > 100


@pytest.mark.parametrize("kwargs, field", [
    ({"algorithm": "sha1"}, "algorithm"), ({"selector": "random"}, "selector"), ({"seed": -1}, "seed"),
    ({"seed": 1 << 32}, "seed"),
])
def test_hash_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EcmpHash(**kwargs)


def test_topology_paths_and_capacities():
    topo = LeafSpine(num_leaves=3, num_spines=2, hosts_per_leaf=2, host_gbps=100, uplink_gbps=200)
    assert topo.num_hosts == 6 and topo.leaf_of(5) == 2
    assert topo.path(0, 1, None) == (Link("host-up", 0), Link("host-down", 1))
    assert topo.path(0, 4, 1) == (Link("host-up", 0), Link("up", 0, 1), Link("down", 1, 2), Link("host-down", 4))
    assert topo.capacity(Link("up", 0, 1)) == 2 * topo.capacity(Link("host-up", 0)) == 25e9
    with pytest.raises(ValueError, match="needs a spine"):
        topo.path(0, 4, None)
    with pytest.raises(ValueError, match="host 6"):
        topo.leaf_of(6)
    with pytest.raises(ValueError, match="num_spines"):
        LeafSpine(2, 0, 2)


def test_fabric_routes_by_the_source_leafs_hash():
    topo = LeafSpine(2, 4, 2)
    per_leaf = EcmpFabric(topo, (EcmpHash("murmur3", 1), EcmpHash("murmur3", 2)))
    ft = per_leaf.flow(0, 2, 50000)
    assert per_leaf.spine_for(0, 2, 50000) == EcmpHash("murmur3", 1).select(ft, 4)
    assert per_leaf.spine_for(0, 1, 50000) is None  # same leaf
    with pytest.raises(ValueError, match="source port"):
        per_leaf.spine_for(0, 2, 1000)
    with pytest.raises(ValueError, match="one per leaf"):
        EcmpFabric(topo, (EcmpHash(),) * 3)
