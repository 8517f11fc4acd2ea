"""The device loop's CUDA C (kernels/*.cu), checked without a GPU.

- Each compilation unit compiles for sm_90 (H100/H200) with NVRTC (the nvidia-cuda-nvrtc
  wheel or a toolkit) and with nvcc, whichever are present; no spills; every kernel defined.
- The PTX holds the memory-order instructions the ring protocol depends on
  (ld.acquire.sys, st.release.sys, fence.sc.sys, fence.acq_rel.sys), the %globaltimer reads
  that bound every spin, and the conditional-handle / device-launch calls.
- The pure decision functions (kernels/cuda/device_loop_logic.cuh) are compiled for the host
  and compared with their Python mirrors in blink.engine.gpu.abi on random inputs.
- The parameter block and every shared constant have the same layout/value on both sides.
"""
from __future__ import annotations

import ctypes
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from blink.engine.gpu import abi
from blink.kernels.cuda import nvrtc_build as nb

KDIR = Path(nb.__file__).resolve().parent

NO_COMPILER = ("no CUDA C compiler: pip install nvidia-cuda-nvrtc==13.0.88 (or put nvcc on PATH) "
               "to run the device-loop compile checks")


def _compilers() -> list[str]:
    found = []
    if nb.load_nvrtc() is not None:
        found.append("nvrtc")
    if nb.find_nvcc() is not None:
        found.append("nvcc")
    return found


@pytest.mark.parametrize("compiler", ["nvrtc", "nvcc"])
@pytest.mark.parametrize("unit", sorted(nb.SOURCES))
def test_cuda_sources_compile_for_sm90(unit, compiler):
    if not _compilers():
        pytest.skip(NO_COMPILER)
    if compiler not in _compilers():
        pytest.skip(f"{compiler} not available here (the other compiler is checked)")
    c = nb.compile_source(unit, 90, compiler)
    assert c.cubin[:4] == b"\x7fELF", "not a cubin"
    assert c.compiler.startswith(compiler)
    assert set(nb.SOURCES[unit][1]) <= nb.defined_kernels(c)
    assert nb.check_ptx(c) == [], c.compiler
    assert c.spills() == 0, c.log
    regs = c.registers()
    assert all(0 < r <= 64 for r in regs.values()), regs  # tiny kernels: no register blow-up


def test_ptx_has_the_ring_memory_order():
    """The exact instructions, in the PTX of the kernels that poll and publish."""
    if not _compilers():
        pytest.skip(NO_COMPILER)
    ptx = nb.compile_source("device_loop", 90).ptx
    for needle in ("ld.acquire.sys", "ld.relaxed.sys", "st.release.sys", "fence.sc.sys",
                   "fence.acq_rel.sys", "%globaltimer", "nanosleep"):
        assert needle in ptx, needle
    # No system-scope atomics on the mapped ring (PCIe hosts may not support them).
    assert not re.search(r"atom\.[a-z.]*sys", ptx)
    launch_ptx = nb.compile_source("device_launch", 90).ptx
    assert "cudaGraphLaunch" in launch_ptx and "%current_graph_exec" in launch_ptx


def test_missing_compiler_message_names_the_pip_line(monkeypatch):
    nb.compile_source.cache_clear()
    monkeypatch.setattr(nb, "load_nvrtc", lambda: None)
    monkeypatch.setattr(nb, "find_nvcc", lambda: None)
    try:
        with pytest.raises(nb.CompilerUnavailable, match="pip install nvidia-cuda-nvrtc"):
            nb.compile_source("device_loop", 90)
        assert nb.available_compiler() is None
    finally:
        nb.compile_source.cache_clear()


# ------------------------------------------------------------------ shared layout/constants


def _defines() -> dict[str, int]:
    out = {}
    for name in ("device_loop_logic.cuh", "device_loop_common.cuh"):
        for m in re.finditer(r"#define (BLINK_\w+) (\d+)\b", (KDIR / name).read_text()):
            out[m.group(1)] = int(m.group(2))
    return out


def test_constants_match_python():
    d = _defines()
    g = abi
    pairs = {
        "BLINK_STOP_NONE": g.STOP_NONE, "BLINK_STOP_DRAIN": g.STOP_DRAIN, "BLINK_STOP_NOW": g.STOP_NOW,
        "BLINK_GATE_WAIT": g.GATE_WAIT, "BLINK_GATE_STEP": g.GATE_STEP, "BLINK_GATE_IDLE": g.GATE_IDLE,
        "BLINK_GATE_STOP": g.GATE_STOP, "BLINK_EXIT_RUNNING": g.EXIT_RUNNING,
        "BLINK_EXIT_STOPPED": g.EXIT_STOPPED, "BLINK_EXIT_DRAINED": g.EXIT_DRAINED,
        "BLINK_EXIT_DRAIN_TIMEOUT": g.EXIT_DRAIN_TIMEOUT, "BLINK_EXIT_HUNG": g.EXIT_HUNG,
        "BLINK_MAX_BUCKETS": g.MAX_BUCKETS, "BLINK_GATE_THREADS": g.GATE_THREADS,
        "BLINK_LS_WORDS": g.LS_WORDS, "BLINK_HC_WORDS": g.HC_WORDS, "BLINK_HC_STOP": g.HC_STOP,
    }
    for name, value in pairs.items():
        assert d[name] == value, name
    for name, value in d.items():
        if name.startswith("BLINK_LS_") and name != "BLINK_LS_WORDS":
            assert getattr(g, name[len("BLINK_"):]) == value, name


