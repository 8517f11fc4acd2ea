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
import tempfile
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

    def __init__(self, kind: str = "auto", workers: int | None = None,
                 cpus: str | None = None) -> None:
        #: pin the hog to these CPUs (``taskset -c``); None: every core, unpinned
        self.cpus = cpus
        default = len(_cpu_list(cpus)) if cpus else (os.cpu_count() or 1)
        self.workers = workers or default
        if kind == "auto":
            kind = "stress-ng" if shutil.which("stress-ng") else "python"
        if kind == "stress-ng" and not shutil.which("stress-ng"):
            raise SystemExit("stress-ng is not installed (apt-get install -y stress-ng), "
                             "or use --hog python")
        self.kind = kind
        self._procs: list[subprocess.Popen] = []

    def describe(self) -> str:
        pin = f" pinned to CPU {self.cpus}" if self.cpus else ""
        if self.kind == "stress-ng":
            return f"stress-ng --cpu {self.workers} (all methods){pin}"
        return f"{self.workers} python/numpy busy processes{pin}"

    def start(self) -> None:
        pin = ["taskset", "-c", self.cpus] if self.cpus else []
        if self.kind == "stress-ng":
            cmd = [*pin, "stress-ng", "--cpu", str(self.workers), "--cpu-method", "all",
                   "--timeout", "0", "--quiet"]
            self._procs = [subprocess.Popen(cmd, start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        else:
            self._procs = [subprocess.Popen([*pin, sys.executable, "-c", _PY_HOG],
                                            start_new_session=True,
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


def _cpu_list(text: str) -> list[int]:
    from blink.threads.policy import parse_cpus

    return sorted(parse_cpus(text))


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


# -- the A/B: several server configurations x {quiet, hog on every core, hog on the frontend's
# cores}, repeated, with paired ratios and their spread ------------------------------------

#: condition name -> (hog on which CPUs: None = no hog, "all" = unpinned on every core)
CONDITIONS = ("quiet", "hog-all", "hog-frontend")
#: (metric, label, kind) of the A/B table
AB_METRICS = [("output_throughput", "output tok/s", "tput"), ("ttft_ms.p99", "P99 TTFT ms", "lat"),
              ("tpot_ms.p99", "P99 TPOT ms", "lat")]


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, var ** 0.5


def _autogroup_nice(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _autogroup_id(pid: int) -> str | None:
    """``/autogroup-N`` of a process (processes of one session share it)."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return None


def level_autogroups(pids: list[int], nice: int) -> None:
    """Put these processes' autogroups (their sessions' scheduling groups) at ``nice``: with
    autogroup on, a session's weight against other sessions comes from its autogroup's nice,
    not from its threads' nice (which the harness's ``nice -n 15`` sets)."""
    for pid in pids:
        if _autogroup_nice(pid) is None:
            continue
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        except OSError:
            pass


def _policy_autogroup(command: str) -> set[str]:
    """The processes whose autogroup the ``--thread-policy`` file in ``command`` sets."""
    import yaml

    argv = shlex.split(command)
    if "--thread-policy" not in argv:
        return set()
    path = argv[argv.index("--thread-policy") + 1]
    try:
        return set((yaml.safe_load(Path(path).read_text()) or {}).get("autogroup") or {})
    except OSError:
        return set()


def _tree(root: int) -> list[int]:
    from blink.supervision import child_processes

    return [root, *child_processes(root, recursive=True)]


def _blink_processes(root: int) -> dict[str, int]:
    """The engine and frontend processes under a launched ``blink serve`` (by main-thread
    name), for thread telemetry; empty for other servers."""
    from blink.supervision import child_processes
    from blink.threads.roles import task_name

    out = {}
    for pid in [root, *child_processes(root, recursive=True)]:
        name = task_name(pid, pid)
        if name in ("blink-engine", "blink-http"):
            out["engine" if name == "blink-engine" else "frontend"] = pid
    return out


def _thread_roles(pids: dict[str, int]) -> dict[str, list]:
    from blink.threads.telemetry import process_roles

    return {proc: process_roles(pid) for proc, pid in pids.items()}


def _roles_delta(after: dict[str, list], before: dict[str, list]) -> dict[str, list[dict]]:
    from blink.threads.telemetry import delta

    return {proc: [r.to_dict() for r in delta(after[proc], before.get(proc, []))]
            for proc in after}


def shifted_policy(policy: str, shift: int, out_dir: str) -> str:
    """A copy of thread policy ``policy`` (file or preset) with every ``nice`` raised by
    ``shift`` (clamped to 19). Scheduler weights depend only on nice *differences*, so a
    policy's nice -10 against a hog at nice 0 is the same contest as nice 5 against a hog at
    nice 15: this lets the A/B run at ``nice -n 15`` (a shared machine) and still measure the
    shipped policy's real advantage."""
    import yaml

    from blink.threads.policy import resolve_policy_path

    path = resolve_policy_path(policy)
    if path is None:
        return policy
    doc = yaml.safe_load(path.read_text())
    for rule in doc.get("threads", []):
        if "nice" in rule:
            rule["nice"] = max(-20, min(19, int(rule["nice"]) + shift))
    for proc, nice in (doc.get("autogroup") or {}).items():
        doc["autogroup"][proc] = max(-20, min(19, int(nice) + shift))
    out = Path(out_dir) / f"{path.stem}-nice{shift:+d}.yaml"
    out.write_text(f"# {path} with every nice {shift:+d} (benchmarks.interference --nice-base)\n"
                   + yaml.safe_dump(doc, sort_keys=False))
    return str(out)


def _shift_policies(command: str, shift: int, out_dir: str) -> str:
    """``command`` with its ``--thread-policy P`` (default: the shipped one, for a blink
    serve) replaced by :func:`shifted_policy`."""
    argv = shlex.split(command)
    if not any(a.endswith("blink") or a == "blink" for a in argv) or "serve" not in argv:
        return command  # not Blink: nothing to shift
    if "--thread-policy" in argv:
        i = argv.index("--thread-policy")
        argv[i + 1] = shifted_policy(argv[i + 1], shift, out_dir)
    else:
        argv += ["--thread-policy", shifted_policy("default", shift, out_dir)]
    return shlex.join(argv)


def run_ab(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Every ``--arm`` server x every condition x ``--repeats``, conditions interleaved within
    a repeat (quiet first) so that each interfered run has its own quiet reference taken
    minutes, not an hour, apart. Ratios are per repeat (interfered / that repeat's quiet),
    then averaged with their standard deviation."""
    arms = []
    for spec in args.arm:
        name, sep, command = spec.partition("=")
        if not sep or not command.strip():
            raise SystemExit(f"--arm {spec!r}: expected NAME=COMMAND")
        command = command.strip()
        if args.nice_base:
            command = _shift_policies(command, args.nice_base, tempfile.mkdtemp(prefix="blink-ab-"))
        arms.append((name.strip(), command))
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    for c in conditions:
        if c not in CONDITIONS:
            raise SystemExit(f"--conditions: unknown {c!r} (known: {', '.join(CONDITIONS)})")
    result: dict[str, Any] = {"arms": [], "conditions": conditions, "repeats": args.repeats,
                              "frontend_cpus": args.frontend_cpus, "started": time.time(),
                              "nice": os.getpriority(os.PRIO_PROCESS, 0),
                              "nice_base": args.nice_base}
    for name, command in arms:
        base_url = base_url_from_command(command) or args.base_url
        arm: dict[str, Any] = {"name": name, "command": command, "runs": []}
        log(f"== arm {name}: {command}")
        # cwd outside the checkout: its kernels/ folder would shadow a peer's `kernels` import
        server = LaunchedServer(command, base_url, f"{args.launch_log}.{name}",
                                ready_timeout_s=args.ready_timeout, cwd=tempfile.gettempdir())
        try:
            with server:
                assert server.proc is not None
                procs = _blink_processes(server.proc.pid)
                if args.nice_base:  # but not the sessions the arm's policy sets itself
                    mine = {_autogroup_id(pid) for proc, pid in procs.items()
                            if proc in _policy_autogroup(command)}
                    level_autogroups([p for p in _tree(server.proc.pid)
                                      if _autogroup_id(p) not in mine], args.nice_base)
                for rep in range(args.repeats):
                    for cond in conditions:
                        hog = None if cond == "quiet" else Hog(
                            args.hog, args.hog_workers if cond == "hog-all" else None,
                            None if cond == "hog-all" else args.frontend_cpus)
                        run = {"repeat": rep, "condition": cond,
                               "hog": hog.describe() if hog else None}
                        if hog is not None:
                            hog.start()
                            if args.nice_base:  # the hog's session as low as the servers'
                                time.sleep(0.2)
                                level_autogroups([q for p in hog._procs for q in _tree(p.pid)],
                                                 args.nice_base)
                        try:
                            if hog is not None:
                                time.sleep(args.settle)
                            run["load_before"] = os.getloadavg()[0]
                            before = _thread_roles(procs)
                            args.base_url, args.label, args.condition = base_url, name, cond
                            log(f"[{name} {rep + 1}/{args.repeats}] {cond}"
                                + (f" ({hog.describe()})" if hog else "")
                                + f", load {run['load_before']:.2f}")
                            metrics = run_benchmark(args, log=log)["runs"][0]
                            run["threads"] = _roles_delta(_thread_roles(procs), before)
                            run["load_after"] = os.getloadavg()[0]
                        finally:
                            if hog is not None:
                                hog.stop()
                        run["metrics"] = {k: _get(metrics, k) for k, _, _ in COMPARED}
                        arm["runs"].append(run)
                        if hog is not None:
                            time.sleep(args.cooldown)
        except (RuntimeError, TimeoutError) as exc:
            arm["error"] = f"{exc}\n{server.tail()}"
            log(f"arm {name} failed: {exc}\n{server.tail()}")
        except KeyboardInterrupt:  # keep what was measured: summarize and report it
            arm["error"] = result["interrupted"] = "interrupted"
        arm["summary"] = summarize_arm(arm["runs"], conditions)
        result["arms"].append(arm)
        if result.get("interrupted"):
            break
    return result


def summarize_arm(runs: list[dict[str, Any]], conditions: list[str]) -> dict[str, Any]:
    """Per condition: mean/std of each metric, and of its per-repeat ratio to the quiet run."""
    quiet = {r["repeat"]: r["metrics"] for r in runs if r["condition"] == "quiet"}
    out: dict[str, Any] = {}
    for cond in conditions:
        rows = [r for r in runs if r["condition"] == cond]
        entry: dict[str, Any] = {"n": len(rows),
                                 "load": [min((r["load_before"] for r in rows), default=None),
                                          max((r["load_after"] for r in rows), default=None)]}
        for key, _, _ in AB_METRICS:
            values = [r["metrics"][key] for r in rows if r["metrics"].get(key) is not None]
            ratios_ = [r["metrics"][key] / quiet[r["repeat"]][key] for r in rows
                       if r["metrics"].get(key) and r["repeat"] in quiet and quiet[r["repeat"]].get(key)]
            entry[key] = {"mean_std": _mean_std(values), "ratio_mean_std": _mean_std(ratios_),
                          "ratio_min_max": [min(ratios_), max(ratios_)] if ratios_ else None}
        out[cond] = entry
    return out


def ab_table(result: dict[str, Any]) -> str:
    """One row per arm and condition: each metric as mean ± std, and its ratio to the quiet
    run of the same repeat as mean ± std [min, max]."""
    head = "| arm | condition | n | load (1-min) | " + " | ".join(
        f"{label} | {'retention' if kind == 'tput' else 'x quiet'}" for _, label, kind in AB_METRICS) + " |"
    lines = [head, "|" + "---|" * (4 + 2 * len(AB_METRICS))]
    for arm in result["arms"]:
        for cond, e in arm["summary"].items():
            load = e["load"]
            cells = [arm["name"], cond, str(e["n"]),
                     "-" if load[0] is None else f"{load[0]:.1f}-{load[1]:.1f}"]
            for key, _, _ in AB_METRICS:
                m, sd = e[key]["mean_std"]
                rm, rsd = e[key]["ratio_mean_std"]
                mm = e[key]["ratio_min_max"]
                cells.append(f"{m:.0f} ± {sd:.0f}" if m == m else "-")
                cells.append("-" if cond == "quiet" or rm != rm else
                             f"{rm:.2f} ± {rsd:.2f} [{mm[0]:.2f}, {mm[1]:.2f}]")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ab_thread_report(result: dict[str, Any]) -> str:
    """Per arm, the per-role thread telemetry of its last hog-all run (Gthulhu's class)."""
    from blink.threads.telemetry import RoleStats, report_table

    out = []
    for arm in result["arms"]:
        runs = [r for r in arm["runs"] if r["condition"] == "hog-all" and r.get("threads")]
        if not runs:
            continue
        last = runs[-1]
        for proc, roles in sorted(last["threads"].items()):
            stats = [RoleStats.from_dict(r) for r in roles if r["runs"] > 0]
            out.append(report_table(stats, f"\n#### {arm['name']}: {proc} threads during its last "
                                           f"hog-all run\n"))
    return "\n".join(out)


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
                        "averaged. With --arm: repeats of every condition, ratios per repeat "
                        "with their spread")
    ab = ap.add_argument_group("A/B (--arm): server configurations x conditions x repeats")
    ab.add_argument("--arm", action="append", default=None, metavar="NAME=COMMAND",
                    help="a server to start (like --launch, its --port sets the URL); repeat "
                         "for each configuration, e.g. --arm 'policy=blink serve --port 8840' "
                         "--arm 'off=blink serve --port 8841 --thread-policy off'. Env vars: "
                         "'NAME=env OMP_WAIT_POLICY=PASSIVE blink serve ...'")
    ab.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="quiet (no hog), hog-all (stress-ng on every core), hog-frontend "
                         "(stress-ng pinned to --frontend-cpus)")
    ab.add_argument("--frontend-cpus", default="0",
                    help="CPUs the frontend runs on, where hog-frontend pins the hog")
    ab.add_argument("--cooldown", type=float, default=2.0,
                    help="seconds after a hog stops before the next run")
    ab.add_argument("--ready-timeout", type=float, default=900.0)
    ab.add_argument("--nice-base", type=int, default=0,
                    help="the nice this harness runs at (e.g. 15 under 'nice -n 15'; the hog "
                         "and the servers inherit it): every Blink arm's thread policy gets "
                         "its nice values (threads and autogroups) shifted by it, and the "
                         "hog's and the servers' autogroups are put at it, so the gap between "
                         "Blink and the hog is the policy's while everything stays below the "
                         "other users of the machine")
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
    # Started in the background (cmd &), a shell leaves SIGINT ignored: Ctrl-C / kill -INT
    # must still stop the hog and the servers through their context managers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.arm:
        result = run_ab(args)
        print(f"\n### A/B, {args.repeats} repeats, concurrency {args.max_concurrency}, "
              f"{args.num_prompts} prompts {args.random_input_len}/{args.random_output_len}, "
              f"{os.cpu_count()} CPUs\n")
        print(ab_table(result))
        print(ab_thread_report(result))
        if args.result_json:
            Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.result_json).write_text(json.dumps(result, indent=2))
            print(f"\nwrote {args.result_json}")
        return 0
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
