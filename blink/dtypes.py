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
* ``auto`` on a CPU without native bf16, for a checkpoint whose every product a CPU kernel here
  multiplies on the file's codes at every step (a GGUF of Q4_0/Q4_1/Q8_0/K-quant matrices only,
  with an int8 build of the kernel without AMX: AVX-512 VNNI, AVX2): bfloat16 too. Those
  products are int8 sums whatever the activations' dtype, and float32 would instead
  dequantize every weight to fp32 (8x a Q4 file's bytes a token): SmolLM2-135M's Q4_1 decode
  step as on an AVX2 CPU (``BLINK_CPU_ISA=avx2``) 44.6-45.2 ms in float32, 11.1-11.3 in bf16
  (docs/performance.md#avx2-cpus).

``BLINK_CPU_BF16=0`` makes ``auto`` pick float32 on any CPU (``=1`` assumes native bf16
where detection misses it). Nothing here imports torch: the frontend half imports the CLI
on machines without it.
"""
from __future__ import annotations

from blink import env as blink_env
from blink.errors import BlinkError
from blink.shared.cpu_features import cpu_flags  # the one reading of /proc/cpuinfo

#: ``/proc/cpuinfo`` flags of x86 CPUs whose bf16 dot products run in hardware.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
#: Overrides the detection: 0/false/no/off = no native bf16 (auto -> float32 on CPU), 1/... = yes.
CPU_BF16_ENV = "BLINK_CPU_BF16"
DTYPE_CHOICES = ("auto", "float32", "bfloat16")

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


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
                  native_bf16: bool | None = None, codes_kernel: str | None = None) -> tuple[str, str]:
    """``(dtype name, why)`` for ``--dtype requested`` on ``device_type`` ("cpu"/"cuda").

    ``checkpoint_dtype`` is the model config's ``torch_dtype`` (None for a GGUF);
    ``native_bf16`` defaults to :func:`cpu_has_native_bf16` (asked only for auto on CPU);
    ``codes_kernel``: the kernel that multiplies the checkpoint's quantized projections on
    their codes at every step from bf16 activations, named in the reason (None: none does)."""
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
    if codes_kernel and not off:
        return "bfloat16", (f"auto on CPU: no native bf16, but the projections run on their codes "
                            f"(the {codes_kernel} kernel) at every step")
    reason = f"{CPU_BF16_ENV}=0" if off else "no native bf16"
    return "float32", f"auto on CPU: {reason}"