_C_SIZES = {"long long*": 8, "const int*": 8, "const long long*": 8, "long long": 8, "int": 4,
            "unsigned long long": 8}


def test_loop_params_layout_matches_the_c_struct():
    text = (KDIR / "device_loop_common.cuh").read_text()
    body = re.search(r"typedef struct BlinkLoopParams \{(.*?)\} BlinkLoopParams;", text, re.S).group(1)
    c_fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.match(r"(.+?)\s*(\w+)(\[\w+\])?;", line)
        ctype, names = m.group(1).strip(), m.group(2)
        c_fields.append((names, ctype, m.group(3)))
    py = abi.LoopParams._fields_
    assert [n for n, _, _ in c_fields] == [n for n, _ in py]
    for (name, ctype, array), (_, pytype) in zip(c_fields, py):
        size = _C_SIZES[ctype] * (abi.MAX_BUCKETS if array else 1)
        assert ctypes.sizeof(pytype) == size, name
    assert ctypes.sizeof(abi.LoopParams) == abi.LOOP_PARAMS_BYTES
    # The C side static_asserts the same total (compiled in the tests above).
    expr = re.search(r"#define BLINK_LOOP_PARAMS_BYTES \((.*)\)", text).group(1)
    assert eval(expr.replace("BLINK_MAX_BUCKETS", str(abi.MAX_BUCKETS))) == abi.LOOP_PARAMS_BYTES


# ----------------------------------------------------- decisions: C (host build) vs Python


class _CGateInput(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "now_ns", "start_ns", "last_empty_ns", "drain_start_ns", "poll_budget_ns",
        "empty_backoff_ns", "drain_timeout_ns")] + [(n, ctypes.c_int32) for n in (
        "stop_request", "shutdown", "any_busy", "any_new", "last_step_empty", "polls", "max_polls")]


@pytest.fixture(scope="module")
def logic_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build device_loop_logic.cuh for the host")
    tmp = tmp_path_factory.mktemp("logic")
    src = tmp / "logic.cpp"
    src.write_text(
        '#include "device_loop_logic.cuh"\n'
        'extern "C" int decide(const BlinkGateInput* in, int* reason) { return blink_gate_decide(in, reason); }\n'
        'extern "C" int dispatch(long long n, long long b, int nb) { return blink_dispatch_bucket(n, b, nb); }\n'
        'extern "C" unsigned sleep_ns(int polls, unsigned max_ns) { return blink_poll_sleep_ns(polls, max_ns); }\n'
    )
    lib = tmp / "liblogic.so"
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", f"-I{KDIR}", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def test_gate_decision_matches_python_mirror(logic_lib):
    assert ctypes.sizeof(_CGateInput) == 7 * 8 + 7 * 4 + 4  # padded like the C struct
    logic_lib.decide.restype = ctypes.c_int
    rng = random.Random(0)
    seen = set()
    for _ in range(4000):
        gi = abi.GateInput(
            now_ns=rng.randrange(0, 10_000), start_ns=rng.randrange(0, 10_000),
            last_empty_ns=rng.randrange(0, 10_000), drain_start_ns=rng.choice([0, rng.randrange(1, 10_000)]),
            poll_budget_ns=rng.randrange(0, 5_000), empty_backoff_ns=rng.randrange(0, 5_000),
            drain_timeout_ns=rng.randrange(0, 5_000), stop_request=rng.randrange(3),
            shutdown=rng.randrange(2), any_busy=rng.randrange(2), any_new=rng.randrange(2),
            last_step_empty=rng.randrange(2), polls=rng.randrange(0, 8), max_polls=rng.randrange(1, 8),
        )
        c_in = _CGateInput(**{n: getattr(gi, n) for n, _ in _CGateInput._fields_})
        reason = ctypes.c_int(-1)
        got = logic_lib.decide(ctypes.byref(c_in), ctypes.byref(reason))
        assert (got, reason.value) == abi.gate_decide(gi), gi
        seen.add((got, reason.value))
    assert len(seen) >= 6  # every decision and exit reason was exercised


def test_dispatch_and_backoff_match_python_mirror(logic_lib):
    logic_lib.dispatch.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int]
    logic_lib.sleep_ns.restype = ctypes.c_uint
    for n in (-1, 0, 1, 700):
        for b in (-1, 0, 3, 7, 8, 40):
            assert logic_lib.dispatch(n, b, 8) == abi.dispatch_bucket(n, b, 8)
    for polls in range(0, 40):
        for cap in (1, 256, 300, 20_000, 1 << 31):
            assert logic_lib.sleep_ns(polls, cap) == abi.poll_sleep_ns(polls, cap)
