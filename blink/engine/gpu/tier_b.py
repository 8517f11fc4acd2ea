"""Tier B (``--loop device``): the CPU-free loop, one CUDA graph launched once.

Its layout::

    WHILE(h_loop) { gate → IF(h_step) { schedule → dispatch → IF(h_bucket[b]) { step_b → fence } } }

``gate``, ``dispatch`` and ``fence`` are CUDA C (``kernels/cuda/device_loop.cu``, compiled with
NVRTC at start for the GPU's own architecture). The gate polls the ring's state words with
acquire semantics (bounded by an iteration cap and ``%globaltimer``), bumps the heartbeat,
honours the host's stop word (drain or now) and the ring's C_SHUTDOWN word (drain), and
decides whether a step is needed; dispatch reads the bucket index the scheduler computed on
the device and enables that bucket's body; the fence (``fence.sc.sys``) publishes the
step. After the launch the host thread only sleeps and checks the stream every 100 ms for
completion or an error: no call per step.

**Why a WHILE conditional graph rather than Blink's persistent launcher kernel.** Both are
implemented in CUDA C (``device_loop.cu`` and ``device_launch.cu``, both compile-checked);
tier B uses the conditional graph because it is the one whose correctness rests only on
documented graph semantics:

- ordering and memory visibility between the gate, the schedule, the dispatch and the
  bucket body are node dependencies, the same guarantee as kernels on one stream; the
  persistent launcher instead spins on a completion ticket written by a fire-and-forget
  graph that must make progress on the SMs its own spinning block leaves free, with
  fences on both sides;
- there is no per-execution limit to manage: a WHILE node iterates indefinitely, whereas
  fire-and-forget launches are capped per graph execution (120) and need the tail
  self-relaunch, whose pending-launch accounting is one more thing to get right;
- nothing but ordinary instantiation: device-launchable graphs need
  ``cudaGraphInstantiateFlagDeviceLaunch`` on every captured graph, an upload before first
  use, and must satisfy device-launch node restrictions; a conditional body has similar node
  restrictions (kernels, memcpy, memset, child graphs, conditionals) which torch's captured
  kernels and copies meet;
- the torch work is captured straight into the conditional bodies with
  ``cuStreamBeginCaptureToGraph`` and the caching allocator routed to one private pool,
  the same mechanism torch's own ``begin_capture_to_if_node`` uses.

Its costs: it needs a CUDA 12.4+ driver (conditional nodes), and every iteration evaluates
one IF node per bucket. Which of the two is faster was not measured (no GPU was lent; see
docs/gpu-results.md): ``benchmarks/gpu_loop.py`` measures tier A vs tier B.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from blink.engine.gpu.abi import (
    EXIT_DRAIN_TIMEOUT,
    EXIT_NAMES,
    GATE_THREADS,
    HC_STOP,
    HC_WORDS,
    LS_EXIT,
    LS_GATE_CALLS,
    LS_IDLE_CALLS,
    LS_STEPS,
    LS_WORDS,
    MAX_BUCKETS,
    STOP_DRAIN,
    STOP_NONE,
    STOP_NOW,
    LoopOptions,
    LoopParams,
)
from blink.engine.gpu.base import _RUNNING_LOOPS, GpuEngine
from blink.engine.gpu.cudart import cuda_bindings_driver
from blink.engine.gpu.mapped_ring import device_pointer
from blink.engine.gpu.plan import GraphPlan
from blink.engine.sched.scheduler import StepBatch
from blink.engine.runners import OnScheduled
from blink.engine.step import StepParts, graph_model_phase
from blink import env as blink_env
from blink.errors import BlinkError
from blink.ring import (
    C_ENGINE_STATE,
    C_HEARTBEAT,
    C_SHUTDOWN,
    ENGINE_DRAINING,
    ENGINE_FAILED,
    ENGINE_READY,
    ENGINE_STOPPED,
    SLOT_FREE,
    SLOT_WRITTEN,
)
from blink.threads.roles import set_thread_name

log = logging.getLogger("blink.gpu")

#: after a stop request, the device's own drain limit expires first; the host asks it to stop
#: now only this much later, then gives it this long again before calling it hung.
_STOP_SLACK_S = 5.0
_HUNG_AFTER_S = 10.0
#: after a stop *now* (``stop(drain=False)``: the gate exits at its next poll, within one
#: step), the loop is called hung this long after the request, not after the drain's limits.
_HUNG_AFTER_STOP_NOW_S = 3.0


# --------------------------------------------------------------------- graph construction


class GraphApi(Protocol):
    """What :func:`build_conditional_loop` needs from a graph library. Implemented over the
    CUDA driver (:class:`CudaGraphApi`) and, for tests, on the host
    (:class:`blink.engine.gpu.host_sim.EagerGraphApi`)."""

    def create_graph(self) -> Any: ...
    def conditional_handle(self, graph: Any, default: int) -> int: ...
    def add_conditional(self, graph: Any, deps: list[Any], handle: int, kind: str) -> tuple[Any, Any]: ...
    def add_kernel(self, graph: Any, deps: list[Any], kernel: str, grid: int, block: int,
                   params: LoopParams | None) -> Any: ...
    def add_dependency(self, graph: Any, src: Any, dst: Any) -> None: ...
    def begin_capture(self, graph: Any) -> None: ...
    def segment(self, fn: Callable[[], Any]) -> Any: ...
    def launch(self, kernel: str, grid: int, block: int, params: LoopParams | None) -> None: ...
    def capture_dependencies(self) -> list[Any]: ...
    def set_capture_dependencies(self, nodes: list[Any]) -> None: ...
    def end_capture(self) -> None: ...
    def abort_capture(self) -> None: ...
    def instantiate(self, graph: Any) -> Any: ...
    def pointer(self, tensor: torch.Tensor) -> int: ...


@dataclass
class ConditionalLoop:
    """Tier B's graph, built: the executable, the parameter block, the static buffers."""

    exec: Any
    graph: Any
    params: LoopParams
    batch: StepBatch
    loop_state: torch.Tensor
    host_ctl: torch.Tensor
    handles: dict[str, Any]
    plan: GraphPlan
    keep: list[Any] = field(default_factory=list)  # objects the graph's memory depends on


