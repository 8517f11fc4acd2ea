"""Kernel launches per captured control-plane step, and (on a GPU) its time per step.

What a CUDA graph of the device loop holds for the control plane is ``scheduler.schedule()``
and ``scheduler.update()`` with ``host_guards=False`` (every stage runs: tier A and tier B
capture them so). Each aten op they dispatch is one graph node -- a kernel, a memcpy or a
memset -- except metadata-only views; each Triton kernel they launch (the fused scheduler
stages, the system fences between a ring payload and its publishing word) is one more.
This counts both (views too: the issue counts every aten op dispatched; the count without
them is printed beside), per step, over steps of a workload that admits, prefills, decodes,
hits the prefix cache, finishes and releases (issue 32's "launches per captured step"),
and breaks the count down by scheduler stage.

    python -m benchmarks.gpu_sched_launches                 # CPU: counts only
    python -m benchmarks.gpu_sched_launches --fused         # the fused Triton stages
    TRITON_INTERPRET=1 python -m benchmarks.gpu_sched_launches --fused   # ... on CPU tensors
    python -m benchmarks.gpu_sched_launches --device cuda   # + µs per step at 64/1024/4096 slots

The count is taken on CPU tensors (the same ops dispatch on any device; on CPU the fence is
a host fence, counted here as the one Triton launch it is on CUDA). On CUDA the step is
also captured as one CUDA graph (schedule + update, the frontend's draining of the streams
outside the count) and replayed: µs per step from CUDA events, over ``--replays`` replays.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blink.engine import prefix_cache
from blink.kernels.triton import sched_count as triton_sched_count
from blink.engine.sched.scheduler import Scheduler
from blink.engine.sched.state import SchedulerConfig, ring_tensors, ring_views
from blink.ring import SLOT_FINISHED, SLOT_FREE, SLOT_WRITTEN, Ring, RingConfig, RingLayout

#: metadata-only aten ops: dispatched, but no kernel (not a graph node)
VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.slice.Tensor", "aten.select.int",
    "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.t.default",
    "aten.transpose.int", "aten.permute.default", "aten.alias.default", "aten.as_strided.default",
    "aten.detach.default", "aten.reshape.default", "aten.flatten.using_ints", "aten.unbind.int",
    "aten.split.Tensor", "aten.view_as.default", "aten.lift_fresh.default", "aten.squeeze.default",
})
STAGES = ("_finish", "_release_finished", "_admit", "_admit_kv_fields", "_lookup", "_allocate",
          "_preempt", "_assign_blocks", "_build_batch", "_write_stats", "_stream_write",
          "_publish_state", "_ring_set")
PROMPT_LEN = 40
SHARED_PREFIX = 32  # two full blocks of 16: every request after the first hits the cache


class LaunchCounter(TorchDispatchMode):
    """Aten ops dispatched inside the block, attributed to the innermost scheduler stage
    running (``stage``), views counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = ["?"]
        self.ops: collections.Counter[str] = collections.Counter()
        self.views: collections.Counter[str] = collections.Counter()
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if triton_sched_count.inside():  # the Triton interpreter's own copies (CPU tensors)
            return func(*args, **(kwargs or {}))
        name = str(func)
        (self.views if name in VIEW_OPS else self.ops)[self.stack[-1]] += 1
        self.by_op[name] += 1
        return func(*args, **(kwargs or {}))


class TritonLaunches:
    """Triton launches of the step: the fused stages count through
    :func:`blink.kernels.triton.sched.launch_count`; the fences through a wrapper."""

    def __init__(self, sched: Scheduler, counter: "LaunchCounter | None" = None) -> None:
        self.n: collections.Counter[str] = collections.Counter()
        fence = sched._fence

        def counted() -> None:
            self.n[counter.stack[-1] if counter else "?"] += 1
            fence()

        sched._fence = counted
        self.counter = counter


