"""End to end: ``blink serve --thread-policy`` on the null model names its threads, applies
the policy to the engine's and the frontend's threads and reports every setting in
``/metrics``; without CAP_SYS_NICE (``setpriv``) the report says denied; a bad policy file
stops ``blink serve`` before it starts anything, naming the line."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from e2e_helpers import BLINK, ServeProcess, wait_until  # noqa: E402

from blink.threads.roles import task_ids, task_name  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux threads")]

POLICY = """\
threads:
  - match: '^blink-(loop|omp-[0-9]+)$'
    nice: 3
    slice_us: 2000
  - match: '^blink-http$'
    nice: 2
  - match: '^blink-bootstrap$'
    ioprio: be:5
"""
NULL = ("--model", "null", "--max-model-len", "256", "--max-num-seqs", "8",
        "--kv-cache-tokens", "4096", "--threads", "2")


def _series(text: str, name: str) -> list[dict[str, str]]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.index("}") + 1]))
            labels["__value__"] = line.rsplit(" ", 1)[1]
            out.append(labels)
    return out


def test_serve_reports_every_thread_setting_in_metrics(tmp_path):
    policy = tmp_path / "threads.yaml"
    policy.write_text(POLICY)
    server = ServeProcess(*NULL, "--thread-policy", str(policy), name="threads-serve")
    try:
        server.wait_ready()
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                       json={"model": "null", "prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 200
        names = {task_name(t, server.engine_pid) for t in task_ids(server.engine_pid)}
        assert {"blink-engine", "blink-loop", "blink-bootstrap", "blink-threads"} <= names, names
        assert any(n and re.fullmatch(r"blink-omp-\d+", n) for n in names), names
        environ = Path(f"/proc/{server.engine_pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_WAIT_POLICY=PASSIVE" in environ  # idle OpenMP workers sleep by default
        fe_names = {task_name(t, server.frontend_pid) for t in task_ids(server.frontend_pid)}
        assert "blink-http" in fe_names, fe_names
        # the engine's snapshot (rewritten every second) reaches the frontend's /metrics
        def engine_reported() -> str | None:
            text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
            steps = _series(text, "blink:engine_step_runqueue_wait_seconds_count")
            return text if steps and float(steps[0]["__value__"]) >= 1 else None

        text = wait_until(engine_reported, 20, 0.2, "the engine's thread settings in /metrics")
        settings = {(s["process"], s["role"], s["setting"], s["value"], s["status"])
                    for s in _series(text, "blink:thread_policy_setting")}
        assert ("engine", "blink-loop", "nice", "3", "applied") in settings
        assert ("engine", "blink-loop", "slice", "2000us", "applied") in settings
        assert ("engine", "blink-omp", "nice", "3", "applied") in settings
        assert ("engine", "blink-bootstrap", "ioprio", "be:5", "applied") in settings
        assert ("frontend", "blink-http", "nice", "2", "applied") in settings
        # the kernel agrees
        loop_tid = next(t for t in task_ids(server.engine_pid)
                        if task_name(t, server.engine_pid) == "blink-loop")
        assert os.getpriority(os.PRIO_PROCESS, loop_tid) == 3
        # telemetry per role, and the engine loop's per-step run-queue wait
        waits = {(s["process"], s["role"]) for s in _series(text, "blink:thread_runqueue_wait_seconds_total")}
        assert ("engine", "blink-loop") in waits and ("frontend", "blink-http") in waits
        assert _series(text, "blink:thread_interactive")
        assert "Traceback" not in server.log(), server.tail()
    finally:
        server.stop()


def test_a_bad_policy_stops_serve_before_anything_starts(tmp_path):
    policy = tmp_path / "bad.yaml"
    policy.write_text("threads:\n  - match: '^blink-loop$'\n    nice: -50\n")
    proc = subprocess.run([*BLINK, "serve", *NULL, "--port", "1", "--thread-policy", str(policy)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"error: {policy}:3: nice must be an integer in [-20, 19], got -50" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0,
                    reason="needs setpriv and root to drop CAP_SYS_NICE")
def test_without_cap_sys_nice_raising_priority_is_reported_denied():
    drop = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]
    proc = subprocess.run([*drop, *BLINK, "thread-policy", "default"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "nice denied" in proc.stdout
    line = next(l for l in proc.stdout.splitlines() if "blink-(loop|omp" in l)
    assert "nice=-10 (denied)" in line
    housekeeping = next(l for l in proc.stdout.splitlines() if "blink-(threads|" in l)
    assert "nice=10 (applied)" in housekeeping  # lowering needs no privilege
