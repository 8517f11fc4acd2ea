"""blink.threads: role names, the policy file and its validation, applying it (with EPERM
injected), the probe, /proc telemetry, the Prometheus series, the Gthulhu export."""
from __future__ import annotations

import errno
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from blink.threads import gthulhu
from blink.threads.metrics import families
from blink.threads.policy import (
    ThreadPolicyError,
    apply_rule,
    format_cpus,
    load_policy,
    parse_cpus,
    policy_from_document,
    presets_dir,
    resolve_policy_path,
)
from blink.threads.roles import (
    MAX_NAME_BYTES,
    ROLES,
    get_thread_name,
    name_new_threads,
    role_label,
    role_of,
    set_thread_name,
    task_ids,
    task_name,
)
from blink.threads.runtime import ThreadPolicyRuntime
from blink.threads.syscalls import APPLIED, DENIED, UNSUPPORTED, Syscalls, predict, probe
from blink.threads.telemetry import (
    INTERACTIVE_RATIO,
    RoleStats,
    StepWaitMeter,
    by_role,
    delta,
    parse_schedstat,
    parse_status_switches,
    read_tasks,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    return p


def eperm(*args: object) -> None:
    raise OSError(errno.EPERM, "Operation not permitted")


def enosys(*args: object) -> None:
    raise OSError(errno.ENOSYS, "Function not implemented")


class Recorder(Syscalls):
    """Syscalls that only record what was asked (no thread is changed)."""

    def __init__(self, **overrides):
        super().__init__()
        self.calls: list[tuple] = []
        for name in ("setaffinity", "setpriority", "setscheduler", "set_slice", "ioprio_set"):
            setattr(self, name, overrides.get(name, self._record(name)))
        self.getscheduler = lambda tid: 0
        self.getpriority = lambda tid: 0

    def _record(self, name):
        return lambda *args: self.calls.append((name, *args))


# -- roles and names -----------------------------------------------------------------------

def test_every_role_name_fits_the_kernel_limit_and_is_unique():
    names = [r.name for r in ROLES]
    assert len(names) == len(set(names))
    for r in ROLES:
        assert len((r.name + ("99" if r.numbered else "")).encode()) <= MAX_NAME_BYTES
    assert role_of("blink-omp-3").name == "blink-omp-"
    assert role_label("blink-omp-3") == "blink-omp" and role_label("python") == "python"
    assert role_of("blink-omp-") is None and role_of("blink-looper") is None


@linux
def test_a_named_thread_has_that_comm_and_a_too_long_name_is_refused():
    seen = {}

    def run():
        set_thread_name("blink-tok-7")
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        seen["get"] = get_thread_name()
        with pytest.raises(ValueError, match="15 bytes"):
            set_thread_name("blink-much-too-long-name")

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == {"comm": "blink-tok-7", "get": "blink-tok-7"}


@linux
def test_threads_a_library_creates_are_named_as_workers_and_others_are_left_alone():
    release = threading.Event()
    out = {}

    def worker():
        release.wait(5)

    def creator():
        set_thread_name("blink-loop")
        before = task_ids()
        helpers = [threading.Thread(target=worker) for _ in range(2)]
        for h in helpers:
            h.start()  # they inherit "blink-loop", like OpenMP's team does
        time.sleep(0.05)
        out["named"] = name_new_threads(before, "blink-omp-", "blink-loop")
        out["names"] = sorted(task_name(t) for t in out["named"])
        release.set()
        for h in helpers:
            h.join()

    other = threading.Thread(target=lambda: (set_thread_name("blink-bs-peer"), release.wait(5)))
    other.start()  # started meanwhile under another name: not an OpenMP worker
    t = threading.Thread(target=creator)
    t.start()
    t.join()
    other.join()
    assert out["names"] == ["blink-omp-0", "blink-omp-1"]


@linux
def test_the_cpu_engine_names_its_loop_and_openmp_workers():
    from blink.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model="null", max_model_len=64, max_num_seqs=4,
                                 kv_cache_tokens=256, threads=2))
    try:
        engine.start()
        names = {task_name(t) for t in task_ids()}
        assert "blink-loop" in names
        assert any(n and re.fullmatch(r"blink-omp-\d+", n) for n in names), names
    finally:
        engine.close()


