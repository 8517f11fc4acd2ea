"""``--dtype auto``: native-bf16 CPU detection (cpuinfo flags mocked both ways) and the rule."""
from __future__ import annotations

import pytest
import torch

from blink import dtypes
from blink.dtypes import CPU_BF16_ENV, cpu_flags, cpu_has_native_bf16, resolve_dtype
from blink.engine.engine import EngineConfig
from blink.errors import BlinkError

ZEN4 = "fpu vme sse2 avx2 avx512f avx512_vnni avx512_bf16 avx512_vbmi2"
SPR = "fpu sse2 avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16"
SKYLAKE = "fpu vme sse2 avx2 avx512f avx512bw avx512vl"


def cpuinfo(tmp_path, flags: str, cpus: int = 2):
    text = "".join(f"processor\t: {i}\nmodel name\t: test cpu\nflags\t\t: {flags}\n\n"
                   for i in range(cpus))
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)


@pytest.mark.parametrize("flags, native", [(ZEN4, True), (SPR, True), (SKYLAKE, False)])
def test_cpu_flags_from_cpuinfo(tmp_path, flags, native):
    parsed = cpu_flags(cpuinfo(tmp_path, flags))
    assert parsed == frozenset(flags.split())
    assert cpu_has_native_bf16(parsed) is native


@pytest.mark.parametrize("flags, native", [(ZEN4, True), (SKYLAKE, False)])
def test_default_reads_cpuinfo(tmp_path, monkeypatch, flags, native):
    path, read = cpuinfo(tmp_path, flags), dtypes.cpu_flags
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: read(path))
    assert cpu_has_native_bf16() is native


def test_no_cpuinfo_falls_back_to_torch_probe(tmp_path, monkeypatch):
    assert cpu_flags(tmp_path / "missing") is None
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: None)
    monkeypatch.setattr(dtypes, "_torch_reports_native_bf16", lambda: True)
    assert cpu_has_native_bf16() is True
    monkeypatch.setattr(dtypes, "_torch_reports_native_bf16", lambda: False)
    assert cpu_has_native_bf16() is False


@pytest.mark.parametrize("value, native", [("0", False), ("off", False), ("1", True), ("yes", True)])
def test_env_overrides_detection(monkeypatch, value, native):
    monkeypatch.setenv(CPU_BF16_ENV, value)
    assert cpu_has_native_bf16(frozenset(ZEN4.split())) is native
    assert cpu_has_native_bf16(frozenset(SKYLAKE.split())) is native


def test_env_bad_value_is_a_readable_error(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "maybe")
    with pytest.raises(BlinkError, match=CPU_BF16_ENV):
        cpu_has_native_bf16(frozenset())


def test_this_machine_agrees_with_proc_cpuinfo():
    flags = cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_native_bf16() is bool({"avx512_bf16", "amx_bf16"} & flags)


# ------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize("device, ckpt, native, want", [
    ("cuda", None, False, "bfloat16"),          # GPU: always bf16
    ("cuda", "float32", False, "bfloat16"),
    ("cpu", None, True, "bfloat16"),            # GGUF (no torch_dtype) on a bf16 CPU
    ("cpu", "bfloat16", True, "bfloat16"),
    ("cpu", "float16", True, "bfloat16"),
    ("cpu", "float32", True, "float32"),        # a float32 checkpoint keeps float32
    ("cpu", None, False, "float32"),            # no native bf16
    ("cpu", "bfloat16", False, "float32"),
])
def test_auto_rule(device, ckpt, native, want):
    assert resolve_dtype("auto", device, ckpt, native_bf16=native)[0] == want


@pytest.mark.parametrize("requested", ["float32", "bfloat16"])
@pytest.mark.parametrize("device, ckpt, native", [("cpu", None, True), ("cpu", "float32", False),
                                                  ("cuda", "bfloat16", True)])
def test_explicit_dtype_always_wins(requested, device, ckpt, native):
    assert resolve_dtype(requested, device, ckpt, native_bf16=native) == (requested, "--dtype " + requested)


def test_env_zero_forces_float32_under_auto(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(ZEN4.split()))
    assert resolve_dtype("auto", "cpu")[0] == "bfloat16"
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert resolve_dtype("auto", "cpu") == ("float32", f"auto on CPU: {CPU_BF16_ENV}=0")
    assert resolve_dtype("auto", "cuda")[0] == "bfloat16"  # the override is about CPUs only


def test_unknown_dtype():
    with pytest.raises(BlinkError, match="unknown dtype"):
        resolve_dtype("float16", "cpu")


