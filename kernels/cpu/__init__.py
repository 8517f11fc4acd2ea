"""The CPU loop's C kernels, each beside its Python wrapper, and their one worker pool."""
from __future__ import annotations

from blink import env as blink_env

#: "0": the kernels act as on a CPU without AMX (blink/env.py)
AMX_ENV = "BLINK_CPU_AMX"


def amx_allowed() -> bool:
    """Whether the C kernels may use AMX where the CPU, the build and the OS have it: False
    under ``$BLINK_CPU_AMX=0``, which makes a CPU with AMX take the paths a CPU without it
    takes (paged attention without AMX tiles or AMX scores, 4-bit projections off the AMX
    kernel), e.g. for ``benchmarks/peers.py --no-amx``. The one reading of the variable."""
    return blink_env.is_true(AMX_ENV, default=True)
