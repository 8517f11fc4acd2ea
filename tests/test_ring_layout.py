"""The ring layout (blink/ring.py) and the publish order the frontend follows.

Headers are validated (magic, version, size); field offsets address exactly what the numpy views
show; a request is never visible to the engine before its state word, even over a transport that
reorders writes freely between fences; tokens are not consumed before the produced counter.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from blink.dpu.ring_protocol import RingClient, attach_layout
from blink.ring import (
    ALIGN,
    C_MAGIC,
    C_TOTAL_BYTES,
    C_VERSION,
    CONTROL_WORDS,
    LAYOUT_VERSION,
    SLOT_WRITTEN,
    Ring,
    RingConfig,
    RingLayout,
    RingLayoutError,
    read_header,
)
from blink.transport.base import as_byte_array

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_ring_fake_engine import FakeEngine, make_ring  # noqa: E402

SMALL = dict(n_slots=5, arena_tokens=100, stream_capacity=4, max_logprobs=2, max_stop_ids=3,
             max_logit_bias=2, max_model_len=50)


class MemoryTransport:
    """The Transport protocol over a local buffer (what the engine sees is the same buffer)."""

    kind = "memory"

    def __init__(self, buffer) -> None:
        self.mem = np.frombuffer(buffer, dtype=np.uint8)
        self.total_bytes = self.mem.size

    def write(self, offset, data):
        src = as_byte_array(data)
        self.mem[offset : offset + src.size] = src

    def read(self, offset, nbytes):
        return self.mem[offset : offset + nbytes].copy()

    def fence(self):
        pass

    def close(self):
        pass


class ReorderingTransport(MemoryTransport):
    """Weakest legal ordering: writes between two fences land in a random order, one at a time,
    and an observer (the engine) looks at memory after every single landing."""

    def __init__(self, buffer, observer, seed: int) -> None:
        super().__init__(buffer)
        self.pending: list[tuple[int, np.ndarray]] = []
        self.observer = observer
        self.rng = random.Random(seed)

    def write(self, offset, data):
        self.pending.append((offset, as_byte_array(data).copy()))

    def _land(self):
        self.rng.shuffle(self.pending)
        while self.pending:
            offset, src = self.pending.pop()
            self.mem[offset : offset + src.size] = src
            self.observer()

    def fence(self):
        self._land()

    def read(self, offset, nbytes):
        self._land()  # a side always sees its own earlier writes
        return super().read(offset, nbytes)


# -- layout -----------------------------------------------------------------------------------


def test_fields_are_aligned_disjoint_and_inside_the_region():
    layout = RingLayout(RingConfig(**SMALL))
    spans = sorted((f.offset, f.offset + f.nbytes, f.name) for f in layout.regions.values())
    assert spans[0][2] == "control" and spans[0][0] == 0
    for (_, a1, _), (b0, _, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert all(f.offset % ALIGN == 0 for f in layout.regions.values())
    assert spans[-1][1] <= layout.total_bytes and layout.total_bytes % ALIGN == 0
    # The request record's fields: aligned to their item size, disjoint, inside the record.
    record = layout.regions["request"]
    assert record.row_stride % 8 == 0
    subs = sorted((f.offset - record.offset, f.offset - record.offset + f.row_nbytes, f.name)
                  for f in layout if f.record == "request")
    assert subs and subs[0][0] == 0 and subs[-1][1] <= record.row_stride
    for (_, a1, _), (b0, _, _) in zip(subs, subs[1:]):
        assert a1 <= b0
    for f in layout:
        if f.record is not None:
            assert f.offset % f.dtype.itemsize == 0 and f.row_stride == record.row_stride
    assert set(layout.fields) == set(layout.regions) | {s[2] for s in subs}


def test_no_prompt_logprob_lanes_take_no_bytes():
    """An engine without prompt-logprob lanes (--prompt-logprobs-lanes 0, or a step that
    computes none) reserves none: its ring is exactly one lane (its four fields, each padded to
    ALIGN) smaller than with one lane; the empty fields still view (shape [0, max_model_len])."""
    plp = ("plp_logprob", "plp_rank", "plp_top_ids", "plp_top_logprobs")
    layouts = [RingLayout(RingConfig(**SMALL, prompt_logprob_lanes=n)) for n in (0, 1, 2)]
    m, top = SMALL["max_model_len"], SMALL["max_logprobs"]
    lane = sum(-(-nbytes // ALIGN) * ALIGN for nbytes in (4 * m, 4 * m, 4 * m * top, 4 * m * top))
    assert all(layouts[0].regions[name].nbytes == 0 for name in plp)
    assert layouts[1].total_bytes - layouts[0].total_bytes == lane
    assert sum(-(-layouts[1].regions[name].nbytes // ALIGN) * ALIGN for name in plp) == lane
    assert layouts[2].total_bytes > layouts[1].total_bytes
    ring = make_ring(**SMALL, prompt_logprob_lanes=0)
    assert ring.plp_top_ids.shape == (0, m, top) and ring.plp_logprob.size == 0


def test_element_offsets_match_the_numpy_views():
    ring = make_ring(**SMALL)
    t = MemoryTransport(ring.buffer)
    spec = ring.layout.fields
    t.write(spec["seed"].element_offset(3), np.array(123456789, "<i8"))
    t.write(spec["top_ids"].element_offset((2, 1)), np.array([7, 8], "<i4"))
    t.write(spec["arena"].element_offset(99), np.array(5, "<i4"))
    assert ring.seed[3] == 123456789 and ring.seed.sum() == 123456789
    assert ring.top_ids[2, 1].tolist() == [7, 8] and ring.top_ids.sum() == 15
    assert ring.arena[99] == 5


def test_attach_reads_the_same_config_and_memory():
    ring = make_ring(**SMALL)
    other = Ring.attach(ring.buffer)
    assert other.config == ring.config
    ring.produced[2] = 9
    assert other.produced[2] == 9
    assert attach_layout(MemoryTransport(ring.buffer)).config == ring.config


def test_create_leaves_padding_sentinels_and_magic_last():
    ring = make_ring(**SMALL)
    assert (ring.stop_token_ids == -1).all() and (ring.logit_bias_ids == -1).all()
    assert ring.control[C_VERSION] == LAYOUT_VERSION
    assert ring.control[C_TOTAL_BYTES] == ring.layout.total_bytes


@pytest.mark.parametrize("damage, message", [
    (lambda c: c.__setitem__(C_MAGIC, 0), "bad magic"),
    (lambda c: c.__setitem__(C_VERSION, LAYOUT_VERSION + 1), "version mismatch"),
    (lambda c: c.__setitem__(C_TOTAL_BYTES, c[C_TOTAL_BYTES] + 64), "size mismatch"),
])
def test_mismatched_header_is_refused_by_both_sides(damage, message):
    ring = make_ring(**SMALL)
    damage(ring.control)
    with pytest.raises(RingLayoutError, match=message):
        read_header(ring.buffer)
    with pytest.raises(RingLayoutError, match=message):
        RingClient(MemoryTransport(ring.buffer))


def test_region_smaller_than_the_layout_is_refused():
    ring = make_ring(**SMALL)
    short = bytes(ring.buffer)[: ring.layout.total_bytes - 64]
    with pytest.raises(RingLayoutError, match="size mismatch"):
        read_header(short)
    with pytest.raises(RingLayoutError, match="size mismatch"):
        RingClient(MemoryTransport(bytearray(short)))
    with pytest.raises(RingLayoutError, match="no control block"):
        read_header(b"\0" * (CONTROL_WORDS * 8 - 1))


def test_uninitialised_region_is_refused():
    with pytest.raises(RingLayoutError, match="bad magic"):
        RingClient(MemoryTransport(bytearray(4096)))


def test_config_validation():
    with pytest.raises(RingLayoutError, match="n_slots"):
        RingConfig(n_slots=0)
    with pytest.raises(RingLayoutError, match="arena_tokens"):
        RingConfig(arena_tokens=10, max_model_len=20)


# -- publish order ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_request_never_visible_before_its_payload_under_reordering(seed):
    ring = make_ring(**SMALL)
    seen = []

    def engine_looks():
        # What a polling engine would admit right now: every WRITTEN slot must be complete.
        for slot in np.flatnonzero(ring.state == SLOT_WRITTEN):
            off, n = int(ring.prompt_offset[slot]), int(ring.prompt_len[slot])
            prompt = ring.arena[(off + np.arange(n)) % ring.config.arena_tokens].tolist()
            seen.append((int(slot), int(ring.seq[slot]), int(ring.request_id[slot]), prompt,
                         int(ring.max_tokens[slot]), ring.stop_token_ids[slot].tolist()))

    client = RingClient(ReorderingTransport(ring.buffer, engine_looks, seed))
    handles = [client.try_submit(10 + i, [i + 1] * (i + 2), max_tokens=3 + i, stop_token_ids=[i])
               for i in range(4)]
    client.transport.fence()
    assert seen, "the engine never saw the requests"
    for slot, seq, rid, prompt, max_tokens, stop in seen:
        i = rid - 10
        assert (slot, seq) == (handles[i].slot, handles[i].seq)
        assert prompt == [i + 1] * (i + 2) and max_tokens == 3 + i and stop == [i, -1, -1]


def test_poll_reads_state_then_counter_then_tokens_and_frees_last():
    ring = make_ring(**SMALL)
    log = []

    class Recording(MemoryTransport):
        def field(self, offset):
            for f in ring.layout:  # a request-record field first, then the region
                if (f.record is not None and f.offset <= offset < f.offset + f.nbytes
                        and (offset - f.offset) % f.row_stride < f.row_nbytes):
                    return f.name
            return next(f.name for f in ring.layout.regions.values()
                        if f.offset <= offset < f.offset + f.nbytes)

        def read(self, offset, nbytes):
            log.append(("read", self.field(offset)))
            return super().read(offset, nbytes)

        def write(self, offset, data):
            log.append(("write", self.field(offset), bytes(as_byte_array(data))))
            super().write(offset, data)

        def fence(self):
            log.append(("fence",))

    client = RingClient(Recording(ring.buffer))
    engine = FakeEngine(ring)
    h = client.submit(1, [4, 5, 6], max_tokens=2)
    engine.step()
    engine.step()  # both tokens produced and FINISHED
    log.clear()
    d = client.poll(h)
    assert d.token_ids == [4, 5] and d.finish_reason == "length"
    names = [e[1] if len(e) > 1 else "fence" for e in log]
    assert names[:4] == ["state", "fence", "produced", "fence"]
    assert names.index("tokens") < names.index("consumed")  # read, then let the engine reuse
    assert log[-1] == ("write", "state", np.array(0, "<i4").tobytes())  # FREE, last
    assert names[-2] == "fence"