# -- the policy file -------------------------------------------------------------------------

def test_every_preset_is_valid_and_the_default_is_the_shipped_file():
    presets = sorted(presets_dir().glob("*.yaml"))
    assert {p.stem for p in presets} >= {"default", "pinned", "realtime"}
    for p in presets:
        load_policy(p, check_cpus=False)
    assert resolve_policy_path(None) == presets_dir() / "default.yaml"
    assert resolve_policy_path("default") == presets_dir() / "default.yaml"
    assert resolve_policy_path("pinned") == presets_dir() / "pinned.yaml"
    assert resolve_policy_path("off") is None
    with pytest.raises(ThreadPolicyError, match="no preset of that name"):
        resolve_policy_path("nosuchpreset")


def test_a_policy_parses_to_rules_with_their_settings(tmp_path):
    p = write(tmp_path, """\
description: test
threads:
  - match: '^blink-(loop|omp-[0-9]+)$'
    nice: -5
    slice_us: 2000
    cpus: 0
    ioprio: be:3
  - match: '^blink-http$'
    class: RR
    priority: 5
  - match: '^blink-threads$'
    class: idle
""")
    pol = load_policy(p)
    assert [r.line for r in pol.rules] == [3, 8, 11]
    loop = pol.rule_for("blink-omp-1")
    assert loop.settings() == [("cpus", "0"), ("nice", "-5"), ("slice", "2000us"), ("ioprio", "be:3")]
    assert pol.rule_for("blink-http").settings() == [("class", "RR:5")]
    assert pol.rule_for("blink-threads").sched_class == "IDLE"
    assert pol.rule_for("blink-serve") is None


@pytest.mark.parametrize("body, line, message", [
    ("threads:\n  - match: '^blink-loop$'\n    nice: -30\n", 3, r"nice must be an integer in \[-20, 19\]"),
    ("threads:\n  - match: '^blink-loop$'\n    nicee: 1\n", 3, "unknown key 'nicee'"),
    ("threads:\n  - match: '^nothing-here$'\n    nice: 1\n", 2, "matches no Blink thread role"),
    ("threads:\n  - match: '^blink-(loop$'\n    nice: 1\n", 2, "not a valid regex"),
    ("threads:\n  - match: '^blink-loop$'\n    cpus: 0-x\n", 3, "cpus: '0-x' is not a CPU"),
    ("threads:\n  - match: '^blink-loop$'\n    cpus: 4096\n", 3, "not available to this process"),
    ("threads:\n  - match: '^blink-loop$'\n    class: FIFO\n", 3, "needs 'priority:'"),
    ("threads:\n  - match: '^blink-loop$'\n    priority: 3\n", 3, "for class FIFO or RR only"),
    ("threads:\n  - match: '^blink-loop$'\n    class: FIFO\n    priority: 1\n    slice_us: 500\n",
     5, "slice_us .* is for class OTHER or BATCH"),
    ("threads:\n  - match: '^blink-loop$'\n    slice_us: 5\n", 3, r"slice_us must be an integer in \[100, 100000\]"),
    ("threads:\n  - match: '^blink-loop$'\n    ioprio: rt:9\n", 3, "ioprio must be"),
    ("threads:\n  - match: '^blink-loop$'\n", 2, "sets nothing"),
    ("threads:\n  - match: '^blink-loop$'\n    nice: 1\n    nice: 2\n", 4, "given twice"),
    ("thread:\n  - match: x\n", 1, "unknown key 'thread'"),
    ("threads: [\n", 2, "not valid YAML"),
    ("threads:\n  - match: '^blink-loop$'\n     nice: 1\n", 3, "not valid YAML"),
])
def test_a_bad_policy_is_refused_naming_its_line(tmp_path, body, line, message):
    p = write(tmp_path, body)
    with pytest.raises(ThreadPolicyError) as info:
        load_policy(p)
    text = str(info.value)
    assert text.startswith(f"{p}:{line}:"), text
    assert re.search(message, text), text


