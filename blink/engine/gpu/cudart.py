"""The CUDA runtime library torch itself loaded, through ctypes (no torch import).

A refused runtime call (``cudaHostRegister`` under gVisor, say) leaves the runtime's last
error set, and torch's next kernel-launch check would report it as its own; only *torch's*
runtime can clear it (cuda-bindings brings a runtime of its own, which does not see it).
Used by the ring mapping (:mod:`blink.engine.gpu.mapped_ring`) and the probes
(:mod:`blink.engine.gpu_probe`); :func:`cuda_bindings_driver` is the one way to the driver API.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any


def cuda_bindings_driver() -> Any:
    """cuda-bindings' driver API module (ImportError where cuda-bindings is missing)."""
    from cuda.bindings import driver  # noqa: PLC0415

    return driver


class TorchCudart:
    """The runtime library torch loaded (found in /proc/self/maps): clears and names errors,
    and answers ``cudaHostGetDevicePointer``. Without the library every call is a no-op or
    raises ``RuntimeError``."""

    def __init__(self) -> None:
        self.path = self._find()
        self.lib = ctypes.CDLL(self.path) if self.path else None
        if self.lib is not None:
            self.lib.cudaGetErrorName.restype = ctypes.c_char_p
            self.lib.cudaGetErrorString.restype = ctypes.c_char_p

    @staticmethod
    def _find() -> str | None:
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    path = line.rstrip("\n").split(" ")[-1]
                    if "libcudart.so" in os.path.basename(path):
                        return path
        except OSError:
            pass
        return ctypes.util.find_library("cudart")

    def name(self, code: int) -> str:
        if self.lib is None:
            return f"cudaError {code}"
        name = self.lib.cudaGetErrorName(int(code)) or b"?"
        text = self.lib.cudaGetErrorString(int(code)) or b""
        return f"{name.decode()} ({code}): {text.decode()}"

    def clear_last_error(self) -> int:
        return int(self.lib.cudaGetLastError()) if self.lib is not None else -1

    def device_pointer(self, host_ptr: int) -> int:
        """cudaHostGetDevicePointer through torch's runtime (raises on an error code)."""
        if self.lib is None:
            raise RuntimeError("torch's CUDA runtime library was not found")
        out = ctypes.c_void_p()
        err = int(self.lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0))
        if err != 0:
            self.clear_last_error()
            raise RuntimeError(f"cudaHostGetDevicePointer failed: {self.name(err)}")
        return int(out.value or 0)


def clear_cuda_last_error() -> None:
    """Clear the runtime's last error in torch's own runtime library after a refused
    runtime call, so torch's next kernel-launch check does not report it as its own. A no-op
    where that library is not found."""
    TorchCudart().clear_last_error()
