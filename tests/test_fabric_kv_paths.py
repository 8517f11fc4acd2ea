"""ARK wired into the KV transfers (blink/fabric/kv_paths.py, docs/disaggregation.md "Path
selection"): the fabric file, two prefill senders on one machine reserving distinct spines
over a real TCP bus, and the KV sender taking a lease before its writes and giving it back
whatever happens to them (written, failed, peer unreachable); the sender's layer-by-layer
streaming (each layer's pieces right after that layer's forward, one lease for them all)."""
from __future__ import annotations

import argparse
import socket
import threading
import time
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from blink.engine.kv_transfer import KVSender
from blink.engine.sched.state import KV_ROUTE_MODE, KV_ROUTE_PEER, KV_ROUTE_SEQ, KV_ROUTE_SLOT, ROW_RELEASING
from blink.fabric.bus import InProcessHub
from blink.fabric.ecmp import EcmpFabric
from blink.fabric.kv_paths import ArkPathSelector, FabricConfig, FabricConfigError
from blink.ring import FINISH_LENGTH, KV_SEND, RingConfig, RingLayout
from blink.transport import TransportError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fabric(ports=(7600, 7601), seed: int = 7) -> dict:
    return {"topology": {"leaves": 2, "spines": 4, "hosts_per_leaf": 4},
            "hash": {"algorithm": "crc32", "seed": seed},
            "senders": {f"prefill-{i}": {"bus": f"127.0.0.1:{p}", "leaf": 0, "host": i}
                        for i, p in enumerate(ports)},
            "decode": [{"leaf": 1, "host": 0}]}