def _instrument(sched: Scheduler, counter: LaunchCounter) -> list[tuple[Any, str, Any]]:
    undo = []

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def inner(*a: Any, **k: Any) -> Any:
            counter.stack.append(label)
            try:
                return fn(*a, **k)
            finally:
                counter.stack.pop()

        undo.append((owner, name, fn))
        setattr(owner, name, inner)

    for name in STAGES:
        if hasattr(sched, name):
            wrap(sched, name, name.strip("_"))
    wrap(prefix_cache, "register", "prefix_register")
    wrap(prefix_cache, "lookup", "prefix_lookup")
    return undo


def build(slots: int, device: str, fused: bool, num_blocks: int | None = None) -> tuple[Ring, Scheduler, Any]:
    """A ring of ``slots`` slots with every slot's request written (prompts sharing a
    two-block prefix), and a scheduler over it in the captured configuration."""
    max_model_len = 256
    ring_cfg = RingConfig(n_slots=slots, arena_tokens=max(slots * PROMPT_LEN, 4 * max_model_len),
                          stream_capacity=64, max_model_len=max_model_len, max_logprobs=2)
    ring = Ring.create(bytearray(RingLayout(ring_cfg).total_bytes), ring_cfg)
    # At most the fused allocator's one-program sort (16384 blocks): 4096 slots then preempt.
    cfg = SchedulerConfig(block_size=16, num_blocks=num_blocks or min(max(64, slots * 6), 16384),
                          max_model_len=max_model_len, max_num_batched_tokens=512, max_admit_per_step=16,
                          enable_prefix_caching=True, eos_token_ids=(0,))
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, 1000, (SHARED_PREFIX,), generator=gen)
    for s in range(slots):
        start = s * PROMPT_LEN
        ring.arena[start:start + SHARED_PREFIX] = prefix.numpy()
        ring.arena[start + SHARED_PREFIX:start + PROMPT_LEN] = torch.randint(
            1, 1000, (PROMPT_LEN - SHARED_PREFIX,), generator=gen).numpy()
        ring.seq[s], ring.arrival[s], ring.prompt_offset[s] = 1, s, start
        ring.prompt_len[s], ring.max_tokens[s] = PROMPT_LEN, 6 + s % 5
        ring.ignore_eos[s], ring.logprobs[s] = 1, s % 3
        ring.state[s] = SLOT_WRITTEN
    views = ring_tensors(ring)
    if device != "cpu":  # the ring's bytes in device memory (a timing run: no frontend reads it)
        views = ring_views(RingLayout(ring_cfg), views["region"].to(device))
    sched = Scheduler(cfg, views, device=device, host_guards=False, fused=fused)
    return ring, sched, views


def fake_sample(sched: Scheduler, batch: Any) -> tuple[torch.Tensor, ...]:
    """The sampler's outputs for every row lane (a token per row from its length; two
    alternatives): shapes of a bucket of S rows, no data-dependent work."""
    S = sched.num_slots
    rows = batch.sample_rows.clamp(min=0)
    tokens = (sched.state.num_tokens[rows] * 7 + rows) % 997 + 1
    logprob = -(tokens % 5).float()
    top_ids = torch.stack([tokens, tokens + 1], 1)
    top_lp = torch.stack([logprob, logprob - 1], 1)
    return tokens, logprob, top_ids, top_lp


def frontend(ring: Ring, views: dict[str, torch.Tensor], step: int) -> None:
    """The frontend's part between steps (not counted): drain the streams, free finished
    slots and write their next request."""
    state = views["state"]
    if state.device.type != "cpu":
        return
    views["consumed"].copy_(views["produced"])
    finished = (state == SLOT_FINISHED).nonzero().flatten().tolist()
    for s in finished:
        ring.state[s] = SLOT_FREE
        ring.seq[s] += 1
        ring.arrival[s] = 10_000 + step * len(state) + s
        ring.state[s] = SLOT_WRITTEN


