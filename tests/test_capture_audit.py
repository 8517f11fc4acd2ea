"""The step the GPU tiers capture holds only ops a CUDA graph can hold (checked on CPU).

- The audit itself: each kind of capture-unsafe op is flagged (tensors from Python data,
  host reads, data-dependent shapes, copies across devices), safe look-alikes are not.
- Tier A and tier B (simulated on CPU: the same captured functions, ``schedule()`` and the
  model phase with the sampler and ``update()`` at bucket shapes) run a workload that
  exercises prefix-cache hits, preemption by recompute, chunked prefill, penalties, seeded
  sampling, logit bias, min_tokens and logprobs under :class:`CaptureAudit`: zero violations,
  and the counters prove those paths ran.
- One ``torch.tensor([1])`` planted in ``schedule()`` makes the audit fail.
- The same step over tensors of a second, data-less device (``meta``; no GPU): a host read
  (``tolist``) or a tensor left on the CPU fails there, which the dispatch mode alone cannot
  see on a CPU-only machine.
"""
from __future__ import annotations

import re

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import BASE, random_prompts, tiny_model_dir  # noqa: E402

from blink.engine import step  # noqa: E402
from blink import llm as llm_module  # noqa: E402
from blink.engine.capture_audit import CaptureAudit, audit, on_meta  # noqa: E402
from blink.engine.engine import Engine, EngineConfig  # noqa: E402
from blink.engine.factory import create_engine  # noqa: E402
from blink.engine.gpu import host_sim  # noqa: E402
from blink.engine.gpu.plan import plan_graphs  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.shared.structured_outputs import StructuredOutputs  # noqa: E402
from blink.engine.sched.scheduler import Scheduler  # noqa: E402
from blink.ring import C_STAT_PREEMPTIONS, C_STAT_PREFIX_HITS  # noqa: E402