def build_conditional_loop(
    api: GraphApi,
    parts: StepParts,
    plan: GraphPlan,
    base: LoopParams,
    loop_state: torch.Tensor,
    host_ctl: torch.Tensor,
) -> ConditionalLoop:
    """Build tier B's graph (layout in ``kernels/cuda/device_loop.cu``) through ``api``.

    ``base`` holds the ring pointers, sizes and options; this fills in the schedule's
    output pointers and the conditional handles. Capture order follows ``plan``."""
    if len(plan.buckets) > MAX_BUCKETS:
        raise ValueError(f"{len(plan.buckets)} buckets; the device loop handles at most {MAX_BUCKETS}")
    root = api.create_graph()
    h_loop = api.conditional_handle(root, 1)
    _, body = api.add_conditional(root, [], h_loop, "while")
    h_step = api.conditional_handle(body, 0)
    step_node, step_graph = api.add_conditional(body, [], h_step, "if")
    h_buckets = [api.conditional_handle(step_graph, 0) for _ in plan.buckets]

    # The step: [schedule] -> dispatch -> IF(bucket b) for every b.
    with _capturing(api, step_graph, "the schedule"):
        step = _capture_step(api, parts, plan, base, loop_state, host_ctl, step_graph,
                             h_loop, h_step, h_buckets)
    batch, params, bucket_graphs = step.batch, step.params, step.bucket_graphs

    # Bucket bodies, largest first: [forward + sampler + update] -> publish fence.
    rows = dict(zip(plan.buckets, plan.rows))
    for name in plan.capture_order[1:]:
        tokens = int(name.split(":")[1])
        with _capturing(api, bucket_graphs[tokens], f"bucket {tokens}"):
            api.segment(lambda t=tokens: graph_model_phase(parts, batch, tokens=t, rows=rows[t]))
            api.launch("blink_publish_fence", 1, 32, None)

    # The gate, ahead of the step in the WHILE body.
    gate = api.add_kernel(body, [], "blink_gate", 1, GATE_THREADS, params)
    api.add_dependency(body, gate, step_node)
    exec_ = api.instantiate(root)
    return ConditionalLoop(exec=exec_, graph=root, params=params, batch=batch, loop_state=loop_state,
                           host_ctl=host_ctl, plan=plan,
                           handles={"loop": h_loop, "step": h_step, "buckets": h_buckets})


