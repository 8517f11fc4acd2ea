"""benchmarks/bench_forward.py runs end to end (on a tiny model) and prints its table."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_forward_prints_before_and_now(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_forward

    model = make_tiny_model("llama", tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "bench_forward", "--model", str(model), "--dtype", "bfloat16", "float32", "--decode", "1", "3",
        "--prefill", "2x8", "--context", "8", "--steps", "1", "--rounds", "1",
    ])
    bench_forward.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| bfloat16", "| float32"))]
    assert len(rows) == 6, out
    assert all(line.count("x |") == 2 for line in rows), out


def test_bench_forward_mixed_steps_against_the_attention_without_tiles(tmp_path, monkeypatch, capsys):
    """``--mixed`` puts prompts and decode rows in one step; ``--before attention-no-tiles``
    builds the C attention kernel without its tiles (a build that works on any CPU)."""
    from benchmarks import bench_forward

    model = make_tiny_model("llama", tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "bench_forward", "--model", str(model), "--before", "attention-no-tiles", "--dtype", "bfloat16",
        "--decode", "--prefill", "--mixed", "2x16+3", "--context", "8", "--steps", "1", "--rounds", "1",
    ])
    bench_forward.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| bfloat16 | mixed 2x16+3")]
    assert len(rows) == 1 and rows[0].count("x |") == 2


@pytest.mark.parametrize("before, shape", [("no-int4", ["--decode", "1", "--prefill"]),
                                           ("q4-one-pass", ["--decode", "--prefill", "2x40"]),
                                           ("q4-tile-parts", ["--decode", "--prefill", "2x40"])])
def test_bench_forward_isolates_the_int4_path_on_a_q4_gguf(tmp_path, monkeypatch, capsys, before, shape):
    """``no-int4``: the 4-bit path against bf16; ``q4-one-pass`` / ``q4-tile-parts``: the AMX
    kernel's many-rows products against a build of it without K slabs / without parts of rows
    (a prefill of 80 rows takes that path)."""
    from gguf import GGMLQuantizationType as Q

    from benchmarks import bench_forward
    from blink.kernels.cpu import q4_linear as cpu_q4_linear
    from test_loader_gguf import export_to_gguf

    if before.startswith("q4-") and not cpu_q4_linear.available():
        pytest.skip("the 4-bit AMX kernel does not run here")
    model = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "q4_1.gguf", Q.Q4_1)
    monkeypatch.setattr(sys, "argv", [
        "bench_forward", "--model", str(model), "--before", before, "--dtype", "bfloat16", *shape,
        "--context", "8", "--steps", "1", "--rounds", "1",
    ])
    bench_forward.main()
    label = "decode 1" if before == "no-int4" else "prefill 2x40"  # the q4 builds: many rows
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| bfloat16 | {label}")]
    assert len(rows) == 1 and rows[0].count("x |") == 2


def test_bench_int4_prints_its_table(monkeypatch, capsys):
    import torch

    from benchmarks import bench_int4
    from blink.models import int4_linear, packed_linear

    cpu = torch.device("cpu")
    if not (packed_linear.packing_available(torch.bfloat16, cpu) and int4_linear.available(torch.bfloat16, cpu)):
        pytest.skip("no native oneDNN bf16 or no int4 CPU kernel here")
    monkeypatch.setattr(sys, "argv", ["bench_int4", "--rows", "1", "2", "--layers", "1", "--rounds", "1"])
    bench_int4.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and all(line.endswith("x |") for line in rows)


def test_bench_cpu_fused_prints_its_table(monkeypatch, capsys):
    from benchmarks import bench_cpu_fused
    from blink.kernels.cpu import fused as cpu_fused

    if cpu_fused.library() is None:
        pytest.skip("the fused ops do not build here")
    monkeypatch.setattr(sys, "argv", ["bench_cpu_fused", "--rows", "2", "--calls", "2", "--rounds", "1"])
    bench_cpu_fused.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| add+RMSNorm | 2 |", "| SiLU-mul | 2 |"))]
    assert len(rows) == 2 and all(line.endswith("x |") for line in rows)
    assert cpu_fused.library() is not None  # the host's build is back in place


def test_bench_cpu_attention_times_cold_calls_against_a_define(monkeypatch, capsys):
    """benchmarks/bench_cpu_attention.py --cold: each call after a read of other memory, against
    the kernel built without the values pass's prefetch (the define must exist: a build that
    ignored it would still run, so the row's columns are checked, not a speed-up); --cold with
    two threads is refused with a message."""
    from benchmarks import bench_cpu_attention
    from blink.kernels.cpu import attention as cpu_attention

    if cpu_attention.native_kernel() is None:
        pytest.skip("the C kernel does not build here")
    source = cpu_attention.LIBRARY.source.read_text()
    assert "#ifndef VALUES_PREFETCH" in source and "VALUES_PREFETCH && g == g_first" in source
    monkeypatch.setattr(sys, "argv", ["bench_cpu_attention", "--threads", "1", "--cold", "2", "--against",
                                      "VALUES_PREFETCH=0", "--only", "decode 1 x 128", "--calls", "2", "--rounds", "1"])
    bench_cpu_attention.main()
    out = capsys.readouterr().out
    assert "each call after reading 2 MB of other memory" in out
    rows = [line for line in out.splitlines() if line.startswith("| decode 1 x 128 ctx |")]
    assert len(rows) == 1 and rows[0].endswith("x |") and rows[0].count("|") == 9, out
    monkeypatch.setattr(sys, "argv", ["bench_cpu_attention", "--threads", "2", "--cold", "2"])
    with pytest.raises(SystemExit):
        bench_cpu_attention.main()
    assert "--cold times one thread" in capsys.readouterr().err


def test_bench_step_parts_prints_every_part(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_step_parts
    from test_loader_gguf import export_to_gguf

    # a GGUF export: the tiny HF directory has no tokenizer, the GGUF file carries one
    model = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "tiny.gguf")
    monkeypatch.setattr(sys, "argv", ["bench_step_parts", "--model", str(model), "--threads", "1",
                                      "--batch", "2", "--tokens", "3", "--max-model-len", "64"])
    bench_step_parts.main()
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ") and not line.startswith(("| part", "|---"))]
    rows = {name: float(ms) for name, ms in cells}
    assert set(rows) == {*bench_step_parts.PARTS, "host (step - replay)"}, out
    assert rows["forward"] > 0 and rows["step"] >= rows["forward"] >= rows["replay"], out
    assert rows["host (step - replay)"] == pytest.approx(rows["step"] - rows["replay"], abs=2e-3), out


def test_bench_llm_wait_alternates_the_bell_and_the_backoff(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_llm_wait.py: generate() on the engine's doorbell and on its backoff in
    alternate rounds of one process, both rows and a ratio a round; the LLM's bell is back in
    place between and after the rounds."""
    from benchmarks import bench_llm_wait
    from blink.transport import doorbell as doorbells
    from test_loader_gguf import export_to_gguf

    if not doorbells.supported():
        pytest.skip("abstract UNIX sockets are Linux's")
    model = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "tiny.gguf")
    monkeypatch.setattr(sys, "argv", ["bench_llm_wait", "--model", str(model), "--threads", "1",
                                      "--kernel-threads", "1", "--batch", "2", "--tokens", "3",
                                      "--rounds", "2", "--max-model-len", "64"])
    bench_llm_wait.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| bell |", "| backoff |"))]
    assert len(rows) == 2 and all(len(line.split("|")[3].split()) == 2 for line in rows), out
    assert "bell / backoff: " in out and out.count("(rounds ") == 1, out


