"""The CPU's feature flags as Blink's kernels see them: the one reading of ``/proc/cpuinfo``.

Every choice made by the CPU's flags (``--dtype auto``'s native bf16, which build of the
4-bit kernel runs, whether AMX is used, the ``-march=native`` builds of the C kernels) reads
:func:`cpu_flags`, so that ``$BLINK_CPU_ISA`` can make all of them act as on a smaller CPU:

* ``BLINK_CPU_ISA=avx2``: as on an x86 CPU with AVX2 and no AVX-512, AVX-VNNI or AMX (AMD Zen
  2 and 3, Intel before Skylake-SP, many cloud VMs): those flags are left out of
  :func:`cpu_flags`, ``-march=native`` builds are ``-march=x86-64-v3`` builds
  (:func:`march_flags`), and the engine's torch is capped the same way
  (:func:`torch_env`: ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, set by
  ``blink engine`` before torch loads; an in-process ``blink.LLM`` needs them in its
  environment before ``import torch``).
* ``BLINK_CPU_ISA=avx2_vnni``: as on an x86 CPU with AVX2 and AVX-VNNI but no AVX-512 or AMX
  (Intel Alder Lake and later client cores, Xeon 6 E-cores: Sierra Forest): ``-march=x86-64-v3
  -mavxvnni``, torch at ``avx2`` / ``AVX2_VNNI``.
* ``BLINK_CPU_ISA=avx512``: as on a CPU with AVX-512 and VNNI but no BF16 or AMX (Intel
  Cascade Lake and Ice Lake, most older cloud VMs): ``-march=cascadelake``, torch at
  ``avx512`` / ``AVX512_CORE_VNNI``.

For measuring those CPUs' paths on a bigger one (``benchmarks/peers.py --isa``); the memory and
the cores stay the bigger CPU's.

Standard library only (the frontend reaches :mod:`blink.shared.native_build`).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

from blink import env as blink_env
from blink.errors import BlinkError

#: caps the flags the kernels act on (blink/env.py)
ISA_ENV = "BLINK_CPU_ISA"


class Cap(NamedTuple):
    """What one ``$BLINK_CPU_ISA`` value makes the kernels act as."""
    #: the CPU it stands for, in the start log
    means: str
    #: prefixes of the flags it leaves out of :func:`cpu_flags`
    dropped: tuple[str, ...]
    #: what its ``-march=native`` builds are built with instead
    native_flags: tuple[str, ...]
    #: torch's own caps (read when torch loads)
    torch_env: dict[str, str]


CAPS: dict[str, Cap] = {
    "avx2": Cap("a CPU with AVX2 and no AVX-512, AVX-VNNI or AMX",
                ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert"), ("-march=x86-64-v3",),
                {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
    "avx2_vnni": Cap("a CPU with AVX2 and AVX-VNNI but no AVX-512 or AMX (Alder Lake and later client cores, "
                     "Sierra Forest)", ("avx512", "amx"), ("-march=x86-64-v3", "-mavxvnni"),
                     {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}),
    "avx512": Cap("a CPU with AVX-512 and VNNI but no BF16 or AMX (Cascade Lake, Ice Lake)",
                  ("avx512_bf16", "avx512_fp16", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert"), ("-march=cascadelake",),
                  {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}),
}


@functools.lru_cache(maxsize=4)
def read_cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's own feature flags (the ``flags`` lines of ``/proc/cpuinfo`` on x86 Linux, the
    ``Features`` lines on Arm), or None where that file cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def isa_cap() -> str:
    """``$BLINK_CPU_ISA`` checked ("" when unset). Raises :class:`BlinkError` for a value
    that names no cap."""
    cap = blink_env.choice(ISA_ENV)
    if cap and cap not in CAPS:
        raise BlinkError(f"{ISA_ENV}={cap!r}: use one of {', '.join(CAPS)} (or leave it unset)")
    return cap


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The flags the kernels act on: :func:`read_cpu_flags` less what ``$BLINK_CPU_ISA``
    leaves out; None where there is no cpuinfo."""
    flags = read_cpu_flags(cpuinfo)
    cap = isa_cap()
    if flags is None or not cap:
        return flags
    return frozenset(f for f in flags if not f.startswith(CAPS[cap].dropped))


def march_flags(flags: tuple[str, ...] | list[str]) -> list[str]:
    """A build's compiler flags with ``-march=native`` made the capped CPU's ``-march`` (with its
    extensions, and ``-mtune=generic``) under ``$BLINK_CPU_ISA``; unchanged otherwise."""
    cap = isa_cap()
    if not cap:
        return list(flags)
    out: list[str] = []
    for flag in flags:
        if flag == "-march=native":
            out += [*CAPS[cap].native_flags, "-mtune=generic"]
        else:
            out.append(flag)
    return out


def torch_env() -> dict[str, str]:
    """torch's own ISA caps for ``$BLINK_CPU_ISA`` (empty when unset): what ``blink engine``
    puts in its environment before torch loads, where the user has not set them."""
    cap = isa_cap()
    return dict(CAPS[cap].torch_env) if cap else {}
