"""The GPU device loops: tier A (host-driven CUDA graphs) and tier B (CPU-free).

Both run the CPU loop's own step (:mod:`blink.engine.graphs`): ``scheduler.schedule()``
and ``model_phase`` (forward → sampler → ``scheduler.update``), captured into CUDA graphs,
one schedule graph and one graph per token bucket (``SchedulerConfig.buckets``). The ring
stays where the frontend writes it: the loopback region (POSIX shared memory) is registered
with ``cudaHostRegister(..., Mapped | Portable)`` and the scheduler reads and writes it
through device views of that mapping, so a frontend process sees tokens with no host engine
thread in between. (A GPUDirect RDMA ring in GPU memory works the same way through a device
pointer; the engine creates host regions today.)

**Tier A** (``--loop host``), the conventional baseline (what vLLM and SGLang do): a host
thread loops [replay the schedule graph → wait for it and read (tokens, bucket) from a
pinned mailbox → replay that bucket's graph], captured with ``torch.cuda.CUDAGraph`` in one
shared memory pool. The host read per step is what tier A pays; the host also decides
idleness, drain and shutdown exactly like the CPU loop (same ``Engine._run``).

**Tier B** (``--loop device``): one CUDA graph, launched once::

    WHILE(h_loop) { gate → IF(h_step) { schedule → dispatch → IF(h_bucket[b]) { step_b → fence } } }

``gate``, ``dispatch`` and ``fence`` are CUDA C (``kernels/device_loop.cu``, compiled with
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

**Checks before tier B starts** (:func:`tier_b_problems`): a CUDA GPU; compute capability
>= 7.0 (``ld.acquire.sys``/``st.release.sys``/``fence.acq_rel.sys``, ``__nanosleep`` and
``%globaltimer`` reads need sm_70; Hopper is 9.0); CUDA driver >= 12.4 and torch built
against CUDA >= 12.4 (conditional nodes); ``cuda-bindings`` importable; NVRTC or nvcc
found; the device maps host memory with unified addressing (the mapped ring); torch has
the allocator hooks used to route captures into a private pool. ``--loop device`` refuses
to start with the list of what is missing; ``--loop auto`` on a GPU falls back to tier A
with a warning; ``--loop host`` needs only a CUDA GPU that maps host memory.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import logging
import mmap
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from blink.engine.capture_audit import CaptureAudit
from blink.engine.engine import Engine, EngineConfig
from blink.engine.graphs import (
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
    STOP_DRAIN,
    STOP_NONE,
    STOP_NOW,
    ConditionalLoop,
    EagerGraphApi,
    EagerRunner,
    GraphPlan,
    HostGraphStep,
    LoopOptions,
    LoopParams,
    StepParts,
    build_conditional_loop,
    model_phase,
    plan_graphs,
)
from blink.engine.state import ring_views
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
    RingLayout,
)
from blink.transport import Region, set_thread_name
from blink.transport.inprocess import InProcessRegion

log = logging.getLogger("blink.gpu_loop")

_MIN_DRIVER_CONDITIONAL = 12040  # CUDA 12.4: IF/WHILE conditional nodes, memcpy/memset in bodies
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2


# ------------------------------------------------------------------------------ checks


def _cuda_bindings_driver():
    from cuda.bindings import driver  # noqa: PLC0415

    return driver


def _version_tuple(text: str | None) -> tuple[int, int]:
    try:
        major, minor = (text or "0.0").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def ring_registration_problem(device: torch.device) -> str | None:
    """Why the GPU cannot map a shared-memory ring (None: it can). Probed once per device
    with one real page (``blink.engine.gpu_probe.host_register_problem``): some sandboxes
    (gVisor) refuse ``cudaHostRegister`` of shared memory."""
    from blink.engine.gpu_probe import host_register_problem  # noqa: PLC0415

    return host_register_problem(device)


def tier_a_problems(device: torch.device | None = None) -> list[str]:
    """What keeps tier A (host-driven CUDA graphs) from starting here (empty = nothing)."""
    if not torch.cuda.is_available():
        return ["torch sees no CUDA GPU (this torch build or machine has none)"]
    props = torch.cuda.get_device_properties(device or torch.device("cuda"))
    if getattr(props, "can_map_host_memory", True) is False:
        return [f"{props.name} cannot map host memory: the ring cannot be mapped into the GPU"]
    return []


def tier_b_problems(device: torch.device | None = None) -> list[str]:
    """What keeps tier B (the CPU-free WHILE-graph loop) from starting here."""
    problems = tier_a_problems(device)
    if problems:
        return problems
    device = device or torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    if major < 7:
        problems.append(f"compute capability {major}.{minor} < 7.0: the loop's acquire/release "
                        "loads and stores, __nanosleep and %globaltimer need sm_70 or newer")
    if _version_tuple(torch.version.cuda) < (12, 4):
        problems.append(f"torch is built against CUDA {torch.version.cuda}; conditional graph nodes "
                        "need CUDA 12.4 or newer")
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        problems.append(f"the CUDA caching allocator backend is {backend!r}: the loop's captures route "
                        "allocations to a private pool of the native allocator; unset "
                        "backend:cudaMallocAsync in PYTORCH_CUDA_ALLOC_CONF")
    try:
        cu = _cuda_bindings_driver()
    except ImportError:
        problems.append("cuda-bindings is not installed (pip install 'cuda-bindings>=13')")
        cu = None
    bindings = _installed_version("cuda-bindings") or _installed_version("cuda-python")
    if cu is not None and bindings is not None and _version_tuple(bindings) < (13, 0):
        problems.append(f"cuda-bindings {bindings} is too old: the loop calls the 13.x signatures "
                        "(cuStreamBeginCaptureToGraph, cuGraphAddNode with edge data); "
                        "pip install 'cuda-bindings>=13'")
        cu = None
    if cu is not None:
        err, version = cu.cuDriverGetVersion()
        if err != cu.CUresult.CUDA_SUCCESS or version < _MIN_DRIVER_CONDITIONAL:
            problems.append(f"the CUDA driver supports CUDA {version // 1000}.{version % 1000 // 10}; "
                            "conditional graph nodes (WHILE/IF) need a 12.4 or newer driver")
        try:
            idx = device.index if device.index is not None else torch.cuda.current_device()
            err, dev = cu.cuDeviceGet(idx)
            for attr, what in (
                (cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, "unified addressing"),
                (cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, "mapped host memory"),
            ):
                err, value = cu.cuDeviceGetAttribute(attr, dev)
                if err == cu.CUresult.CUDA_SUCCESS and not value:
                    problems.append(f"the GPU lacks {what} (needed for the ring mapped into the GPU)")
        except Exception as exc:  # noqa: BLE001 - a failed query is reported, not fatal
            problems.append(f"could not query the GPU's attributes: {exc}")
    from blink.kernels.nvrtc_build import available_compiler

    if available_compiler() is None:
        problems.append("no CUDA C compiler for the loop's kernels: pip install "
                        "nvidia-cuda-nvrtc (matching the driver), or put nvcc on PATH")
    if not (hasattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool")
            or hasattr(torch._C, "_cuda_beginAllocateToPool")):
        problems.append("this torch has no allocator hook to capture into a private pool")
    return problems


# -------------------------------------------------------------------- the ring on the GPU


class _CudaArray:
    """``__cuda_array_interface__`` over a raw device address (keeps ``owner`` alive)."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None, "version": 2,
        }


