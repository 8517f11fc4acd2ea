"""Disaggregated prefill/decode in one process (docs/disaggregation.md): a decode engine
reserves blocks, a prefill engine computes the prompt and writes its KV into them through the
loopback transport, the decode engine admits the row with no host work and continues it.
Greedy fp32 outputs must equal a colocated engine's; the bytes moved equal the prompt's KV
rounded to whole blocks; cancelled and force-cancelled reservations free their blocks.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import BASE, tiny_model_dir  # noqa: E402

from blink.dpu.ring_packing import pack_sampling  # noqa: E402
from blink.dpu.ring_protocol import KvRoute, RingClient  # noqa: E402
from blink.engine.engine import Engine, EngineConfig  # noqa: E402
from blink.engine.kv_transfer import KVLayout, block_runs  # noqa: E402
from blink.ring import (  # noqa: E402
    C_STAT_KV_BLOCKS_USED,
    C_STAT_KV_BYTES_SENT,
    C_STAT_KV_TRANSFERS,
    KV_RESERVE,
    KV_SEND,
    SLOT_FREE,
)
from blink.transport import BootstrapServer, LoopbackTransport  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SECRET = b"k" * 32
PROMPTS = [[5, 17, 99, 3, 44, 8, 120, 7, 66, 1, 2, 250, 9, 31, 77, 12, 200, 14, 15, 16, 90],
           [1, 2, 3], list(range(40, 90))]


def _config(model: Path, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", enforce_eager=True, block_size=8,
                        **{**BASE, **kw})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.mktemp("disagg"))
    decode = Engine(_config(model, role="decode"))
    server = BootstrapServer(decode.region, model_name="m", max_model_len=decode.max_model_len,
                             tokenizer="t", secret=SECRET, kv_region=decode.kv_region,
                             kv_layout=decode.kv_layout.to_dict(), extra={"engine_role": "decode"})
    host, port = server.start()
    prefill = Engine(_config(model, role="prefill", kv_peers=(f"{host}:{port}",)))
    prefill.attach_kv_peers(SECRET)
    both = Engine(_config(model))
    for e in (decode, prefill, both):
        e.start()
    clients = {name: RingClient(LoopbackTransport(e.region.name, e.region.total_bytes))
               for name, e in (("decode", decode), ("prefill", prefill), ("both", both))}
    yield {"decode": decode, "prefill": prefill, "both": both, "clients": clients}
    for c in clients.values():
        c.close()
    server.stop()
    for e in (prefill, decode, both):
        e.close()


def _drain(client: RingClient, handle, timeout_s: float = 60.0):
    """(tokens, finish reason, reservation) of one request, polled to the end."""
    tokens, reservation = [], None
    deadline = time.monotonic() + timeout_s
    while not handle.done:
        out = client.poll(handle)
        if out is not None:
            tokens += out.token_ids
            reservation = reservation or out.kv_reservation
        assert time.monotonic() < deadline, "request did not finish"
        time.sleep(0.001)
    return tokens, handle.finish_reason, reservation


def _wait_reservation(client: RingClient, handle, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        out = client.poll(handle)
        if out is not None and out.kv_reservation is not None:
            return out.kv_reservation
        assert time.monotonic() < deadline, "no reservation"
        time.sleep(0.001)


def _disaggregated(engines, prompt: list[int], max_tokens: int) -> list[int]:
    cd, cp = engines["clients"]["decode"], engines["clients"]["prefill"]
    full = pack_sampling(cd.config, temperature=0.0, max_tokens=max_tokens, ignore_eos=1)
    h_d = cd.submit(cd.new_request_id(), prompt, full, kv=KvRoute(KV_RESERVE))
    slot, seq, blocks = _wait_reservation(cd, h_d)
    assert len(blocks) == -(-len(prompt) // 8)
    first = pack_sampling(cp.config, temperature=0.0, max_tokens=1, ignore_eos=1)
    h_p = cp.submit(cp.new_request_id(), prompt, first,
                    kv=KvRoute(KV_SEND, peer=0, slot=slot, seq=seq, blocks=tuple(blocks)))
    head, reason, _ = _drain(cp, h_p)
    assert reason == "length" and len(head) == 1
    rest, reason, _ = _drain(cd, h_d)
    assert reason == "length"
    return head + rest


def _colocated(engines, prompt: list[int], max_tokens: int) -> list[int]:
    cb = engines["clients"]["both"]
    h = cb.submit(cb.new_request_id(), prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=1)
    return _drain(cb, h)[0]


def test_disaggregated_greedy_equals_colocated_and_moves_the_prompts_kv(engines):
    layout: KVLayout = engines["decode"].kv_layout
    sent_before = int(engines["prefill"].ring.control[C_STAT_KV_BYTES_SENT])
    for prompt in PROMPTS:
        assert _disaggregated(engines, prompt, 12) == _colocated(engines, prompt, 12)
    expected = sum(2 * layout.num_layers * layout.kv_heads * layout.head_dim * 4 * 8 * -(-len(p) // 8)
                   for p in PROMPTS)
    assert layout.bytes_for(len(PROMPTS[0])) == 2 * layout.num_layers * 3 * layout.block_nbytes
    assert int(engines["prefill"].ring.control[C_STAT_KV_BYTES_SENT]) - sent_before == expected
    assert int(engines["prefill"].ring.control[C_STAT_KV_TRANSFERS]) >= len(PROMPTS)
    _assert_nothing_held(engines)


def _assert_nothing_held(engines) -> None:
    for name in ("decode", "prefill"):
        engine, client = engines[name], engines["clients"][name]
        deadline = time.monotonic() + 10
        while int(engine.ring.control[C_STAT_KV_BLOCKS_USED]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int(engine.ring.control[C_STAT_KV_BLOCKS_USED]) == 0, name
        assert (np.asarray(engine.ring.state) == SLOT_FREE).all(), name
        assert not client.active


def test_cancelled_reservation_waits_for_its_kv_unless_forced(engines):
    cd, cp = engines["clients"]["decode"], engines["clients"]["prefill"]
    decode = engines["decode"]
    prompt = PROMPTS[2]
    full = pack_sampling(cd.config, temperature=0.0, max_tokens=8, ignore_eos=1)
    # a plain cancel: the reservation holds its blocks until the KV is there, then aborts
    h = cd.submit(cd.new_request_id(), prompt, full, kv=KvRoute(KV_RESERVE))
    slot, seq, blocks = _wait_reservation(cd, h)
    cd.cancel(h)
    time.sleep(0.2)
    assert not h.done and int(decode.ring.control[C_STAT_KV_BLOCKS_USED]) == len(blocks)
    first = pack_sampling(cp.config, temperature=0.0, max_tokens=1, ignore_eos=1)
    h_p = cp.submit(cp.new_request_id(), prompt, first,
                    kv=KvRoute(KV_SEND, peer=0, slot=slot, seq=seq, blocks=tuple(blocks)))
    _drain(cp, h_p)
    assert _drain(cd, h)[1] == "abort"
    # a forced cancel (the prefill engine is gone): freed at once
    h = cd.submit(cd.new_request_id(), prompt, full, kv=KvRoute(KV_RESERVE))
    _wait_reservation(cd, h)
    cd.cancel(h, force=True)
    assert _drain(cd, h)[1] == "abort"
    _assert_nothing_held(engines)


def test_block_runs_coalesce_consecutive_blocks():
    assert block_runs([4, 5, 6, 9], [10, 11, 3, 4]) == [(4, 10, 2), (6, 3, 1), (9, 4, 1)]
    assert block_runs([], []) == []


def test_bootstrap_offers_the_kv_region_only_to_prefill_roles_of_a_decode_engine(engines):
    from blink.transport import HandshakeError, connect

    decode = engines["decode"]
    server = BootstrapServer(decode.region, model_name="m", max_model_len=decode.max_model_len,
                             tokenizer="t", secret=SECRET, kv_region=decode.kv_region,
                             kv_layout=decode.kv_layout.to_dict())
    plain = BootstrapServer(engines["both"].region, model_name="m", max_model_len=256,
                            tokenizer="t", secret=SECRET)
    with server, plain:
        info, kv = connect(*server.address, secret=SECRET, role="kv_region", timeout_s=5)
        assert kv.total_bytes == decode.kv_layout.total_bytes
        assert KVLayout.from_dict(info.connection["kv_layout"]) == decode.kv_layout
        kv.close()
        with pytest.raises(HandshakeError, match="no KV region"):
            connect(*plain.address, secret=SECRET, role="kv_region", timeout_s=5)
        with pytest.raises(HandshakeError, match="no KV region"):
            connect(*plain.address, secret=SECRET, role="kv_writer", timeout_s=5)


class _WritesOnly:
    """A transport with ``write`` and nothing else (verbs today): one write per piece."""

    def __init__(self, inner) -> None:
        self.inner, self.writes = inner, 0

    def write(self, offset, data) -> None:
        self.writes += 1
        self.inner.write(offset, data)


@pytest.mark.parametrize("copy_list", [True, False], ids=["write_segments", "write"])
@pytest.mark.parametrize("shuffled", [False, True])
def test_write_blocks_puts_every_block_where_the_decode_engine_reads_it(shuffled, copy_list):
    import random

    import torch

    from blink.engine.kv_transfer import write_blocks
    from blink.transport import LoopbackRegion

    layout = KVLayout(2, 40, 4, 2, 8, "float32")
    caches = [(torch.randn(41, 4, 2, 8), torch.randn(41, 4, 2, 8)) for _ in range(2)]
    n = 16
    rng = random.Random(1)
    src = rng.sample(range(40), n) if shuffled else list(range(5, 5 + n))
    dst = rng.sample(range(40), n) if shuffled else list(range(20, 20 + n))
    with LoopbackRegion(layout.total_bytes) as region:
        transport = LoopbackTransport(region.name, layout.total_bytes)
        target = transport if copy_list else _WritesOnly(transport)
        assert write_blocks(target, layout, caches, src, dst) == 2 * 2 * n * layout.block_nbytes
        if not copy_list:  # one write per layer, K/V and run of consecutive blocks
            assert target.writes == 2 * 2 * len(block_runs(src, dst))
        remote = torch.frombuffer(region.buffer, dtype=torch.float32).view(2, 2, 41, 4, 2, 8)
        for layer in range(2):
            for kv in range(2):
                assert torch.equal(remote[layer, kv][dst], caches[layer][kv][src])
        untouched = sorted(set(range(41)) - set(dst))
        assert not remote[:, :, untouched].any()
        transport.close()
        del remote


def test_the_prefill_engine_streams_each_layer_during_the_forward(engines, monkeypatch):
    import blink.engine.kv_transfer as kvt

    sender = engines["prefill"].kv_sender
    real, seen = kvt.BlockWrite.write, []

    def spy(self, layers=None):
        st = sender.scheduler.state  # what update() has counted so far, per streamed row
        seen.append((None if layers is None else list(layers),
                     [int(st.num_computed[t.row]) for t in sender._streams]))
        return real(self, layers)

    monkeypatch.setattr(kvt.BlockWrite, "write", spy)
    prompt, streamed = PROMPTS[2], sender.streamed
    assert _disaggregated(engines, prompt, 6) == _colocated(engines, prompt, 6)
    layers = engines["decode"].kv_layout.num_layers
    assert [w for w, _ in seen] == [[layer] for layer in range(layers)]  # one call per layer
    # every layer went before the step's update counted the prompt as computed: mid-forward
    assert all(c < len(prompt) for _, computed in seen for c in computed) and seen[0][1]
    assert sender.streamed == streamed + 1
    sender.stream_layers = False  # the same request, sent whole after its step: same tokens
    try:
        seen.clear()
        assert _disaggregated(engines, prompt, 6) == _colocated(engines, prompt, 6)
        assert seen == [(list(range(layers)), [])]  # one write, all layers, no stream open
    finally:
        sender.stream_layers = True
    _assert_nothing_held(engines)
