"""CPU-interference harness: the same serving benchmark with and without a CPU hog beside the
server, and the interference/isolation ratio of every metric (the paper's Table 7 brackets).

The hog is ``stress-ng --cpu N`` when stress-ng is installed (``apt-get install -y stress-ng``),
else a built-in hog of N Python processes (numpy matrix products with one BLAS thread, which
also churns the caches, mixed with a pure-Python loop). N defaults to every core. The server is
either started here (``--launch "blink serve --port 8765 ..."``; ready when ``/v1/models``
answers, stopped with SIGINT at the end) or an existing ``--base-url``. Example::

    python -m benchmarks.interference --launch "blink serve --port 8765 --max-num-seqs 32 \\
        --max-model-len 2048" --base-url http://127.0.0.1:8765 --max-concurrency 16 \\
        --random-input-len 128 --random-output-len 128 --ignore-eos --num-prompts 48 \\
        --result-json interference.json

Ratios: latencies are interference / isolation (> 1 = slower under interference); throughputs
are retention, interference / isolation (< 1 = lost throughput).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.serve import add_serve_args, run_benchmark, wait_for_server

#: (key, label, kind) of the metrics compared; kind "lat" -> ratio, "tput" -> retention
COMPARED: list[tuple[str, str, str]] = [
    ("output_throughput", "Output tok/s", "tput"),
    ("request_throughput", "Requests/s", "tput"),
    ("ttft_ms.mean", "Mean TTFT (ms)", "lat"),
    ("ttft_ms.p50", "P50 TTFT (ms)", "lat"),
    ("ttft_ms.p99", "P99 TTFT (ms)", "lat"),
    ("tpot_ms.mean", "Mean TPOT (ms)", "lat"),
    ("tpot_ms.p50", "P50 TPOT (ms)", "lat"),
    ("tpot_ms.p99", "P99 TPOT (ms)", "lat"),
    ("itl_ms.p50", "P50 ITL (ms)", "lat"),
    ("itl_ms.p99", "P99 ITL (ms)", "lat"),
    ("e2el_ms.p50", "P50 E2EL (ms)", "lat"),
    ("e2el_ms.p99", "P99 E2EL (ms)", "lat"),
]

_PY_HOG = r"""
import os, sys, time
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
try:
    import numpy as np
    a = np.random.rand(384, 384); b = np.random.rand(384, 384)
except Exception:
    np = None
