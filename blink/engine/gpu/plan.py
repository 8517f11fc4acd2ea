"""Which graphs a GPU loop captures, in which order, with which shapes.

Every bucket of ``SchedulerConfig.buckets`` gets a graph, because ``StepBatch.bucket_index``
(computed on the device) may name any of them. Capture order: the schedule graph first (its
outputs, the ``StepBatch`` tensors, are the static inputs of every bucket graph and stay
allocated), then the buckets largest first so that each smaller capture reuses blocks the
larger one freed. All captures share one memory pool; bucket graphs may replay in any order
because each one's temporaries are dead when it ends and the static inputs are never freed.
"""
from __future__ import annotations

from dataclasses import dataclass

from blink.engine.sched.state import SchedulerConfig


@dataclass(frozen=True)
class GraphPlan:
    """Which graphs a GPU loop captures, in which order, with which shapes.

    buckets[i]      tokens of bucket i (== ``SchedulerConfig.buckets``: bucket_index indexes it)
    rows[i]         sampler rows of bucket i: min(tokens, slots) (a step samples at most one
                    row per scheduled token and per slot)
    capture_order   graph names in capture order: "schedule", then "bucket:<tokens>"
                    largest first
    """

    buckets: tuple[int, ...]
    rows: tuple[int, ...]
    capture_order: tuple[str, ...]

    @staticmethod
    def bucket_name(tokens: int) -> str:
        return f"bucket:{tokens}"

    def bucket_index(self, num_tokens: int) -> int:
        """Host mirror of ``StepBatch.bucket_index`` (``torch.bucketize``, right=False)."""
        for i, b in enumerate(self.buckets):
            if num_tokens <= b:
                return i
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")


def plan_graphs(config: SchedulerConfig, num_slots: int) -> GraphPlan:
    buckets = tuple(config.buckets)
    rows = tuple(min(b, num_slots) for b in buckets)
    order = ("schedule", *(GraphPlan.bucket_name(b) for b in sorted(buckets, reverse=True)))
    return GraphPlan(buckets=buckets, rows=rows, capture_order=order)
