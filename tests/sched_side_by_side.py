"""Two schedulers side by side over one workload, compared step by step: every step's batch,
the whole engine state and the whole ring region (the fused Triton stages and the CPU loop's
C stages against the torch reference: tests/test_scheduler_fused.py, tests/test_scheduler_c.py)."""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import numpy as np
import torch

import test_scheduler as ts
from blink.engine.sampler import SamplerPlan
from blink.engine.sched.scheduler import Scheduler
from blink.engine.step import compact_rows
from blink.engine.sched.state import K_PREEMPTIONS, K_PREFIX_HITS, ring_tensors
from blink.shared.sampling_fields import SAMPLING_FIELDS as SAMPLING_FIELD_TABLE

#: (config, ring tensors) -> a scheduler
MakeScheduler = Callable[..., Scheduler]


def _state(sched: Scheduler) -> dict[str, torch.Tensor]:
    """The engine state without its write sinks (the last token column, the last entry of
    the block arrays, the table and the prefix table: lanes with nothing to write go there,
    and what they leave is nobody's value)."""
    st = sched.state
    out = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)
           if isinstance(getattr(st, f.name), torch.Tensor)}
    out["tokens"] = st.tokens[:, :-1]
    out["block_table"] = out["block_table_flat"] = st.block_table_flat[:-1]
    for name in ("block_ref", "block_last_used", "block_key", "block_slot", "block_parent", "block_gen",
                 "block_parent_gen", "block_tokens", "hash_table", "insert_best"):
        out[name] = out[name][:-1]
    out.update({f"sampling.{k}": v for k, v in st.sampling.items()})
    return out


def _metadata(md) -> dict[str, torch.Tensor]:
    out = {f.name: getattr(md, f.name) for f in dataclasses.fields(md) if isinstance(getattr(md, f.name), torch.Tensor)}
    out.update(max_context=torch.tensor(md.max_context), max_query_len=torch.tensor(md.max_query_len))
    return out


def _sampler_inputs(inputs) -> dict[str, torch.Tensor]:
    """The inputs' tensors; a plan the gather read on the way must be the one the torch code
    reads from them."""
    if inputs.plan is not None:
        assert inputs.plan == SamplerPlan.from_features(inputs.features, inputs.suppress_ids)
    out = {f.name: getattr(inputs.sampling, f.name) for f in dataclasses.fields(inputs.sampling)}
    out.update({name: getattr(inputs, name) for name in inputs._fields if name not in ("sampling", "plan")})
    return out


def _batch(batch) -> dict[str, torch.Tensor]:
    out = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "attn"}
    out.update({f"attn.{f.name}": getattr(batch.attn, f.name) for f in dataclasses.fields(batch.attn)
                if isinstance(getattr(batch.attn, f.name), torch.Tensor)})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what} {k}: dtype/shape"
        assert torch.equal(a[k], b[k]), f"{what} {k} differs:\n{a[k]}\n{b[k]}"


#: StepBatch's flat per-token tensors and the value of each padding lane
_FLAT_PADDING = {"input_ids": 0, "attn.positions": 0, "attn.token_seq_idx": 0}


def _flat_to_common_length(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], cfg
                           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The batches' flat per-token tensors cut to the shorter one's length: with host guards
    a step's are as long as the smallest bucket holding it, the fused (graph) ones the
    budget's. The lanes cut off must be padding (scratch-block slots for the slot mapping)."""
    pads = {**_FLAT_PADDING, "attn.slot_mapping": cfg.num_blocks * cfg.block_size}
    a, b = dict(a), dict(b)
    for name, pad in pads.items():
        n = min(a[name].shape[0], b[name].shape[0])
        for side in (a, b):
            assert (side[name][n:] == pad).all(), f"{name}: a lane past the shorter batch is not padding"
            side[name] = side[name][:n]
    return a, b


