"""The GPU loops on the host, for the CPU suite: graph semantics without a GPU.

- :class:`EagerRunner` (tier A): "capture" runs the function once and keeps clones of its
  outputs as the static buffers; "replay" runs it again and copies the results into them,
  which is what replaying a graph does to its output memory.
- Kernel models: :func:`gate_poll_model` and friends mirror the kernels of
  ``kernels/cuda/device_loop.cu`` line by line, reading the same :class:`LoopParams` block
  through raw addresses.
- :class:`EagerGraphApi` (tier B): records the graph that
  :func:`blink.engine.gpu.tier_b.build_conditional_loop` builds (the exact calls the CUDA
  build makes) and interprets it: WHILE/IF nodes, kernel nodes run by their models,
  captured segments run eagerly.
- :class:`HostSimulation`: what a test or dry run hands the engine factory
  (``create_engine(config, loop, simulation=HostSimulation())``). Nothing in the product
  imports this module.
"""
from __future__ import annotations

import ctypes
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from blink.engine.gpu.abi import (
    EXIT_RUNNING,
    GATE_IDLE,
    GATE_STEP,
    GATE_STOP,
    GATE_WAIT,
    HC_STOP,
    HC_WORDS,
    LS_DRAIN_START_NS,
    LS_EMPTY_STEPS,
    LS_EXIT,
    LS_GATE_CALLS,
    LS_IDLE_CALLS,
    LS_LAST_BUCKET,
    LS_LAST_EMPTY_NS,
    LS_LAST_HEARTBEAT_NS,
    LS_LAST_STEP_EMPTY,
    LS_STEPS,
    LS_WORDS,
    STOP_DRAIN,
    GateInput,
    LoopParams,
    dispatch_bucket,
    gate_decide,
    poll_sleep_ns,
)


def copy_into(static: Any, fresh: Any) -> None:
    """Copy ``fresh`` into ``static`` tensor by tensor (dataclasses, tuples and dicts are
    walked): what a graph replay does to the memory of its outputs."""
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif dataclasses.is_dataclass(static):
        for f in dataclasses.fields(static):
            copy_into(getattr(static, f.name), getattr(fresh, f.name))
    elif isinstance(static, (tuple, list)):
        for a, b in zip(static, fresh):
            copy_into(a, b)
    elif isinstance(static, dict):
        for k in static:
            copy_into(static[k], fresh[k])


