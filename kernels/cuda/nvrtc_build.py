"""Compile the device loop's CUDA C (``kernels/*.cu``) with NVRTC, or nvcc, no GPU needed.

The device loop's small kernels (the gate that polls the ring, the bucket dispatch, the
publish fence, and the persistent launcher of the alternative mechanism) are CUDA C in this
folder. At engine start they are compiled for the GPU's own architecture and loaded with
the driver API; in the test suite they are compiled for ``sm_90`` (H100/H200) so a compile
error, a lost memory-order qualifier or a spill is caught on a machine without a GPU.

Compilers, in order:

- **NVRTC** through ``ctypes`` (no cuda-bindings needed to compile): the library from the
  ``nvidia-cuda-nvrtc`` wheel (``pip install nvidia-cuda-nvrtc==13.0.88``; torch's CUDA
  wheels bring it too), a CUDA toolkit (``$CUDA_HOME/lib64``), or ``$BLINK_NVRTC_LIB``;
- **nvcc** (``$CUDA_HOME/bin/nvcc`` or on ``PATH``), when no NVRTC library is found.

NVRTC output is a cubin (machine code for exactly that architecture, so the driver never
JIT-compiles PTX and a driver older than the compiler can still load it) plus the PTX,
which the tests read for the ``ld.acquire.sys`` / ``st.release.sys`` / ``fence.sc.sys``
instructions the ring protocol depends on::

    python -m blink.kernels.cuda.nvrtc_build [--arch 90] [--compiler nvrtc|nvcc]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

#: Compilation units: name -> (file, kernels it defines).
SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "device_loop": ("device_loop.cu", ("blink_gate", "blink_dispatch", "blink_publish_fence")),
    "device_launch": ("device_launch.cu", ("blink_launcher", "blink_graph_done")),
}

#: PTX the ring protocol needs: (pattern, what it is for).
REQUIRED_PTX = {
    "device_loop": (
        (r"ld\.acquire\.sys", "acquire loads of the host stop word and the ring's shutdown word"),
        (r"ld\.relaxed\.sys", "polls of the slot state words"),
        (r"fence\.acq_rel\.sys", "the acquire fence after a poll of the slot words"),
        (r"st\.release\.sys", "release stores of the engine state word"),
        (r"fence\.sc\.sys", "the publish fence after a step"),
        (r"%globaltimer", "timeouts of the bounded poll"),
        (r"nanosleep", "back-off between polls"),
        (r"cudaGraphSetConditional", "the conditional-node handles"),
    ),
    "device_launch": (
        (r"ld\.acquire\.sys", "acquire loads of the done ticket"),
        (r"fence\.sc\.sys", "the release fence before the done ticket"),
        (r"cudaGraphLaunch", "device-side graph launch"),
        (r"%current_graph_exec", "the tail self-relaunch"),
        (r"%globaltimer", "timeouts of the bounded waits"),
    ),
}


class CompilerUnavailable(RuntimeError):
    """Neither NVRTC nor nvcc could be found."""


class CompileError(RuntimeError):
    """The CUDA C source did not compile."""


@dataclass(frozen=True)
class Compiled:
    name: str
    arch: int
    cubin: bytes
    ptx: str
    log: str
    compiler: str  # e.g. "nvrtc 13.0" or "nvcc 13.0"

    def registers(self) -> dict[str, int]:
        """Registers per thread of each kernel, from the ptxas report in the log."""
        out: dict[str, int] = {}
        current = None
        for line in self.log.splitlines():
            m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
            if m:
                current = m.group(1)
            m = re.search(r"Used (\d+) registers", line)
            if m and current:
                out[current] = int(m.group(1))
        return out

    def spills(self) -> int:
        return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", self.log))


# ----------------------------------------------------------------------------- NVRTC


def _nvrtc_candidates() -> list[str]:
    from blink import env as blink_env

    found: list[str] = []
    env = blink_env.get("BLINK_NVRTC_LIB")
    if env:
        found.append(env)
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r and os.path.isdir(os.path.join(r, "nvidia"))):
        # nvidia-cuda-nvrtc (13.x: nvidia/cu13/lib), nvidia-cuda-nvrtc-cu12 (nvidia/cuda_nvrtc/lib)
        for pattern in ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            found += sorted(p for p in glob.glob(os.path.join(root, pattern))
                            if "builtins" not in p and ".alt." not in p)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
            found += sorted(glob.glob(os.path.join(home, "targets", "*", "lib", "libnvrtc.so*")))
    import ctypes.util

    lib = ctypes.util.find_library("nvrtc")
    if lib:
        found.append(lib)
    return list(dict.fromkeys(found))


class _Nvrtc:
    def __init__(self, path: str) -> None:
        self.path = path
        # libnvrtc dlopens libnvrtc-builtins by soname; a wheel's copy sits beside it but
        # off the loader's path, so load it first (RTLD_GLOBAL) when it is there.
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
            if ".alt." not in builtins:
                try:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError:
                    continue
        self.lib = lib = ctypes.CDLL(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            msg = self.lib.nvrtcGetErrorString(result).decode()
            raise CompileError(f"{what}: {msg}")

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bytes, str, str]:
        lib = self.lib
        prog = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            log_text = log.value.decode(errors="replace")
            if result != 0:
                raise CompileError(f"NVRTC failed to compile {name}:\n{log_text}")
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, ptx.value.decode(), log_text
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


@lru_cache(maxsize=1)
def load_nvrtc() -> _Nvrtc | None:
    """The first NVRTC library that loads, or None."""
    for path in _nvrtc_candidates():
        try:
            return _Nvrtc(path)
        except (OSError, AttributeError, CompileError):
            continue
    return None


# ------------------------------------------------------------------------------ nvcc


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "?"


def _compile_nvcc(nvcc: str, file: Path, arch: int) -> tuple[bytes, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        base = [nvcc, f"-arch=sm_{arch}", "-std=c++17", f"-I{KERNEL_DIR}", "-lineinfo"]
        cubin, ptx = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        proc = subprocess.run([*base, "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(file)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed to compile {file.name}:\n{proc.stdout}{proc.stderr}")
        proc2 = subprocess.run([*base, "--ptx", "-o", str(ptx), str(file)], capture_output=True, text=True)
        if proc2.returncode != 0:
            raise CompileError(f"nvcc --ptx failed on {file.name}:\n{proc2.stdout}{proc2.stderr}")
        return cubin.read_bytes(), ptx.read_text(), proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- public


def available_compiler() -> str | None:
    """``"nvrtc"``, ``"nvcc"`` or None."""
    if load_nvrtc() is not None:
        return "nvrtc"
    if find_nvcc() is not None:
        return "nvcc"
    return None


def nvrtc_options(arch: int) -> list[str]:
    return [f"-arch=sm_{arch}", "-std=c++17", f"--include-path={KERNEL_DIR}", "-lineinfo",
            "--ptxas-options=-v"]


@lru_cache(maxsize=None)
def compile_source(name: str, arch: int = 90, compiler: str = "auto") -> Compiled:
    """Compile the unit ``name`` (a key of :data:`SOURCES`) for ``sm_<arch>``."""
    file = KERNEL_DIR / SOURCES[name][0]
    source = file.read_text()
    if compiler in ("auto", "nvrtc"):
        nvrtc = load_nvrtc()
        if nvrtc is not None:
            cubin, ptx, log = nvrtc.compile(source, file.name, nvrtc_options(arch))
            return Compiled(name, arch, cubin, ptx, log, f"nvrtc {nvrtc.version[0]}.{nvrtc.version[1]}")
        if compiler == "nvrtc":
            raise CompilerUnavailable(
                "NVRTC not found: pip install nvidia-cuda-nvrtc==13.0.88 (or set BLINK_NVRTC_LIB)"
            )
    nvcc = find_nvcc()
    if nvcc is None:
        raise CompilerUnavailable(
            "no CUDA C compiler: pip install nvidia-cuda-nvrtc==13.0.88, or put nvcc on PATH"
        )
    cubin, ptx, log = _compile_nvcc(nvcc, file, arch)
    return Compiled(name, arch, cubin, ptx, log, f"nvcc {_nvcc_version(nvcc)}")


def check_ptx(compiled: Compiled) -> list[str]:
    """Missing memory-order / timer / graph instructions in ``compiled``'s PTX (empty = ok)."""
    return [f"{pattern} ({why})" for pattern, why in REQUIRED_PTX[compiled.name]
            if not re.search(pattern, compiled.ptx)]


def defined_kernels(compiled: Compiled) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)", compiled.ptx))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--compiler", default="auto", choices=["auto", "nvrtc", "nvcc"])
    args = parser.parse_args(argv)
    failed = 0
    for name in SOURCES:
        c = compile_source(name, args.arch, args.compiler)
        missing = check_ptx(c)
        kernels = defined_kernels(c)
        regs = c.registers()
        print(f"{name}: {c.compiler}, sm_{c.arch}, cubin {len(c.cubin)} B, kernels "
              + ", ".join(f"{k} ({regs.get(k, '?')} regs)" for k in sorted(kernels))
              + f", spills {c.spills()} B")
        for m in missing:
            failed += 1
            print(f"    ERROR: PTX lacks {m}")
        for k in set(SOURCES[name][1]) - kernels:
            failed += 1
            print(f"    ERROR: kernel {k} not defined")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
