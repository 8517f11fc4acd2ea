"""The fused Triton scheduler stages (``Scheduler(fused=True)``, kernels/triton/sched.py) on
the scheduler tests' own workloads, on CPU tensors under the Triton interpreter: the same
streams (tokens, logprobs, alternatives, finish reasons) as the reference, every invariant
the reference's tests check, the property test's random workloads included.

The fused path works on the whole slot table (no row window). Every fused stage reproduces
the reference bit for bit (checked step by step, batch, state and ring, also in the captured
configuration, ``host_guards=False``), the allocator included: both take the lowest id among
equally old free blocks."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
import test_scheduler as ts  # noqa: E402
import test_scheduler_reference as tsr  # noqa: E402
from sched_side_by_side import side_by_side  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

from blink.engine.sched.scheduler import FUSED_STAGES, Scheduler  # noqa: E402
from blink.engine.sampler import _FEATURES as FEATURES  # noqa: E402
from blink.engine.sched.state import SAMPLING_FIELDS, ring_tensors  # noqa: E402
from blink.shared.sampling_fields import SAMPLING_FIELDS as SAMPLING_FIELD_TABLE  # noqa: E402

pytestmark = pytest.mark.slow  # the Triton interpreter: ~2-3 minutes for the whole module

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the fused stages were imported without TRITON_INTERPRET=1", allow_module_level=True)


@pytest.fixture(autouse=True)
def fused_scheduler(monkeypatch):
    monkeypatch.setattr(ts, "Scheduler", functools.partial(Scheduler, fused=True))


#: the fused stages compared with the reference step by step (all of them: the allocator and
#: the reference's stable sort both take the lowest id among equally old free blocks)
EXACT_STAGES = ("build_batch", "release", "stats", "publish", "register", "lookup", "admit", "cancel", "allocate")


def _side_by_side(seed: int, pool: int, guards: bool, sampling: bool = False, **cfg_kw) -> list[Scheduler]:
    """The torch reference (host guards as asked, no C stages) and the fused stages that
    reproduce it, every step compared (:func:`sched_side_by_side.side_by_side`)."""
    return side_by_side(seed, pool, functools.partial(Scheduler, host_guards=guards, c_stages=False),
                        functools.partial(Scheduler, host_guards=False, fused=EXACT_STAGES), sampling, **cfg_kw)


@pytest.mark.parametrize("seed,pool,guards", [(0, 32, False), (1, 14, False), (2, 32, True)])
def test_fused_stages_match_the_reference_step_by_step(seed, pool, guards):
    _side_by_side(seed, pool, guards)


@pytest.mark.parametrize("seed,pool", [(3, 32), (4, 14)])
def test_fused_admission_copies_random_sampling_records(seed, pool, monkeypatch):
    """Random sampling records (every field of the table) through both admissions, step by
    step (the state's sampling fields and feature words compared at every step); the
    workload sets every feature bit of the sampler (penalties, seeds, logprobs, bias, ...)."""
    seen = []
    real = Scheduler._admit

    def spy(self, *a, **k):
        real(self, *a, **k)
        seen.extend(self.state.sampler_features.tolist())

    monkeypatch.setattr(Scheduler, "_admit", spy)
    _side_by_side(seed, pool, False, sampling=True)
    word = 0
    for v in seen:
        word |= v
    assert word == (1 << len(FEATURES)) - 1, f"feature bits seen: {word:b}"


@pytest.mark.parametrize("seed,pool,other_prefill", [(5, 32, 3), (7, 14, 64)])
def test_fused_priority_policy_step_by_step(seed, pool, other_prefill):
    """``--scheduling-policy priority`` (the random records carry random priorities; one
    admission and one lookup per step, so their queue order decides): admit and lookup
    order the queue by (priority, arrival) as the torch code does, step by step (the fused
    allocator's order and prefill bound: the oracle tests below, every stage fused)."""
    _side_by_side(seed, pool, False, sampling=True, scheduling_policy="priority", max_admit_per_step=1,
                  priority_other_prefill_tokens=other_prefill)


def test_record_copy_covers_every_sampling_field():
    """The admit kernel's copy table holds every word of every sampling field once (derived
    from the state and the ring: a field added to SAMPLING_FIELDS is copied with no edit)."""
    sched = Scheduler(ts._cfg(), ring_tensors(ts.make_ring(4, 32, 4, None)), fused=True)
    st, table = sched.state, sched._admit_scratch.copy
    words_per_row = sum(t[0].numel() * t.element_size() // 4 for t in st.sampling.values())
    assert table.shape == (4, words_per_row)
    assert {name for name, _ in SAMPLING_FIELDS} == {f.name for f in SAMPLING_FIELD_TABLE} == set(st.sampling)
    dst = (table[0][None, :] + torch.arange(4)[:, None] * table[1][None, :]).flatten()
    assert dst.unique().numel() == dst.numel() == 4 * words_per_row


def test_fused_stages_are_selected():
    ring = ts.make_ring(4, 32, 4, None)
    sched = ts.Scheduler(ts._cfg(), ring_tensors(ring))
    assert sched.fused and sched._triton.__name__ == "blink.kernels.triton.sched"


def test_unknown_fused_stage_is_refused():
    with pytest.raises(ts.BlinkError, match="unknown fused stage"):
        Scheduler(ts._cfg(), ring_tensors(ts.make_ring(4, 32, 4, None)), fused=("admit_everything",))


def test_two_requests_end_to_end():
    ts.test_two_requests_end_to_end()


# Every workload of the reference's tests, through the fused stages (the fixture above).
_NOT_FOR_FUSED = {
    "test_two_requests_end_to_end",  # above
    "test_forced_hash_collisions_never_give_false_hits",  # below: the fused keys collide too
    # torch.compile(fullgraph) traces the torch code; a fused stage is one Triton launch already
    # (its capture safety: tests/test_capture_audit.py).
    "test_compiled_steps_are_one_graph_each",
    # the fused stages work on the whole table: there is no row window to follow or compare
    "test_row_window_follows_the_rows_in_use",
    "test_row_windows_change_no_output",
    # the fused batch build is the graphs': the budget's T lanes, no bucket cut on the host
    "test_a_host_step_builds_its_batch_over_the_smallest_bucket",
    # preemption and recompute in the fused allocator are checked step by step against the
    # reference below (pool 14, preemptions asserted) and by the oracle's tiny pools; this
    # workload adds only its length (~20 s in the interpreter)
    "test_tiny_pool_preempts_and_recomputes",
    # the torch reference with one insert round (the fused stages' rounds are compiled in)
    "test_one_insert_round_loses_blocks_of_that_prompt",
}
for _name in dir(ts):
    if _name.startswith("test_") and _name not in _NOT_FOR_FUSED and callable(getattr(ts, _name)):
        globals()[_name] = getattr(ts, _name)


def test_forced_hash_collisions_never_give_false_hits(monkeypatch):
    from blink.kernels.triton import sched as triton_sched

    monkeypatch.setattr(triton_sched, "COLLIDE_KEYS", True)  # the fused insert and lookup collide too
    ts.test_forced_hash_collisions_never_give_false_hits(monkeypatch)


def test_prefix_constants_agree():
    from blink.engine import prefix_cache
    from blink.kernels.triton import sched as triton_sched

    assert triton_sched.PRIMES == prefix_cache.PRIMES
    assert triton_sched.INSERT_ROUNDS == prefix_cache.INSERT_ROUNDS


def test_fused_insert_rounds_match_the_reference():
    """Prompts of up to 128 tokens in 4-token blocks, three admitted a step, a 256-slot table:
    blocks of one step share slots, and the insert's later rounds run."""
    _side_by_side(4, 72, False, max_model_len=256, max_num_batched_tokens=256, admit_window_tokens=256,
                  lookup_window_blocks=64)


# The property tests' random workloads: few examples, the interpreter is slow (~3-8 s each);
# not derandomized, so successive runs try different workloads.
test_random_workloads_keep_every_invariant = settings(
    max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
    given(ts.scenarios())(ts.test_random_workloads_keep_every_invariant.hypothesis.inner_test))


# The per-request Python oracle (blink/engine/sched/reference.py), step by step, every stage
# fused: the same rows, tokens per row, block counts, preemptions and finishes.
@pytest.fixture
def fused_oracle(monkeypatch):
    monkeypatch.setattr(tsr, "Scheduler", functools.partial(Scheduler, fused=True))


def test_fused_scheduler_agrees_with_the_python_reference(fused_oracle):
    tsr.test_tiny_pool_agrees_step_by_step()
    tsr.test_prefix_caching_agrees_while_nothing_is_evicted(0)


def test_fused_priority_policy_agrees_with_the_python_reference(fused_oracle):
    tsr.test_priority_tiny_pool_agrees_step_by_step()
    tsr.test_priority_prefix_caching_agrees_while_nothing_is_evicted(1)
    tsr.test_priority_policy_with_zero_priorities_is_fcfs()


def test_fused_urgency_register_agrees_with_the_python_reference(fused_oracle, monkeypatch):
    """The urgency register (set, aged, expired after W steps, set again), the capped
    first prompt and the urgent prompt's steps without less urgent rows (a chunked prompt
    too), in the fused allocator, step by step against the reference."""
    import test_priority as tp

    tsr.test_priority_urgency_register_agrees_step_by_step(monkeypatch)
    tp.test_a_low_first_prompt_is_capped_while_urgent_was_seen_and_whole_after(True)
    # (the same-priority half of that test is the fcfs path, checked above; 56 -> ~28 s)
    tp.check_the_urgent_prompt_prefills_alone(100, 10, np.random.default_rng(7))


test_priority_random_workloads_agree_with_the_reference = pytest.mark.usefixtures("fused_oracle")(settings(
    max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
    given(ts.scenarios(), hst.lists(hst.integers(-3, 3), min_size=10, max_size=10), hst.integers(1, 24),
          hst.integers(1, 12))(tsr.test_priority_random_workloads_agree_with_the_reference.hypothesis.inner_test)))

test_random_workloads_agree_with_the_reference = pytest.mark.usefixtures("fused_oracle")(settings(
    max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
    given(ts.scenarios())(tsr.test_random_workloads_agree_with_the_reference.hypothesis.inner_test)))


@pytest.mark.parametrize("loop", ["host", "device"])
def test_simulated_tiers_with_the_fused_scheduler_give_the_cpu_loops_tokens(tmp_path, monkeypatch, loop):
    """BLINK_FUSED_SCHEDULER=1: the GPU tiers (simulated on CPU) capture the fused stages;
    greedy tokens equal the CPU loop's (the reference scheduler)."""
    from benchmarks import gpu_loop
    from test_engine import BASE, random_prompts, tiny_model_dir

    from blink.engine.engine import EngineConfig
    from blink.shared.sampling_params import SamplingParams

    model = tiny_model_dir(tmp_path)
    prompts = random_prompts(3, 5, 20, seed=5)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    kw = dict(BASE, max_num_batched_tokens=64)
    ref, _ = gpu_loop.generate_prestaged(EngineConfig, model, kw, "cpu", prompts, params, "cpu", timeout_s=60)
    monkeypatch.setenv("BLINK_FUSED_SCHEDULER", "1")
    made = []
    real = gpu_loop.make_engine

    def spy(*a, **k):
        eng = real(*a, **k)
        made.append(eng)
        return eng

    monkeypatch.setattr(gpu_loop, "make_engine", spy)
    out, _ = gpu_loop.generate_prestaged(EngineConfig, model, kw, loop, prompts, params, "cpu", timeout_s=120,
                                         simulate=True)
    assert made[0].scheduler.fused == frozenset(FUSED_STAGES)
    assert out == ref and all(len(t) == 5 for t in out)
