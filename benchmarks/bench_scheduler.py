"""Control-plane step time on CPU: schedule + sample + update, per part, and ops per step,
against the number of slots.

No model: the step's logits are the null model's (one fixed token wins, as
``blink serve --model null``), so what is timed is the scheduler and the sampler alone, at
the engine's default sizes (max_model_len 8192, block 16, the token budget
``--max-num-batched-tokens`` defaults to: 2,048). Two loads:

- ``one``: one request in steady-state decode, every other slot empty. The cost of an
  almost idle engine: it should not depend on the slot count (the target is <= 1 ms per
  step at 256 slots, flat from 64 to 4096). The KV pool is fixed (``--num-blocks``), as the
  engine's is (sized by memory, not by slots).
- ``all``: every slot decoding one token per step (all prompts prefilled, streams drained
  between steps): the work grows with the rows, as it should. The pool holds them all.

``--flush-mb N`` reads N MB (a tensor's sum) before every timed step, untimed, as a forward
streaming the weights does between two of the engine's steps: the control plane then runs on
flushed caches, as it does in the engine (compare with ``--flush-mb 0``, the default).

Per part: the scheduler's stages (inclusive wall time, median over the timed steps; a stage
skipped by its host guard costs nothing), the sampler, and aten ops per step (counted with a
dispatch mode: each is a kernel launch inside a GPU graph, a dispatcher call on CPU). Steps
run under ``torch.inference_mode()``, as in the engine's loop. Run:

    python -m benchmarks.bench_scheduler [--slots 64 256 1024 4096] [--load one all]
        [--threads 1] [--steps 30] [--no-prefix-caching] [--compile _build_batch,...]
        [--flush-mb 200] [--stages c|torch] [--json out.json]

``--stages``: the CPU loop's per-step stages in C (``kernels/cpu/sched.c``, the default, as
the engine runs them) or the torch reference code (``BLINK_CPU_SCHED=torch``).
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blink.engine import prefix_cache
from blink.engine.sampler import Sampler, SamplerPlan
from blink.engine.sched.scheduler import Scheduler
from blink.engine.sched.state import SchedulerConfig, ring_tensors
from blink.engine_options import config_default
from blink.ring import SLOT_WRITTEN, Ring, RingConfig, RingLayout

PROMPT_LEN = 128
MAX_MODEL_LEN = 8192
BLOCK_SIZE = 16
#: EngineConfig.max_num_batched_tokens' default
BUDGET = config_default("max_num_batched_tokens")
#: the timing clock: this thread's CPU time by default (a shared machine's other load
#: inflates wall time but hardly a thread's CPU time); ``--clock wall`` for wall time.
CLOCK: Callable[[], float] = time.thread_time
#: the CPU loop's C stages (--stages c) or the torch code (--stages torch)
C_STAGES = True
VOCAB = 49152  # SmolLM2's, as the null model's logits
NULL_TOKEN = 260
STAGES = ("_finish", "_release_finished", "_admit", "_lookup", "_allocate", "_preempt",
          "_assign_blocks", "_build_batch", "_write_stats", "_stream_write")


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched inside the block, by the phase the step is in."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "schedule"
        self.counts: dict[str, int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))


def build(slots: int, active: int, num_blocks: int, prefix_caching: bool) -> tuple[Ring, Scheduler]:
    ring_cfg = RingConfig(n_slots=slots, arena_tokens=max(slots * PROMPT_LEN, 4 * MAX_MODEL_LEN),
                          stream_capacity=64, max_model_len=MAX_MODEL_LEN)
    ring = Ring.create(bytearray(RingLayout(ring_cfg).total_bytes), ring_cfg)
    cfg = SchedulerConfig(
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=max(BUDGET, 2 * active),  # room to prefill beside the decodes
        max_admit_per_step=max(16, active // 64),  # admission keeps up with the rows
        enable_prefix_caching=prefix_caching,
        eos_token_ids=(0,),
    )
    sched = Scheduler(cfg, ring_tensors(ring), c_stages=C_STAGES)
    rng = np.random.default_rng(0)
    ring.arena[: active * PROMPT_LEN] = rng.integers(1, 32000, active * PROMPT_LEN)
    for s in range(active):  # the frontend's writes: payload, then the state word
        ring.seq[s] = 1
        ring.arrival[s] = s
        ring.prompt_offset[s] = s * PROMPT_LEN
        ring.prompt_len[s] = PROMPT_LEN
        ring.max_tokens[s] = MAX_MODEL_LEN
        ring.ignore_eos[s] = 1
        ring.state[s] = SLOT_WRITTEN
    return ring, sched


class Step:
    """One CPU-loop step without the forward: schedule, null logits, sample, update."""

    def __init__(self, ring: Ring, sched: Scheduler) -> None:
        self.ring, self.sched = ring, sched
        self.sampler = Sampler(max_logprobs=sched.num_top)
        self.times: dict[str, float] = collections.defaultdict(float)
        self.counter: OpCounter | None = None

    def _phase(self, name: str) -> None:
        if self.counter is not None:
            self.counter.phase = name

    def __call__(self) -> int:
        sched, times = self.sched, self.times
        self._phase("schedule")
        t0 = CLOCK()
        batch = sched.schedule()
        t1 = CLOCK()
        n = int(batch.num_scheduled_tokens)
        self._phase("sample")
        if n:
            rows = max(int(batch.num_sample_rows), 1)
            inputs = sched.sampler_inputs(batch, rows)
            plan = SamplerPlan.from_features(inputs.features, inputs.suppress_ids)
            logits = torch.zeros(rows, VOCAB)
            logits[:, NULL_TOKEN] = 30.0
            out = self.sampler(logits, inputs.sampling, None, inputs.prompt_lens, inputs.total_lens,
                               inputs.total_lens, inputs.suppress_ids, plan=plan)
            t2 = CLOCK()
            self._phase("update")
            sched.update(batch, out.tokens, out.logprob, out.top_ids, out.top_logprobs, num_tokens=n)
        else:
            t2 = t1
        t3 = CLOCK()
        self.ring.consumed[:] = self.ring.produced  # the frontend drains every stream
        times["schedule"] += t1 - t0
        times["sample"] += t2 - t1
        times["update"] += t3 - t2
        return n


def timed(acc: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += CLOCK() - t
    return wrapper


@torch.inference_mode()  # as the engine's loop runs its steps (autograd's bookkeeping: ~15% more)
def measure(slots: int, load: str, steps: int, num_blocks: int | None, prefix_caching: bool,
            compiled: tuple[str, ...] = (), flush: torch.Tensor | None = None) -> dict[str, Any]:
    """One configuration's timings. ``flush``: a tensor read in full before every timed step
    (untimed), so that the step runs on the caches a forward's weight stream leaves."""
    active = 1 if load == "one" else slots
    blocks = num_blocks if load == "one" else active * (PROMPT_LEN + 2 * steps + 64) // BLOCK_SIZE
    blocks = max(blocks, MAX_MODEL_LEN // BLOCK_SIZE)
    ring, sched = build(slots, active, blocks, prefix_caching)
    step = Step(ring, sched)
    for _ in range(10 * active + 10):  # admission and prefill, untimed
        n = step()
        if n == active and int((sched.state.num_computed > 0).sum()) == active:
            break
    else:
        raise RuntimeError(f"{slots} slots never reached steady-state decode")
    for name in compiled:  # inductor, static shapes; compiled during the warm-up below
        setattr(sched, name, torch.compile(getattr(sched, name), dynamic=False))
    for _ in range(2 * BLOCK_SIZE):  # warm-up: every path of a decode step, block boundary too
        step()
    parts: dict[str, float] = collections.defaultdict(float)
    for name in STAGES:  # instance attributes shadow the methods: per-part wall time
        if name not in compiled:
            setattr(sched, name, timed(parts, name, getattr(sched, name)))
    register = prefix_cache.register
    prefix_cache.register = timed(parts, "register", register)
    try:
        step.times.clear()
        per_step = []
        for _ in range(steps):
            if flush is not None:
                flush.sum()  # outside the step's clock: only its effect on the caches counts
            before = dict(step.times)
            step()
            per_step.append(sum(step.times.values()) - sum(before.values()))
        step.counter = counter = OpCounter()
        with counter:
            step()
        step.counter = None
    finally:
        prefix_cache.register = register
        for name in STAGES:
            if name not in compiled:
                delattr(sched, name)
    ms = {k: 1e3 * v / steps for k, v in step.times.items()}
    return {
        "slots": slots, "load": load, "active": active, "num_blocks": blocks,
        "step_ms_median": 1e3 * float(np.median(per_step)),
        **{f"{k}_ms": v for k, v in ms.items()},
        "parts_ms": {k: 1e3 * v / steps for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "ops_per_step": dict(counter.counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--load", nargs="+", choices=["one", "all"], default=["one", "all"])
    parser.add_argument("--num-blocks", type=int, default=8192,
                        help="KV pool of the 'one' load (default 8192 blocks = 128k tokens)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--compile", default="",
                        help="comma-separated scheduler methods to torch.compile (inductor), e.g. "
                             "_build_batch,_write_stats,sampler_inputs (to compare with eager)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="thread CPU time (default) or wall time")
    parser.add_argument("--flush-mb", type=int, default=0,
                        help="read this many MB before every timed step, untimed (what a forward's "
                             "weights do to the caches between the engine's steps; default 0: none)")
    parser.add_argument("--stages", choices=["c", "torch"], default="c",
                        help="the per-step stages in C (default, as the CPU loop runs them) or the torch code")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.flush_mb < 0:
        parser.error("--flush-mb must be >= 0")
    flush = torch.ones(args.flush_mb * 2**20 // 4) if args.flush_mb else None
    global CLOCK, C_STAGES
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    C_STAGES = args.stages == "c"
    torch.set_num_threads(args.threads)
    print(f"CPU, {args.threads} thread(s), max_model_len {MAX_MODEL_LEN}, block {BLOCK_SIZE}, "
          f"budget max({BUDGET}, 2*rows), prefix caching {'off' if args.no_prefix_caching else 'on'}, "
          f"null-model logits over {VOCAB} tokens; {args.stages} stages; {args.clock} time, mean of {args.steps} steps "
          f"(median total too)" + (f"; {args.flush_mb} MB read before each step" if flush is not None else ""))
    print(f"{'load':>4} {'slots':>6} {'schedule':>9} {'sample':>7} {'update':>7} {'step ms':>8} "
          f"{'median':>7} {'ops s+u':>7} {'ops smp':>7}  parts (ms, inclusive)")
    results = []
    with torch.inference_mode():
        measure(args.slots[0], "one", 5, args.num_blocks, True)  # the process's first-call costs
        for load in args.load:
            for slots in args.slots:
                r = measure(slots, load, args.steps, args.num_blocks, not args.no_prefix_caching,
                            tuple(n for n in args.compile.split(",") if n), flush)
                results.append(r)
                total = r["schedule_ms"] + r["sample_ms"] + r["update_ms"]
                parts = " ".join(f"{k.strip('_')}={v:.2f}" for k, v in r["parts_ms"].items() if v >= 0.005)
                ops = r["ops_per_step"]
                print(f"{load:>4} {slots:>6} {r['schedule_ms']:>9.2f} {r['sample_ms']:>7.2f} "
                      f"{r['update_ms']:>7.2f} {total:>8.2f} {r['step_ms_median']:>7.2f} "
                      f"{ops.get('schedule', 0) + ops.get('update', 0):>7} {ops.get('sample', 0):>7}  "
                      f"{parts}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
