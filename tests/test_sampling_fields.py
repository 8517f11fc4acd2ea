"""The one table of sampling fields (blink/shared/sampling_fields.py) and what is derived from
it: the ring's request record, the engine's state tensors and ring views, SamplingTensors, the
frontend's packed record. Adding a knob in one place and forgetting another fails here.
Also: the frontend writes a request's slot payload with one transport write."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from blink.dpu.ring_packing import _DEFAULTS, RingRequestError, pack_sampling, ring_fields
from blink.dpu.ring_protocol import RingClient
from blink.engine.sampler import SamplingTensors
from blink.engine.sched.state import EngineState, SchedulerConfig, ring_tensors, ring_views
from blink.ring import SLOT_WRITTEN, Ring, RingConfig, RingLayout
from blink.shared.sampling_fields import SAMPLER_FIELDS, SAMPLING_FIELDS, SamplingField
from blink.shared.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from test_ring_layout import MemoryTransport  # noqa: E402

CFG = RingConfig(n_slots=5, arena_tokens=256, stream_capacity=8, max_logprobs=3,
                 max_stop_ids=3, max_logit_bias=6, max_model_len=128)
TORCH = {"<i4": torch.int32, "<i8": torch.int64, "<f4": torch.float32}


def expected(cfg=CFG, fields=SAMPLING_FIELDS):
    return [(f.name, np.dtype(f.dtype), f.shape(cfg)) for f in fields]


def test_table_is_well_formed():
    names = [f.name for f in SAMPLING_FIELDS]
    assert len(names) == len(set(names))
    for f in SAMPLING_FIELDS:
        assert isinstance(f, SamplingField) and f.dtype in TORCH
        assert f.width is None or hasattr(CFG, f.width)
        assert f.bound is None or hasattr(CFG, f.bound)
    # The packing has a default for every field but max_tokens (which it requires).
    assert set(_DEFAULTS) == set(names) - {"max_tokens"}


def test_ring_request_record_holds_exactly_the_table():
    layout = RingLayout(CFG)
    rec = layout.request_dtype
    sampling = [n for n in rec.names if n in {f.name for f in SAMPLING_FIELDS}]
    assert sampling == [f.name for f in SAMPLING_FIELDS]
    assert rec.names[-len(sampling):] == tuple(sampling)  # header first, then the table
    got = []
    for name in sampling:
        sub = rec.fields[name][0]
        got.append((name, sub.base if sub.subdtype else sub, sub.shape))
        spec = layout.fields[name]
        assert spec.record == "request" and spec.shape == (CFG.n_slots, *sub.shape)
    assert got == expected()
    assert rec.itemsize % 8 == 0
    ring = Ring.create(bytearray(layout.total_bytes), CFG)
    for f in SAMPLING_FIELDS:  # created with the neutral values
        assert (ring.arrays[f.name] == f.pad).all(), f.name


def test_engine_state_and_ring_views_follow_the_table():
    ring = Ring.create(bytearray(RingLayout(CFG).total_bytes), CFG)
    st = EngineState.allocate(SchedulerConfig(block_size=4, num_blocks=32, max_model_len=128,
                                              max_num_batched_tokens=16), CFG)
    assert [(n, t.dtype, tuple(t.shape[1:])) for n, t in st.sampling.items()] == [
        (n, TORCH[d.str], s) for n, d, s in expected()]
    for f in SAMPLING_FIELDS:
        assert (st.sampling[f.name] == f.pad).all(), f.name
    views = ring_tensors(ring)
    rng = np.random.default_rng(0)
    for f in SAMPLING_FIELDS:  # torch views alias the numpy record fields, slot by slot
        arr = ring.arrays[f.name]
        arr[...] = rng.integers(-50, 50, arr.shape).astype(f.dtype)
        v = views[f.name]
        assert v.dtype == TORCH[f.dtype] and tuple(v.shape) == (CFG.n_slots, *f.shape(CFG))
        assert np.array_equal(v.numpy(), arr), f.name
    views["seed"][3] = 77  # and writes go through
    assert ring.seed[3] == 77
    # ring_views over a uint8 base tensor (how the GPU loop views its mapped pointer).
    base = torch.frombuffer(ring.buffer, dtype=torch.uint8)
    again = ring_views(ring.layout, base)
    for name in [f.name for f in SAMPLING_FIELDS] + ["seq", "consumed", "prompt_len"]:
        assert np.array_equal(again[name].numpy(), ring.arrays[name]), name
        assert again[name].data_ptr() == base.data_ptr() + ring.layout.fields[name].offset


def test_sampling_tensors_are_the_tables_sampler_fields():
    assert [f.name for f in dataclasses.fields(SamplingTensors)] == [f.name for f in SAMPLER_FIELDS]
    empty = SamplingTensors.empty(2, max_logit_bias=CFG.max_logit_bias)
    for f in SAMPLER_FIELDS:
        t = getattr(empty, f.name)
        assert t.dtype == TORCH[f.dtype] and tuple(t.shape) == (2, *f.shape(CFG))
        assert (t == f.pad).all()


def test_packed_record_sets_every_table_field():
    rec = ring_fields(SamplingParams(max_tokens=9, temperature=0.5, top_k=-1, seed=3, logprobs=2,
                                     stop_token_ids=[4, 5], logit_bias={7: 1.5}), 10, 128, CFG)
    assert rec.dtype == RingLayout(CFG).request_dtype and rec.shape == ()
    assert int(rec["max_tokens"]) == 9 and int(rec["top_k"]) == 0 and int(rec["logprobs"]) == 2
    assert float(rec["temperature"]) == 0.5 and int(rec["seed"]) == 3
    assert rec["stop_token_ids"].tolist() == [4, 5, -1]
    assert rec["logit_bias_ids"].tolist() == [7] + [-1] * 5
    assert rec["logit_bias_values"].tolist() == [1.5] + [0.0] * 5
    with pytest.raises(TypeError, match="unknown"):
        pack_sampling(CFG, max_tokens=1, n_logprobs=1)
    with pytest.raises(RingRequestError, match="seed must fit in a signed 64-bit integer"):
        pack_sampling(CFG, max_tokens=1, seed=2**63)
    with pytest.raises(RingRequestError, match="logprobs can be at most 3"):
        pack_sampling(CFG, max_tokens=1, logprobs=4)
    with pytest.raises(RingRequestError, match="logit_bias can hold at most 6"):
        pack_sampling(CFG, max_tokens=1, logit_bias={i: 1.0 for i in range(7)})


class CountingTransport(MemoryTransport):
    def __init__(self, buffer, layout):
        super().__init__(buffer)
        self.layout, self.log = layout, []

    def write(self, offset, data):
        arena = self.layout.fields["arena"]
        where = "arena" if arena.offset <= offset < arena.offset + arena.nbytes else offset
        self.log.append(("write", where))
        super().write(offset, data)

    def fence(self):
        self.log.append(("fence",))
        super().fence()


@pytest.mark.parametrize("kwargs", [dict(max_tokens=3),
                                    dict(max_tokens=3, stop_token_ids=[1], logit_bias={2: 1.0},
                                         logprobs=2, seed=5, temperature=0.7)])
def test_try_submit_writes_the_slot_payload_once_then_the_state_word(kwargs):
    layout = RingLayout(CFG)
    ring = Ring.create(bytearray(layout.total_bytes), CFG)
    t = CountingTransport(ring.buffer, layout)
    client = RingClient(t)
    for i in range(2):
        t.log.clear()
        h = client.try_submit(10 + i, [1, 2, 3], **kwargs)
        log = [e for e in t.log if e[1:] != ("arena",)]
        record = layout.fields["request"].element_offset(h.slot)
        state = layout.fields["state"].element_offset(h.slot)
        assert log == [("write", record), ("fence",), ("write", state)]
        assert ring.state[h.slot] == SLOT_WRITTEN and ring.request_id[h.slot] == 10 + i
        assert ring.prompt_len[h.slot] == 3 and ring.max_tokens[h.slot] == 3
        assert ring.consumed[h.slot] == 0 and ring.cancel[h.slot] == 0
