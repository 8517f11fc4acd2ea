"""benchmarks/gpu_check.py and blink/engine/gpu_probe.py on a machine without a GPU.

The GPU phases themselves cannot run here; what can: the phase list and its order, the
orchestrator (one subprocess per phase, JSON per phase written also on timeout and crash,
summary, exit codes), the environment and probe phases reporting "no CUDA GPU" instead of
crashing, and the probes' no-GPU answers. ``--simulate`` (the phases' code over the GPU
loops simulated on CPU tensors) is exercised for the tier B small-model phase.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # --import-mode=importlib adds no rootdir; benchmarks/ is no package install

from benchmarks import gpu_check  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")

EXPECTED_ORDER = ["environment", "probe", "tier_a_small", "tier_b_small", "kernels", "model_1b",
                  "steady_decode", "makespan", "serve_e2e"]


def _run(*args: str, out: Path | None, work: Path, timeout: float = 60,
         env_out: Path | None = None) -> subprocess.CompletedProcess:
    """gpu_check with ``--out out``, or with ``OUT=env_out`` in the environment (the device
    tool's way: results then go to $OUT/gpu_check)."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if env_out is not None:
        env["OUT"] = str(env_out)
    where = ["--out", str(out)] if out is not None else []
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *where, "--work-dir", str(work), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_list_prints_the_phases_in_order_and_their_timeouts_fit_the_budget():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--list"], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert names == EXPECTED_ORDER + ["total"]
    assert [p.name for p in gpu_check.PHASES] == EXPECTED_ORDER
    total = sum(p.timeout_s for p in gpu_check.PHASES)
    assert total < 9 * 60 and total <= gpu_check.build_parser().parse_args([]).budget_s


def test_every_phase_name_maps_to_a_documented_function():
    for phase in gpu_check.PHASES + gpu_check.TEST_PHASES:
        assert callable(phase.fn) and phase.fn.__name__ == f"phase_{phase.name}".replace("phase__", "_phase_")
        assert phase.doc, f"{phase.name} has no docstring"
        assert gpu_check.PHASE_BY_NAME[phase.name] is phase
    assert len(gpu_check.PHASE_BY_NAME) == len(gpu_check.PHASES) + len(gpu_check.TEST_PHASES)


def test_help_explains_phases_and_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for word in EXPECTED_ORDER + ["Exit status", "--phases", "--budget-s", "--timeout"]:
        assert word in proc.stdout


def test_environment_and_probe_without_gpu_write_json_and_skip(tmp_path):
    out = tmp_path / "OUT" / "gpu_check"  # the default folder under $OUT
    proc = _run("--phases", "probe,environment", out=None, env_out=tmp_path / "OUT", work=tmp_path / "work")
    assert proc.returncode == gpu_check.EXIT_SKIPPED, proc.stdout + proc.stderr
    env = json.loads((out / "environment.json").read_text())
    probe = json.loads((out / "probe.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert env["status"] == "PASS" and env["values"]["environment"]["gpu"]["reason"] == "no CUDA GPU"
    assert env["values"]["tier_b_problems"]  # names what is missing, no crash
    assert probe["status"] == "SKIP" and probe["reason"] == "no CUDA GPU"
    assert {c["name"] for c in probe["checks"]} == {"host_register", "gate_kernel", "conditional_graph"}
    assert all(c["status"] == "SKIP" and c["detail"] == "no CUDA GPU" for c in probe["checks"])
    assert list(summary["phases"]) == ["environment", "probe"]  # standard order, not argv order
    assert summary["exit_code"] == gpu_check.EXIT_SKIPPED
    assert "probe" in proc.stdout and "SKIP" in proc.stdout


def test_a_phase_over_its_timeout_is_killed_and_reported_with_what_it_recorded(tmp_path):
    out = tmp_path / "out"
    proc = _run("--phases", "_sleep", "--timeout", "_sleep=1.5", out=out, work=tmp_path / "work")
    assert proc.returncode == gpu_check.EXIT_FAILED
    result = json.loads((out / "_sleep.json").read_text())
    assert result["status"] == "TIMEOUT" and "timeout" in result["reason"]
    assert result["values"] == {"started": True}  # recorded before the timeout, kept
    assert result["wall_s"] < 1.5 + gpu_check.TERM_GRACE_S + 2


def test_a_crashed_phase_is_reported_and_the_run_goes_on(tmp_path):
    out = tmp_path / "out"
    proc = _run("--phases", "_crash,_sleep", "--timeout", "_sleep=1", out=out, work=tmp_path / "work")
    assert proc.returncode == gpu_check.EXIT_FAILED
    crash = json.loads((out / "_crash.json").read_text())
    assert crash["status"] == "CRASH" and "exit status 7" in crash["reason"]
    assert crash["checks"][0]["name"] == "before the crash"
    assert json.loads((out / "_sleep.json").read_text())["values"] == {"started": True}  # ran after it


def test_budget_leaves_later_phases_not_run(tmp_path):
    out = tmp_path / "out"
    # _sleep gets its 2 s; then less than MIN_PHASE_S is left of the 8 s budget.
    proc = _run("--phases", "_sleep,environment", "--budget-s", "8", "--timeout", "_sleep=2",
                out=out, work=tmp_path / "work")
    assert proc.returncode == gpu_check.EXIT_FAILED
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"]["_sleep"]["status"] == "TIMEOUT"
    assert summary["phases"]["environment"]["status"] == "NOT_RUN"


def test_unknown_phase_is_a_usage_error(tmp_path):
    proc = _run("--phases", "nope", out=tmp_path / "out", work=tmp_path / "work")
    assert proc.returncode == gpu_check.EXIT_USAGE and "unknown phase" in proc.stderr


def test_fold_keeps_the_device_tools_file_limit(tmp_path):
    results = []
    for i in range(10):
        (tmp_path / f"p{i}.json").write_text("{}")
        results.append({"phase": f"p{i}", "status": "FAIL" if i == 3 else "PASS"})
    (tmp_path / "summary.json").write_text("{}")
    removed = gpu_check.fold_phase_files(tmp_path, results, 8)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 8 and "summary.json" in left and "p3.json" in left  # failures kept
    assert len(removed) == 3


def test_gpu_wheels_script_parses():
    proc = subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_wheels.sh")], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "/.gpu-wheels/" in (REPO / ".gitignore").read_text().splitlines()


def test_probes_answer_no_gpu_without_raising():
    from blink.engine import gpu_probe

    assert gpu_probe.host_register_problem() == gpu_probe.NO_GPU
    for result in gpu_probe.all_probes():
        assert not result.ok and result.reason == gpu_probe.NO_GPU
        assert json.dumps(result.to_dict())
    env = gpu_probe.environment()
    assert env["gpu"]["cuda_available"] is False and env["cpu_count"]
    assert {"total_bytes", "free_bytes"} <= set(env["dev_shm"])
    assert env["sandbox"]["kind"] in ("gvisor", "firecracker", "unknown")
    json.dumps(env, default=str)


def test_simulated_tier_b_phase_matches_the_cpu_loop(tmp_path):
    """The tier phases' own code (model writing, CPU reference, prestaged runs, checks)
    over tier B's loop simulated on CPU tensors."""
    out = tmp_path / "out"
    proc = _run("--simulate", "--phases", "tier_b_small", out=out, work=tmp_path / "work", timeout=120)
    assert proc.returncode == gpu_check.EXIT_OK, proc.stdout[-3000:] + proc.stderr[-3000:]
    b = json.loads((out / "tier_b_small.json").read_text())
    assert b["status"] == "PASS"
    assert [(c["name"].split(" (")[0], c["status"]) for c in b["checks"]] == [
        ("tier B tokens == CPU loop", "PASS"), ("tier B tokens == tier A", "SKIP")]  # tier A not run