def test_realtime_for_a_busy_polling_role_needs_the_kernel_rt_bound():
    doc = {"threads": [{"match": "^blink-loop$", "class": "FIFO", "priority": 1,
                        "__line__": 2, "__lines__": {"class": 3}}]}
    with pytest.raises(ThreadPolicyError, match="busy-polling role.*blink-loop.*sched_rt_runtime_us = -1"):
        policy_from_document(doc, "p.yaml", rt_runtime_us=-1)
    assert policy_from_document(doc, "p.yaml", rt_runtime_us=950000).rules[0].sched_class == "FIFO"
    sleeper = {"threads": [{"match": "^blink-http$", "class": "RR", "priority": 2,
                            "__line__": 2, "__lines__": {}}]}
    policy_from_document(sleeper, "p.yaml", rt_runtime_us=-1)  # it sleeps: allowed


def test_cpu_lists_round_trip():
    assert parse_cpus("0-2,6") == {0, 1, 2, 6}
    assert format_cpus(parse_cpus("3,0-1,7,8")) == "0-1,3,7-8"
    for bad in ("", "1,,2", "3-1", "a"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


# -- applying, probing, the unprivileged path -----------------------------------------------

def _policy(tmp_path, text):
    return load_policy(write(tmp_path, text))


def test_apply_reports_each_setting_and_an_eperm_does_not_stop_the_others(tmp_path):
    pol = _policy(tmp_path, "threads:\n  - match: '^blink-loop$'\n    cpus: 0\n    nice: -5\n"
                            "    slice_us: 3000\n    ioprio: be:2\n")
    calls = Recorder(setpriority=eperm)
    results = apply_rule(pol.rules[0], 1234, "blink-loop", calls)
    assert [(r.setting, r.status) for r in results] == [
        ("cpus", APPLIED), ("nice", DENIED), ("slice", APPLIED), ("ioprio", APPLIED)]
    assert ("setaffinity", 1234, {0}) in calls.calls
    assert ("set_slice", 1234, 0, 0, 3_000_000) in calls.calls  # class and nice kept as they are
    assert ("ioprio_set", 1234, "be", 2) in calls.calls
    assert results[1].detail == "Operation not permitted"


def test_the_probe_says_denied_or_unsupported_from_injected_errors():
    calls = Recorder(setpriority=eperm, setscheduler=eperm, set_slice=enosys, ioprio_set=eperm)
    calls.getaffinity = lambda tid: {0}
    caps = probe(calls)
    assert caps.status == {"cpus": APPLIED, "nice": DENIED, "class": DENIED, "slice": UNSUPPORTED,
                           "ioprio": DENIED}
    assert predict(caps, "nice", "10") == APPLIED  # lowering needs no privilege
    assert predict(caps, "nice", "-10") == DENIED
    assert predict(caps, "class", "BATCH") == APPLIED and predict(caps, "class", "RR:3") == DENIED
    assert predict(caps, "slice", "1000us") == UNSUPPORTED


def test_a_slice_the_kernel_ignores_is_unsupported():
    calls = Recorder()
    calls.get_slice = lambda tid: 3_000_000  # not the 1 ms the probe asked for
    assert probe(calls).status["slice"] == UNSUPPORTED


@linux
def test_the_runtime_applies_to_threads_named_later_and_reports_them(tmp_path):
    pol = _policy(tmp_path, "threads:\n  - match: '^blink-tok-[0-9]+$'\n    nice: -3\n"
                            "  - match: '^blink-bs-peer$'\n    nice: 4\n")
    calls = Recorder(setpriority=eperm)
    calls.getaffinity = lambda tid: {0}
    rt = ThreadPolicyRuntime("frontend", pol, calls=calls, watch_interval_s=0.05).start()
    try:
        done = threading.Event()
        tids = []
        t = threading.Thread(target=lambda: (tids.append(threading.get_native_id()),
                                             set_thread_name("blink-tok-0"), done.wait(5)))
        t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(r.tid in tids for r in rt.results()):
            time.sleep(0.01)
        mine = [(r.comm, r.setting, r.value, r.status) for r in rt.results() if r.tid in tids]
        assert mine == [("blink-tok-0", "nice", "-3", DENIED)]
        summary = rt.settings_summary()  # other tests' pools may hold blink-tok threads too
        assert any(s["role"] == "blink-tok" and s["status"] == DENIED and s["threads"] >= 1
                   for s in summary)
        snap = rt.snapshot()
        assert snap["process"] == "frontend" and snap["capabilities"]["nice"] == DENIED
        assert any(r["role"] == "blink-tok" for r in snap["roles"])
        done.set()
        t.join()
    finally:
        rt.stop()


@linux
def test_applying_for_real_changes_this_threads_scheduling(tmp_path):
    pol = _policy(tmp_path, "threads:\n  - match: '^blink-bs-peer$'\n    nice: 7\n    slice_us: 2500\n"
                            f"    cpus: {min(os.sched_getaffinity(0))}\n")
    out = {}

    def run():
        set_thread_name("blink-bs-peer")
        tid = threading.get_native_id()
        out["results"] = apply_rule(pol.rules[0], tid, "blink-bs-peer", Syscalls())
        out["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        out["cpus"] = os.sched_getaffinity(tid)
        out["slice"] = Syscalls().get_slice(tid)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    statuses = {r.setting: r.status for r in out["results"]}
    assert statuses["nice"] == APPLIED and out["nice"] == 7
    assert out["cpus"] == {min(os.sched_getaffinity(0))}
    if statuses["slice"] == APPLIED:
        assert out["slice"] == 2_500_000


# -- telemetry -------------------------------------------------------------------------------

def test_proc_parsers():
    assert parse_schedstat("12 34 5\n") == (12, 34, 5)
    status = "Name:\tx\nvoluntary_ctxt_switches:\t17\nnonvoluntary_ctxt_switches:\t4\n"
    assert parse_status_switches(status) == (17, 4)
    with pytest.raises(ValueError):
        parse_schedstat("1 2")


@linux
def test_telemetry_of_real_threads_tells_a_sleeper_from_a_spinner():
    import subprocess

    # The spinner is a process of its own: a thread here would wait for the GIL (a voluntary
    # switch each time) whenever this busy test process's other threads hold it.
    spin = subprocess.Popen([sys.executable, "-c",
                             "from blink.threads.roles import set_thread_name\n"
                             "set_thread_name('blink-loop')\n"
                             "import sys; sys.stdout.write('up\\n'); sys.stdout.flush()\n"
                             "while True: pass\n"], stdout=subprocess.PIPE, text=True)
    stop = threading.Event()

    def sleeper():
        set_thread_name("blink-bs-peer")
        while not stop.wait(0.002):
            pass

    thread = threading.Thread(target=sleeper)
    try:
        assert spin.stdout.readline() == "up\n"
        spin_before = by_role(read_tasks(spin.pid))  # its start-up's switches do not count
        thread.start()
        time.sleep(0.6)
        # only this test's threads: earlier tests in this process may leave threads with these
        # names behind (idle OpenMP workers of an engine), which would blur the sums
        sleep_role = by_role([t for t in read_tasks() if t.tid == thread.native_id])[0]
        spin_role = delta(by_role(read_tasks(spin.pid)), spin_before)[0]
    finally:
        stop.set()
        spin.kill()
        spin.wait()
        if thread.is_alive():
            thread.join()
    assert (sleep_role.role, spin_role.role) == ("blink-bs-peer", "blink-loop")
    assert sleep_role.threads == spin_role.threads == 1
    assert sleep_role.runs > 20 and sleep_role.voluntary > 20
    assert sleep_role.interactive and sleep_role.voluntary_per_run >= INTERACTIVE_RATIO
    assert spin_role.cpu_ns > 0.1e9
    assert not spin_role.interactive  # it never gives the CPU up by itself


@linux
def test_the_step_wait_meter_counts_steps_into_buckets():
    meter = StepWaitMeter()
    assert meter.available
    for _ in range(3):
        meter.begin()
        sum(range(10000))
        meter.end()
    snap = meter.snapshot()
    assert snap["count"] == 3 and sum(snap["counts"]) == 3 and snap["sum"] >= 0
    # the file stays open, and it is the measuring thread's: another thread reads its own
    fd = meter._file[0]
    assert os.readlink(f"/proc/self/fd/{fd}").endswith(f"/task/{threading.get_native_id()}/schedstat")

    def elsewhere():
        meter.begin()
        meter.end()
        seen.append(os.readlink(f"/proc/self/fd/{meter._file[0]}"))

    seen: list[str] = []
    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert seen[0].endswith(f"/task/{worker.native_id}/schedstat") and meter.snapshot()["count"] == 4
    meter.close()
    assert meter._file is None


def test_prometheus_series_of_a_snapshot():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    snap = {"process": "engine", "policy": "default.yaml", "capabilities": {"nice": DENIED},
            "settings": [{"role": "blink-loop", "setting": "nice", "value": "-10",
                          "status": DENIED, "threads": 1}],
            "roles": [RoleStats("blink-loop", 1, 2_000_000_000, 500_000_000, 100, 10, 90).to_dict(),
                      RoleStats("blink-http", 1, 1, 1, 10, 9, 1).to_dict()],
            "step_wait": {"buckets": [0.001, 0.01], "counts": [2, 1, 1], "sum": 0.5, "count": 4}}

    class C(Collector):
        def collect(self):
            return families([snap])

    reg = CollectorRegistry()
    reg.register(C())
    text = generate_latest(reg).decode()
    assert ('blink:thread_policy_setting{process="engine",role="blink-loop",setting="nice",'
            'status="denied",value="-10"} 1.0') in text
    assert 'blink:thread_runqueue_wait_seconds_total{process="engine",role="blink-loop"} 0.5' in text
    assert 'blink:thread_interactive{process="engine",role="blink-http"} 1.0' in text
    assert 'blink:thread_interactive{process="engine",role="blink-loop"} 0.0' in text
    assert 'blink:engine_step_runqueue_wait_seconds_bucket{le="0.01",process="engine"} 3.0' in text
    assert 'blink:engine_step_runqueue_wait_seconds_count{process="engine"} 4.0' in text


def test_each_disaggregated_engine_gets_its_own_process_label(tmp_path, monkeypatch):
    """With --disaggregated each engine writes engine-<role>-<n>.json next to engine.json;
    the frontend's /metrics reads them all, labelled by file name, so series never collide."""
    import json

    from prometheus_client import CollectorRegistry, generate_latest

    from blink.threads.metrics import ThreadsCollector
    from blink.threads.runtime import SNAPSHOT_ENV, snapshot_sources

    role = RoleStats("blink-loop", 1, 1_000, 10, 5, 1, 4).to_dict()
    for name in ("engine-decode-0", "engine-prefill-1"):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"process": "engine", "policy": "off", "roles": [role]}))
    (tmp_path / "engine-broken-2.json").write_text("{half")  # being rewritten: skipped
    monkeypatch.setenv(SNAPSHOT_ENV, str(tmp_path / "engine.json"))
    reg = CollectorRegistry()
    reg.register(ThreadsCollector(snapshot_sources()))
    text = generate_latest(reg).decode()
    assert 'blink:thread_count{process="engine-decode-0",role="blink-loop"} 1.0' in text
    assert 'blink:thread_count{process="engine-prefill-1",role="blink-loop"} 1.0' in text
    assert 'process="engine"' not in text and "engine-broken" not in text


