"""Scheduler step time (schedule + update) against the number of slots, on CPU.

Every slot holds a request in steady-state decode (all prompts prefilled, streams drained by
a frontend stand-in between steps), so each step schedules one token per slot and publishes
one token per slot: the scheduler's own cost, with no model. Run:

    python benchmarks/bench_scheduler.py [--threads 2] [--steps 20] [--slots 64 256 1024 4096]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from blink.engine.scheduler import Scheduler
from blink.engine.state import SchedulerConfig, ring_tensors
from blink.ring import SLOT_WRITTEN, Ring, RingConfig, RingLayout

PROMPT_LEN = 128
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16


def build(slots: int, prefix_caching: bool) -> tuple[Ring, Scheduler]:
    ring_cfg = RingConfig(n_slots=slots, arena_tokens=slots * PROMPT_LEN, stream_capacity=64,
                          max_model_len=MAX_MODEL_LEN)
    ring = Ring.create(bytearray(RingLayout(ring_cfg).total_bytes), ring_cfg)
    cfg = SchedulerConfig(
        block_size=BLOCK_SIZE,
        num_blocks=slots * (MAX_MODEL_LEN // BLOCK_SIZE // 2),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=max(2048, 2 * slots),  # room to prefill beside the decodes
        max_admit_per_step=max(16, slots // 64),  # admission keeps up with the slot count
        enable_prefix_caching=prefix_caching,
        eos_token_ids=(0,),
    )
    sched = Scheduler(cfg, ring_tensors(ring))
    rng = np.random.default_rng(0)
    ring.arena[: slots * PROMPT_LEN] = rng.integers(1, 32000, slots * PROMPT_LEN)
    for s in range(slots):  # the frontend's writes: payload, then the state word
        ring.seq[s] = 1
        ring.arrival[s] = s
        ring.prompt_offset[s] = s * PROMPT_LEN
        ring.prompt_len[s] = PROMPT_LEN
        ring.max_tokens[s] = MAX_MODEL_LEN
        ring.ignore_eos[s] = 1
        ring.state[s] = SLOT_WRITTEN
    return ring, sched


def step(ring: Ring, sched: Scheduler, outputs: tuple[torch.Tensor, ...]) -> tuple[float, float, float, int]:
    """One step: (schedule wall s, update wall s, process CPU s, tokens)."""
    c0, t0 = time.process_time(), time.perf_counter()
    batch = sched.schedule()
    t1 = time.perf_counter()
    sched.update(batch, *outputs, num_tokens=max(int(batch.num_scheduled_tokens), 1))
    t2, c1 = time.perf_counter(), time.process_time()
    ring.consumed[:] = ring.produced  # the frontend drains every stream
    return t1 - t0, t2 - t1, c1 - c0, int(batch.num_scheduled_tokens)


def measure(slots: int, steps: int, prefix_caching: bool) -> dict[str, float]:
    ring, sched = build(slots, prefix_caching)
    n_top = sched.num_top
    outputs = (
        torch.full((slots,), 7, dtype=torch.int64),
        torch.zeros(slots),
        torch.zeros(slots, n_top, dtype=torch.int64),
        torch.zeros(slots, n_top),
    )
    for _ in range(10 * slots):  # admission and prefill, untimed
        *_, n = step(ring, sched, outputs)
        if n == slots and int((sched.state.num_computed > 0).sum()) == slots:
            break  # every slot decodes one token per step
    else:
        raise RuntimeError(f"{slots} slots never reached steady-state decode")
    for _ in range(3):  # warm-up
        step(ring, sched, outputs)
    times = np.array([step(ring, sched, outputs) for _ in range(steps)])
    return {
        "schedule_ms": 1e3 * float(np.median(times[:, 0])),
        "update_ms": 1e3 * float(np.median(times[:, 1])),
        "cpu_ms": 1e3 * float(np.median(times[:, 2])),
        "tokens_per_step": float(times[:, 3].mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 256, 1024, 4096])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU, {args.threads} threads, steady-state decode, block {BLOCK_SIZE}, "
          f"max_model_len {MAX_MODEL_LEN}, budget max(2048, 2*slots), admit max(16, slots/64), "
          f"median of {args.steps} steps")
    print("(wall: elapsed time; cpu: process CPU time, all threads; a loaded machine inflates wall)")
    print(f"{'slots':>6} {'prefix$':>7} {'schedule ms':>12} {'update ms':>10} {'step ms':>8} "
          f"{'cpu ms':>7} {'tok/step':>9}")
    for slots in args.slots:
        for prefix_caching in (False, True):
            r = measure(slots, args.steps, prefix_caching)
            total = r["schedule_ms"] + r["update_ms"]
            print(f"{slots:>6} {'on' if prefix_caching else 'off':>7} {r['schedule_ms']:>12.2f} "
                  f"{r['update_ms']:>10.2f} {total:>8.2f} {r['cpu_ms']:>7.2f} {r['tokens_per_step']:>9.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
