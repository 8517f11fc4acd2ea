"""bench_priority's workload on the scheduler's policy alone: which steps a high-priority
request waits for and shares, with no model and no clock (a model, not a measurement).

The reference scheduler (blink/engine/sched/reference.py, which the tensor code agrees with
step by step) runs closed-loop low-priority streams and a high-priority request every
``--high-interval-ms``; a step costs ``a + b * tokens`` ms (``--step-ms A B``, default 8 ms +
0.30 ms per token: SmolLM2-135M Q4_1 on one Xeon thread, where an idle 200-token prompt is
~70 ms). A high request's TTFT is the end of the step that samples its first token minus its
arrival: the rest of the step in flight, then its own (and any before it). The idle run is
the same with no low streams. It shows how the step composition sets the tail::

    python -m benchmarks.priority_steps                      # fcfs, priority, several bounds
    python -m benchmarks.priority_steps --other-prefill 32   # one bound
    python -m benchmarks.priority_steps --other-prefill 32 --urgent-window 0 16 256

An arrival waits for the step in flight (it is submitted at the next step boundary, its
TTFT counted from its arrival time). ``--urgent-window`` W: the scheduler's
``priority_urgent_window_steps`` (while a more urgent priority was seen in the last W steps,
a less urgent first prompt only shares the bound, so the step in flight is short too); 0
models the rule before that register (a less urgent first prompt always prefills whole).

Frontend, client and CPU contention are not modelled (bench_priority measures them).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from blink.engine.sched.reference import ReferenceScheduler, Request
from blink.engine.sched.state import SchedulerConfig


def simulate(policy: str, other_prefill: int, *, seconds: float = 100.0, low_streams: int = 16,
             high_interval_ms: float = 500.0, prompt_tokens: tuple[int, int] = (195, 215),
             low_max_tokens: int = 256, high_max_tokens: int = 16,
             step_ms: tuple[float, float] = (8.0, 0.30), budget: int = 2048,
             urgent_window: int | None = None, seed: int = 0) -> dict[str, float]:
    """High-priority TTFTs (ms: P50, P99, max, count), the low streams' finished requests
    and output tokens per second over ``seconds`` of modelled time, and the steps run.
    ``urgent_window``: ``priority_urgent_window_steps`` (None: the config's default; 0: no
    urgency register, the rule before it)."""
    extra = {} if urgent_window in (None, 0) else {"priority_urgent_window_steps": urgent_window}
    cfg = SchedulerConfig(block_size=16, num_blocks=8192, max_model_len=2048,
                          max_num_batched_tokens=budget, max_admit_per_step=16,
                          enable_prefix_caching=False, scheduling_policy=policy,
                          priority_other_prefill_tokens=other_prefill, **extra)
    high_slots = 32  # a high request lasts well under 32 intervals: a slot is free again
    ref = ReferenceScheduler(cfg, low_streams + high_slots, 1 << 30)
    if urgent_window == 0:  # no register: no live request is ever less urgent than it
        def no_register(queue: list[Request]) -> None:
            ref.urgent_priority = 2**63 - 1
        ref._track_urgent = no_register
    rng = np.random.default_rng(seed)
    arrivals = iter(range(1, 1 << 62))
    a, b = step_ms

    def submit(slot: int, priority: int, max_tokens: int) -> Request:
        req = Request(slot=slot, arrival=next(arrivals), prompt=[7] * int(rng.integers(*prompt_tokens)),
                      max_tokens=max_tokens, ignore_eos=True, priority=priority)
        ref.add(req)
        return req

    for slot in range(low_streams):
        submit(slot, 10, low_max_tokens)
    t, next_high, n_high, seen = 0.0, 2000.0, 0, 0
    arrived: dict[int, float] = {}  # id(request) -> arrival time (ms), high ones
    ttft: list[float] = []
    low_done = low_tokens = steps = 0
    while t < seconds * 1000:
        steps += 1
        if t >= next_high:
            arrived[id(submit(low_streams + n_high % high_slots, 0, high_max_tokens))] = next_high
            n_high, next_high = n_high + 1, next_high + high_interval_ms
        num_new = ref.schedule()
        rows = ref.sample_rows(num_new)
        t += a + b * sum(num_new.values()) if num_new else 1.0
        ref.update(num_new, {row: 5 for row in rows})
        for row in rows:
            req = ref.rows[row]
            if id(req) in arrived and req.produced == 1:
                ttft.append(t - arrived.pop(id(req)))
            elif req.priority == 10:
                low_tokens += 1
        for req in ref.rows:
            if req is not None:
                req.consumed = req.produced  # the client reads at once
        for req in ref.finished[seen:]:
            if req.priority == 10:
                low_done += 1
                submit(req.slot, 10, low_max_tokens)  # closed loop: the next one at once
        seen = len(ref.finished)
    v = np.array(ttft) if ttft else np.array([float("nan")])
    return dict(p50=float(np.percentile(v, 50)), p99=float(np.percentile(v, 99)), max=float(v.max()),
                n=len(ttft), low_done=low_done, low_tok_s=low_tokens / seconds, steps=steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=100.0, help="modelled seconds per run")
    p.add_argument("--low-streams", type=int, default=16)
    p.add_argument("--high-interval-ms", type=float, default=500.0)
    p.add_argument("--step-ms", type=float, nargs=2, default=(8.0, 0.30), metavar=("A", "B"))
    p.add_argument("--other-prefill", type=int, nargs="*", default=[2048, 64, 32, 16],
                   help="priority_other_prefill_tokens values to model (2048: no bound)")
    p.add_argument("--urgent-window", type=int, nargs="*", default=[0, 256],
                   help="priority_urgent_window_steps values to model (0: no urgency register)")
    a = p.parse_args(argv)
    kw = dict(seconds=a.seconds, high_interval_ms=a.high_interval_ms, step_ms=tuple(a.step_ms))
    idle = simulate("priority", 64, low_streams=0, **kw)
    print(f"idle: high TTFT P50 {idle['p50']:.1f} P99 {idle['p99']:.1f} ms")
    runs = [("fcfs", 64, 0)] + [("priority", o, w) for o in a.other_prefill for w in a.urgent_window]
    for policy, other, window in runs:
        r = simulate(policy, other, low_streams=a.low_streams, urgent_window=window, **kw)
        print(f"{policy:8s} other_prefill={other:5d} urgent_window={window:4d}: high TTFT P50 {r['p50']:6.1f} "
              f"P99 {r['p99']:6.1f} max {r['max']:6.1f} ms (P99 / idle P99 {r['p99'] / idle['p99']:.2f}x, "
              f"n={r['n']}); low: {r['low_done']} finished, {r['low_tok_s']:.0f} tok/s; "
              f"{r['steps'] / max(r['n'], 1):.0f} steps per urgent arrival")
    return 0


if __name__ == "__main__":
    sys.exit(main())