def clone_outputs(x: Any) -> Any:
    """Own copies of every tensor in ``x`` (static buffers that later calls do not alias)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: clone_outputs(getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, tuple):
        return type(x)(clone_outputs(v) for v in x) if not hasattr(x, "_fields") else type(x)(
            *(clone_outputs(v) for v in x))
    if isinstance(x, list):
        return [clone_outputs(v) for v in x]
    if isinstance(x, dict):
        return {k: clone_outputs(v) for k, v in x.items()}
    return x


class EagerRunner:
    """A :class:`GraphRunner` for CPU tensors: capture runs ``fn`` once and keeps clones of
    its outputs as the static buffers; replay runs it again and copies the new outputs into
    them. Code written against it sees graph semantics (fixed output memory) without a GPU."""

    def __init__(self) -> None:
        self.fns: dict[str, Callable[[], Any]] = {}
        self.outputs: dict[str, Any] = {}
        self.replays: list[str] = []
        self._mailbox: tuple[torch.Tensor, torch.Tensor] | None = None

    def capture(self, name: str, fn: Callable[[], Any]) -> Any:
        self.fns[name] = fn
        self.outputs[name] = clone_outputs(fn())
        return self.outputs[name]

    def replay(self, name: str) -> None:
        self.replays.append(name)
        fresh = self.fns[name]()
        if self.outputs[name] is not None:
            copy_into(self.outputs[name], fresh)

    def publish_mailbox(self, num_tokens: torch.Tensor, bucket_index: torch.Tensor) -> None:
        # Captured inside the schedule function: on CPU the mailbox is the values themselves.
        self._mailbox = (num_tokens, bucket_index)

    def read_mailbox(self) -> tuple[int, int]:
        out = self.outputs["schedule"]
        return int(out.num_scheduled_tokens), int(out.bucket_index)


def _words(addr: int, ctype: Any, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * n).from_address(addr))


def _word(addr: int, index: int = 0) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(addr + 8 * index)


def gate_poll_model(p: LoopParams, clock_ns: Callable[[], int] = time.monotonic_ns,
                    sleep_ns: Callable[[int], None] = lambda ns: time.sleep(ns * 1e-9)) -> tuple[int, int]:
    """Host model of ``blink_gate_poll``: the same reads and writes through ``p``'s
    addresses, in the same order. (Loads and stores here are plain: the host is the
    only agent in the model; the ordering qualifiers are the CUDA source's business.)"""
    ls = _words(p.loop_state, ctypes.c_int64, LS_WORDS)
    control = _words(p.control, ctypes.c_int64, max(p.c_heartbeat, p.c_shutdown, p.c_engine_state) + 1)
    host = _words(p.host_ctl, ctypes.c_int64, HC_WORDS)
    states = _words(p.slot_state, ctypes.c_int32, p.n_slots)
    cancel = _words(p.slot_cancel, ctypes.c_int32, p.n_slots)
    start = clock_ns()
    decision, reason = GATE_WAIT, EXIT_RUNNING
    for polls in range(p.max_polls):
        st = states.copy()
        busy = bool((st != p.slot_free).any())
        fresh = bool(((st == p.slot_written) | ((st != p.slot_free) & (cancel != 0))).any())
        now = clock_ns()
        if now - int(ls[LS_LAST_HEARTBEAT_NS]) >= p.heartbeat_period_ns:
            control[p.c_heartbeat] += 1
            ls[LS_LAST_HEARTBEAT_NS] = now
        gi = GateInput(
            now_ns=now, start_ns=start, last_empty_ns=int(ls[LS_LAST_EMPTY_NS]),
            poll_budget_ns=p.poll_budget_ns, empty_backoff_ns=p.empty_backoff_ns,
            drain_timeout_ns=p.drain_timeout_ns, stop_request=int(host[HC_STOP]),
            shutdown=int(control[p.c_shutdown] != 0), any_busy=int(busy), any_new=int(fresh),
            last_step_empty=int(ls[LS_LAST_STEP_EMPTY]), polls=polls, max_polls=p.max_polls,
        )
        if (gi.stop_request == STOP_DRAIN or gi.shutdown) and ls[LS_DRAIN_START_NS] == 0:
            ls[LS_DRAIN_START_NS] = now
            control[p.c_engine_state] = p.engine_draining
        gi.drain_start_ns = int(ls[LS_DRAIN_START_NS])
        decision, reason = gate_decide(gi)
        if decision != GATE_WAIT:
            break
        sleep_ns(poll_sleep_ns(polls, p.max_sleep_ns))
    if decision == GATE_WAIT:
        decision = GATE_IDLE
    return decision, reason


def gate_record_model(p: LoopParams, decision: int, reason: int) -> None:
    """Host model of ``blink_gate_record``."""
    ls = _words(p.loop_state, ctypes.c_int64, LS_WORDS)
    ls[LS_GATE_CALLS] += 1
    if decision == GATE_IDLE:
        ls[LS_IDLE_CALLS] += 1
    if decision == GATE_STOP:
        ls[LS_EXIT] = reason
        _word(p.control, p.c_engine_state).value = p.engine_stopped


def dispatch_record_model(p: LoopParams, clock_ns: Callable[[], int] = time.monotonic_ns) -> int:
    """Host model of ``blink_dispatch_record``."""
    ls = _words(p.loop_state, ctypes.c_int64, LS_WORDS)
    d = dispatch_bucket(_word(p.num_scheduled_tokens).value, _word(p.bucket_index).value, p.n_buckets)
    ls[LS_LAST_BUCKET] = d
    if d < 0:
        ls[LS_EMPTY_STEPS] += 1
        ls[LS_LAST_STEP_EMPTY] = 1
        ls[LS_LAST_EMPTY_NS] = clock_ns()
    else:
        ls[LS_STEPS] += 1
        ls[LS_LAST_STEP_EMPTY] = 0
    return d


def gate_kernel_model(p: LoopParams, set_conditional: Callable[[int, int], None]) -> None:
    """Host model of the ``blink_gate`` kernel."""
    decision, reason = gate_poll_model(p)
    gate_record_model(p, decision, reason)
    set_conditional(p.h_step, int(decision == GATE_STEP))
    set_conditional(p.h_loop, int(decision != GATE_STOP))


def dispatch_kernel_model(p: LoopParams, set_conditional: Callable[[int, int], None]) -> None:
    """Host model of the ``blink_dispatch`` kernel."""
    d = dispatch_record_model(p)
    for i in range(p.n_buckets):
        set_conditional(p.h_bucket[i], int(i == d))


KERNEL_MODELS: dict[str, Callable[..., None]] = {
    "blink_gate": gate_kernel_model,
    "blink_dispatch": dispatch_kernel_model,
    "blink_publish_fence": lambda p, set_conditional: None,
}


@dataclass
class _Node:
    kind: str  # "kernel" | "segment" | "conditional"
    deps: list["_Node"]
    kernel: str = ""
    params: LoopParams | None = None
    fn: Callable[[], Any] | None = None
    out: Any = None
    cond: str = ""
    handle: int = 0
    body: "_Graph | None" = None


@dataclass
class _Graph:
    nodes: list[_Node] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)