def test_engine_config_resolves_through_the_rule(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(ZEN4.split()))
    cpu = torch.device("cpu")
    assert EngineConfig().resolved_dtype(cpu) == torch.bfloat16
    assert EngineConfig().resolved_dtype(cpu, "float32") == torch.float32
    assert EngineConfig(dtype="float32").resolved_dtype(cpu) == torch.float32
    assert EngineConfig().resolved_dtype(torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(SKYLAKE.split()))
    assert EngineConfig().resolved_dtype(cpu) == torch.float32
    assert EngineConfig(dtype="bfloat16").resolved_dtype(cpu) == torch.bfloat16


def test_engine_uses_and_reports_the_choice(monkeypatch, caplog):
    """The null model (config without torch_dtype) on a mocked bf16 CPU: auto -> bf16, logged once."""
    import logging

    from blink.engine.engine import Engine

    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(ZEN4.split()))
    small = dict(model="null", device="cpu", max_model_len=64, kv_cache_tokens=256, max_num_seqs=2)
    with caplog.at_level(logging.INFO, logger="blink.engine"):
        engine = Engine(EngineConfig(**small))
    try:
        assert engine.dtype == torch.bfloat16 and "native bf16" in engine.dtype_reason
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")]
        assert lines == [f"dtype bfloat16 ({engine.dtype_reason})"]
    finally:
        engine.close()
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    engine = Engine(EngineConfig(**small))
    try:
        assert engine.dtype == torch.float32
    finally:
        engine.close()


# ------------------------------------------------- a quantized file on a CPU without native bf16

AVX2_INT8 = "AVX2 (int8 activations)"


def test_codes_every_step_make_auto_bf16_without_native_bf16(monkeypatch):
    """The projections are int8 sums on their codes whatever the activations' dtype; float32
    would dequantize every weight instead."""
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    name, why = resolve_dtype("auto", "cpu", None, native_bf16=False, codes_kernel=AVX2_INT8)
    assert name == "bfloat16" and AVX2_INT8 in why and "no native bf16" in why
    assert resolve_dtype("auto", "cpu", None, native_bf16=False)[0] == "float32"  # no such kernel
    assert resolve_dtype("auto", "cpu", "float32", native_bf16=False, codes_kernel=AVX2_INT8)[0] == "float32"
    assert resolve_dtype("float32", "cpu", None, native_bf16=False, codes_kernel=AVX2_INT8)[0] == "float32"
    monkeypatch.setenv(CPU_BF16_ENV, "0")  # the user's override wins
    assert resolve_dtype("auto", "cpu", None, codes_kernel=AVX2_INT8)[0] == "float32"


def test_engine_asks_for_the_codes_kernel_only_where_it_decides(monkeypatch):
    """``_codes_kernel``: the SmolLM2 GGUF as on an AVX2 CPU (BLINK_CPU_ISA=avx2) names the AVX2
    int8 build; not for --dtype given, a compiled step, --int4-decode off, a file with a
    matrix the kernels do not take (or none: an HF directory) or a CPU with native bf16."""
    from blink.engine.engine import _codes_kernel
    from blink.errors import ModelLoadError
    from blink.kernels.cpu import quant_linear
    from blink.loader import DEFAULT_MODEL, open_model
    from blink.shared.native_build import find_compiler

    try:
        files = open_model(DEFAULT_MODEL)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    if find_compiler() is None or "avx2" not in (dtypes.cpu_flags() or ()):
        pytest.skip("needs a C compiler and an AVX2 CPU")
    assert files.uncoded_matrices() == []  # Q4_1 projections, the tied Q8_0 embedding/head
    monkeypatch.setenv("BLINK_CPU_ISA", "avx2")
    quant_linear.reset()
    try:
        cpu = torch.device("cpu")
        assert _codes_kernel(EngineConfig(), cpu, files, "cpu-graphs") == AVX2_INT8
        assert _codes_kernel(EngineConfig(), cpu, files, "compiled") is None
        assert _codes_kernel(EngineConfig(dtype="bfloat16"), cpu, files, "cpu-graphs") is None
        assert _codes_kernel(EngineConfig(int4_decode=False), cpu, files, "cpu-graphs") is None

        class Files:
            def __init__(self, uncoded):
                self.uncoded = uncoded

            def uncoded_matrices(self):
                return self.uncoded

        assert _codes_kernel(EngineConfig(), cpu, Files(["model.layers.0.self_attn.q_proj.weight"]),
                             "cpu-graphs") is None
        assert _codes_kernel(EngineConfig(), cpu, Files(None), "cpu-graphs") is None  # an HF directory
        assert _codes_kernel(EngineConfig(), cpu, Files([]), "cpu-graphs") == AVX2_INT8
        monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(ZEN4.split()))  # native bf16
        assert _codes_kernel(EngineConfig(), cpu, files, "cpu-graphs") is None
    finally:
        monkeypatch.delenv("BLINK_CPU_ISA")
        quant_linear.reset()