@dataclass
class MappedRing:
    """A host ring region registered with the GPU, and device views of its fields."""

    host_ptr: int
    device_ptr: int
    nbytes: int
    views: dict[str, torch.Tensor]
    registered: bool = True

    def unregister(self) -> bool:
        """Unregister the ring from the GPU. False when the driver refused (the ring must
        then stay mapped: the GPU may still address it)."""
        if self.registered:
            err = torch.cuda.cudart().cudaHostUnregister(self.host_ptr)
            if int(err) != 0:
                log.warning("cudaHostUnregister failed with CUDA error %s; the ring stays mapped", int(err))
                return False
            self.registered = False
            self.views.clear()
        return True


def _device_pointer(host_ptr: int) -> int:
    """Device address of registered/pinned host memory (cudaHostGetDevicePointer; the
    same address under unified addressing when cuda-bindings is missing)."""
    try:
        from cuda.bindings import runtime  # noqa: PLC0415
    except ImportError:
        return host_ptr
    err, dptr = runtime.cudaHostGetDevicePointer(host_ptr, 0)
    if err != runtime.cudaError_t.cudaSuccess:
        raise BlinkError(f"cudaHostGetDevicePointer failed: {err}")
    return int(dptr)


def map_ring(buffer: Any, layout: RingLayout, device: torch.device) -> MappedRing:
    """Register the ring's host buffer (mapped, portable) and view it from ``device``."""
    nbytes = layout.total_bytes
    host_ptr = np.frombuffer(buffer, dtype=np.uint8, count=nbytes).ctypes.data
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping covers whole pages
    err = torch.cuda.cudart().cudaHostRegister(host_ptr, size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
    if int(err) != 0:
        from blink.engine.gpu_probe import clear_cuda_last_error  # noqa: PLC0415

        clear_cuda_last_error()  # else torch's next launch check reports this error as its own
        raise BlinkError(f"cudaHostRegister of the ring ({size} bytes) failed with CUDA error "
                         f"{int(err)}: the ring cannot be mapped into the GPU")
    dptr = _device_pointer(host_ptr)
    base = torch.as_tensor(_CudaArray(dptr, nbytes, buffer), device=device)
    if base.data_ptr() != dptr:
        raise BlinkError("torch copied the mapped ring instead of viewing it")
    return MappedRing(host_ptr, dptr, nbytes, ring_views(layout, base))


class PinnedRegion(InProcessRegion):
    """The ring in pinned host memory the engine allocates itself (``cudaHostAlloc`` through
    torch; mapped into the GPU under unified addressing, so no ``cudaHostRegister``): the
    fallback where registering a shared-memory segment is refused. Only a frontend in this
    process can reach it (:mod:`blink.transport.inprocess`)."""

    def __init__(self, total_bytes: int) -> None:
        pinned = torch.zeros(total_bytes, dtype=torch.uint8, pin_memory=True)
        super().__init__(pinned.numpy(), total_bytes, owner=pinned)


def map_pinned_ring(region: PinnedRegion, layout: RingLayout, device: torch.device) -> MappedRing:
    """Device views of a :class:`PinnedRegion`'s ring (already mapped: nothing to register)."""
    host_ptr = np.frombuffer(region.buffer, dtype=np.uint8, count=layout.total_bytes).ctypes.data
    dptr = _device_pointer(host_ptr)
    base = torch.as_tensor(_CudaArray(dptr, layout.total_bytes, region.buffer), device=device)
    return MappedRing(host_ptr, dptr, layout.total_bytes, ring_views(layout, base), registered=False)


# ------------------------------------------------------------------- tier A: CUDA runner


class TorchCudaRunner:
    """:class:`~blink.engine.graphs.GraphRunner` over ``torch.cuda.CUDAGraph``: one
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


# ----------------------------------------------------------- tier B: CUDA graph building


def _check(result: Any) -> Any:
    """cuda-bindings call result -> its value(s); raises on a CUDA error."""
    cu = _cuda_bindings_driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise BlinkError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class CudaGraphApi:
    """:class:`~blink.engine.graphs.GraphApi` over the CUDA driver (cuda-bindings).

    Torch work is captured with ``cuStreamBeginCaptureToGraph`` on one stream whose
    allocations go to one private pool (``_cuda_beginAllocateCurrentStreamToPool``);
    the loop's kernels come from the NVRTC-compiled ``device_loop.cu``."""

    KERNELS = ("blink_gate", "blink_dispatch", "blink_publish_fence")

    def __init__(self, device: torch.device, cubin: bytes) -> None:
        cu = self.cu = _cuda_bindings_driver()
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(self.index)
        torch.cuda.init()
        self.ctx = _check(cu.cuCtxGetCurrent())
        self.module = _check(cu.cuModuleLoadData(cubin))
        self.functions = {k: _check(cu.cuModuleGetFunction(self.module, k.encode())) for k in self.KERNELS}
        self.stream = torch.cuda.Stream(device)
        self.cu_stream = cu.CUstream(self.stream.cuda_stream)
        self.pool = torch.cuda.graph_pool_handle()
        self._keep: list[Any] = []  # parameter blocks and argv arrays the driver copied from
        self._stream_ctx: Any = None

    # -- building
    def create_graph(self) -> Any:
        return _check(self.cu.cuGraphCreate(0))

    def conditional_handle(self, graph: Any, default: int) -> int:
        h = _check(self.cu.cuGraphConditionalHandleCreate(graph, self.ctx, default,
                                                           self.cu.CU_GRAPH_COND_ASSIGN_DEFAULT))
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
        node = _check(cu.cuGraphAddNode(graph, list(deps) or None, None, len(deps), p))
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
        return _check(cu.cuGraphAddKernelNode(graph, list(deps) or None, len(deps), kp))

    def add_dependency(self, graph: Any, src: Any, dst: Any) -> None:
        _check(self.cu.cuGraphAddDependencies(graph, [src], [dst], None, 1))

    def begin_capture(self, graph: Any) -> None:
        torch.cuda.synchronize(self.device)
        _check(self.cu.cuStreamBeginCaptureToGraph(
            self.cu_stream, graph, None, None, 0,
            self.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
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
                                      self.cu_stream, self._argv(params), 0))

    def capture_dependencies(self) -> list[Any]:
        info = _check(self.cu.cuStreamGetCaptureInfo(self.cu_stream))
        # (status, id, graph, dependencies, edge data, count)
        deps, count = info[3], info[-1]
        return list(deps)[: int(count)]

    def set_capture_dependencies(self, nodes: list[Any]) -> None:
        cu = self.cu
        _check(cu.cuStreamUpdateCaptureDependencies(
            self.cu_stream, list(nodes), None, len(nodes),
            cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES))

    def end_capture(self) -> None:
        self._end_routing()
        _check(self.cu.cuStreamEndCapture(self.cu_stream))

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
        exec_ = _check(self.cu.cuGraphInstantiate(graph, 0))
        _check(self.cu.cuGraphUpload(exec_, self.cu_stream))
        return exec_

    def pointer(self, tensor: torch.Tensor) -> int:
        """Device address of ``tensor``; pinned host tensors (the host words) through
        cudaHostGetDevicePointer."""
        if tensor.device.type == "cpu":
            if not tensor.is_pinned():
                raise BlinkError("a host tensor the device loop reads must be pinned")
            return _device_pointer(tensor.data_ptr())
        return tensor.data_ptr()

    # -- running
    def launch_graph(self, exec_: Any) -> None:
        _check(self.cu.cuCtxSetCurrent(self.ctx))  # the engine thread is not the builder's
        _check(self.cu.cuGraphLaunch(exec_, self.cu_stream))

    def query(self) -> bool:
        """True when the launched loop has finished; raises on a device error."""
        err = self.cu.cuStreamQuery(self.cu_stream)
        err = err[0] if isinstance(err, tuple) else err
        if err == self.cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check((err,))
        return True


# ------------------------------------------------------------------------------- engine


class GpuEngine(Engine):
    """The engine with a GPU device loop: ``tier="A"`` (``--loop host``) or ``"B"``
    (``--loop device``).

    ``simulate=True`` runs the same loop code on CPU tensors (tests): tier A through
    :class:`~blink.engine.graphs.EagerRunner`, tier B through
    :class:`~blink.engine.graphs.EagerGraphApi` (the graph recorded by the same builder and
    interpreted on the host, kernels run by their host models)."""

    supported_devices = ("cuda", "cpu")

    def __init__(self, config: EngineConfig, tier: str = "B", *, simulate: bool = False,
                 options: LoopOptions | None = None) -> None:
        if tier not in ("A", "B"):
            raise BlinkError(f"unknown GPU loop tier {tier!r}")
        self.tier = tier
        self.simulate = simulate
        self.options = options or LoopOptions()
        self.mapped: MappedRing | None = None
        self.loop: ConditionalLoop | None = None
        self.host_step: HostGraphStep | None = None
        self.exit_reason: str | None = None
        try:
            super().__init__(config)
            if self.device.type != "cuda" and not simulate:
                raise BlinkError(f"--loop {'host' if tier == 'A' else 'device'} needs a CUDA GPU "
                                 "(--device cuda); use --loop cpu")
            if self.device.type == "cuda" and simulate:
                raise BlinkError("simulate=True runs on CPU tensors only")
            self.plan: GraphPlan = plan_graphs(self.scheduler_config, self.ring_config.n_slots)
            self.parts = StepParts(self.scheduler, self.executor, self.sampler)
            self._build_graphs()
        except BaseException:
            if hasattr(self, "region"):
                self._release_ring()  # a failed start leaves no registered ring or segment behind
            raise

    def _build_graphs(self) -> None:
        tier, simulate = self.tier, self.simulate
        t0 = time.monotonic()
        with torch.inference_mode():
            if tier == "A":
                runner = EagerRunner() if simulate else TorchCudaRunner(self.device)
                self.stream = None if simulate else runner.stream
                if not simulate:
                    with torch.cuda.stream(runner.stream):
                        self._warmup()
                self.host_step = HostGraphStep(self.parts, self.plan, runner)
            else:
                self._build_tier_b()
        log.info("tier %s graphs for buckets %s built in %.1f s", tier, self.plan.buckets, time.monotonic() - t0)

    # -- construction hooks
    def _create_region(self, total_bytes: int) -> Region:
        if self.device.type == "cuda" and self.config.transport == "inprocess":
            return PinnedRegion(total_bytes)
        return super()._create_region(total_bytes)

    def _ring_tensors(self) -> dict[str, torch.Tensor]:
        if self.device.type != "cuda":
            return super()._ring_tensors()
        layout = RingLayout(self.ring_config)
        if isinstance(self.region, PinnedRegion):
            self.mapped = map_pinned_ring(self.region, layout, self.device)
        else:
            self.mapped = map_ring(self.region.buffer, layout, self.device)
        return self.mapped.views

    def _loop_params(self, views: dict[str, torch.Tensor]) -> LoopParams:
        o = self.options
        p = LoopParams()
        p.control = views["control"].data_ptr()
        p.slot_state = views["state"].data_ptr()
        p.slot_cancel = views["cancel"].data_ptr()
        p.poll_budget_ns, p.heartbeat_period_ns = o.poll_budget_ns, o.heartbeat_period_ns
        p.empty_backoff_ns, p.drain_timeout_ns = o.empty_backoff_ns, o.drain_timeout_ns
        p.n_slots = self.ring_config.n_slots
        p.max_polls, p.max_sleep_ns = o.max_polls, o.max_sleep_ns
        p.c_engine_state, p.c_heartbeat, p.c_shutdown = C_ENGINE_STATE, C_HEARTBEAT, C_SHUTDOWN
        p.engine_draining, p.engine_stopped, p.engine_failed = ENGINE_DRAINING, ENGINE_STOPPED, ENGINE_FAILED
        p.slot_free, p.slot_written = SLOT_FREE, SLOT_WRITTEN
        return p

    def _warmup(self) -> None:
        """Run the step once per bucket, eagerly, on the empty ring (Triton JIT, cuBLAS),
        under the capture audit: on the GPU it also sees copies between host and device, and
        an op a graph cannot hold is reported by name here rather than as a failed capture."""
        if not bool((self.ring.state == SLOT_FREE).all()):
            raise BlinkError("the GPU loop is built before any request is accepted")
        audit = CaptureAudit()
        with audit:
            batch = self.scheduler.schedule()
            for tokens, rows in zip(self.plan.buckets, self.plan.rows):
                model_phase(self.parts, batch, tokens=tokens, rows=rows, compact=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        try:
            audit.check("the step the GPU graphs capture")
        except AssertionError as exc:
            raise BlinkError(str(exc)) from None

    def _build_tier_b(self) -> None:
        with torch.inference_mode(False):  # host-written words: normal tensors
            self._build_tier_b_inner()

    def _build_tier_b_inner(self) -> None:
        if self.simulate:
            api: Any = EagerGraphApi()
            views = self.scheduler.ring
            loop_state = torch.zeros(LS_WORDS, dtype=torch.int64)
            host_ctl = torch.zeros(HC_WORDS, dtype=torch.int64)
        else:
            from blink.kernels.nvrtc_build import compile_source

            major, minor = torch.cuda.get_device_capability(self.device)
            compiled = compile_source("device_loop", arch=major * 10 + minor)
            api = CudaGraphApi(self.device, compiled.cubin)
            views = self.mapped.views if self.mapped else self.scheduler.ring
            loop_state = torch.zeros(LS_WORDS, dtype=torch.int64, device=self.device)
            host_ctl = torch.zeros(HC_WORDS, dtype=torch.int64, pin_memory=True)
            with torch.cuda.stream(api.stream):
                self._warmup()
        base = self._loop_params(views)
        self.api = api
        with torch.inference_mode():
            self.loop = build_conditional_loop(api, self.parts, self.plan, base, loop_state, host_ctl)

    # -- tier A: the host loop is Engine._run; only the step differs
    def step(self) -> bool:
        if self.tier != "A":
            raise BlinkError("tier B has no host step")
        assert self.host_step is not None
        return self.host_step.step()

    # -- lifecycle
    def stop(self, drain: bool = True) -> None:
        if self.tier == "B" and self.loop is not None:
            self.loop.host_ctl[HC_STOP] = STOP_DRAIN if drain else STOP_NOW
        super().stop(drain)

    def close(self) -> None:
        self.stop(drain=False)
        self._release_ring()

    def _release_ring(self) -> None:
        """Unregister the mapped ring, then unmap it; never unmap a ring the GPU may still
        touch: while a hung device loop runs (or unregistering fails) the mapping stays until
        the process exits, and only the segment's name is removed."""
        if self.mapped is not None and self.mapped.registered:
            api = getattr(self, "api", None)
            if self.tier == "B" and not self.simulate and api is not None and not api.query():
                log.error("the device loop is still running at close; the ring stays registered "
                          "and mapped until the process exits")
                self.region.unlink()
                return
            torch.cuda.synchronize(self.device)
            if not self.mapped.unregister():
                self.region.unlink()
                return
        self.region.close()

    def _run(self) -> None:
        if self.tier == "A":
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    super()._run()
                self.stream.synchronize()
            else:
                super()._run()
            return
        set_thread_name("blink-loop")
        control = self.ring.control
        assert self.loop is not None
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
        after a stop request the device gets the drain timeout (plus slack) before the host
        asks it to stop now, then 10 s more before the engine is marked FAILED."""
        api = self.api
        api.launch_graph(self.loop.exec)
        stop_seen: float | None = None
        forced: float | None = None
        while not api.query():
            time.sleep(0.1)
            if self._stop.is_set() and stop_seen is None:
                stop_seen = time.monotonic()
            if stop_seen is not None and forced is None and \
                    time.monotonic() - stop_seen > self.drain_timeout_s + 5:
                self.loop.host_ctl[HC_STOP] = STOP_NOW
                forced = time.monotonic()
            if forced is not None and time.monotonic() - forced > 10:
                raise BlinkError("the device loop did not stop 10 s after a stop request: hung")

    def loop_counters(self) -> dict[str, int]:
        """Gate calls, idle gate calls and steps the device loop made (tier B)."""
        if self.loop is None:
            return {}
        ls = self.loop.loop_state.cpu()
        return {"gate_calls": int(ls[LS_GATE_CALLS]), "idle_calls": int(ls[LS_IDLE_CALLS]),
                "steps": int(ls[LS_STEPS])}


def create_engine(config: EngineConfig, loop: str = "auto", *, simulate: bool = False,
                  options: LoopOptions | None = None, in_process_frontend: bool = False) -> Engine:
    """The engine for ``--loop cpu|host|device|auto`` (``blink serve``, ``blink engine`` and
    ``LLM`` all come here).

    ``auto``: the CPU loop on a CPU device; on a GPU tier B, or tier A (with a warning
    naming what tier B lacks). ``device`` refuses to start where tier B cannot run.
    On a GPU whose driver refuses to register the shared-memory ring (gVisor), a frontend
    in another process cannot reach the engine: with ``in_process_frontend`` (``LLM``) the
    ring moves to pinned memory of the engine's own (``transport="inprocess"``, logged);
    otherwise the engine refuses to start, saying so.
    ``simulate`` (tests): the GPU loops' code on CPU tensors."""
    if loop not in ("auto", "cpu", "host", "device"):
        raise BlinkError(f"unknown --loop {loop!r}")
    if loop == "cpu" and config.device == "auto":
        config = dataclasses.replace(config, device="cpu")
    device = torch.device("cpu") if simulate else config.resolved_device()
    if loop == "cpu" or (loop == "auto" and device.type == "cpu" and not simulate):
        return Engine(config)
    if device.type != "cuda" and not simulate:
        raise BlinkError(f"--loop {loop} runs CUDA graphs and needs a CUDA GPU (--device cuda); "
                         f"torch sees none here: use --loop cpu")
    if simulate:
        config = dataclasses.replace(config, device="cpu")
        return GpuEngine(config, "A" if loop == "host" else "B", simulate=True, options=options)
    tier_a = tier_a_problems(device)
    if tier_a:
        raise BlinkError(f"--loop {loop} cannot start: " + "; ".join(tier_a))
    if config.transport == "loopback":
        refused = ring_registration_problem(device)
        if refused is not None and in_process_frontend:
            log.warning("the GPU cannot map a shared-memory ring (%s): the ring is pinned memory "
                        "of the engine's own, read by this process's frontend (transport inprocess)",
                        refused)
            config = dataclasses.replace(config, transport="inprocess")
        elif refused is not None:
            raise BlinkError(
                f"--loop {loop}: the GPU cannot map the shared-memory ring here ({refused}), so a "
                "frontend in another process cannot reach the engine's memory. Run the frontend in "
                "the engine's process (blink.LLM falls back to a pinned in-process ring by itself) "
                "or serve from the CPU with --loop cpu --device cpu.")
    if loop == "host":
        return GpuEngine(config, "A", options=options)
    problems = tier_b_problems(device)
    if problems:
        if loop == "device":
            raise BlinkError("--loop device (tier B, CPU-free) cannot start here: " + "; ".join(problems)
                             + ". Use --loop host (tier A) or --loop auto (falls back to tier A).")
        log.warning("tier B unavailable (%s); using tier A (host-driven CUDA graphs)", "; ".join(problems))
        return GpuEngine(config, "A", options=options)
    return GpuEngine(config, "B", options=options)