class EagerGraphApi:
    """:class:`GraphApi` that records the graph and runs it on the host.

    Kernel nodes run their models (:data:`KERNEL_MODELS`) on the same parameter block the
    GPU kernels get; segments (the torch work a CUDA build captures) run eagerly, their
    outputs copied into the memory of the first run (graph semantics); conditional nodes
    follow their handles like the CUDA graph executor. ``launch(exec)`` runs to the end
    (the WHILE handle reaching 0)."""

    def __init__(self) -> None:
        self._next_handle = 1
        self.values: dict[int, int] = {}
        self.defaults: dict[int, int] = {}
        self._capture: _Graph | None = None
        self._capture_deps: list[_Node] = []
        self.kernel_runs: dict[str, int] = {}
        self.aborted_captures = 0
        self.destroyed: list[Any] = []  # graphs destroyed (tier B's close)

    # -- building
    def create_graph(self) -> _Graph:
        return _Graph()

    def conditional_handle(self, graph: _Graph, default: int) -> int:
        h = self._next_handle
        self._next_handle += 1
        graph.handles.append(h)
        self.defaults[h] = default
        return h

    def add_conditional(self, graph: _Graph, deps: list[_Node], handle: int, kind: str) -> tuple[_Node, _Graph]:
        if kind not in ("if", "while"):
            raise ValueError(kind)
        node = _Node("conditional", list(deps), cond=kind, handle=handle, body=_Graph())
        graph.nodes.append(node)
        return node, node.body  # type: ignore[return-value]

    def add_kernel(self, graph: _Graph, deps: list[_Node], kernel: str, grid: int, block: int,
                   params: LoopParams | None) -> _Node:
        node = _Node("kernel", list(deps), kernel=kernel,
                     params=None if params is None else LoopParams.from_buffer_copy(params))
        graph.nodes.append(node)
        return node

    def add_dependency(self, graph: _Graph, src: _Node, dst: _Node) -> None:
        dst.deps.append(src)

    def begin_capture(self, graph: _Graph) -> None:
        if self._capture is not None:
            raise RuntimeError("a capture is already under way")
        self._capture, self._capture_deps = graph, []

    def _append(self, node: _Node) -> None:
        assert self._capture is not None, "not capturing"
        self._capture.nodes.append(node)
        self._capture_deps = [node]

    def segment(self, fn: Callable[[], Any]) -> Any:
        node = _Node("segment", list(self._capture_deps), fn=fn)
        node.out = clone_outputs(fn())
        self._append(node)
        return node.out

    def launch(self, kernel: str, grid: int, block: int, params: LoopParams | None) -> None:
        self._append(_Node("kernel", list(self._capture_deps), kernel=kernel,
                           params=None if params is None else LoopParams.from_buffer_copy(params)))

    def capture_dependencies(self) -> list[_Node]:
        return list(self._capture_deps)

    def set_capture_dependencies(self, nodes: list[_Node]) -> None:
        self._capture_deps = list(nodes)

    def end_capture(self) -> None:
        self._capture = None

    def abort_capture(self) -> None:
        self._capture = None
        self.aborted_captures += 1

    def instantiate(self, graph: _Graph) -> _Graph:
        return graph

    def pointer(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr()

    def destroy(self, exec_: _Graph, graph: _Graph) -> None:
        """What the CUDA build's destroy does (executable, graph, pool): recorded."""
        if graph in self.destroyed:
            raise RuntimeError("graph destroyed twice")
        self.destroyed.append(graph)

    # -- running
    def set_conditional(self, handle: int, value: int) -> None:
        self.values[handle] = value

    def launch_graph(self, graph: _Graph, max_iterations: int | None = None) -> int:
        """Run ``graph`` to completion; returns WHILE iterations run. ``max_iterations``
        bounds them (tests)."""
        for h, v in self.defaults.items():
            self.values[h] = v
        return self._run(graph, max_iterations)

    def _run(self, graph: _Graph, max_iterations: int | None) -> int:
        iterations = 0
        done: set[int] = set()
        pending = list(graph.nodes)
        while pending:
            ready = [n for n in pending if all(id(d) in done for d in n.deps)]
            if not ready:
                raise RuntimeError("graph has a dependency cycle")
            for node in ready:
                if node.kind == "kernel":
                    self.kernel_runs[node.kernel] = self.kernel_runs.get(node.kernel, 0) + 1
                    KERNEL_MODELS[node.kernel](node.params, self.set_conditional)
                elif node.kind == "segment":
                    fresh = node.fn()  # type: ignore[misc]
                    if node.out is not None:
                        copy_into(node.out, fresh)
                elif node.cond == "if":
                    if self.values.get(node.handle, 0):
                        iterations += self._run(node.body, max_iterations)  # type: ignore[arg-type]
                else:  # while
                    while self.values.get(node.handle, 0):
                        self._run(node.body, max_iterations)  # type: ignore[arg-type]
                        iterations += 1
                        if max_iterations is not None and iterations >= max_iterations:
                            break
                done.add(id(node))
                pending.remove(node)
        return iterations


class HostSimulation:
    """The GPU tiers on the host (:class:`blink.engine.gpu.base.HostSimulation`): tier A's
    graphs run by :class:`EagerRunner`, tier B's by :class:`EagerGraphApi`."""

    def graph_runner(self) -> EagerRunner:
        return EagerRunner()

    def graph_api(self) -> EagerGraphApi:
        return EagerGraphApi()
