"""The CPU loop's scheduler stages in C (kernels/cpu/sched.c) against the torch reference
(blink/engine/sched/): side by side over the scheduler tests' workloads (prefix hits,
preemption in a small pool, finishes and releases, cancels, random sampling records, the
priority policy), every step's batch, the whole engine state and the whole ring region
identical. The scheduler's own tests run the C stages too (a CPU scheduler with host guards
takes them by default); these pin the reference beside them."""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
import test_scheduler as ts  # noqa: E402
from sched_side_by_side import _same, _sampler_inputs, _state, side_by_side  # noqa: E402

from blink.engine import prefix_cache  # noqa: E402
from blink.engine.sched.scheduler import Scheduler  # noqa: E402
from blink.engine.sched.state import ROW_WAITING, ring_tensors  # noqa: E402
from blink.errors import BlinkError  # noqa: E402
from blink.kernels.cpu import abi, sched as c_sched  # noqa: E402
from blink.shared.native_build import NativeBuildError, find_compiler  # noqa: E402

REFERENCE = functools.partial(Scheduler, host_guards=True, c_stages=False)
WITH_C = functools.partial(Scheduler, host_guards=True, c_stages=True)


@pytest.fixture(autouse=True)
def library():
    if find_compiler() is None:
        pytest.skip("no C compiler here: the scheduler runs its torch stages")
    assert c_sched.LIBRARY.get() is not None, c_sched.LIBRARY.unavailable()  # built, and its layout checked


@pytest.mark.parametrize("seed,pool", [(0, 32), (1, 14), (2, 32)])
def test_c_stages_match_the_reference_step_by_step(seed, pool):
    side_by_side(seed, pool, REFERENCE, WITH_C)


def test_c_stages_over_several_row_windows():
    """20 slots, up to 40 requests at once: the row window grows past 16 rows (to 20) and
    shrinks back; rows 16 and up are scheduled, finish and are released."""
    scheds = side_by_side(9, 400, REFERENCE, WITH_C, slots=20, requests=40, max_admit_per_step=8,
                          max_num_batched_tokens=64)
    assert 20 in scheds[1]._windows and 16 in scheds[1]._windows


def test_c_stages_insert_rounds_match_the_reference():
    """Prompts of up to 128 tokens in 4-token blocks, three admitted a step, a 256-slot table:
    blocks of one step share slots, and the insert's later rounds run."""
    side_by_side(4, 72, REFERENCE, WITH_C, max_model_len=256, max_num_batched_tokens=256,
                 admit_window_tokens=256, lookup_window_blocks=64)


def test_c_stages_with_every_prefix_key_colliding(monkeypatch):
    """Verification alone keeps the prefix cache right (the C insert's keys collide as the
    reference's do with ``table_key`` replaced)."""
    monkeypatch.setattr(prefix_cache, "table_key", lambda h: torch.zeros_like(h[0]))
    monkeypatch.setattr(c_sched, "COLLIDE_KEYS", True)
    side_by_side(8, 32, REFERENCE, WITH_C)


@pytest.mark.parametrize("seed,pool", [(3, 32), (4, 14)])
def test_c_stages_with_random_sampling_records(seed, pool):
    """Every sampling field at random (stop ids, min/max tokens, ignore_eos among them:
    the publish stage's finish checks)."""
    side_by_side(seed, pool, REFERENCE, WITH_C, sampling=True)


@pytest.mark.parametrize("seed,pool,other_prefill", [(5, 32, 3), (7, 14, 64)])
def test_c_stages_under_the_priority_policy(seed, pool, other_prefill):
    side_by_side(seed, pool, REFERENCE, WITH_C, sampling=True, scheduling_policy="priority",
                 max_admit_per_step=1, priority_other_prefill_tokens=other_prefill)


def _sched(**kw) -> Scheduler:
    return Scheduler(ts._cfg(), ring_tensors(ts.make_ring(4, 32, 4, None)), **kw)


def test_a_cpu_scheduler_with_host_guards_takes_the_c_stages():
    assert _sched()._c is not None
    assert _sched(host_guards=False)._c is None  # graphs: the torch code, captured
    assert _sched(c_stages=False)._c is None


def test_graphs_and_fused_stages_drop_the_c_stages():
    """The GPU tiers turn host guards off (or fuse the stages) after building the scheduler:
    their captured step must be the torch code."""
    sched = _sched()
    sched.host_guards = False
    assert sched._c is None
    sched = _sched()
    sched.use_fused(("stats",))
    assert sched._c is None


def test_the_c_stages_are_refused_where_they_cannot_run():
    with pytest.raises(BlinkError, match="host guards"):
        _sched(host_guards=False, c_stages=True)


def test_blink_cpu_sched_torch_keeps_the_reference(monkeypatch):
    monkeypatch.setenv(c_sched.ENV, "torch")
    c_sched.LIBRARY.reset()
    try:
        assert _sched()._c is None
        with pytest.raises(BlinkError, match="not available"):
            _sched(c_stages=True)
    finally:
        monkeypatch.delenv(c_sched.ENV)
        c_sched.LIBRARY.reset()