@contextmanager
def _capturing(api: GraphApi, graph: Any, what: str) -> Iterator[None]:
    """A capture into ``graph`` that is ended on every path: a failure inside it aborts the
    capture (and the allocator's routing to the private pool) before the error propagates,
    so the process is never left capturing."""
    api.begin_capture(graph)
    try:
        yield
    except BaseException as exc:
        api.abort_capture()
        raise BlinkError(f"capturing {what} into tier B's graph failed: {type(exc).__name__}: {exc}") from exc
    api.end_capture()


@dataclass
class _StepCapture:
    batch: StepBatch
    params: LoopParams
    bucket_graphs: dict[int, Any]


def _capture_step(api: GraphApi, parts: StepParts, plan: GraphPlan, base: LoopParams,
                  loop_state: torch.Tensor, host_ctl: torch.Tensor, step_graph: Any,
                  h_loop: int, h_step: int, h_buckets: list[int]) -> _StepCapture:
    """The step graph's captured part: schedule, dispatch, one IF node per bucket."""
    batch: StepBatch = api.segment(parts.scheduler.schedule)
    params = LoopParams.from_buffer_copy(base)
    params.num_scheduled_tokens = api.pointer(batch.num_scheduled_tokens)
    params.bucket_index = api.pointer(batch.bucket_index)
    params.loop_state = api.pointer(loop_state)
    params.host_ctl = api.pointer(host_ctl)
    params.n_buckets = len(plan.buckets)
    params.h_loop, params.h_step = h_loop, h_step
    for i, h in enumerate(h_buckets):
        params.h_bucket[i] = h
    api.launch("blink_dispatch", 1, 32, params)
    after_dispatch = api.capture_dependencies()
    bucket_nodes, bucket_graphs = [], {}
    for tokens, h in zip(plan.buckets, h_buckets):
        node, g = api.add_conditional(step_graph, after_dispatch, h, "if")
        bucket_nodes.append(node)
        bucket_graphs[tokens] = g
    api.set_capture_dependencies(bucket_nodes)
    return _StepCapture(batch, params, bucket_graphs)


def loop_params(views: dict[str, torch.Tensor], n_slots: int, options: LoopOptions,
                drain_timeout_s: float) -> LoopParams:
    """The parameter block's ring pointers, sizes and options (the schedule's outputs and
    the conditional handles are filled in by :func:`build_conditional_loop`)."""
    o = options
    p = LoopParams()
    p.control = views["control"].data_ptr()
    p.slot_state = views["state"].data_ptr()
    p.slot_cancel = views["cancel"].data_ptr()
    p.poll_budget_ns, p.heartbeat_period_ns = o.poll_budget_ns, o.heartbeat_period_ns
    p.empty_backoff_ns, p.drain_timeout_ns = o.empty_backoff_ns, int(drain_timeout_s * 1e9)
    p.n_slots = n_slots
    p.max_polls, p.max_sleep_ns = o.max_polls, o.max_sleep_ns
    p.c_engine_state, p.c_heartbeat, p.c_shutdown = C_ENGINE_STATE, C_HEARTBEAT, C_SHUTDOWN
    p.engine_draining, p.engine_stopped, p.engine_failed = ENGINE_DRAINING, ENGINE_STOPPED, ENGINE_FAILED
    p.slot_free, p.slot_written = SLOT_FREE, SLOT_WRITTEN
    return p


# ------------------------------------------------------------------- the CUDA driver API


def _error_text(cu: Any, err: Any) -> str:
    """A CUresult as ``NAME: description``."""
    def text(pair: Any) -> str:
        value = pair[1] if isinstance(pair, tuple) else pair
        return value.decode() if isinstance(value, bytes) else str(value)
    try:
        name = text(cu.cuGetErrorName(err))
    except Exception:  # noqa: BLE001 - an unknown code still gets reported
        name = str(err)
    try:
        return f"{name}: {text(cu.cuGetErrorString(err))}"
    except Exception:  # noqa: BLE001
        return name


