"""A copied ``vllm serve`` line works with ``blink serve``: the positional model, vLLM's flags
(honoured, refused or noted), ``--version``, errors with ``blink serve``'s usage, defaults in
``--help``, the port checked before the model loads, and timestamped log lines."""
from __future__ import annotations

import argparse
import logging
import re
import socket

import pytest

from blink.cli import main, parse_args
from blink.cli_args import (
    check_frontend_flags,
    check_port_free,
    check_vllm_flags,
    frontend_passed_args,
    prefix_caching_enabled,
)
from blink.errors import BlinkError
from blink.launcher import engine_config_from_args, frontend_args
from blink.logs import configure_logging, request_id

VLLM_LINE = [
    "serve", "Qwen/Qwen2.5-0.5B-Instruct", "--chat-template", "{{ messages }}",
    "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9", "--trust-remote-code",
    "--tokenizer", "some/tokenizer", "--seed", "0", "--enable-prefix-caching",
    "--max-logprobs", "5", "--uvicorn-log-level", "warning", "--disable-log-requests",
    "--root-path", "/llm", "--allowed-origins", '["*"]', "--device", "cpu",
    "--host", "0.0.0.0", "--port", "8001", "--max-model-len", "4096",
    "--served-model-name", "qwen",
]


def test_a_vllm_serve_line_parses_with_vllms_meaning():
    a = parse_args(VLLM_LINE)
    assert a.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert a.tensor_parallel_size == 1 and a.seed == 0 and a.max_logprobs == 5
    assert a.enable_prefix_caching is True and prefix_caching_enabled(a)
    assert a.disable_log_requests and a.root_path == "/llm" and a.uvicorn_log_level == "warning"
    cfg = engine_config_from_args(a)
    assert cfg.max_logprobs == 5 and cfg.enable_prefix_caching and cfg.max_model_len == 4096
    # what blink serve hands its frontend process
    fe = frontend_args(a, "127.0.0.1:7000")
    for flag, value in (("--tokenizer", "some/tokenizer"), ("--seed", "0"),
                        ("--root-path", "/llm"), ("--allowed-origins", '["*"]'),
                        ("--uvicorn-log-level", "warning"), ("--chat-template", "{{ messages }}")):
        assert fe[fe.index(flag) + 1] == value
    assert "--disable-log-requests" in fe
    assert parse_args(["serve", "--frontend-only", *fe[2:]]).seed == 0  # the child parses it


def test_prefix_caching_switches():
    assert not prefix_caching_enabled(parse_args(["serve", "--no-enable-prefix-caching"]))
    assert not prefix_caching_enabled(parse_args(["serve", "--no-prefix-caching"]))
    assert prefix_caching_enabled(parse_args(["serve"]))
    with pytest.raises(BlinkError, match="contradict"):
        prefix_caching_enabled(parse_args(["serve", "--enable-prefix-caching",
                                           "--no-prefix-caching"]))


def test_model_twice_must_agree(capsys):
    assert parse_args(["serve", "m1", "--model", "m1"]).model == "m1"
    with pytest.raises(SystemExit) as info:
        parse_args(["serve", "m1", "--model", "m2"])
    assert info.value.code == 2
    assert "usage: blink serve" in capsys.readouterr().err


def test_unknown_flag_prints_serve_usage(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["serve", "--no-such-flag", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: blink serve") and "--no-such-flag" in err
    assert "docs/vllm-migration.md" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--version"])
    assert info.value.code == 0
    assert re.fullmatch(r"blink \S+\n", capsys.readouterr().out)


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                                  "--kv-cache-memory", "--max-logprobs", "--uvicorn-log-level"])
def test_help_shows_defaults(capsys, flag):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    start = out.index(f" {flag} ")
    assert "(default: " in out[start:start + 400].split(" --", 2)[1] or \
        "(default: " in out[start:start + 400], out[start:start + 400]


@pytest.mark.parametrize("flags, message", [
    (["-tp", "2"], "--tensor-parallel-size 2: Blink has no tensor parallel"),
    (["--pipeline-parallel-size", "4"], "no pipeline parallel"),
    (["--data-parallel-size", "2"], "one 'blink serve' per device"),
    (["--gpu-memory-utilization", "0.9", "--device", "cuda"], "--kv-cache-memory"),
    (["--gpu-memory-utilization", "1.5", "--device", "cpu"], "must be in (0, 1]"),
    (["--max-logprobs", "50"], "--max-logprobs must be between 0 and 20"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill: Blink always chunks"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: Blink's KV cache has the model's"),
    (["--kv-cache-dtype", "bfloat16", "--dtype", "float32"], "use --dtype bfloat16"),
    (["--dtype", "half"], "--dtype half: Blink's kernels run bfloat16 or float32"),
    (["--dtype", "float16"], "--dtype float16: Blink's kernels"),
    (["--generation-config", "vllm"], "--generation-config vllm: Blink always takes"),
    (["--reasoning-parser", "granite"], "--reasoning-parser granite: Blink has the reasoning"),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'],
     "--structured-outputs-config {\"backend\": \"xgrammar\"}: Blink's structured outputs"),
    (["--structured-outputs-config", "nope"], "--structured-outputs-config must be a JSON"),
    (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend outlines: Blink's"),
    (["--chat-template-content-format", "openai"], "--chat-template-content-format openai:"),
    (["--response-role", "user"], "--response-role user: Blink's answers"),
    (["--limit-mm-per-prompt", '{"image": 1}'], "--limit-mm-per-prompt: Blink serves text-only"),
])
def test_flags_blink_cannot_honour_are_refused(flags, message):
    with pytest.raises(BlinkError) as info:
        check_vllm_flags(parse_args(["serve", *flags]))
    assert message in str(info.value)