def test_bench_step_source_times_whole_steps_and_stops_on_different_tokens(tmp_path, capsys):
    """benchmarks/bench_step_source.py: the checkout's quant_linear.c against a copy of itself in
    the replayed calls of whole decode steps prints both versions and a ratio a round; a version
    whose products differ (an exponent bit of each product's first output) generates other
    tokens and stops the run (which only happens if the graphs' calls were retargeted)."""
    from gguf import GGMLQuantizationType as Q

    from benchmarks import bench_step_source
    from blink.kernels.cpu import quant_linear as q
    from test_loader_gguf import export_to_gguf

    if q.variant() is None:
        pytest.skip("no build of the kernel without AMX runs here")
    model = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "q4_1.gguf", Q.Q4_1)
    source = Path(q.__file__).with_name("quant_linear.c").read_text()
    tail = "    return status;\n#endif\n}"
    assert source.count(tail) == 1
    same, changed = tmp_path / "same.c", tmp_path / "changed.c"
    same.write_text(source)
    changed.write_text(source.replace(tail, "    if (status == 0) y[0] ^= 0x4000; /* an exponent bit */\n" + tail))
    base = ["--model", str(model), "--rounds", "2", "--tokens", "4", "--prompt-words", "2",
            "--max-model-len", "64", "--kernel-threads", "1"]
    usual = q.LIBRARIES[q.variant()].get()
    try:
        bench_step_source.main(["--before", str(same), *base])
    except SystemExit as exc:  # e.g. a CPU whose decode steps take another kernel
        if "no decode step replays a call of quant_linear.c" in str(exc):
            pytest.skip(str(exc))
        raise
    out = capsys.readouterr().out
    assert "calls of the kernel, 2 rounds of 4 tokens" in out, out
    assert [line.split("|")[1].strip() for line in out.splitlines() if line.startswith(("| before", "| now"))] == [
        "before", "now"], out
    assert len(out.split("now / before: median ")[1].split("rounds ")[1].split()) == 2, out
    with pytest.raises(SystemExit, match="generated different tokens"):
        bench_step_source.main(["--before", str(changed), *base])
    assert q.LIBRARIES[q.variant()].get() is usual
    with pytest.raises(SystemExit):  # argparse's error, not a traceback
        bench_step_source.main(["--before", str(tmp_path / "missing.c"), *base])
    assert "missing.c: no such file" in capsys.readouterr().err