#: chunked prefill (buckets 8..64) and a KV cache far smaller than the workload: preemption.
SMALL = dict(BASE, max_num_batched_tokens=64, kv_cache_tokens=512, max_num_seqs=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # An EOS (id 0) so that structured outputs can end; the other rows ignore it.
    return tiny_model_dir(tmp_path_factory.mktemp("capture_audit_models"), eos_token_id=0)


# ------------------------------------------------------------------------ the audit itself


@pytest.mark.parametrize("unsafe", [
    lambda x: torch.tensor([1, 2]),
    lambda x: x.sum().item(),
    lambda x: int(x[0]),
    lambda x: bool(x[0] > 0),
    lambda x: torch.equal(x, x),
    lambda x: x.nonzero(),
    lambda x: torch.where(x > 1),
    lambda x: x[x > 1],
    lambda x: x.masked_select(x > 1),
    lambda x: torch.unique(x),
    lambda x: x.repeat_interleave(x),
    lambda x: x.__setitem__(2, 7),
    lambda x: x.pin_memory() if torch.cuda.is_available() else x.to("meta"),
])
def test_each_kind_of_unsafe_op_is_flagged(unsafe):
    x = torch.arange(5)
    mode = CaptureAudit()
    with mode:
        try:
            unsafe(x)
        except NotImplementedError:  # e.g. meta copies of a CPU tensor: the flag is what counts
            pass
    assert mode.violations, "the audit missed a capture-unsafe op"
    with pytest.raises(AssertionError, match="capture-unsafe"):
        mode.check()


def test_safe_lookalikes_are_not_flagged():
    x = torch.arange(5)
    mode = CaptureAudit()
    with mode:
        torch.where(x > 1, x, 0)
        x[torch.arange(2)]
        x[3:4].fill_(-1)
        x.repeat_interleave(2, dim=0)
        torch.full_like(x, 3)
        x += 1
        torch.topk(x, 2)
        x.index_fill_(0, torch.zeros(1, dtype=torch.long), 4)
    mode.check()
    assert mode.ops  # it did see the ops


# ------------------------------------------------------------ the captured step, tier A/B


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a 3-block prefix (prefix hits once the first ones are registered),
    long enough together to overflow the 32-block cache (preemption), with every sampler
    stage on: penalties, seeds, top-k/p, min-p, logit bias, min_tokens, logprobs,
    allowed_token_ids, bad_words, cache_salt, and structured outputs (the token-mask gate
    and mask: a regex row and a choice row)."""
    shared = random_prompts(1, 48, 48, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(12, 8, 40, seed=3)]
    kinds = [
        dict(temperature=0.0, bad_words=["ab", "c"]),
        dict(temperature=0.8, seed=11, top_k=20, top_p=0.9, cache_salt="tenant"),
        dict(temperature=1.0, seed=5, min_p=0.05, repetition_penalty=1.3,
             allowed_token_ids=list(range(40, 140))),
        dict(temperature=0.7, seed=9, presence_penalty=0.5, frequency_penalty=0.4, logprobs=3),
        dict(temperature=0.0, logit_bias={65: 5.0, 66: -100.0}, min_tokens=4, logprobs=2),
        dict(temperature=0.9, seed=1, top_p=0.5, stop_token_ids=[3, 4], min_tokens=2),
    ]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **kinds[i % len(kinds)])
              for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=40, temperature=0.8, seed=3,
                               structured_outputs=StructuredOutputs(regex="[a-z ]{5,60}"))
    params[6] = SamplingParams(max_tokens=40, temperature=0.0,
                               structured_outputs=StructuredOutputs(choice=("alpha", "beta")))
    return prompts, params


def _audit_tier(loop: str, monkeypatch) -> CaptureAudit:
    """LLM's engines run tier ``loop`` simulated on CPU, with every captured function (tier A:
    runner captures and replays; tier B: the graph's torch segments) audited into the result."""
    mode = CaptureAudit()
    orig_capture = host_sim.EagerRunner.capture
    orig_segment = host_sim.EagerGraphApi.segment
    monkeypatch.setattr(host_sim.EagerRunner, "capture",
                        lambda self, name, fn: orig_capture(self, name, audit(fn, mode)))
    monkeypatch.setattr(host_sim.EagerGraphApi, "segment",
                        lambda self, fn: orig_segment(self, audit(fn, mode)))
    monkeypatch.setattr(llm_module, "create_engine",
                        lambda cfg, loop_=None, **_kw: create_engine(cfg, loop, simulation=host_sim.HostSimulation()))
    return mode


def _run_audited(model_dir: Path, loop: str, monkeypatch) -> tuple[CaptureAudit, dict[str, int]]:
    """The workload through LLM with tier ``loop`` simulated, every captured function
    (tier A: runner captures and replays; tier B: the graph's torch segments) audited."""
    mode = _audit_tier(loop, monkeypatch)
    prompts, params = _workload()
    with llm_module.LLM(str(model_dir), **SMALL) as llm:
        # Two waves: the second finds the first wave's prefix blocks in the cache.
        llm.generate(prompts[:2], params[:2], timeout_s=120)
        outs = llm.generate(prompts, params, timeout_s=240)
        control = llm._ring.engine_status().control
        counters = {"preemptions": int(control[C_STAT_PREEMPTIONS]),
                    "prefix_hits": int(control[C_STAT_PREFIX_HITS])}
    assert all(len(o.outputs[0].token_ids) >= 2 for o in outs)
    # The masked rows obey their constraints: the gate and the mask ran in the captured step
    # (on CPU the mask is one C call, so no aten op of its own shows in the audit).
    assert re.fullmatch("[a-z ]{5,60}", outs[1].outputs[0].text.removesuffix("\x00"))
    assert outs[6].outputs[0].text.removesuffix("\x00") in ("alpha", "beta")
    assert any(o.outputs[0].logprobs for o in outs)
    # allowed_token_ids (rows 2 and 8) and the one-token bad word "c" (row 0)
    assert all(40 <= t < 140 for i in (2, 8) for t in outs[i].outputs[0].token_ids)
    assert all(ord("c") not in outs[i].outputs[0].token_ids for i in (0,))
    return mode, counters


@pytest.mark.parametrize("loop", ["host", "device"])
def test_captured_step_holds_only_capturable_ops(model_dir, loop, monkeypatch):
    mode, counters = _run_audited(model_dir, loop, monkeypatch)
    assert counters["preemptions"] > 0, "the workload must exercise preemption"
    assert counters["prefix_hits"] > 0, "the workload must exercise prefix-cache hits"
    seen = set(mode.ops)
    for op in ("aten.topk.default", "aten.scatter_reduce_.two", "aten.index_put_.default",
               "aten.cumsum.default", "aten.bucketize.Tensor"):
        assert op in seen, f"the audit did not see {op}: it did not run the whole step"
    mode.check(f"tier {'A' if loop == 'host' else 'B'}'s captured step")


SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.mark.parametrize("loop", ["host", "device"])
def test_captured_speculative_step_holds_only_capturable_ops(model_dir, loop, monkeypatch):
    """--speculative-config on tier A/B: the draft stage in schedule() and the verify phase
    (blink.engine.speculative.spec_model_phase) over repetitive prompts (drafts hit), greedy
    and seeded sampled rows with logprobs and penalties, rows that finish inside an accepted
    run (a stop id, max_tokens): no capture-unsafe op, and drafts were accepted."""
    from test_spec_decode import _repetitive

    mode = _audit_tier(loop, monkeypatch)
    prompts = _repetitive(4, 8)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.2),
              SamplingParams(max_tokens=30, temperature=1.0, seed=5, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[prompts[4][2]]),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias={5: 2.0}),
              SamplingParams(max_tokens=13, temperature=0.6, seed=9, ignore_eos=True)]
    with llm_module.LLM(str(model_dir), **{**SMALL, "speculative_config": SPEC}) as llm:
        outs = llm.generate(prompts, params, timeout_s=240)
        counters = llm.engine.scheduler.spec_counters.tolist()
    assert counters[2] > 0, f"no draft was accepted ({counters}): the workload must hit"
    assert len(outs[5].token_ids) == 7 and len(outs[7].token_ids) == 13
    seen = set(mode.ops)
    for op in ("aten.cumprod.default", "aten.unfold.default", "aten.index_put_.default"):
        assert op in seen, f"the audit did not see {op}: it did not run the speculative step"
    mode.check(f"tier {'A' if loop == 'host' else 'B'}'s captured speculative step")


