"""What keeps a GPU loop from starting on this machine, as a list of reasons.

``--loop device`` refuses to start with the list; ``--loop auto`` on a GPU falls back to
tier A with a warning naming it; ``--loop host`` needs only a CUDA GPU that maps host memory.
Tier B also needs: compute capability >= 7.0 (``ld.acquire.sys``/``st.release.sys``/
``fence.acq_rel.sys``, ``__nanosleep`` and ``%globaltimer`` need sm_70; Hopper is 9.0); a CUDA
12.4+ driver and torch built against CUDA 12.4+ (conditional nodes); cuda-bindings 13+; NVRTC
or nvcc; unified addressing and mapped host memory; the native caching allocator (captures
are routed to a private pool of it) and its pool hooks. Whether the driver will register a
shared-memory ring is probed with one real page (:func:`ring_registration_problem`).
"""
from __future__ import annotations

import importlib.metadata

import torch

from blink.engine.gpu.cudart import cuda_bindings_driver


_MIN_DRIVER_CONDITIONAL = 12040  # CUDA 12.4: IF/WHILE conditional nodes, memcpy/memset in bodies


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
        cu = cuda_bindings_driver()
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
    from blink.kernels.cuda.nvrtc_build import available_compiler

    if available_compiler() is None:
        problems.append("no CUDA C compiler for the loop's kernels: pip install "
                        "nvidia-cuda-nvrtc (matching the driver), or put nvcc on PATH")
    if not (hasattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool")
            or hasattr(torch._C, "_cuda_beginAllocateToPool")):
        problems.append("this torch has no allocator hook to capture into a private pool")
    return problems
