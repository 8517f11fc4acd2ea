"""ARK on the real KV transfers: the fabric file a prefill engine is started with, and the
path selector its :class:`~blink.engine.kv_transfer.KVSender` calls before each transfer.

``blink engine --role prefill --fabric FILE [--fabric-sender ID]`` (and ``blink serve
--disaggregated --fabric FILE``) reads a YAML or TOML file like::

    topology: {leaves: 4, spines: 4, hosts_per_leaf: 4}   # host_gbps / uplink_gbps optional
    hash: {algorithm: crc32, seed: 0, selector: modulo}   # the switches' ECMP hash
    # or one per leaf:  hashes: [{algorithm: crc32, seed: 7}, ...]
    senders:            # every prefill engine (ARK's senders), this one included
      prefill-0: {bus: 127.0.0.1:7600, leaf: 0, host: 0}
      prefill-1: {bus: 127.0.0.1:7601, leaf: 0, host: 1}
    decode:             # where each --kv-peer sits, in --kv-peer order
      - {leaf: 2, host: 0}
    ack_timeout_s: 2.0  # optional

``host`` is the index under the leaf (the model's address is 10.<leaf>.<host>.1,
:meth:`~blink.fabric.topology.LeafSpine.host_ip`). The prefill engine joins a
:class:`~blink.fabric.bus.TcpBus` on its ``bus`` address with every other sender, builds an
:class:`~blink.fabric.ark.ArkAgent` over the hash model, and :class:`ArkPathSelector` makes
each KV transfer reserve a spine (a RoCEv2 UDP source port) before its first write; the
sender releases the lease when the transfer is over, written or failed. Peers need not be up
at start: a sender that joins later gets every claim held (the protocol's state transfer).

Where the port goes: over ``verbs`` onto the ``kv_region`` queue pair
(:func:`~blink.fabric.roce.apply_udp_sport`: mlx5dv past RTR, which is what a connected queue
pair allows; it says in the log when it cannot); over ``loopback`` there is no wire, so the
port is chosen and reserved (other senders route around it) but applied nowhere, said once in
the log.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from blink.errors import BlinkError
from blink.fabric.ark import ArkAgent, PathLease, PathSelectionError, Transfer
from blink.fabric.ecmp import HASH_ALGORITHMS, SELECTORS, EcmpFabric, EcmpHash
from blink.fabric.topology import LeafSpine

logger = logging.getLogger("blink.fabric")


class FabricConfigError(BlinkError):
    """The fabric file is missing, unreadable or wrong (the message names the field)."""


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be HOST:PORT (for example 127.0.0.1:7600), got {value!r}")
    return host, int(port)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TopologySpec(_Strict):
    leaves: int = Field(ge=1)
    spines: int = Field(ge=1)
    hosts_per_leaf: int = Field(ge=1, le=255)
    host_gbps: float = Field(default=100.0, gt=0)
    uplink_gbps: float = Field(default=100.0, gt=0)


class HashSpec(_Strict):
    algorithm: str = "crc32"
    seed: int = Field(default=0, ge=0, le=0xFFFFFFFF)
    selector: str = "modulo"

    @field_validator("algorithm")
    @classmethod
    def _algorithm(cls, v: str) -> str:
        if v not in HASH_ALGORITHMS:
            raise ValueError(f"must be one of {sorted(HASH_ALGORITHMS)}")
        return v

    @field_validator("selector")
    @classmethod
    def _selector(cls, v: str) -> str:
        if v not in SELECTORS:
            raise ValueError(f"must be one of {list(SELECTORS)}")
        return v


class Placement(_Strict):
    """A host in the topology: its leaf and its index under that leaf."""

    leaf: int = Field(ge=0)
    host: int = Field(default=0, ge=0)


class SenderSpec(Placement):
    bus: str  # HOST:PORT this sender's ARK bus listens on

    @field_validator("bus")
    @classmethod
    def _bus(cls, v: str) -> str:
        _host_port(v)
        return v


class FabricFile(_Strict):
    topology: TopologySpec
    hash: HashSpec | None = None
    hashes: list[HashSpec] | None = None
    senders: dict[str, SenderSpec] = Field(min_length=1)
    decode: list[Placement] = Field(min_length=1)
    ack_timeout_s: float = Field(default=2.0, gt=0)


@dataclass(frozen=True)
class FabricConfig:
    """A parsed, checked fabric file (module docstring)."""

    topology: LeafSpine
    hashes: tuple[EcmpHash, ...]
    senders: dict[str, SenderSpec]
    decode: tuple[Placement, ...]
    ack_timeout_s: float
    source: str = "<dict>"

    @classmethod
    def load(cls, path: str | Path) -> "FabricConfig":
        path = Path(path)
        if not path.is_file():
            raise FabricConfigError(f"fabric file {path}: not found")
        try:
            text = path.read_text()
            if path.suffix.lower() == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as exc:  # the parsers raise many types; all mean "not a valid file"
            raise FabricConfigError(f"fabric file {path}: cannot parse it: {exc}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "FabricConfig":
        try:
            spec = FabricFile.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}"
                                 for e in exc.errors())
            raise FabricConfigError(f"fabric file {source}: {problems}") from None
        t = spec.topology
        topology = LeafSpine(t.leaves, t.spines, t.hosts_per_leaf, t.host_gbps, t.uplink_gbps)
        if spec.hash is not None and spec.hashes is not None:
            raise FabricConfigError(f"fabric file {source}: give 'hash' (every leaf) or 'hashes' "
                                    f"(one per leaf), not both")
        hashes = spec.hashes if spec.hashes is not None else [spec.hash or HashSpec()]
        if len(hashes) not in (1, t.leaves):
            raise FabricConfigError(f"fabric file {source}: hashes: one per leaf ({t.leaves}), "
                                    f"got {len(hashes)}")
        for where, place in [*((f"senders.{k}", v) for k, v in spec.senders.items()),
                             *((f"decode.{i}", v) for i, v in enumerate(spec.decode))]:
            if place.leaf >= t.leaves or place.host >= t.hosts_per_leaf:
                raise FabricConfigError(
                    f"fabric file {source}: {where}: leaf {place.leaf} host {place.host} is not in "
                    f"the topology ({t.leaves} leaves of {t.hosts_per_leaf} hosts)")
        return cls(topology, tuple(EcmpHash(h.algorithm, h.seed, h.selector) for h in hashes),
                   dict(spec.senders), tuple(spec.decode), spec.ack_timeout_s, source)

    def host_index(self, place: Placement) -> int:
        return place.leaf * self.topology.hosts_per_leaf + place.host

    def sender_id(self, chosen: str | None) -> str:
        """``chosen`` checked against the file, or the only sender when it names one."""
        if chosen is None:
            if len(self.senders) != 1:
                raise FabricConfigError(f"fabric file {self.source} names {len(self.senders)} senders "
                                        f"({', '.join(self.senders)}): say which one this engine is "
                                        f"(--fabric-sender)")
            return next(iter(self.senders))
        if chosen not in self.senders:
            raise FabricConfigError(f"--fabric-sender {chosen!r} is not among the senders of "
                                    f"{self.source} ({', '.join(self.senders)})")
        return chosen


class ArkPathSelector:
    """``KVSender.path_selector``: one ARK reservation per KV transfer (module docstring).

    ``selector(peer_index, transport, nbytes) -> PathLease | None``; the caller releases the
    lease once the transfer is over. ``None`` (the path could not be reserved) means the
    transfer goes on the transport's default path, logged: a KV transfer is never dropped for
    want of a path.
    """

    def __init__(self, config: FabricConfig, sender_id: str, kv_peers: Sequence[str], *,
                 bus: Any = None) -> None:
        if len(config.decode) != len(kv_peers):
            raise FabricConfigError(
                f"fabric file {config.source} places {len(config.decode)} decode engines "
                f"(decode:), this prefill engine has {len(kv_peers)} --kv-peer: give one "
                f"placement per --kv-peer, in the same order")
        self.config = config
        self.sender_id = config.sender_id(sender_id)
        me = config.senders[self.sender_id]
        self.src_host = config.host_index(me)
        self.dst_hosts = [config.host_index(p) for p in config.decode]
        self.kv_peers = list(kv_peers)
        if bus is None:
            from blink.fabric.bus import TcpBus

            members = {k: _host_port(v.bus) for k, v in config.senders.items()}
            try:
                bus = TcpBus(self.sender_id, members)
            except OSError as exc:
                raise FabricConfigError(f"ARK bus of sender {self.sender_id}: cannot listen on "
                                        f"{me.bus}: {exc}") from None
        self.agent = ArkAgent(bus, EcmpFabric(config.topology, config.hashes),
                              ack_timeout_s=config.ack_timeout_s)
        self._ids = itertools.count()
        self._said_unapplied: set[str] = set()
        logger.info("ARK path selection on (%s): sender %s on leaf %d, %d spines, %s hash seed %d; "
                    "%d other senders join as they start", config.source, self.sender_id, me.leaf,
                    config.topology.num_spines, config.hashes[0].algorithm, config.hashes[0].seed,
                    len(config.senders) - 1)

    def __call__(self, peer_index: int, transport: Any, nbytes: int) -> PathLease | None:
        transfer = Transfer(f"{self.sender_id}/kv{next(self._ids)}", self.src_host,
                            self.dst_hosts[peer_index], nbytes)
        try:
            lease = self.agent.choose_path(transfer)
        except PathSelectionError as exc:
            logger.warning("ARK: no path reserved for a KV transfer to %s (%s); it takes the "
                           "transport's default path", self.kv_peers[peer_index], exc)
            return None
        self._apply(peer_index, transport, lease)
        return lease

    def _apply(self, peer_index: int, transport: Any, lease: PathLease) -> None:
        kind = getattr(transport, "kind", "?")
        device = getattr(transport, "device_name", "") or ""
        peer = self.kv_peers[peer_index]
        if kind == "verbs" and device.startswith("mlx5"):
            from blink.fabric.roce import apply_udp_sport

            # the kv_region queue pair is connected: mlx5dv can still change its port
            control = apply_udp_sport(transport.qp.qp, device, lease.udp_sport)
            logger.debug("ARK: %s on spine %s, UDP source port %d (%s)", lease.lease_id,
                         lease.spine, lease.udp_sport, control.method)
            return
        if peer in self._said_unapplied:
            return
        self._said_unapplied.add(peer)
        if kind == "verbs":
            logger.warning("ARK: RDMA device %r has no per-queue-pair UDP source port call (only "
                           "mlx5dv has one; the flow label is fixed when the queue pair connects), "
                           "so KV transfers to %s take the NIC's default path: their ports are "
                           "reserved (other senders avoid them) but not applied", device, peer)
        else:
            logger.info("ARK: KV transfers to %s go over the %s transport, which has no wire: their "
                        "source ports are chosen and reserved (spine %s, port %d for the first) but "
                        "not applied", peer, kind, lease.spine, lease.udp_sport)

    def close(self) -> None:
        self.agent.close()