def test_a_planted_python_tensor_in_schedule_fails_the_audit(model_dir, monkeypatch):
    orig = Scheduler.schedule

    def schedule_with_plant(self):
        batch = orig(self)
        batch.num_scheduled_tokens.add_(torch.tensor([1]).sum() * 0)  # the plant
        return batch

    monkeypatch.setattr(Scheduler, "schedule", schedule_with_plant)
    mode, _ = _run_audited(model_dir, "host", monkeypatch)
    assert any(v.op.startswith("aten.lift_fresh") and "schedule_with_plant" in v.where
               for v in mode.violations), mode.violations[:5]
    with pytest.raises(AssertionError, match="capture-unsafe"):
        mode.check()


# ------------------------------------------------------------------ over meta tensors


def _on_meta_step(engine: Engine) -> CaptureAudit:
    """schedule() + the model phase of every bucket, as the graphs run them
    (``graph_model_phase``: a speculative engine's verify phase), with every engine tensor
    on a meta device."""
    plan = plan_graphs(engine.scheduler_config, engine.ring_config.n_slots)
    parts = step.StepParts(engine.scheduler, engine.executor, engine.sampler)
    engine.scheduler.host_guards = False  # as the graphs run it: every stage
    mode = CaptureAudit()
    with torch.inference_mode(), on_meta(engine.scheduler, engine.executor, engine.sampler):
        with mode:
            batch = engine.scheduler.schedule()
            assert batch.input_ids.device.type == "meta"
            for tokens, rows in zip(plan.buckets, plan.rows):
                step.graph_model_phase(parts, batch, tokens=tokens, rows=rows)
    return mode


@pytest.mark.parametrize("speculative", [None, SPEC])
def test_the_step_runs_over_meta_tensors(model_dir, speculative):
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", speculative_config=speculative, **SMALL))
    try:
        _on_meta_step(engine).check("the step over meta tensors")
    finally:
        engine.region.close()


@pytest.mark.parametrize("plant", ["tolist", "cpu_tensor"])
def test_meta_run_catches_what_the_dispatch_mode_cannot_see_on_cpu(model_dir, monkeypatch, plant):
    orig = Scheduler.schedule

    def schedule_with_plant(self):
        batch = orig(self)
        if plant == "tolist":
            batch.num_new_tokens.tolist()  # no dispatch on a real CPU tensor
        else:
            batch.num_new_tokens.add_(torch.zeros(batch.num_new_tokens.shape, dtype=torch.long))
        return batch

    monkeypatch.setattr(Scheduler, "schedule", schedule_with_plant)
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", **SMALL))
    try:
        # tolist: meta tensors hold no data to read; a CPU tensor next to meta ones: either
        # the op refuses the mix or the audit flags it.
        with pytest.raises((NotImplementedError, RuntimeError, AssertionError),
                           match="meta|several devices|device") as info:
            _on_meta_step(engine).check()
        assert "schedule_with_plant" in "".join(str(f) for f in info.traceback) or \
            "schedule_with_plant" in str(info.value)
    finally:
        engine.region.close()