# -- Gthulhu ---------------------------------------------------------------------------------

#: the spec fields and types of Gthulhu's CRDs (gthulhu.io/v1alpha1; see blink.threads.gthulhu)
_GTHULHU_SPEC = {
    "NodeSchedulingPolicy": {"nodeNames": list, "nodeSelectors": list, "draSelectors": list,
                             "commandRegex": str, "priority": int, "executionTime": int},
    "SchedulingStrategy": {"strategyNamespace": str, "labelSelectors": list, "k8sNamespaces": list,
                           "commandRegex": str, "priority": int, "executionTime": int},
}


@pytest.mark.parametrize("kind", ["node", "pod"])
def test_the_gthulhu_export_follows_the_crd_schema(kind):
    pol = load_policy(presets_dir() / "default.yaml", check_cpus=False)
    text = gthulhu.export_yaml(pol, kind=kind, node_names=["gpu-node-1"], namespace="llm")
    docs = list(yaml.safe_load_all(text))
    assert docs, text
    for doc in docs:
        assert doc["apiVersion"] == "gthulhu.io/v1alpha1"
        fields = _GTHULHU_SPEC[doc["kind"]]
        assert set(doc["spec"]) <= set(fields), doc["spec"]
        for key, value in doc["spec"].items():
            assert isinstance(value, fields[key]), (key, value)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert doc["metadata"]["namespace"] == "llm"
        # the regex reaches Blink roles, the way Gthulhu matches comm
        assert any(re.search(doc["spec"]["commandRegex"], r.name + ("0" if r.numbered else ""))
                   for r in ROLES)
        assert doc["spec"]["priority"] in (0, 1)
    by_regex = {d["spec"]["commandRegex"]: d["spec"] for d in docs}
    loop = by_regex["^blink-(loop|omp-[0-9]+|kern-[0-9]+|hostloop)$"]
    assert loop["priority"] == 1 and "executionTime" not in loop
    http = by_regex["^blink-(http|tok-[0-9]+)$"]
    assert http["priority"] == 1 and http["executionTime"] == 1_000_000  # ns
    if kind == "node":
        assert all(d["spec"]["nodeNames"] == ["gpu-node-1"] for d in docs)
    else:
        assert all(d["spec"]["labelSelectors"] == [{"key": "app.kubernetes.io/name", "value": "blink"}]
                   for d in docs)
    assert "left out (no Gthulhu equivalent): ^blink-(threads|pwatch|eng-log|fe-log)$ nice=10" in text