def _check(result: Any, what: str = "?", cu: Any = None) -> Any:
    """cuda-bindings call result -> its value(s); raises on a CUDA error, naming the driver
    call (``what``) and the error's name and description."""
    cu = cu or cuda_bindings_driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise BlinkError(f"CUDA driver call {what} failed: {_error_text(cu, err)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def graph_dump_dir() -> Path:
    """Where a graph that fails to instantiate is written (``cuGraphDebugDotPrint``):
    ``$BLINK_GRAPH_DUMP_DIR``, else ``$OUT`` (the device tool's folder), else the temp dir."""
    return Path(blink_env.get("BLINK_GRAPH_DUMP_DIR") or os.environ.get("OUT") or tempfile.gettempdir())


def dedicated_stream(cu: Any, device: torch.device) -> tuple[Any, torch.cuda.ExternalStream]:
    """A stream of tier B's own, created with the driver (non-blocking: the legacy default
    stream never waits for it, nor it for the default stream), never one from torch's
    stream pool, which a later ``torch.cuda.Stream()`` elsewhere in the process could be
    handed while the WHILE graph occupies it. Returns (CUstream, torch's view of it)."""
    flags = getattr(getattr(cu, "CUstream_flags", None), "CU_STREAM_NON_BLOCKING", 1)
    stream = _check(cu.cuStreamCreate(flags), "cuStreamCreate(CU_STREAM_NON_BLOCKING)", cu)
    return stream, torch.cuda.ExternalStream(int(stream), device=device)


class CudaGraphApi:
    """:class:`GraphApi` over the CUDA driver (cuda-bindings).

    Torch work is captured with ``cuStreamBeginCaptureToGraph`` on one stream whose
    allocations go to one private pool (``_cuda_beginAllocateCurrentStreamToPool``);
    the loop's kernels come from the NVRTC-compiled ``device_loop.cu``."""

    KERNELS = ("blink_gate", "blink_dispatch", "blink_publish_fence")

    def __init__(self, device: torch.device, cubin: bytes) -> None:
        cu = self.cu = cuda_bindings_driver()
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(self.index)
        torch.cuda.init()
        self.ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self.module = _check(cu.cuModuleLoadData(cubin), "cuModuleLoadData(device_loop cubin)")
        self.functions = {k: _check(cu.cuModuleGetFunction(self.module, k.encode()), f"cuModuleGetFunction({k})")
                          for k in self.KERNELS}
        self.cu_stream, self.stream = dedicated_stream(cu, device)
        # A second stream of its own for host reads of device words while the loop runs
        # (a copy there waits for nothing but itself: see read_words).
        self.watch_cu_stream, self.watch_stream = dedicated_stream(cu, device)
        self.pool = torch.cuda.graph_pool_handle()
        self.destroyed = False
        self._keep: list[Any] = []  # parameter blocks and argv arrays the driver copied from
        self._stream_ctx: Any = None

    # -- building
    def create_graph(self) -> Any:
        return _check(self.cu.cuGraphCreate(0), "cuGraphCreate")

    def conditional_handle(self, graph: Any, default: int) -> int:
        h = _check(self.cu.cuGraphConditionalHandleCreate(graph, self.ctx, default,
                                                           self.cu.CU_GRAPH_COND_ASSIGN_DEFAULT),
                   "cuGraphConditionalHandleCreate")
        return int(h)

    def add_conditional(self, graph: Any, deps: list[Any], handle: int, kind: str) -> tuple[Any, Any]:
        cu = self.cu
        p = cu.CUgraphNodeParams()
        p.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        p.conditional.handle = cu.CUgraphConditionalHandle(handle)
        p.conditional.type = (cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE if kind == "while"
                              else cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)
        p.conditional.size = 1
        p.conditional.ctx = self.ctx
        node = _check(cu.cuGraphAddNode(graph, list(deps) or None, None, len(deps), p),
                      f"cuGraphAddNode(conditional {kind.upper()})")
        body = p.conditional.phGraph_out[0]
        self._keep.append(p)
        return node, body

    def _argv(self, params: LoopParams | None) -> int:
        if params is None:
            return 0
        block = LoopParams.from_buffer_copy(params)
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(block))
        self._keep += [block, argv]
        return ctypes.addressof(argv)

    def add_kernel(self, graph: Any, deps: list[Any], kernel: str, grid: int, block: int,
                   params: LoopParams | None) -> Any:
        cu = self.cu
        kp = cu.CUDA_KERNEL_NODE_PARAMS()
        kp.func = self.functions[kernel]
        kp.gridDimX, kp.gridDimY, kp.gridDimZ = grid, 1, 1
        kp.blockDimX, kp.blockDimY, kp.blockDimZ = block, 1, 1
        kp.sharedMemBytes = 0
        kp.kernelParams = self._argv(params)
        kp.extra = 0
        self._keep.append(kp)
        return _check(cu.cuGraphAddKernelNode(graph, list(deps) or None, len(deps), kp),
                      f"cuGraphAddKernelNode({kernel})")

    def add_dependency(self, graph: Any, src: Any, dst: Any) -> None:
        _check(self.cu.cuGraphAddDependencies(graph, [src], [dst], None, 1), "cuGraphAddDependencies")

    def begin_capture(self, graph: Any) -> None:
        # Stream-scoped: a device-wide synchronize would wait forever behind a WHILE graph
        # running elsewhere in the process. The capture stream follows torch's current
        # stream (the warm-up and the tensors the capture reads).
        torch.cuda.current_stream(self.device).synchronize()
        self.stream.synchronize()
        _check(self.cu.cuStreamBeginCaptureToGraph(
            self.cu_stream, graph, None, None, 0,
            self.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCaptureToGraph")
        try:
            self._stream_ctx = torch.cuda.stream(self.stream)
            self._stream_ctx.__enter__()
            if hasattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool"):
                torch._C._cuda_beginAllocateCurrentStreamToPool(self.index, self.pool)
            else:
                torch._C._cuda_beginAllocateToPool(self.index, self.pool)
            self._routing = True
        except BaseException:
            self.abort_capture()
            raise

    def segment(self, fn: Callable[[], Any]) -> Any:
        return fn()  # torch ops on the capturing stream are recorded into the graph

    def launch(self, kernel: str, grid: int, block: int, params: LoopParams | None) -> None:
        _check(self.cu.cuLaunchKernel(self.functions[kernel], grid, 1, 1, block, 1, 1, 0,
                                      self.cu_stream, self._argv(params), 0), f"cuLaunchKernel({kernel})")

    def capture_dependencies(self) -> list[Any]:
        info = _check(self.cu.cuStreamGetCaptureInfo(self.cu_stream), "cuStreamGetCaptureInfo")
        # (status, id, graph, dependencies, edge data, count)
        deps, count = info[3], info[-1]
        return list(deps)[: int(count)]

    def set_capture_dependencies(self, nodes: list[Any]) -> None:
        cu = self.cu
        _check(cu.cuStreamUpdateCaptureDependencies(
            self.cu_stream, list(nodes), None, len(nodes),
            cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES),
            "cuStreamUpdateCaptureDependencies")

    def end_capture(self) -> None:
        self._end_routing()
        _check(self.cu.cuStreamEndCapture(self.cu_stream), "cuStreamEndCapture")

    def abort_capture(self) -> None:
        """After a failure inside a capture: stop routing allocations to the pool, leave the
        capture stream and end the (invalidated) capture, ignoring its error, so that the
        process is usable again (a later capture, eager work, or a clean exit)."""
        self._end_routing()
        status = self.cu.cuStreamIsCapturing(self.cu_stream)
        capturing = status[0] == self.cu.CUresult.CUDA_SUCCESS and \
            status[1] != self.cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        if capturing:
            self.cu.cuStreamEndCapture(self.cu_stream)  # error expected: the capture is invalid

    def _end_routing(self) -> None:
        if getattr(self, "_routing", False):
            self._routing = False
            torch._C._cuda_endAllocateToPool(self.index, self.pool)
        if self._stream_ctx is not None:
            ctx, self._stream_ctx = self._stream_ctx, None
            ctx.__exit__(None, None, None)

    def instantiate(self, graph: Any) -> Any:
        """``cuGraphInstantiateWithParams`` (uploaded to the loop's stream): a refusal names
        the instantiate result and the node the driver blames, and the graph is written with
        ``cuGraphDebugDotPrint`` under :func:`graph_dump_dir`."""
        cu = self.cu
        params = cu.CUDA_GRAPH_INSTANTIATE_PARAMS()
        params.flags = int(getattr(getattr(cu, "CUgraphInstantiate_flags", None),
                                   "CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD", 2))
        params.hUploadStream = self.cu_stream
        err, *rest = cu.cuGraphInstantiateWithParams(graph, params)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise BlinkError(self._instantiate_failure(graph, params, err))
        return rest[0]

    def _instantiate_failure(self, graph: Any, params: Any, err: Any) -> str:
        cu = self.cu
        parts = [f"CUDA driver call cuGraphInstantiateWithParams failed: {_error_text(cu, err)}"]
        result = getattr(params, "result_out", None)
        parts.append(f"instantiate result {getattr(result, 'name', result)}")
        node = getattr(params, "hErrNode_out", None)
        if node is not None and int(node):
            try:
                kind = _check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType", cu)
                parts.append(f"error node {int(node):#x} of type {getattr(kind, 'name', kind)}")
            except BlinkError as exc:
                parts.append(f"error node {int(node):#x} ({exc})")
        else:
            parts.append("no error node named")
        path = graph_dump_dir() / f"tier_b_graph_{os.getpid()}.dot"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            verbose = int(getattr(getattr(cu, "CUgraphDebugDot_flags", None),
                                  "CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE", 1))
            _check(cu.cuGraphDebugDotPrint(graph, str(path).encode(), verbose), "cuGraphDebugDotPrint", cu)
            parts.append(f"graph written to {path}")
        except Exception as exc:  # noqa: BLE001 - the failure is reported either way
            parts.append(f"graph not written ({exc})")
        return "; ".join(parts)

    def destroy(self, exec_: Any, graph: Any) -> None:
        """Destroy the executable and the graph, release the capture pool's memory to the
        caching allocator and destroy the streams (only once the loop has ended)."""
        if self.destroyed:
            return
        self.destroyed = True
        cu = self.cu
        _check(cu.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
        _check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
        self._keep.clear()
        release_pool = getattr(torch._C, "_cuda_releasePool", None)
        if release_pool is not None:
            release_pool(self.index, self.pool)
        for stream in (self.watch_cu_stream, self.cu_stream):
            _check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
            _check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
        _check(cu.cuModuleUnload(self.module), "cuModuleUnload")

    def pointer(self, tensor: torch.Tensor) -> int:
        """Device address of ``tensor``; pinned host tensors (the host words) through
        cudaHostGetDevicePointer."""
        if tensor.device.type == "cpu":
            if not tensor.is_pinned():
                raise BlinkError("a host tensor the device loop reads must be pinned")
            return device_pointer(tensor.data_ptr())
        return tensor.data_ptr()

    # -- running
    def launch_graph(self, exec_: Any) -> None:
        _check(self.cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")  # the engine thread is not the builder's
        _check(self.cu.cuGraphLaunch(exec_, self.cu_stream), "cuGraphLaunch")

    def query(self) -> bool:
        """True when the launched loop has finished; raises on a device error."""
        err = self.cu.cuStreamQuery(self.cu_stream)
        err = err[0] if isinstance(err, tuple) else err
        if err == self.cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check((err,), "cuStreamQuery (the device loop's stream)")
        return True

    def read_words(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of device words the running loop writes (its counters), copied on a
        stream of its own and synchronised on that stream alone: neither waits for the WHILE
        graph (never a device-wide synchronize while it runs)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(self.watch_stream):
            host.copy_(tensor, non_blocking=True)
        self.watch_stream.synchronize()
        return host


# ------------------------------------------------------------------------------- engine


class DeviceLoop:
    """Tier B's step runner (:class:`blink.engine.runners.StepRunner` ``tier-b``): the steps
    run inside the graph the engine launches once; the host runs none."""

    name = "tier-b"

    def __init__(self, loop: ConditionalLoop) -> None:
        self.loop = loop

    def prepare(self) -> None:
        pass  # built at construction, launched by the engine's monitor thread

    def run(self, on_scheduled: OnScheduled | None = None) -> bool:
        raise BlinkError("tier B has no host step: its loop runs on the device")


class TierBEngine(GpuEngine):
    """The engine with tier B's loop: one graph launch, then the host only watches it."""

    tier, loop_flag = "B", "device"
    rings_doorbell = False  # no host step to ring it after: the frontend keeps its timers
    loop_thread_name = "blink-gpumon"
    loop: ConditionalLoop

    def _build_graphs(self) -> DeviceLoop:
        with torch.inference_mode(False):  # host-written words: normal tensors
            if self.simulation is not None:
                self.api: Any = self.simulation.graph_api()
                views = self.scheduler.ring
                loop_state = torch.zeros(LS_WORDS, dtype=torch.int64)
                host_ctl = torch.zeros(HC_WORDS, dtype=torch.int64)
            else:
                from blink.kernels.cuda.nvrtc_build import compile_source  # noqa: PLC0415

                major, minor = torch.cuda.get_device_capability(self.device)
                compiled = compile_source("device_loop", arch=major * 10 + minor)
                self.api = CudaGraphApi(self.device, compiled.cubin)
                assert self.mapped is not None  # a CUDA engine always maps its ring
                views = self.mapped.views
                loop_state = torch.zeros(LS_WORDS, dtype=torch.int64, device=self.device)
                host_ctl = torch.zeros(HC_WORDS, dtype=torch.int64, pin_memory=True)
                with torch.cuda.stream(self.api.stream):
                    self._warmup()
            base = loop_params(views, self.ring_config.n_slots, self.options, self.drain_timeout_s)
            with torch.inference_mode():
                self.loop = build_conditional_loop(self.api, self.parts, self.plan, base, loop_state, host_ctl)
        return DeviceLoop(self.loop)

    def stop(self, drain: bool = True) -> None:
        if hasattr(self, "loop"):
            self.loop.host_ctl[HC_STOP] = STOP_DRAIN if drain else STOP_NOW
        super().stop(drain)

    def close(self) -> None:
        super().close()  # stop now, then release the ring (kept while the loop may run)
        self._destroy_loop()

    def _destroy_loop(self) -> None:
        """Destroy the graph's executable and release its pool, once the loop has ended
        (a hung loop keeps them: the device may still run them)."""
        api = getattr(self, "api", None)
        if api is None or not hasattr(self, "loop") or self._device_may_touch_ring():
            return
        destroy = getattr(api, "destroy", None)
        if destroy is not None:
            destroy(self.loop.exec, self.loop.graph)

    def _device_may_touch_ring(self) -> bool:
        return not self.simulate and hasattr(self, "api") and not self.api.query()

    def _run(self) -> None:
        set_thread_name(self.loop_thread_name)
        control = self.ring.control
        try:
            self.loop.host_ctl[HC_STOP] = STOP_NONE
            control[C_ENGINE_STATE] = ENGINE_READY
            if self.simulate:
                with torch.inference_mode():
                    self.api.launch_graph(self.loop.exec)
            else:
                self._monitor_device_loop()
            reason = int(self.loop.loop_state[LS_EXIT])
            self.exit_reason = EXIT_NAMES[reason] if 0 <= reason < len(EXIT_NAMES) else str(reason)
            if reason == EXIT_DRAIN_TIMEOUT:
                log.warning("drain timed out with requests still in flight")
            if control[C_ENGINE_STATE] != ENGINE_FAILED:
                control[C_ENGINE_STATE] = ENGINE_STOPPED
        except BaseException as exc:  # the loop must never die silently
            self.error = exc
            control[C_ENGINE_STATE] = ENGINE_FAILED
            print("blink device loop failed:\n" + traceback.format_exc(), file=sys.stderr, flush=True)

    def _monitor_device_loop(self) -> None:
        """Launch tier B's graph once, then only watch it: no host call per step. Bounded:
        after a stop request the device drains within the engine's drain timeout; the host
        asks it to stop now ``_STOP_SLACK_S`` later, and calls it hung ``_HUNG_AFTER_S``
        after that."""
        api = self.api
        _RUNNING_LOOPS.add(self)  # until the stream is seen to finish (a hung loop stays)
        api.launch_graph(self.loop.exec)
        stop_seen: float | None = None
        forced: float | None = None
        hung_after = _HUNG_AFTER_S
        while not api.query():
            time.sleep(0.1 if stop_seen is None else 0.02)
            if self._stop.is_set() and stop_seen is None:
                stop_seen = time.monotonic()
            if stop_seen is not None and forced is None and not getattr(self, "_drain", True):
                forced, hung_after = stop_seen, _HUNG_AFTER_STOP_NOW_S  # stop(drain=False)
            if stop_seen is not None and forced is None and \
                    time.monotonic() - stop_seen > self.drain_timeout_s + _STOP_SLACK_S:
                self.loop.host_ctl[HC_STOP] = STOP_NOW
                forced = time.monotonic()
            if forced is not None and time.monotonic() - forced > hung_after:
                raise BlinkError(f"the device loop did not stop {hung_after:g} s after a stop "
                                 f"{'now' if hung_after == _HUNG_AFTER_STOP_NOW_S else 'request'}: hung")
        _RUNNING_LOOPS.discard(self)

    def loop_counters(self) -> dict[str, int]:
        """Gate calls, idle gate calls and steps the device loop made."""
        ls = self.loop.loop_state
        if ls.device.type == "cuda":
            ls = self.api.read_words(ls)  # its own stream: no wait for the running loop
        return {"gate_calls": int(ls[LS_GATE_CALLS]), "idle_calls": int(ls[LS_IDLE_CALLS]),
                "steps": int(ls[LS_STEPS])}