def test_flags_that_do_not_apply_are_noted():
    notes = check_vllm_flags(parse_args(["serve", "--gpu-memory-utilization", "0.9",
                                         "--device", "cpu", "--trust-remote-code"]))
    assert any("no effect on the CPU" in n for n in notes)
    assert any("never runs code shipped with a checkpoint" in n for n in notes)
    assert check_vllm_flags(parse_args(["serve"])) == []


@pytest.mark.parametrize("flags, message", [
    (["--allowed-origins", "*"], "--allowed-origins must be a JSON list of strings"),
    (["--ssl-keyfile", "/nonexistent.key"], "go together"),
    (["--ssl-keyfile", "/nonexistent.key", "--ssl-certfile", "/nonexistent.crt"], "no such file"),
    (["--root-path", "llm"], "must start with '/'"),
])
def test_bad_frontend_flags(flags, message):
    with pytest.raises(BlinkError, match=re.escape(message)):
        check_frontend_flags(parse_args(["serve", *flags]))


def test_refusal_is_one_line_before_anything_starts(capsys):
    assert main(["serve", "--model", "null", "--tensor-parallel-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "error: --tensor-parallel-size 2" in err and "Traceback" not in err


def test_port_in_use_is_reported_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(BlinkError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
        # through the CLI: no engine process is started (it would take seconds and print more)
        assert main(["serve", "--model", "null", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    check_port_free("127.0.0.1", port)  # free again


def test_log_lines_have_time_level_and_request_id(capsys):
    configure_logging("info")
    logging.getLogger().handlers[0].setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    token = request_id.set("abc123")
    logging.getLogger("blink.test").info("hello")
    request_id.reset(token)
    logging.getLogger("blink.test").warning("outside")
    configure_logging("info")  # the real format
    logging.getLogger("blink.test").info("plain")
    lines = capsys.readouterr().err.splitlines()
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO blink.test \[abc123\] hello", lines[0])
    assert "WARNING blink.test [-] outside" in lines[1]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} INFO  blink.test: plain", lines[2])


def test_frontend_passed_args_skip_unset_flags():
    assert frontend_passed_args(argparse.Namespace()) == []
    passed = frontend_passed_args(parse_args(["serve"]))
    for unset in ("--tokenizer", "--chat-template", "--seed", "--root-path", "--ssl-keyfile",
                  "--allowed-origins", "--disable-log-requests"):
        assert unset not in passed
    assert passed[passed.index("--uvicorn-log-level") + 1] == "info"


def test_issue_33_vllm_line_parses_and_its_flags_are_honoured():
    """The 'vllm serve' line of issue 33: --disable-log-stats (Blink logs no periodic stats),
    --enable-chunked-prefill (always on), --kv-cache-dtype auto|bfloat16."""
    a = parse_args(["serve", "Qwen/Qwen2.5-0.5B-Instruct", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", "--max-model-len", "4096",
                    "--gpu-memory-utilization", "0.9", "--served-model-name", "foo",
                    "--disable-log-stats", "--enable-chunked-prefill", "--device", "cpu",
                    "--kv-cache-dtype", "auto"])
    assert a.disable_log_stats and a.enable_chunked_prefill and a.kv_cache_dtype == "auto"
    assert check_vllm_flags(a) == [n for n in check_vllm_flags(a) if "CPU" in n]
    assert engine_config_from_args(a).max_model_len == 4096
    bf16 = parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert any("bfloat16" in n for n in check_vllm_flags(bf16)) and bf16.dtype == "bfloat16"
    same = parse_args(["serve", "--kv-cache-dtype", "bfloat16", "--dtype", "bfloat16"])
    assert check_vllm_flags(same) == [] and same.dtype == "bfloat16"


def test_several_served_model_names_reach_the_frontend():
    a = parse_args(["serve", "some/model", "--served-model-name", "a", "b"])
    assert a.served_model_name == ["a", "b"]
    fe = frontend_args(a, "127.0.0.1:7000")
    i = fe.index("--served-model-name")
    assert fe[i + 1:i + 3] == ["a", "b"]
    assert parse_args(["serve", "--frontend-only", *fe[2:]]).served_model_name == ["a", "b"]
    assert parse_args(["serve", "--served-model-name", "foo"]).served_model_name == ["foo"]


def test_issue_33_flags_honoured_or_noted():
    a = parse_args(["serve", "--swap-space", "4", "--disable-frontend-multiprocessing",
                    "--structured-outputs-config", '{"backend": "guidance"}',
                    "--guided-decoding-backend", "auto", "--enable-prompt-tokens-details",
                    "--generation-config", "auto", "--response-role", "assistant",
                    "--chat-template-content-format", "auto"])
    notes = check_vllm_flags(a)
    assert len(notes) == 2
    assert any(n.startswith("--swap-space 4 has no effect") for n in notes)
    assert any(n.startswith("--disable-frontend-multiprocessing has no effect") for n in notes)
    assert check_vllm_flags(parse_args(["serve", "--guided-decoding-backend", "guidance",
                                        "--structured-outputs-config", "{}"])) == []


def test_served_model_names_from_a_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("served-model-name: foo\n")
    assert parse_args(["serve", "--config", str(cfg)]).served_model_name == ["foo"]
    cfg.write_text("served-model-name: [a, b]\n")
    assert parse_args(["serve", "--config", str(cfg)]).served_model_name == ["a", "b"]
