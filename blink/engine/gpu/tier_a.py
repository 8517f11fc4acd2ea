"""Tier A (``--loop host``): host-driven CUDA graphs, the conventional baseline (what vLLM
and SGLang do).

The step (:mod:`blink.engine.step`) is captured with ``torch.cuda.CUDAGraph``: one schedule
graph plus one graph per token bucket, in one shared pool. A host thread loops [replay the
schedule graph → wait for it and read (tokens, bucket) from a pinned mailbox → replay that
bucket's graph]. The host read per step is what tier A pays; the host also decides idleness,
drain and shutdown exactly like the CPU loop (the same ``Engine._run``, which also writes the
heartbeat).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from blink.engine.gpu.base import GpuEngine
from blink.engine.gpu.plan import GraphPlan
from blink.engine.runners import OnScheduled
from blink.engine.sched.scheduler import StepBatch
from blink.engine.step import StepParts, graph_model_phase
from blink.errors import BlinkError


class GraphRunner(Protocol):
    """Captures callables as graphs and replays them (tier A's view of a device)."""

    def capture(self, name: str, fn: Callable[[], Any]) -> Any: ...
    def replay(self, name: str) -> None: ...
    def publish_mailbox(self, num_tokens: torch.Tensor, bucket_index: torch.Tensor) -> None: ...
    def read_mailbox(self) -> tuple[int, int]: ...


class HostGraphStep:
    """Tier A's step runner (:class:`blink.engine.runners.StepRunner` ``tier-a``): replay the
    schedule graph, read (tokens, bucket) on the host (the one host read per step that tier A
    pays), replay that bucket's graph.

    The graphs are ``scheduler.schedule()`` and :func:`graph_model_phase` (``model_phase`` with
    ``compact=False``, or a speculative scheduler's verify phase):
    the CPU loop's own functions, captured (at construction) by ``graphs``."""

    name = "tier-a"

    def __init__(self, parts: StepParts, plan: GraphPlan, graphs: GraphRunner) -> None:
        self.parts, self.plan, self.graphs = parts, plan, graphs
        self.steps = 0

        def schedule() -> StepBatch:
            batch = parts.scheduler.schedule()
            graphs.publish_mailbox(batch.num_scheduled_tokens, batch.bucket_index)
            return batch

        self.batch: StepBatch = graphs.capture("schedule", schedule)
        by_tokens = dict(zip(plan.buckets, plan.rows))
        for name in plan.capture_order[1:]:
            tokens = int(name.split(":")[1])
            graphs.capture(name, self._bucket_fn(tokens, by_tokens[tokens]))

    def _bucket_fn(self, tokens: int, rows: int) -> Callable[[], None]:
        def run() -> None:
            graph_model_phase(self.parts, self.batch, tokens=tokens, rows=rows)
        return run

    def prepare(self) -> None:
        pass  # captured at construction

    def run(self, on_scheduled: OnScheduled | None = None) -> bool:
        if on_scheduled is not None:  # the factory keeps the KV sender's role on the CPU loop
            raise BlinkError("tier A runs no host code between its graphs")
        self.graphs.replay("schedule")
        n, b = self.graphs.read_mailbox()
        if n == 0:
            return False
        self.graphs.replay(GraphPlan.bucket_name(self.plan.buckets[b]))
        self.steps += 1
        return True


class TorchCudaRunner:
    """:class:`GraphRunner` over ``torch.cuda.CUDAGraph``: one
    capture stream, one shared pool, a pinned mailbox for (tokens, bucket)."""

    def __init__(self, device: torch.device, *, blocking_sync: bool = False) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[str, Any] = {}
        self.mailbox = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        self._mailbox_dev: torch.Tensor | None = None
        # Spin-waiting is what vLLM/SGLang do; blocking_sync trades latency for host CPU.
        self.done = torch.cuda.Event(blocking=blocking_sync)

    def capture(self, name: str, fn: Callable[[], Any]) -> Any:
        # No eager warm-up of ``fn`` here: a bucket function would read the schedule
        # graph's static outputs, which hold nothing before its first replay. The engine
        # warms every graph's code up once, consistently, before the first capture.
        graph = torch.cuda.CUDAGraph()
        try:
            # torch.cuda.graph's __exit__ ends the capture and the pool routing on every path.
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = fn()
        except Exception as exc:
            raise BlinkError(f"capturing the {name} graph failed: {type(exc).__name__}: {exc}") from exc
        self.graphs[name] = graph
        self.outputs[name] = out
        return out

    def publish_mailbox(self, num_tokens: torch.Tensor, bucket_index: torch.Tensor) -> None:
        self._mailbox_dev = torch.stack([num_tokens.reshape(()), bucket_index.reshape(())])
        self.mailbox.copy_(self._mailbox_dev, non_blocking=True)

    def replay(self, name: str) -> None:
        self.graphs[name].replay()

    def read_mailbox(self) -> tuple[int, int]:
        self.done.record()
        self.done.synchronize()  # the host read per step that tier A pays
        n, b = self.mailbox.tolist()
        return int(n), int(b)


class TierAEngine(GpuEngine):
    """The engine with tier A's loop: ``Engine._run`` on the host, each step two replays."""

    tier, loop_flag = "A", "host"
    loop_thread_name = "blink-hostloop"

    def _build_graphs(self) -> HostGraphStep:
        self.stream: torch.cuda.Stream | None = None
        if self.simulation is not None:
            graphs: GraphRunner = self.simulation.graph_runner()
        else:
            cuda_graphs = TorchCudaRunner(self.device)
            self.stream = cuda_graphs.stream
            with torch.cuda.stream(cuda_graphs.stream):
                self._warmup()
            graphs = cuda_graphs
        return HostGraphStep(self.parts, self.plan, graphs)

    def _run(self) -> None:
        if self.stream is None:
            super()._run()
            return
        with torch.cuda.stream(self.stream):
            super()._run()
        self.stream.synchronize()