def test_bench_step_source_compares_attention_and_pool_versions(tmp_path, capsys):
    """bench_step_source's --attention-before and --pool-before: the checkout's attention.c or
    pool.c against a copy of itself in whole replayed steps (same tokens, both versions timed);
    an attention whose every call fails makes the replayed steps fail (they call it)."""
    from gguf import GGMLQuantizationType as Q

    from benchmarks import bench_step_source
    from blink.kernels.cpu import attention, pool, quant_linear as q
    from test_loader_gguf import export_to_gguf

    if q.variant() is None or attention.LIBRARY.get() is None or pool.LIBRARY.get() is None:
        pytest.skip("no build of the kernels without AMX runs here")
    model = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "q4_1.gguf", Q.Q4_1)
    base = ["--model", str(model), "--rounds", "2", "--tokens", "4", "--prompt-words", "2",
            "--max-model-len", "64", "--kernel-threads", "2"]
    for flag, name, what in (("--attention-before", "attention.c", "attention's"), ("--pool-before", "pool.c", "pool's")):
        copy = tmp_path / name
        copy.write_text(Path(q.__file__).with_name(name).read_text())
        bench_step_source.main([flag, str(copy), *base])
        out = capsys.readouterr().out
        assert f"two versions of the {what} source" in out and "now / before: median " in out, out
    source = Path(q.__file__).with_name("attention.c").read_text()
    opening = "                          float scale, int threads) {\n"
    assert source.count(opening) == 1
    changed = tmp_path / "changed_attention.c"  # every call fails: the replayed steps are its
    changed.write_text(source.replace(opening, opening + "    if (T > 0) return -2;\n"))
    with pytest.raises(Exception, match="blink_paged_attention failed"):
        bench_step_source.main(["--attention-before", str(changed), *base])