def _wait(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_fabric_file_is_read_and_bad_fields_are_named(tmp_path):
    path = tmp_path / "fabric.yaml"
    path.write_text("topology: {leaves: 2, spines: 4, hosts_per_leaf: 4}\n"
                    "hash: {algorithm: murmur3, seed: 9, selector: fold16}\n"
                    "senders: {p0: {bus: '127.0.0.1:7600', leaf: 0}}\n"
                    "decode: [{leaf: 1, host: 2}]\n")
    config = FabricConfig.load(path)
    assert config.topology.num_spines == 4 and config.hashes[0].seed == 9
    assert config.hashes[0].selector == "fold16"
    assert config.sender_id(None) == "p0" and config.host_index(config.decode[0]) == 6
    bad = _fabric()
    bad["hash"]["algorithm"] = "md5"
    with pytest.raises(FabricConfigError, match=r"hash\.algorithm: .*must be one of"):
        FabricConfig.from_dict(bad)
    bad = _fabric()
    bad["senders"]["prefill-1"]["leaf"] = 5
    with pytest.raises(FabricConfigError, match=r"senders\.prefill-1: leaf 5 host 1 is not in the topology"):
        FabricConfig.from_dict(bad)
    bad = _fabric()
    bad["senders"]["prefill-0"]["bus"] = "nowhere"
    with pytest.raises(FabricConfigError, match=r"senders\.prefill-0\.bus.*HOST:PORT"):
        FabricConfig.from_dict(bad)
    with pytest.raises(FabricConfigError, match="--fabric-sender"):
        FabricConfig.from_dict(_fabric()).sender_id(None)
    with pytest.raises(FabricConfigError, match="one placement per --kv-peer"):
        ArkPathSelector(FabricConfig.from_dict(_fabric()), "prefill-0", ["a:1", "b:2"],
                        bus=InProcessHub().join("prefill-0"))


def test_the_example_fabric_file_is_valid():
    from pathlib import Path

    config = FabricConfig.load(Path(__file__).resolve().parents[1] / "configs" / "fabric" / "example.yaml")
    assert sorted(config.senders) == ["prefill-0", "prefill-1"] and len(config.decode) == 1


def test_serve_refuses_a_fabric_that_does_not_fit_its_engines(tmp_path):
    from blink.errors import BlinkError
    from blink.launcher import check_disaggregation_flags, fabric_senders

    import yaml

    path = tmp_path / "fabric.yaml"
    path.write_text(yaml.safe_dump(_fabric()))
    args = argparse.Namespace(disaggregated=True, prefill_engines=2, decode_engines=1, loop="cpu",
                              fabric=path)
    assert fabric_senders(args) == ["prefill-0", "prefill-1"]
    args.prefill_engines = 3
    with pytest.raises(BlinkError, match="one sender per prefill engine"):
        check_disaggregation_flags(args)
    with pytest.raises(BlinkError, match="--fabric is for --disaggregated"):
        check_disaggregation_flags(argparse.Namespace(disaggregated=False, prefill_engines=1,
                                                      decode_engines=1, fabric=path))


class _Wire:
    kind = "loopback"


def test_two_prefill_senders_on_a_tcp_bus_reserve_distinct_spines():
    config = FabricConfig.from_dict(_fabric((_free_port(), _free_port())))
    a = ArkPathSelector(config, "prefill-0", ["127.0.0.1:9"])
    b = ArkPathSelector(config, "prefill-1", ["127.0.0.1:9"])
    truth = EcmpFabric(config.topology, config.hashes)  # the switches hash as the file says
    try:
        a.agent.wait_peers(["prefill-1"])
        b.agent.wait_peers(["prefill-0"])
        for round_ in range(6):  # both claim at once, several rounds: never the same spine
            # a real contest: uncoordinated, both would take the same spine first (the planner
            # breaks ties by the transfer id's CRC, and these ids collide mod 4 every round)
            assert len({zlib.crc32(f"prefill-{i}/kv{round_}".encode()) % 4 for i in (0, 1)}) == 1
            leases: dict[str, object] = {}
            start = threading.Barrier(2)

            def claim(name, selector):
                start.wait()
                leases[name] = selector(0, _Wire(), 1 << 20)

            threads = [threading.Thread(target=claim, args=(n, s)) for n, s in (("a", a), ("b", b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            la, lb = leases["a"], leases["b"]
            assert la.spine != lb.spine and not la.shared and not lb.shared
            for selector in (a, b):  # each learnt the other's claim over the bus
                assert {c.sender for c in selector.agent.known_claims()} == {"prefill-0", "prefill-1"}
            for lease, src in ((la, a.src_host), (lb, b.src_host)):
                assert truth.spine_for(src, a.dst_hosts[0], lease.udp_sport) == lease.spine
            la.release()
            lb.release()
            _wait(lambda: not a.agent.known_claims() and not b.agent.known_claims())
    finally:
        a.close()
        b.close()


class _FakeKV:
    """The decode engine's KV region as the sender sees it; ``fail`` makes writes fail."""

    kind = "loopback"

    def __init__(self, fail: bool, during_write=None, fail_after: int = 0) -> None:
        self.fail, self.during_write, self.writes, self.fail_after = fail, during_write, 0, fail_after
        self.offsets: list[int] = []

    def write(self, offset, data) -> None:
        if self.during_write is not None:
            self.during_write()
        if self.fail and self.writes >= self.fail_after:
            raise TransportError("the peer went away mid-transfer")
        self.writes += 1
        self.offsets.append(offset)

    def fence(self) -> None:
        pass

    def close(self) -> None:
        pass


class _FakeRing(_FakeKV):
    def peer_alive(self) -> bool:
        return True


def _sender(kv: _FakeKV, address: str = "127.0.0.1:9", layers: int = 1) -> KVSender:
    """A KVSender over one finished KV_SEND row (4 prompt tokens, blocks of 2), its peer
    already attached to fake transports; the executor's model has the per-layer callback."""
    caches = [(torch.zeros(5, 2, 1, 4), torch.zeros(5, 2, 1, 4)) for _ in range(layers)]
    executor = SimpleNamespace(kv_caches=caches, num_blocks=4, block_size=2,
                               model=SimpleNamespace(on_layer=None))
    route = torch.zeros(1, 4, dtype=torch.long)
    route[0, KV_ROUTE_MODE], route[0, KV_ROUTE_PEER], route[0, KV_ROUTE_SLOT], route[0, KV_ROUTE_SEQ] = KV_SEND, 0, 0, 1
    state = SimpleNamespace(kv_route=route, status=torch.tensor([ROW_RELEASING]),
                            num_prompt=torch.tensor([4]), num_computed=torch.tensor([4]),
                            block_table=torch.tensor([[1, 2]]), kv_dest_blocks=torch.tensor([[0, 3]]),
                            tokens=torch.tensor([[5, 6, 7, 8, 9]]),
                            sampling={"max_tokens": torch.tensor([1])})
    scheduler = SimpleNamespace(state=state, ring={"finish_reason": torch.tensor([FINISH_LENGTH])})
    sender = KVSender(scheduler, executor, torch.float32, np.zeros(64, dtype=np.int64), [address], None)
    peer = sender.peers[0]
    peer.ring, peer.kv, peer.layout = _FakeRing(False, None), kv, sender.layout
    peer.ring_layout = RingLayout(RingConfig(n_slots=2, arena_tokens=64, max_model_len=64, max_kv_blocks=2))
    return sender


@pytest.mark.parametrize("fail", [False, True])
def test_kv_sender_holds_a_lease_only_while_it_writes(fail):
    hub = InProcessHub()
    config = FabricConfig.from_dict(_fabric())
    other = ArkPathSelector(config, "prefill-1", ["127.0.0.1:9"], bus=hub.join("prefill-1"))
    mine = ArkPathSelector(config, "prefill-0", ["127.0.0.1:9"], bus=hub.join("prefill-0"))
    seen: list[int] = []
    # What the other sender knows of this one's claims at each write. choose_path returns
    # once every peer acked the claim, i.e. recorded it (pending or already marked held: the
    # "held" re-broadcast may still be on its way), and a recorded claim is what the other
    # sender's planner avoids.
    kv = _FakeKV(fail, during_write=lambda: seen.append(
        sum(c.sender == "prefill-0" for c in other.agent.known_claims())))
    sender = _sender(kv)
    sender.path_selector = mine
    try:
        mine.agent.wait_peers(["prefill-1"])
        sender.after_step()
        # every write ran under this sender's claim, as the other sender saw it
        assert seen and all(n == 1 for n in seen)
        assert (sender.failures, sender.transfers) == ((1, 0) if fail else (0, 1))
        _wait(lambda: not mine.agent.known_claims() and not other.agent.known_claims())
    finally:
        sender.close()  # closes the selector (its bus) too
        other.close()


def test_kv_sender_takes_no_lease_when_the_peer_cannot_be_reached():
    calls: list[int] = []
    sender = _sender(_FakeKV(False), address=f"127.0.0.1:{_free_port()}")
    sender.peers[0].close()  # not attached: the sender must connect, and nobody listens
    sender.path_selector = lambda peer, transport, nbytes: calls.append(peer)
    sender.after_step()
    assert sender.failures == 1 and not calls


def test_over_verbs_the_port_goes_onto_the_queue_pair_where_the_device_allows(monkeypatch, caplog):
    import blink.fabric.roce as roce

    applied: list[tuple] = []
    monkeypatch.setattr(roce, "apply_udp_sport", lambda qp, dev, port: applied.append((qp, dev, port))
                        or roce.SportControl("mlx5dv", port))
    hub = InProcessHub()
    selector = ArkPathSelector(FabricConfig.from_dict(_fabric()), "prefill-0", ["127.0.0.1:9"],
                               bus=hub.join("prefill-0"))
    qp = object()
    try:
        mlx5 = SimpleNamespace(kind="verbs", device_name="mlx5_0", qp=SimpleNamespace(qp=qp))
        lease = selector(0, mlx5, 1 << 20)
        assert applied == [(qp, "mlx5_0", lease.udp_sport)]
        lease.release()
        rxe = SimpleNamespace(kind="verbs", device_name="rxe0", qp=SimpleNamespace(qp=qp))
        with caplog.at_level("WARNING", logger="blink.fabric"):
            for _ in range(2):
                selector(0, rxe, 1 << 20).release()
        assert len(applied) == 1  # no call that cannot work, and one warning, not one per transfer
        said = [r for r in caplog.records if "no per-queue-pair UDP source port" in r.message]
        assert len(said) == 1 and "rxe0" in said[0].message
    finally:
        selector.close()


def _stream_step(sender: KVSender, layers: int, heartbeat: list[int]) -> list[int]:
    """One prefill step as the CPU loop runs it, the row's last 3 prompt tokens in it:
    schedule -> before_forward -> the forward's layers (each calling on_layer) -> update ->
    after_step. Returns the writes seen after each layer."""
    st, model, kv = sender.scheduler.state, sender.executor.model, sender.peers[0].kv
    model.on_layer = lambda: heartbeat.append(1)  # the engine's own per-layer callback
    st.status[0], st.num_computed[0] = 2, 1  # RUNNING, one prompt token from an earlier chunk
    sender.before_forward(SimpleNamespace(num_new_tokens=torch.tensor([3])))
    writes = []
    for _ in range(layers):
        model.on_layer()
        writes.append(kv.writes)
    st.status[0], st.num_computed[0] = ROW_RELEASING, 4  # update(): the token, the finish
    sender.after_step()
    return writes


def test_kv_streams_layer_by_layer_during_the_forward_under_one_lease():
    hub = InProcessHub()
    config = FabricConfig.from_dict(_fabric())
    other = ArkPathSelector(config, "prefill-1", ["127.0.0.1:9"], bus=hub.join("prefill-1"))
    mine = ArkPathSelector(config, "prefill-0", ["127.0.0.1:9"], bus=hub.join("prefill-0"))
    kv = _FakeKV(False)
    sender = _sender(kv, layers=3)
    sender.path_selector = mine
    heartbeat: list[int] = []
    try:
        mine.agent.wait_peers(["prefill-1"])
        writes = _stream_step(sender, 3, heartbeat)
        # four pieces (K and V of blocks 1 -> 0 and 2 -> 3) after each layer, not all at the end
        assert writes == [4, 8, 12] and len(heartbeat) == 3
        assert sender.executor.model.on_layer is not None and sender._hooked is None  # restored
        layout = sender.layout
        assert kv.offsets == [layout.offset(layer, k, b) for layer in range(3) for k in (0, 1) for b in (0, 3)]
        assert (sender.transfers, sender.streamed, sender.failures) == (1, 1, 0)
        assert sender.bytes_sent == layout.bytes_for(4)
        assert sender.peers[0].ring.writes == 2  # the first token, then the ready word
        _wait(lambda: not mine.agent.known_claims() and not other.agent.known_claims())
    finally:
        sender.close()
        other.close()


def test_a_stream_that_fails_mid_forward_releases_its_lease_and_publishes_nothing():
    hub = InProcessHub()
    config = FabricConfig.from_dict(_fabric())
    other = ArkPathSelector(config, "prefill-1", ["127.0.0.1:9"], bus=hub.join("prefill-1"))
    mine = ArkPathSelector(config, "prefill-0", ["127.0.0.1:9"], bus=hub.join("prefill-0"))
    sender = _sender(_FakeKV(True, fail_after=4), layers=3)  # layer 0 lands, layer 1 fails
    sender.path_selector = mine
    ring = sender.peers[0].ring
    try:
        mine.agent.wait_peers(["prefill-1"])
        writes = _stream_step(sender, 3, [])
        assert writes == [4, 4, 4]  # nothing after the failure
        assert (sender.transfers, sender.failures) == (0, 1) and ring.writes == 0
        assert sender.peers[0].kv is None  # closed: reconnected at its next use
        _wait(lambda: not mine.agent.known_claims() and not other.agent.known_claims())
    finally:
        sender.close()
        other.close()


def test_without_streaming_the_kv_goes_whole_after_the_step():
    kv = _FakeKV(False)
    sender = _sender(kv, layers=3)
    sender.stream_layers = False
    assert _stream_step(sender, 3, []) == [0, 0, 0]  # nothing during the forward
    assert kv.writes == 12 and (sender.transfers, sender.streamed) == (1, 0)


def test_layers_the_forward_did_not_announce_go_after_the_step():
    kv = _FakeKV(False)
    sender = _sender(kv, layers=3)
    assert _stream_step(sender, 1, []) == [4]  # a forward that called on_layer once only
    assert kv.writes == 12 and (sender.transfers, sender.failures) == (1, 0)
    assert kv.offsets[4:] == [sender.layout.offset(layer, k, b) for layer in (1, 2) for k in (0, 1) for b in (0, 3)]