#: the sampling fields the tests' frontend writes for the workload itself (the rest are random
#: in the workloads with random sampling records)
_WORKLOAD_FIELDS = {"max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "logprobs"}


class RandomSamplingFrontend(ts.Frontend):
    """The tests' frontend, writing every other sampling field of SAMPLING_FIELDS at random
    too (half of them their pad): penalties, seeds, filters, logit bias, allowed and bad
    words, salts, constraints, and any field the table grows. Both sides of a comparison
    draw the same values (one generator per side, same seed)."""

    def __init__(self, ring, seed: int) -> None:
        super().__init__(ring)
        self.rng = np.random.default_rng(seed)

    def submit(self, req) -> bool:
        if not super().submit(req):
            return False
        for f in SAMPLING_FIELD_TABLE:
            if f.name in _WORKLOAD_FIELDS:
                continue
            shape = f.shape(self.ring.config)
            if self.rng.random() < 0.5:
                value = np.full(shape, f.pad)
            elif f.name == "cache_salt":
                value = np.full(shape, self.rng.choice([0, 7]))  # salted and unsalted hits both
            elif f.dtype == "<f4":
                value = self.rng.choice([0.0, 0.5, 1.0, 1.5], size=shape)
            elif f.dtype == "<i8":
                value = self.rng.integers(0, 2**62, size=shape)
            else:
                value = self.rng.integers(-1, 3, size=shape) * self.rng.integers(1, 40, size=shape)
            getattr(self.ring, f.name)[req.slot] = value
        return True


def side_by_side(seed: int, pool: int, reference: MakeScheduler, other: MakeScheduler, sampling: bool = False,
                 slots: int = 4, requests: int = 10, **cfg_kw) -> list[Scheduler]:
    """``reference`` and ``other`` side by side over one workload (prefix hits,
    preemption in the small pool, finishes and releases, cancels; with ``sampling``, random
    sampling records): every step's batch, the whole engine state and the whole ring region
    are identical. ``slots``, ``requests``: the ring's slots and the workload's requests
    (more slots than 16: several row windows). ``cfg_kw``: more of the scheduler's config
    (the priority policy). Returns the two schedulers."""
    rng = np.random.default_rng(seed)
    cfg = ts._cfg(**{"num_blocks": pool, "max_admit_per_step": 3, **cfg_kw})
    reqs = ts._random_reqs(rng, requests, cfg.max_model_len, shared=12)
    reqs[3].cancel_step = 4
    twins = [copy.deepcopy(reqs) for _ in range(2)]
    rings = [ts.make_ring(slots, cfg.max_model_len, 4, None) for _ in range(2)]
    scheds = [reference(cfg, ring_tensors(rings[0])), other(cfg, ring_tensors(rings[1]))]
    models = [ts.FakeModel(cfg, 4) for _ in range(2)]
    fes = [RandomSamplingFrontend(r, seed) if sampling else ts.Frontend(r) for r in rings]
    queues = [sorted(t, key=lambda r: r.submit_step) for t in twins]
    for step in range(400):
        if all(len(fe.done) == len(reqs) for fe in fes) and all(
                bool((s.state.status == ts.ROW_EMPTY).all()) for s in scheds):
            break
        batches = []
        for fe, queue, sched, model, twin in zip(fes, queues, scheds, models, twins):
            while queue and queue[0].submit_step <= step and fe.submit(queue[0]):
                queue.pop(0)
            for req in twin:
                if req.cancel_step == step:
                    fe.cancel(req)
            batches.append(sched.schedule())
        _same(*_flat_to_common_length(_batch(batches[0]), _batch(batches[1]), cfg), f"step {step} batch")
        _same(_state(scheds[0]), _state(scheds[1]), f"step {step} state after schedule")
        n = int(batches[0].num_scheduled_tokens)
        if n:  # the CPU loop's compacted attention metadata
            _same(*(_metadata(compact_rows(batch, n, sched)) for sched, batch in zip(scheds, batches)),
                  f"step {step} compacted metadata")
        for rows in (1, int(batches[0].num_sample_rows) or 1, scheds[0].num_slots):  # padded lanes too
            _same(*(_sampler_inputs(sched.sampler_inputs(batch, rows)) for sched, batch in zip(scheds, batches)),
                  f"step {step} sampler inputs of {rows} rows")
        for sched, batch, model, fe in zip(scheds, batches, models, fes):
            sched.update(batch, *model(sched, batch))
            fe.poll()
        _same(_state(scheds[0]), _state(scheds[1]), f"step {step} state after update")
        # The ring, field by field (request_id is the frontend's id() of its Req: differs).
        views = [ring_tensors(r) for r in rings]
        for name in views[0]:
            if name not in ("region", "request", "request_id"):
                assert torch.equal(views[0][name], views[1][name]), f"step {step}: ring field {name} differs"
    else:
        raise AssertionError("the workload did not finish")
    assert [r.out for r in twins[0]] == [r.out for r in twins[1]]
    assert int(scheds[1].state.counters[K_PREFIX_HITS]) > 0
    if pool < 32:
        assert int(scheds[1].state.counters[K_PREEMPTIONS]) > 0
    return scheds