@torch.inference_mode()
def count(slots: int, steps: int, fused: bool) -> dict[str, Any]:
    ring, sched, views = build(slots, "cpu", fused)
    counter = LaunchCounter()
    triton_n = TritonLaunches(sched, counter)
    undo = _instrument(sched, counter)
    tokens = 0
    try:
        launches0 = triton_sched_count.total()
        with counter:
            for i in range(steps):
                counter.stack = ["schedule"]
                batch = sched.schedule()
                counter.stack = ["sampler"]  # the sampler's stand-in: not the control plane's
                outputs = fake_sample(sched, batch)
                counter.stack = ["update"]
                sched.update(batch, *outputs)
                counter.stack = ["frontend"]
                frontend(ring, views, i)
        fused_launches = triton_sched_count.total() - launches0
        tokens = int(sched.state.counters.sum())  # progress: the workload did run
    finally:
        for owner, name, fn in reversed(undo):
            if owner is sched:
                delattr(sched, name)
            else:
                setattr(owner, name, fn)
    outside = ("frontend", "sampler")  # the frontend's part and the sampler's stand-in
    ops = {k: v for k, v in counter.ops.items() if k not in outside}
    fences = {k: v for k, v in triton_n.n.items() if k not in outside}
    aten = sum(ops.values())
    views = sum(v for k, v in counter.views.items() if k not in outside)
    per_step = (aten + views + sum(fences.values()) + fused_launches) / steps
    return {"slots": slots, "steps": steps, "fused": fused, "launches_per_step": per_step,
            "kernels_per_step": per_step - views / steps,
            "aten_per_step": aten / steps, "views_per_step": views / steps,
            "fences_per_step": sum(fences.values()) / steps, "triton_per_step": fused_launches / steps,
            "by_stage": {k: v / steps for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
            "top_ops": counter.by_op.most_common(12), "progress": tokens}


def time_gpu(slots: int, fused: bool, replays: int) -> dict[str, Any]:
    """µs per captured step on CUDA: schedule + update in one CUDA graph, replayed."""
    ring, sched, views = build(slots, "cuda", fused)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):  # warm-up (Triton compiles, allocator)
            batch = sched.schedule()
            sched.update(batch, *fake_sample(sched, batch))
            views["consumed"].copy_(views["produced"])
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            batch = sched.schedule()
            sched.update(batch, *fake_sample(sched, batch))
            views["consumed"].copy_(views["produced"])  # the frontend's draining (1 node, not counted)
        graph.replay()
        stream.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record(stream)
        for _ in range(replays):
            graph.replay()
        t1.record(stream)
        stream.synchronize()
    us = 1e3 * t0.elapsed_time(t1) / replays
    return {"slots": slots, "fused": fused, "us_per_step": us, "replays": replays}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[64, 1024, 4096])
    p.add_argument("--count-slots", type=int, nargs="+", default=[64],
                   help="slot counts to count launches at (on CPU; the count does not depend on it)")
    p.add_argument("--steps", type=int, default=12, help="counted steps")
    p.add_argument("--fused", action="store_true", help="the fused Triton stages (Scheduler(fused=True))")
    p.add_argument("--device", default="cpu", help="cuda: also time the captured step")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out: dict[str, Any] = {"argv": sys.argv[1:], "triton_interpret": os.environ.get("TRITON_INTERPRET"),
                           "counts": [], "timings": []}
    for slots in args.count_slots:
        t0 = time.perf_counter()
        r = count(slots, args.steps, args.fused)
        r["count_s"] = round(time.perf_counter() - t0, 1)
        out["counts"].append(r)
        print(f"{'fused' if args.fused else 'reference'} scheduler, {slots} slots, {args.steps} steps: "
              f"{r['launches_per_step']:.1f} launches per captured step = {r['aten_per_step']:.1f} aten ops "
              f"+ {r['views_per_step']:.1f} aten views + {r['fences_per_step']:.1f} fences + "
              f"{r['triton_per_step']:.1f} fused Triton kernels ({r['kernels_per_step']:.1f} without the "
              f"views, which launch nothing)", flush=True)
        print("  by stage (aten ops per step): " + ", ".join(f"{k} {v:.1f}" for k, v in r["by_stage"].items()))
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("no CUDA device: no timing")
        for slots in args.slots:
            if not torch.cuda.is_available():
                break
            r = time_gpu(slots, args.fused, args.replays)
            out["timings"].append(r)
            print(f"  {slots} slots: {r['us_per_step']:.1f} µs per captured step ({r['replays']} replays)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
