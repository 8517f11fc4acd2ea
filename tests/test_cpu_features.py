"""blink.shared.cpu_features: the one reading of the CPU's flags, and ``$BLINK_CPU_ISA=avx2``
making every choice made by them act as on a CPU with AVX2 alone (--dtype auto, AMX, the 4-bit
kernel's build, the -march=native builds, torch's caps in ``blink engine``)."""
from __future__ import annotations

import os
import shutil

import pytest

from blink import dtypes
from blink.errors import BlinkError
from blink.shared.cpu_features import ISA_ENV, cpu_flags, march_flags, read_cpu_flags, torch_env
from blink.shared.native_build import build_library

SPR = "fpu sse4_2 avx avx2 fma f16c avx_vnni avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16"


@pytest.fixture
def cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("".join(f"processor\t: {i}\nflags\t\t: {SPR}\n\n" for i in range(2)))
    return path


def test_without_the_cap_the_flags_are_the_cpus(monkeypatch, cpuinfo):
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert cpu_flags(cpuinfo) == read_cpu_flags(cpuinfo) == frozenset(SPR.split())
    assert march_flags(("-O3", "-march=native")) == ["-O3", "-march=native"]
    assert torch_env() == {}


def test_avx2_leaves_out_avx512_vnni_and_amx(monkeypatch, cpuinfo):
    monkeypatch.setenv(ISA_ENV, "AVX2 ")  # read as the other choice variables: stripped, lower case
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"})
    assert march_flags(["-O3", "-march=native", "-ffp-contract=off"]) == [
        "-O3", "-march=x86-64-v3", "-mtune=generic", "-ffp-contract=off"]
    assert march_flags(["-O3", "-march=x86-64-v4"]) == ["-O3", "-march=x86-64-v4"]  # a named build stays
    assert torch_env() == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    # --dtype auto: no native bf16 on such a CPU, so float32
    assert dtypes.cpu_has_native_bf16(cpu_flags(cpuinfo)) is False


def test_avx512_leaves_out_bf16_and_amx(monkeypatch, cpuinfo):
    monkeypatch.setenv(ISA_ENV, "avx512")
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                            "avx512vl", "avx512_vnni"})
    assert march_flags(["-march=native"]) == ["-march=cascadelake", "-mtune=generic"]
    assert torch_env() == {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}
    assert dtypes.cpu_has_native_bf16(cpu_flags(cpuinfo)) is False


def test_avx2_vnni_keeps_avx_vnni_and_leaves_out_avx512_and_amx(monkeypatch, cpuinfo):
    monkeypatch.setenv(ISA_ENV, "avx2_vnni")
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni"})
    assert march_flags(["-O3", "-march=native"]) == ["-O3", "-march=x86-64-v3", "-mavxvnni", "-mtune=generic"]
    assert torch_env() == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}
    assert dtypes.cpu_has_native_bf16(cpu_flags(cpuinfo)) is False


def test_an_unknown_cap_is_a_readable_error(monkeypatch, cpuinfo):
    monkeypatch.setenv(ISA_ENV, "avx10")
    with pytest.raises(BlinkError, match=f"{ISA_ENV}='avx10': use one of avx2, avx2_vnni, avx512"):
        cpu_flags(cpuinfo)


def test_no_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert cpu_flags(tmp_path / "missing") is None


def test_arm_features_lines_are_read(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp sve i8mm\n\n")
    assert read_cpu_flags(path) == frozenset({"fp", "asimd", "asimddp", "sve", "i8mm"})


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                    reason="no C compiler")
@pytest.mark.skipif("avx512f" not in (read_cpu_flags() or ()), reason="needs a CPU with AVX-512 to tell the builds apart")
def test_native_builds_follow_the_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "isa.c"
    source.write_text("int blink_isa(void) {\n#if defined(__AVX512F__)\n return 512;\n"
                      "#elif defined(__AVX2__)\n return 2;\n#else\n return 0;\n#endif\n}\n")
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert build_library(source, flags=("-O2", "-march=native")).blink_isa() == 512
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert build_library(source, flags=("-O2", "-march=native")).blink_isa() == 2


def test_the_kernels_choices_follow_the_cap(monkeypatch):
    """On this machine: AMX off and the 4-bit kernel's build one an AVX2 CPU can run."""
    pytest.importorskip("torch")
    from blink.kernels.cpu import amx_allowed, onednn_amx, quant_linear

    monkeypatch.setenv(ISA_ENV, "avx2")
    assert not amx_allowed() and not onednn_amx()
    flags = quant_linear.cpu_flags()
    assert not any(f.startswith(("avx512", "amx")) for f in flags)
    quant_linear.reset()
    try:
        chosen = quant_linear.variant()
        if "avx2" in flags and shutil.which(os.environ.get("CC", "cc")):
            assert chosen in ("avx2_int8", "avx2")
        monkeypatch.setenv(ISA_ENV, "avx2_vnni")  # the AVX-VNNI build where the CPU has it
        quant_linear.reset()
        if "avx_vnni" in (read_cpu_flags() or ()) and shutil.which(os.environ.get("CC", "cc")):
            assert quant_linear.variant() == "avx2_vnni"
    finally:
        monkeypatch.delenv(ISA_ENV)
        quant_linear.reset()


def test_blink_engine_caps_torch_before_it_loads(monkeypatch):
    """``blink engine`` (run_engine, before torch loads) puts torch's caps in its environment
    where they are unset, and says so in the start log."""
    from blink.launcher import cap_torch_isa

    monkeypatch.delenv(ISA_ENV, raising=False)
    environ: dict[str, str] = {}
    assert cap_torch_isa(environ) is None and environ == {}
    monkeypatch.setenv(ISA_ENV, "avx2")
    environ = {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}  # the user's own cap is kept
    note = cap_torch_isa(environ)
    assert environ == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}
    assert note == (f"{ISA_ENV}=avx2: the CPU kernels act as on a CPU with AVX2 and no AVX-512, "
                    "AVX-VNNI or AMX (torch: ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2_VNNI)")
