"""The 1B-class peers benchmark and the threads benchmark (issue 35 items 3-4): the parts that
run without servers -- prefill/decode split, ratios, weight bytes and FLOPs per token, the
llama-server command, the model arguments, the arms, setup_peers.sh's ISA flags."""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from benchmarks.bench_threads import Arm, arms_table, default_arms, model_work, parse_arms, summarize
from benchmarks.peers import (build_parser, copy_bandwidth, gguf_weight_bytes, last_level_cache_bytes,
                              machine_header, no_amx_env, peer_command, peer_status, ratio_table, read_bandwidth, resolve_model_args, split_rates, split_table)
from benchmarks.serve_metrics import RequestOutput, calculate_metrics

REPO = Path(__file__).resolve().parent.parent


def _run(ttft: float, tpot: float, n_out: int = 9, prompt: int = 100, requests: int = 2) -> dict:
    outs = [RequestOutput(success=True, prompt_len=prompt, output_tokens=n_out, ttft=ttft,
                          itl=[tpot] * (n_out - 1), latency=ttft + tpot * (n_out - 1))
            for _ in range(requests)]
    return calculate_metrics(outs, duration_s=1.0)


def test_split_rates_are_prompt_over_ttft_and_one_over_tpot():
    sp = split_rates(_run(ttft=0.5, tpot=0.02))
    assert sp["prefill_tok_s"] == pytest.approx(200.0)   # 100 tokens / 0.5 s
    assert sp["decode_tok_s"] == pytest.approx(50.0)     # 1 / 20 ms