def test_the_gthulhu_export_refuses_regex_go_cannot_read(tmp_path):
    pol = _policy(tmp_path, "threads:\n  - match: '^blink-(?!loop)http$'\n    nice: -1\n")
    with pytest.raises(ThreadPolicyError, match="RE2"):
        gthulhu.export(pol, node_names=["n"])


def test_the_docs_list_every_role():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "threads.md").read_text()
    for r in ROLES:
        assert f"| `{r.name}{'N' if r.numbered else ''}` | {r.process} |" in doc, r.name


def test_the_autogroup_setting_is_validated_and_reported(tmp_path):
    from blink.threads.policy import apply_autogroup

    pol = _policy(tmp_path, "autogroup:\n  engine: -7\nthreads:\n  - match: '^blink-loop$'\n    nice: 1\n")
    assert pol.autogroup == {"engine": -7}
    for bad, msg in (("autogroup:\n  gpu: 1\n", "unknown process 'gpu'"),
                     ("autogroup:\n  engine: -40\n", r"must be a nice value in \[-20, 19\]")):
        with pytest.raises(ThreadPolicyError, match=msg):
            _policy(tmp_path, bad + "threads:\n  - match: '^blink-loop$'\n    nice: 1\n")
    seen = []
    calls = Recorder()
    calls.autogroup_enabled = lambda: 1
    calls.set_autogroup = seen.append
    assert apply_autogroup(-7, calls).status == APPLIED and seen == [-7]
    calls.set_autogroup = eperm
    assert apply_autogroup(-7, calls).status == DENIED
    calls.autogroup_enabled = lambda: 0
    assert apply_autogroup(-7, calls).status == UNSUPPORTED


@linux
def test_the_thread_policy_command_checks_reports_and_exports():
    import io

    from blink.cli import parse_args
    from blink.threads.command import run_thread_policy_command

    out = io.StringIO()
    assert run_thread_policy_command(parse_args(["thread-policy", "default"]), out) == 0
    text = out.getvalue()
    assert "default.yaml: valid." in text and "this host allows (privileged forms)" in text
    assert re.search(r"line \d+: \^blink-\(loop\|omp-\[0-9\]\+\|kern-\[0-9\]\+\|hostloop\)\$ -> roles blink-loop, "
                     r"blink-omp-N, blink-kern-N, blink-hostloop: nice=-10 \((applied|denied)\)", text), text

    out = io.StringIO()
    args = parse_args(["thread-policy", "--report", "--pid", str(os.getpid())])
    assert run_thread_policy_command(args, out) == 0
    assert "| role | threads | CPU s | run-queue wait s |" in out.getvalue()

    out = io.StringIO()
    args = parse_args(["thread-policy", "pinned", "--export", "gthulhu", "--node", "n1"])
    assert run_thread_policy_command(args, out) == 0
    kinds = {d["kind"] for d in yaml.safe_load_all(out.getvalue())}
    assert kinds == {"NodeSchedulingPolicy"}