def test_a_changed_state_dtype_is_refused_not_misread():
    """sched.c reads the state at its dtypes: a field that changed type is an error at the
    first publish, never a silent misread."""
    sched = _sched()
    w = sched._window(sched.num_slots)
    st = dataclasses.replace(w.state, num_tokens=w.state.num_tokens.to(torch.int32))
    no_rows = torch.full((sched.num_slots,), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_tokens"):
        sched._c.publish(st, w.ring, sched._words[: sched.num_slots], no_rows, torch.zeros(1, dtype=torch.int64),
                         torch.zeros(1), torch.zeros(1, 0), torch.zeros(1, 0), sched._done,
                         stream_capacity=sched.stream_capacity, num_top=sched.num_top)


@pytest.mark.parametrize("never_cached", [0, 2])
def test_new_blocks_come_in_the_references_lru_order_ties_included(never_cached):
    """The free pool's order: never-cached blocks first, then cached ones by last use, the
    lowest id first among equally old ones (blocks released in one step share a stamp)."""
    cfg = ts._cfg(num_blocks=12)
    stamps = torch.tensor([9, 3, 7, 3, 3, 8, 1, 3, 9, 2, 3, 5])
    out = []
    for make in (REFERENCE, WITH_C):
        sched = make(cfg, ring_tensors(ts.make_ring(4, cfg.max_model_len, 4)))
        st, n = sched.state, cfg.num_blocks
        st.block_slot[:n] = torch.arange(n)  # every block cached ...
        st.block_slot[n - never_cached: n] = -1  # ... but the last ones
        st.block_last_used[:n] = stamps
        st.status[0], st.arrival[0] = ROW_WAITING, 1
        st.num_tokens[0] = st.num_prompt[0] = 6 * cfg.block_size - 1  # six blocks, within the budget
        sched._w = sched._window(sched.num_slots)
        num_new = sched._allocate()
        out.append((num_new.clone(), {k: v.clone() for k, v in _state(sched).items()}))
    (ref_new, ref_state), (c_new, c_state) = out
    assert torch.equal(ref_new, c_new)
    assert int(c_new[0]) == cfg.max_num_batched_tokens
    expected = [10, 11, 6, 9] if never_cached else [6, 9, 1, 3]  # budget 16 tokens: 4 blocks
    assert c_state["block_table"][:4].tolist() == expected  # row 0's first blocks (flat table)
    _same(ref_state, c_state, "after the allocation")


def test_the_sampler_inputs_suppress_stop_and_eos_ids_as_the_reference_does():
    """Rows before and after ``min_tokens`` outputs, ignoring EOS or not, with stop ids; lanes
    past the sample rows pad with row 0."""
    cfg = ts._cfg()
    out = []
    for make in (REFERENCE, WITH_C):
        sched = make(cfg, ring_tensors(ts.make_ring(4, cfg.max_model_len, 4)))
        st, sp = sched.state, sched.state.sampling
        st.num_prompt[:4] = torch.tensor([5, 5, 6, 7])
        st.num_tokens[:4] = torch.tensor([6, 9, 8, 7])  # 1, 4, 2, 0 outputs
        sp["min_tokens"][:4] = torch.tensor([3, 3, 0, 2], dtype=torch.int32)
        sp["ignore_eos"][:4] = torch.tensor([1, 0, 0, 0], dtype=torch.int32)
        sp["stop_token_ids"][:4] = torch.arange(4 * sp["stop_token_ids"].shape[1], dtype=torch.int32).view(4, -1)
        sp["temperature"][:4] = torch.tensor([0.0, 0.5, 1.0, 1.5])
        st.sampler_features[:4] = torch.tensor([1, 2, 4, 8], dtype=torch.int32)
        batch = SimpleNamespace(sample_rows=torch.tensor([3, 0, 2, -1]))
        out.append([_sampler_inputs(sched.sampler_inputs(batch, rows)) for rows in (2, 4, 6)])
    for rows, ref, c in zip((2, 4, 6), *out):
        _same(ref, c, f"{rows} rows")
    suppress = out[1][2]["suppress_ids"]
    assert (suppress[0, :-1] >= 0).all() and suppress[0, -1] >= 0  # row 3: 0 of 2 outputs, EOS too
    assert (suppress[1, -1] == -1) and (suppress[1, 0] >= 0)  # row 0: too early, but ignores EOS
    assert (suppress[2] == -1).all()  # row 2: min_tokens 0


def test_a_structure_that_drifted_from_its_ctypes_mirror_is_refused_at_load():
    """sched.c's structures and sched.py's ctypes mirrors must agree in size: a field added
    on one side only makes the library unavailable (the torch stages run), never a misread."""
    real = c_sched.LIBRARY.get()

    def sizes_with_one_more_field(out, n):
        count = real.blink_sched_struct_sizes(out, n)
        out[2] += 8  # blink_rows_t grew a field sched.py does not know
        return count

    stub = SimpleNamespace(**{name: (lambda *a: 0) for name in abi.SCHED})
    stub.blink_sched_struct_sizes = sizes_with_one_more_field
    with pytest.raises(NativeBuildError, match="differ from sched.py's ctypes mirrors"):
        c_sched._setup(stub)
    c_sched._setup(real)  # the real one agrees
