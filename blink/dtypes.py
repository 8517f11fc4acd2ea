"""What ``--dtype auto`` means: the one place that decides the engine's compute dtype.

The rule (:func:`resolve_dtype`):

* ``--dtype float32`` / ``--dtype bfloat16``: exactly that, everywhere.
* ``auto`` on a CUDA GPU: bfloat16.
* ``auto`` on CPU: bfloat16 when the CPU runs bf16 matmuls natively
  (:func:`cpu_has_native_bf16`: AVX512-BF16 or AMX-BF16) and the checkpoint is not a float32
  one; float32 otherwise. On such a CPU the executor's bf16 single-stream decode measured
  1.5-2.2x its float32 decode (docs/performance.md#bf16). A checkpoint whose config says
  ``torch_dtype: float32`` (or ``dtype``) keeps float32: its author shipped full precision
  and rounding it would change its greedy outputs (vLLM's CPU backend downcasts those to
  bf16 too; Blink does not). A GGUF has no such field and is dequantised to bf16.

``BLINK_CPU_BF16=0`` makes ``auto`` pick float32 on any CPU (``=1`` assumes native bf16
where detection misses it). Nothing here imports torch: the frontend half imports the CLI
on machines without it.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from blink import env as blink_env
from blink.errors import BlinkError

#: ``/proc/cpuinfo`` flags of x86 CPUs whose bf16 dot products run in hardware.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
#: Overrides the detection: 0/false/no/off = no native bf16 (auto -> float32 on CPU), 1/... = yes.
CPU_BF16_ENV = "BLINK_CPU_BF16"
DTYPE_CHOICES = ("auto", "float32", "bfloat16")

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=4)
def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (the ``flags`` lines of ``/proc/cpuinfo`` on x86 Linux), or
    None where that file cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


def _torch_reports_native_bf16() -> bool:
    """torch's own CPU probe, for systems without ``/proc/cpuinfo`` (private API: guarded)."""
    try:
        import torch

        probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None),
                  getattr(torch.cpu, "_is_amx_tile_supported", None))
        return any(bool(p()) for p in probes if p is not None)
    except Exception:  # noqa: BLE001 - a probe that fails means "no"
        return False


def cpu_has_native_bf16(flags: frozenset[str] | set[str] | None = None) -> bool:
    """Whether this CPU runs bf16 matmuls natively (x86 ``avx512_bf16`` or ``amx_bf16``).

    ``BLINK_CPU_BF16`` (0/1) overrides the answer. Otherwise ``flags`` (default: read from
    ``/proc/cpuinfo``) decides; where there is no cpuinfo, torch's CPU probe does. Other
    CPUs (ARM's BF16 extension included) answer False: bf16 was not measured faster there.
    """
    env = blink_env.choice(CPU_BF16_ENV)
    if env in _FALSE:
        return False
    if env in _TRUE:
        return True
    if env:
        raise BlinkError(f"{CPU_BF16_ENV}={env!r}: use 0 (float32 on CPU) or 1 (assume native bf16)")
    if flags is None:
        flags = cpu_flags()
        if flags is None:
            return _torch_reports_native_bf16()
    return bool(NATIVE_BF16_CPU_FLAGS & set(flags))


def resolve_dtype(requested: str, device_type: str, checkpoint_dtype: str | None = None,
                  native_bf16: bool | None = None) -> tuple[str, str]:
    """``(dtype name, why)`` for ``--dtype requested`` on ``device_type`` ("cpu"/"cuda").

    ``checkpoint_dtype`` is the model config's ``torch_dtype`` (None for a GGUF);
    ``native_bf16`` defaults to :func:`cpu_has_native_bf16` (asked only for auto on CPU)."""
    if requested not in DTYPE_CHOICES:
        raise BlinkError(f"unknown dtype {requested!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        return requested, "--dtype " + requested
    if device_type != "cpu":
        return "bfloat16", f"auto on {device_type}"
    if checkpoint_dtype == "float32":
        return "float32", "auto on CPU: the checkpoint is float32"
    if native_bf16 is None:
        native_bf16 = cpu_has_native_bf16()
    if native_bf16:
        return "bfloat16", "auto on CPU: native bf16"
    off = blink_env.choice(CPU_BF16_ENV) in _FALSE
    reason = f"{CPU_BF16_ENV}=0" if off else "no native bf16"
    return "float32", f"auto on CPU: {reason}"