x = 0
while True:
    if np is not None:
        for _ in range(20):
            a = a @ b
            a /= (abs(a).max() + 1.0)
    for i in range(200000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
"""


def _get(m: dict[str, Any], dotted: str) -> float | None:
    cur: Any = m
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return float(cur) if cur is not None else None


def ratios(isolated: dict[str, Any], interfered: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per compared metric: isolated, interference, ratio (interference / isolation)."""
    rows = []
    for key, label, kind in COMPARED:
        a, b = _get(isolated, key), _get(interfered, key)
        ratio = (b / a) if (a not in (None, 0.0) and b is not None) else None
        rows.append({"metric": key, "label": label, "kind": kind, "isolated": a,
                     "interference": b, "ratio": ratio})
    return rows


def ratio_table(rows: list[dict[str, Any]]) -> str:
    out = ["| metric | isolated | interference | interference / isolation |",
           "|---|---:|---:|---:|"]
    for r in rows:
        fmt = (lambda v: "-" if v is None else f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}")
        ratio = "-" if r["ratio"] is None else f"[{r['ratio']:.2f}]"
        if r["kind"] == "tput" and r["ratio"] is not None:
            ratio += " retention"
        out.append(f"| {r['label']} | {fmt(r['isolated'])} | {fmt(r['interference'])} | {ratio} |")
    return "\n".join(out)


# -- processes -------------------------------------------------------------------------------
class Hog:
    """A CPU hog on ``workers`` cores: stress-ng if available (or asked), else Python processes."""

    def __init__(self, kind: str = "auto", workers: int | None = None) -> None:
        self.workers = workers or os.cpu_count() or 1
        if kind == "auto":
            kind = "stress-ng" if shutil.which("stress-ng") else "python"
        if kind == "stress-ng" and not shutil.which("stress-ng"):
            raise SystemExit("stress-ng is not installed (apt-get install -y stress-ng), "
                             "or use --hog python")
        self.kind = kind
        self._procs: list[subprocess.Popen] = []

    def describe(self) -> str:
        if self.kind == "stress-ng":
            return f"stress-ng --cpu {self.workers} (all methods)"
        return f"{self.workers} python/numpy busy processes"

    def start(self) -> None:
        if self.kind == "stress-ng":
            cmd = ["stress-ng", "--cpu", str(self.workers), "--cpu-method", "all",
                   "--timeout", "0", "--quiet"]
            self._procs = [subprocess.Popen(cmd, start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        else:
            self._procs = [subprocess.Popen([sys.executable, "-c", _PY_HOG], start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                           for _ in range(self.workers)]

    def stop(self) -> None:
        for p in self._procs:
            _stop_group(p, signal.SIGTERM, 10.0)
        self._procs = []

    def __enter__(self) -> "Hog":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_group(proc: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Signal the process group we created for ``proc`` (it leads it), then SIGKILL after grace."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


class LaunchedServer:
    """A server command started in its own session; output goes to ``log_path``."""

    def __init__(self, command: str | Sequence[str], base_url: str, log_path: str | Path,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 600.0,
                 cwd: str | Path | None = None) -> None:
        self.argv = shlex.split(command) if isinstance(command, str) else list(command)
        self.base_url = base_url
        self.log_path = Path(log_path)
        self.env = env
        self.ready_timeout_s = ready_timeout_s
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> "LaunchedServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env, cwd=self.cwd)
        try:
            wait_for_server(self.base_url, self.ready_timeout_s, self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc, signal.SIGINT, 30.0)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def base_url_from_command(command: str) -> str | None:
    m = re.search(r"--port[= ](\d+)", command)
    return f"http://127.0.0.1:{m.group(1)}" if m else None


# -- main ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.interference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    h = ap.add_argument_group("interference")
    h.add_argument("--launch", default=None,
                   help="start this server command (e.g. \"blink serve --port 8765\") and stop it "
                        "at the end; --base-url defaults to its --port")
    h.add_argument("--launch-log", default="/tmp/blink-interference-server.log")
    h.add_argument("--hog", default="auto", choices=["auto", "stress-ng", "python"])
    h.add_argument("--hog-workers", type=int, default=None, help="default: every core")
    h.add_argument("--settle", type=float, default=3.0,
                   help="seconds between starting the hog and measuring")
    h.add_argument("--repeats", type=int, default=1,
                   help="isolated/interference pairs (alternating); metrics of the pairs are "
                        "averaged")
    add_serve_args(ap)
    return ap


def _mean_runs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Average numeric metrics of the same run index over repeats (for --repeats > 1)."""
    if len(docs) == 1:
        return docs[0]
    base = json.loads(json.dumps(docs[0]))
    for i, run in enumerate(base["runs"]):
        for key, val in run.items():
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                run[key] = sum(d["runs"][i][key] for d in docs) / len(docs)
            elif isinstance(val, dict) and key.endswith("_ms"):
                for k2 in val:
                    val[k2] = sum(d["runs"][i][key][k2] for d in docs) / len(docs)
    base["repeats"] = len(docs)
    return base


def run_interference(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    hog = Hog(args.hog, args.hog_workers)
    log(f"hog: {hog.describe()}")
    iso_docs, int_docs = [], []
    label = args.label
    for rep in range(args.repeats):
        args.condition, args.label = "isolated", label
        log(f"[{rep + 1}/{args.repeats}] isolated")
        iso_docs.append(run_benchmark(args, log=log))
        with hog:
            time.sleep(args.settle)
            args.condition = "interference"
            log(f"[{rep + 1}/{args.repeats}] interference ({hog.describe()})")
            int_docs.append(run_benchmark(args, log=log))
    iso, inter = _mean_runs(iso_docs), _mean_runs(int_docs)
    tables = []
    for i, (a, b) in enumerate(zip(iso["runs"], inter["runs"])):
        rows = ratios(a, b)
        rate = a.get("offered_rate")
        tables.append({"offered_rate": rate, "max_concurrency": a.get("max_concurrency"),
                       "rows": rows})
    return {"hog": hog.describe(), "isolated": iso, "interference": inter, "ratios": tables}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.launch and args.base_url == "http://127.0.0.1:8000":
        args.base_url = base_url_from_command(args.launch) or args.base_url
    if args.launch:
        print(f"launching: {args.launch}")
        server = LaunchedServer(args.launch, args.base_url, args.launch_log)
        try:
            with server:
                result = run_interference(args)
        except (RuntimeError, TimeoutError) as exc:
            print(f"server failed: {exc}\n{server.tail()}", file=sys.stderr)
            return 1
    else:
        result = run_interference(args)
    for t in result["ratios"]:
        rate = "inf" if t["offered_rate"] is None else f"{t['offered_rate']:g} req/s"
        print(f"\n### {result['isolated']['label']}: rate {rate}, concurrency "
              f"{t['max_concurrency']}, hog: {result['hog']}\n")
        print(ratio_table(t["rows"]))
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.result_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