def test_bench_quant_source_times_two_versions_and_stops_on_different_bits(tmp_path, capsys):
    """benchmarks/bench_quant_source.py: the checkout's quant_linear.c against a copy of itself
    prints a row per row count; a version whose products differ by one bit stops the run
    unless ``--allow-different-bits``; one that does not build stops it too."""
    from gguf import GGMLQuantizationType as Q

    from benchmarks import bench_quant_source
    from blink.kernels.cpu import quant_linear as q
    from test_loader_gguf import export_to_gguf

    if q.variant() is None:
        pytest.skip("no build of the kernel without AMX runs here")
    model = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "q4_1.gguf", Q.Q4_1)
    source = Path(q.__file__).with_name("quant_linear.c").read_text()
    same, off_by_one, broken = tmp_path / "same.c", tmp_path / "off.c", tmp_path / "broken.c"
    same.write_text(source)
    tail = "    return status;\n#endif\n}"
    assert source.count(tail) == 1
    off_by_one.write_text(source.replace(tail, "    if (status == 0) y[0] ^= 1; /* one output bit */\n" + tail))
    broken.write_text(source + "\n#error not a kernel\n")
    base = ["--model", str(model), "--rows", "1", "3", "--rounds", "1"]
    usual = q.LIBRARIES[q.variant()].get()
    bench_quant_source.main(["--before", str(same), *base])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2 and all(line.endswith("x |") for line in rows)
    with pytest.raises(SystemExit, match="different bits at 1 rows"):
        bench_quant_source.main(["--before", str(off_by_one), *base])
    bench_quant_source.main(["--before", str(off_by_one), "--allow-different-bits", *base])
    assert "note: different bits at 1 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not build"):
        bench_quant_source.main(["--before", str(broken), *base])
    assert q.LIBRARIES[q.variant()].get() is usual  # the checkout's build is back in place
    with pytest.raises(SystemExit):  # argparse's error, not a traceback
        bench_quant_source.main(["--before", str(tmp_path / "missing.c"), *base])
    assert "missing.c: no such file" in capsys.readouterr().err


def test_bench_quant_source_times_two_builds_of_the_checkouts_source(tmp_path, capsys):
    """``--before-build``: the checkout's source built as another int8 build on the same packed
    weights (the same bits: the run goes through), named in the header; without ``--before`` or
    ``--before-build`` argparse says what is missing. Its build lists are quant_linear's."""
    from gguf import GGMLQuantizationType as Q

    from benchmarks import bench_kquant_bytes, bench_quant_source
    from blink.kernels.cpu import quant_linear as q
    from test_loader_gguf import export_to_gguf

    assert bench_kquant_bytes.X86_BUILDS == [name for name in q.VARIANTS if name != "neon_dotprod"]
    flags = q.cpu_flags() or frozenset()
    int8 = [name for name in q.VARIANTS if name in q.INT8_BUILDS and all(f in flags for f in q.VARIANTS[name][1])
            and name != "neon_dotprod"]
    if len(int8) < 2 or any(q.LIBRARIES[name].get() is None for name in int8[:2]):
        pytest.skip("this CPU runs fewer than two x86 int8 builds")
    model = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "q4_1.gguf", Q.Q4_1)
    bench_quant_source.main(["--build", int8[0], "--before-build", int8[1], "--model", str(model),
                             "--rows", "1", "5", "--rounds", "1"])
    out = capsys.readouterr().out
    assert f"build {int8[0]} (before: {int8[1]})" in out
    assert len([line for line in out.splitlines() if line.startswith(("| 1 |", "| 5 |"))]) == 2, out
    with pytest.raises(SystemExit):
        bench_quant_source.main(["--model", str(model)])
    assert "--before is required" in capsys.readouterr().err