def test_split_and_ratio_tables_blink_over_peer():
    args = argparse.Namespace(concurrency=16, machine={"decode_limit_tok_s": 100.0, "decode_read_limit_tok_s": 200.0})
    rows = [{"peer": "blink", "status": "ok", "concurrent": _run(1.0, 0.05), "single": _run(0.1, 0.02)},
            {"peer": "llamaserver", "status": "ok", "concurrent": _run(2.0, 0.1),
             "single": _run(0.2, 0.04)},
            {"peer": "vllm", "status": "skipped: not installed"}]
    split = split_table(rows, args)
    blink_single = next(x for x in split.splitlines() if x.startswith("| blink | 1 |"))
    assert blink_single.endswith("| 0.50 | 0.25 |")  # 50 tok/s decode / the 100 copy limit, / the 200 read limit
    assert next(x for x in split.splitlines() if x.startswith("| blink | 16 |")).endswith("| - | - |")
    no_read = split_table(rows, argparse.Namespace(concurrency=16, machine={"decode_limit_tok_s": 100.0}))
    assert next(x for x in no_read.splitlines() if x.startswith("| blink | 1 |")).endswith("| 0.50 | - |")
    ratios = ratio_table(rows, args)
    line = next(x for x in ratios.splitlines() if x.startswith("| llamaserver |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # output tok/s equal (same tokens, same duration); P99 TTFT 1/2; ITL 1/2; prefill and decode 2x
    assert cells[1:] == ["1.00", "0.50", "1.00", "0.50", "2.00", "2.00"]
    assert "vllm" not in ratios


def test_read_bandwidth_is_a_rate_and_copy_counts_both_ways():
    gbs = read_bandwidth(8 << 20, 2)
    assert 0.1 < gbs < 10_000  # GB/s: bytes / seconds / 1e9, not bytes or seconds
    copy = copy_bandwidth(8 << 20, 2)
    assert copy["best_gbs"] == max(copy["numpy_1thread_gbs"], copy.get("torch_gbs", 0.0))


def _tiny_gguf(path: Path, tied: bool) -> Path:
    import numpy as np
    gguf = pytest.importorskip("gguf")

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))   # 320 bytes, 80 params
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float32))  # 256 bytes, 64 params
    w.add_tensor("output_norm.weight", np.zeros(8, np.float32))        # 32 bytes, a vector
    if not tied:
        w.add_tensor("output.weight", np.zeros((10, 8), np.float16))   # 160 bytes, 80 params
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_last_level_cache_is_the_largest_data_cache(tmp_path):
    for index, (kind, size) in enumerate([("Data", "48K"), ("Instruction", "64K"),
                                          ("Unified", "2048K"), ("Unified", "491520K"),
                                          ("Instruction", "2G"), ("Unified", "")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 491520 << 10
    assert last_level_cache_bytes(tmp_path / "none") is None


@pytest.mark.parametrize("llc", [None, 100, 1 << 30])
def test_the_header_says_when_the_weights_fit_in_the_last_level_cache(tmp_path, monkeypatch, llc):
    import benchmarks.peers as peers

    monkeypatch.setattr(peers, "last_level_cache_bytes", lambda: llc)
    args = argparse.Namespace(smoke=True, no_amx=False, gguf=str(_tiny_gguf(tmp_path / "m.gguf", True)),
                              model_name="tiny")
    text = machine_header(args)["text"]
    assert ("last-level cache" in text) is (llc is not None)
    assert ("fit in the" in text) is (llc == 1 << 30)  # 608 bytes a token fit in 1 GB, not in 100 bytes


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_and_flops_per_token(tmp_path, tied):
    path = str(_tiny_gguf(tmp_path / "m.gguf", tied))
    w = gguf_weight_bytes(path)
    assert w["tied_head"] is tied
    # tied: the embedding is the head (read whole); untied: the head instead, the embedding is a
    # row lookup (left out)
    assert w["bytes_per_token"] == (320 + 256 + 32 if tied else 160 + 256 + 32)
    assert w["file_tensor_bytes"] == 608 + (0 if tied else 160)
    assert model_work(path)["matmul_params"] == 80 + 64  # head (tied or not) + attn_q, no norm


def test_model_1b_args_and_the_llama_server_command(tmp_path):
    args = build_parser().parse_args(["--model-1b", str(tmp_path), "--quant", "Q4_1"])
    with pytest.raises(SystemExit, match="no model-Q4_1.gguf"):
        resolve_model_args(args)
    (tmp_path / "model-Q4_1.gguf").write_bytes(b"")
    args = build_parser().parse_args(["--model-1b", str(tmp_path), "--quant", "Q4_1", "--threads", "2"])
    resolve_model_args(args)
    assert args.gguf == str(tmp_path / "model-Q4_1.gguf") and args.hf_dir == str(tmp_path / "hf")
    assert args.model_name == "llama-1b-shaped" and args.output_len == 64 and args.input_len == 128
    argv, env, overrides = peer_command("llamaserver", 9000, args)
    assert argv[0].endswith("llama.cpp/bin/llama-server") and not overrides
    assert argv[argv.index("-np") + 1] == "16"
    assert argv[argv.index("--threads-http") + 1] == "18"
    assert argv[argv.index("-c") + 1] == str(16 * (128 + 64 + 32))
    assert "--cont-batching" in argv and argv[argv.index("-t") + 1] == "2"  # --threads
    args.llamaserver_threads = 3
    argv, _, _ = peer_command("llamaserver", 9000, args)
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == "3"
    assert argv[argv.index("-m") + 1] == args.gguf
    args.no_amx = True
    _, env, _ = peer_command("blink", 9001, args)
    assert env["BLINK_CPU_AMX"] == "0" and "AMX" not in env["ONEDNN_MAX_CPU_ISA"]
    assert no_amx_env(["avx512_bf16", "amx_int8"]) == {"BLINK_CPU_AMX": "0",
                                                        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    assert no_amx_env(["avx2"])["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    # --isa avx2: blink as on an AVX2 CPU, llama-server's AVX2 build, the other peers not run
    args.no_amx, args.isa = False, "avx2"
    _, env, _ = peer_command("blink", 9001, args)
    assert env == {"BLINK_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    argv, env, _ = peer_command("llamaserver", 9000, args)
    assert argv[0].endswith("llama.cpp-avx2/bin/llama-server") and env == {}
    assert peer_status("vllm", tmp_path, "avx2").startswith("not run with --isa avx2")
    assert peer_status("llamaserver", tmp_path, "avx2") == (
        "not installed (run: bash benchmarks/setup_peers.sh llamaserver-avx2)")
    assert peer_status("llamaserver", tmp_path) == "not installed (run: bash benchmarks/setup_peers.sh llamaserver)"
    (tmp_path / "llama.cpp-avx2").mkdir()
    (tmp_path / "llama.cpp-avx2" / "STATUS").write_text("ok\n")
    assert peer_status("llamaserver", tmp_path, "avx2") == "ok" and peer_status("blink", tmp_path, "avx2") == "ok"
    # --isa avx2_vnni: the same with AVX-VNNI, against llama-server's AVX-VNNI build
    args.isa = "avx2_vnni"
    _, env, _ = peer_command("blink", 9001, args)
    assert env == {"BLINK_CPU_ISA": "avx2_vnni", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}
    argv, _, _ = peer_command("llamaserver", 9000, args)
    assert argv[0].endswith("llama.cpp-avx2_vnni/bin/llama-server")
    assert peer_status("llamaserver", tmp_path, "avx2_vnni") == (
        "not installed (run: bash benchmarks/setup_peers.sh llamaserver-avx2_vnni)")
    assert build_parser().parse_args(["--isa", "avx2_vnni"]).isa == "avx2_vnni"
    smoke = build_parser().parse_args(["--smoke"])
    resolve_model_args(smoke)
    assert (smoke.concurrency, smoke.output_len, smoke.model_name) == (4, 8, "smollm2-135m")


def test_threads_arms():
    assert [a.name for a in default_arms(2)] == ["t1k2-passive", "t2k2-passive", "t1k1-passive",
                                                 "t1k2-active", "t2k2-active"]
    assert [a.name for a in default_arms(1)] == ["t1k1-passive", "t1k1-active"]
    arm = parse_arms("t2k2-active")[0]
    assert arm.serve_flags() == ["--threads", "2", "--kernel-threads", "2"]
    assert arm.env() == {"OMP_WAIT_POLICY": "ACTIVE"}
    for bad in ("t0k1-passive", "t1k1-spin", "t1k1-passive,t1k1-passive", ""):
        with pytest.raises(SystemExit, match="--arms"):
            parse_arms(bad)


def test_threads_table_ratios_to_the_first_arm():
    arms = [Arm(1, 2, "passive"), Arm(2, 2, "passive")]
    rows = [{"arm": "t1k2-passive", "model": "1b", "status": "ok", "concurrent": _run(1.0, 0.1),
             "single": _run(0.2, 0.04)},
            {"arm": "t2k2-passive", "model": "1b", "status": "ok", "concurrent": _run(1.0, 0.1),
             "single": _run(0.1, 0.04)},
            {"arm": "t2k2-passive", "model": "1b", "status": "failed: x"}]
    summary = summarize(rows, arms, "1b")
    assert [s["repeats"] for s in summary] == [1, 1]
    table = arms_table(summary, 16)
    line = next(x for x in table.splitlines() if x.startswith("| t2k2-passive |") and "2.00" in x)
    assert "| 2.00 | 1.00 | 1.00 |" in line  # prefill 2x, decode and output equal


def test_setup_peers_isa_flags_follow_this_cpu():
    script = REPO / "benchmarks" / "setup_peers.sh"
    fn = subprocess.run(["sed", "-n", "/^ggml_isa_flags()/,/^}/p", str(script)],
                        capture_output=True, text=True, check=True).stdout
    def isa(env: dict, cap: str = "") -> list:
        return subprocess.run(["bash", "-c", fn + f"\nggml_isa_flags {cap}"], capture_output=True,
                              text=True, check=True, env=env).stdout.split()

    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("no x86 flags in /proc/cpuinfo")
    out, amx = isa({"PATH": "/usr/bin:/bin"}), isa({"PATH": "/usr/bin:/bin", "LLAMA_AMX": "1"})
    assert "-DGGML_NATIVE=OFF" in out
    for cpu_flag, opt in (("avx2", "AVX2"), ("avx512f", "AVX512"), ("fma", "FMA")):
        assert f"-DGGML_{opt}={'ON' if cpu_flag in flags else 'OFF'}" in out
    assert "-DGGML_AMX_INT8=OFF" in out  # llama.cpp's AMX kernels only with LLAMA_AMX=1
    assert f"-DGGML_AMX_INT8={'ON' if 'amx_int8' in flags else 'OFF'}" in amx
    # the capped builds: AVX2 alone, and AVX2 with AVX-VNNI where this CPU has it
    plain, vnni = isa({"PATH": "/usr/bin:/bin"}, "avx2"), isa({"PATH": "/usr/bin:/bin"}, "avx2_vnni")
    assert "-DGGML_AVX512=OFF" in plain and "-DGGML_AVX512=OFF" in vnni and "-DGGML_AVX_VNNI=OFF" in plain
    assert f"-DGGML_AVX_VNNI={'ON' if 'avx_vnni' in flags else 'OFF'}" in vnni


def test_alternating_single_streams_give_ratios_round_by_round_and_their_medians():
    from benchmarks.peers import alternating_table

    def peer(out, decode):
        return {"output_tok_s": out, "decode_tok_s": decode, "itl_p50_ms": 1000 / decode}

    rounds = [{"blink": peer(40, 44), "llamaserver": peer(40, 40)},
              {"blink": peer(30, 33), "llamaserver": peer(20, 22)},
              {"blink": peer(36, 36), "llamaserver": peer(40, 45)}]
    table = alternating_table(rounds).splitlines()
    assert table[0].startswith("| round | blink out / decode tok/s | llamaserver out / decode tok/s")
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    assert cells(table[2]) == ["1", "40.0 / 44.0", "40.0 / 40.0", "1.10", "1.00"]
    assert cells(table[3])[3:] == ["1.50", "1.50"]
    # medians of each column over the rounds: decode ratios 1.10, 1.50, 0.80 -> 1.10
    assert cells(table[-1]) == ["median", "36.0 / 36.0", "40.0 / 40.0", "**1.10**", "**1.00**"]
    assert alternating_table([]) == ""
    # with the header's copy limit: each peer's decode over it, per round and the median's
    with_limit = alternating_table(rounds, copy_limit=50.0).splitlines()
    assert with_limit[0].endswith("| blink decode ÷ copy limit | llamaserver decode ÷ copy limit |")
    assert with_limit[1].count("---:") == 6
    assert cells(with_limit[2])[5:] == ["0.88", "0.80"]
    assert cells(with_limit[-1])[5:] == ["**0.72**", "**0.80**"]  # medians 36 and 40 tok/s


def test_alternating_rounds_with_read_probes_give_each_peers_share_of_the_read_limit():
    from benchmarks.peers import alternating_table

    def peer(decode, read_gbs, of_limit):
        return {"output_tok_s": decode, "decode_tok_s": decode, "itl_p50_ms": 1000 / decode,
                "read_gbs": read_gbs, "of_read_limit": of_limit}

    rounds = [{"blink": peer(40, 36.0, 0.88), "llamaserver": peer(38, 35.0, 0.86)},
              {"blink": peer(47, 60.0, 0.62), "llamaserver": peer(41, 62.0, 0.53)},
              {"blink": peer(39, 35.5, 0.87), "llamaserver": peer(39, 36.5, 0.85)}]
    table = alternating_table(rounds).splitlines()
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    assert cells(table[0])[-2:] == ["blink decode ÷ read limit (read GB/s)",
                                    "llamaserver decode ÷ read limit (read GB/s)"]
    assert len(cells(table[1])) == len(cells(table[0]))
    assert cells(table[3])[-2:] == ["0.62 (60.0)", "0.53 (62.0)"]
    assert cells(table[-1])[-2:] == ["**0.87** (36.0)", "**0.85** (36.5)"]


def test_alternating_rounds_with_copy_probes_take_each_rounds_copy_limit():
    """The copy limit of a round is its own probe's, not the header's (minutes earlier: the VM's
    bandwidth moves between levels), per round and in the medians."""
    from benchmarks.peers import alternating_table

    def peer(decode, copy_gbs, of_limit):
        return {"output_tok_s": decode, "decode_tok_s": decode, "itl_p50_ms": 1000 / decode,
                "read_gbs": copy_gbs * 1.2, "of_read_limit": of_limit / 1.2,
                "copy_gbs": copy_gbs, "of_copy_limit": of_limit}

    rounds = [{"blink": peer(40, 30.0, 0.80), "llamaserver": peer(38, 31.0, 0.70)},
              {"blink": peer(47, 50.0, 0.60), "llamaserver": peer(41, 52.0, 0.50)},
              {"blink": peer(39, 29.0, 0.78), "llamaserver": peer(39, 33.0, 0.72)}]
    table = alternating_table(rounds, copy_limit=50.0).splitlines()  # the header's: not used
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    assert cells(table[0])[5:7] == ["blink decode ÷ copy limit (copy GB/s)",
                                    "llamaserver decode ÷ copy limit (copy GB/s)"]
    assert len(cells(table[1])) == len(cells(table[0])) == 9
    assert cells(table[3])[5:7] == ["0.60 (50.0)", "0.50 (52.0)"]
    assert cells(table[-1])[5:7] == ["**0.78** (30.0)", "**0.70** (33.0)"]


def test_the_read_probe_reads_its_pages_again_and_again():
    from benchmarks.peers import ReadProbe

    probe = ReadProbe(8 << 20)
    assert probe.gbs(2) > 0 and probe.gbs(1) > 0 and probe.once() > 0
    assert probe.copy_gbs(2) > 0 and probe.copy_gbs(1) > 0  # its copy target made once, kept
