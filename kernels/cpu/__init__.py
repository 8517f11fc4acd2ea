"""The CPU loop's C kernels, each beside its Python wrapper, and their one worker pool."""
from __future__ import annotations

from blink import env as blink_env
from blink.shared import cpu_features

#: "0": the kernels act as on a CPU without AMX (blink/env.py)
AMX_ENV = "BLINK_CPU_AMX"


def amx_allowed() -> bool:
    """Whether the C kernels may use AMX where the CPU, the build and the OS have it: False
    under ``$BLINK_CPU_AMX=0``, which makes a CPU with AMX take the paths a CPU without it
    takes (paged attention without AMX tiles or AMX scores, 4-bit projections off the AMX
    kernel), e.g. for ``benchmarks/peers.py --no-amx``. The one reading of the variable. False
    too where the flags the kernels see have no ``amx_tile`` (:mod:`blink.shared.cpu_features`:
    ``$BLINK_CPU_ISA=avx2`` leaves it out)."""
    return blink_env.is_true(AMX_ENV, default=True) and "amx_tile" in (cpu_features.cpu_flags() or ())


def onednn_amx() -> bool:
    """Whether oneDNN's bf16 products (a packed bf16 copy's) run on AMX here: AMX allowed
    (:func:`amx_allowed`), in the CPU's flags and granted to the process by the OS (torch
    asks), and ``$ONEDNN_MAX_CPU_ISA`` (oneDNN's own cap) not below it. Decides which
    steps the int8 projection kernel takes (:func:`blink.models.int4_linear.native_max_rows`)."""
    import os

    import torch

    if not amx_allowed():
        return False
    flags = cpu_features.cpu_flags() or frozenset()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if "amx_bf16" not in flags or (cap not in ("", "ALL", "DEFAULT") and "AMX" not in cap):
        return False
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    return bool(init()) if init is not None else False