def _q6k_projections_gguf(path: Path) -> Path:
    """A GGUF holding one layer's projections and a head, all Q6_K (random blocks): what
    benchmarks/bench_kquant_bytes.py's ``_projections`` reads, nothing more."""
    import gguf

    from test_cpu_quant_linear import random_blocks

    writer = gguf.GGUFWriter(str(path), "llama")
    shapes = {"attn_q": (256, 256), "attn_k": (256, 256), "attn_v": (256, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    for seed, (name, (rows, cols)) in enumerate(shapes.items()):
        writer.add_tensor(f"blk.0.{name}.weight", random_blocks(gguf.GGMLQuantizationType.Q6_K, rows, cols, seed),
                          raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.add_tensor("output.weight", random_blocks(gguf.GGMLQuantizationType.Q6_K, 512, 256, 9),
                      raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bench_quant_source_packs_the_befores_6_bit_planes_and_groups_rounds_by_read_bandwidth(tmp_path, capsys):
    """bench_quant_source's ``--before-pos6``: the before version's weights in that 6-bit plane
    order (the checkout's source reading another order gives other bits: the option takes
    effect); ``--read-bands``: a table row per band of the plain read's GB/s, per projection
    kind with ``--by-kind``; a malformed order is argparse's error, not a traceback."""
    from benchmarks import bench_quant_source
    from blink.kernels.cpu import quant_linear as q

    if q.variant() is None:
        pytest.skip("no build of the kernel without AMX runs here")
    model = _q6k_projections_gguf(tmp_path / "q6k.gguf")
    source = tmp_path / "same.c"
    source.write_text(Path(q.__file__).with_name("quant_linear.c").read_text())
    base = ["--before", str(source), "--model", str(model), "--rows", "1", "--rounds", "1"]
    checkout = ",".join(str(b) for b in q.POS6)
    other = ",".join(str(b) for b in range(0, 16, 2))
    assert other != checkout
    with pytest.raises(SystemExit, match="different bits at 1 rows"):
        bench_quant_source.main([*base, "--before-pos6", other])
    assert q.POS6 == tuple(int(b) for b in checkout.split(","))  # the packer's order is back
    # (each call builds the before source: one call for the order given explicitly and the bands)
    bench_quant_source.main([*base, "--before-pos6", checkout, "--read-bands", "0.5", "--read-mb", "8", "--by-kind"])
    out = capsys.readouterr().out
    bands = [line for line in out.splitlines() if line.startswith("| ") and "-" in line.split("|")[1]
             and line.split("|")[1].strip()[0].isdigit()]
    assert bands and all(line.endswith("x |") for line in bands), out
    assert "head Q6_K" in out and "gate_up Q6_K" in out, out
    with pytest.raises(SystemExit):
        bench_quant_source.main([*base, "--before-pos6", "0,2,4"])
    assert "not the 8 even bit positions" in capsys.readouterr().err


def test_bench_offline_lengths_take_a_range_or_one_length():
    import argparse

    from benchmarks.bench_offline import length_range

    assert length_range("16,192") == (16, 192) and length_range("32") == (32, 32)
    for bad in ("5,2", "0", "x", "1,2,3", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            length_range(bad)


def test_bench_scheduler_reads_the_flush_between_steps_only(monkeypatch, capsys):
    """benchmarks/bench_scheduler.py ``--flush-mb``: the flush tensor is read once before each
    timed step, outside the step's clock, and the run prints its row; a negative size is
    refused."""
    import torch

    from benchmarks import bench_scheduler

    reads = []
    real_sum = torch.Tensor.sum

    def counting_sum(self, *args, **kwargs):
        if self.numel() == 2**20 // 4:  # the 1 MB flush tensor (no scheduler tensor has this size)
            reads.append(self.numel())
        return real_sum(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", counting_sum)
    monkeypatch.setattr(sys, "argv", ["bench_scheduler", "--slots", "64", "--load", "one", "--steps", "3",
                                      "--num-blocks", "512", "--flush-mb", "1"])
    bench_scheduler.main()
    out = capsys.readouterr().out
    assert "1 MB read before each step" in out, out
    assert len(reads) == 3, reads  # the timed steps only: not the warm-up, not the op count
    assert any(line.split()[:2] == ["one", "64"] for line in out.splitlines()), out
    monkeypatch.setattr(sys, "argv", ["bench_scheduler", "--flush-mb", "-1"])
    with pytest.raises(SystemExit):
        bench_scheduler.main()


def test_bench_forward_amx_every_step_needs_a_viewed_weight(tmp_path, monkeypatch):
    """``--before amx-every-step`` compares against the AMX kernel for every step: on a model
    with no 4-bit AMX weight (the tiny HF one has none) it says so instead of timing two
    identical forwards."""
    from benchmarks import bench_forward

    model = make_tiny_model("llama", tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "bench_forward", "--model", str(model), "--before", "amx-every-step", "--dtype", "bfloat16",
        "--decode", "1", "--context", "8", "--steps", "1", "--rounds", "1",
    ])
    with pytest.raises(SystemExit, match="no projection here runs few rows on the int8 build"):
        bench_forward.main()
