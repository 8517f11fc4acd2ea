"""One process's thread policy at run time: applied to the threads that exist at start, to
each thread Blink names (at its creation point, through :func:`blink.threads.roles.on_thread_named`),
and by a watcher (``blink-threads``, every 0.5 s: a listdir and a few small reads) to any
other new thread or a thread whose name changed.

The reports (one per setting per thread: applied / denied / unsupported) go to the start
log once per (role, setting, status), and with the per-role telemetry and the engine loop's
per-step run-queue wait into :meth:`ThreadPolicyRuntime.snapshot`. The frontend's
``/metrics`` reads its own process's snapshot directly, and the engine's from the file
``$BLINK_THREADS_SNAPSHOT`` that ``blink serve`` hands both children (the engine's watcher
rewrites it, atomically, every second). A split deployment (``blink engine`` on another host)
has no such file: there ``blink thread-policy --report`` reads the engine's threads.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from blink import env as blink_env
from blink.threads.policy import SettingResult, ThreadPolicy, apply_autogroup, apply_rule
from blink.threads.roles import on_thread_named, role_label, set_thread_name, task_ids, task_name
from blink.threads.syscalls import Capabilities, Syscalls, probe
from blink.threads.telemetry import StepWaitMeter, by_role, read_tasks

log = logging.getLogger("blink.threads")

#: the file ``blink serve`` names for the engine's thread snapshot (read by the frontend)
SNAPSHOT_ENV = "BLINK_THREADS_SNAPSHOT"
WATCH_INTERVAL_S = 0.5
SNAPSHOT_INTERVAL_S = 1.0


class ThreadPolicyRuntime:
    """Applies ``policy`` (None: no policy, telemetry only) to the threads of this process."""

    def __init__(self, process: str, policy: ThreadPolicy | None, *,
                 calls: Syscalls | None = None, snapshot_path: str | os.PathLike | None = None,
                 watch_interval_s: float = WATCH_INTERVAL_S) -> None:
        self.process = process
        self.policy = policy
        self.calls = calls or Syscalls()
        self.snapshot_path = Path(snapshot_path) if snapshot_path else None
        self.watch_interval_s = watch_interval_s
        self.capabilities: Capabilities | None = None
        #: tid -> (name it had when the policy was applied, results)
        self._applied: dict[int, tuple[str, list[SettingResult]]] = {}
        self._logged: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._remove_hook = None
        self._autogroup: SettingResult | None = None
        #: the engine loop's per-step run-queue wait (set by the engine; None elsewhere)
        self.step_wait: StepWaitMeter | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> "ThreadPolicyRuntime":
        """Probe, apply to every current thread, log, start the watcher."""
        if self.policy is not None:
            self.capabilities = probe(self.calls)
            log.info("thread policy %s (%s): this host allows (privileged forms) %s", self.policy.source,
                     self.process, self.capabilities.summary())
        else:
            log.info("thread policy off (%s): threads keep the default scheduling", self.process)
        if self.policy is not None and self.process in self.policy.autogroup:
            self._autogroup = apply_autogroup(self.policy.autogroup[self.process], self.calls)
            r = self._autogroup
            log.log(logging.INFO if r.status == "applied" else logging.WARNING,
                    "thread policy: %s autogroup nice=%s %s%s", self.process, r.value, r.status,
                    f" ({r.detail})" if r.detail else "")
        self.scan()
        self._remove_hook = on_thread_named(lambda tid, name: self.apply(tid, name))
        self._thread = threading.Thread(target=self._watch, name="blink-threads", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._remove_hook is not None:
            self._remove_hook()
        if self._thread is not None:
            self._thread.join(2.0)

    def _watch(self) -> None:
        set_thread_name("blink-threads")
        last_snapshot = 0.0
        while not self._stop.wait(self.watch_interval_s):
            try:
                self.scan()
                now = time.monotonic()
                if self.snapshot_path is not None and now - last_snapshot >= SNAPSHOT_INTERVAL_S:
                    self.write_snapshot()
                    last_snapshot = now
            except Exception:  # noqa: BLE001 - telemetry must never take the process down
                log.exception("thread policy watcher")

    # -- applying ------------------------------------------------------------------------

    def scan(self) -> None:
        """Apply the policy to threads not seen before (or renamed since); forget gone ones."""
        live = set(task_ids())
        with self._lock:
            for tid in list(self._applied):
                if tid not in live:
                    del self._applied[tid]
        for tid in live:
            name = task_name(tid)
            if name is None:
                continue
            seen = self._applied.get(tid)
            if seen is None or seen[0] != name:
                self.apply(tid, name)

    def apply(self, tid: int, name: str) -> list[SettingResult]:
        """Apply the first matching rule to one thread (nothing if none matches)."""
        rule = self.policy.rule_for(name) if self.policy is not None else None
        results = apply_rule(rule, tid, name, self.calls, self.capabilities) if rule else []
        with self._lock:
            self._applied[tid] = (name, results)
        for r in results:
            key = (role_label(r.comm), r.setting, r.status)
            if key not in self._logged:
                self._logged.add(key)
                level = logging.INFO if r.status == "applied" else logging.WARNING
                log.log(level, "thread policy: %s %s=%s %s%s", key[0], r.setting, r.value,
                        r.status, f" ({r.detail})" if r.detail else "")
        return results

    def results(self) -> list[SettingResult]:
        with self._lock:
            out = [r for _, results in self._applied.values() for r in results]
        return out + ([self._autogroup] if self._autogroup is not None else [])

    # -- reports -------------------------------------------------------------------------

    def settings_summary(self) -> list[dict[str, Any]]:
        """(role, setting, value, status) -> number of threads, for /metrics."""
        counts: dict[tuple[str, str, str, str], int] = {}
        for r in self.results():
            key = (role_label(r.comm), r.setting, r.value, r.status)
            counts[key] = counts.get(key, 0) + 1
        return [{"role": k[0], "setting": k[1], "value": k[2], "status": k[3], "threads": n}
                for k, n in sorted(counts.items())]

    def snapshot(self) -> dict[str, Any]:
        """Everything /metrics shows about this process's threads (JSON-able)."""
        return {
            "process": self.process,
            "pid": os.getpid(),
            "policy": self.policy.source if self.policy is not None else "off",
            "capabilities": dict(self.capabilities.status) if self.capabilities else {},
            "settings": self.settings_summary(),
            "roles": [r.to_dict() for r in by_role(read_tasks())],
            "step_wait": self.step_wait.snapshot() if self.step_wait is not None else None,
            "time": time.time(),
        }

    def write_snapshot(self) -> None:
        """Write :meth:`snapshot` to ``snapshot_path`` atomically (rename over)."""
        assert self.snapshot_path is not None
        tmp = self.snapshot_path.with_name(self.snapshot_path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self.snapshot_path)


def read_snapshot(path: str | os.PathLike) -> dict[str, Any] | None:
    """Another process's snapshot file, or None if it is missing or half-written."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


#: this process's runtime (one per process), for the engine and /metrics to find
_current: ThreadPolicyRuntime | None = None


def load_thread_policy(policy_arg: str | None) -> ThreadPolicy | None:
    """``--thread-policy`` (``off``, ``default``/None, a preset name or a file) -> the
    validated policy, or None for ``off``. A bad file raises
    :class:`~blink.threads.policy.ThreadPolicyError` naming the line: call it first thing."""
    from blink.threads.policy import load_policy, resolve_policy_path

    path = resolve_policy_path(policy_arg)
    return load_policy(path) if path is not None else None


def start_thread_policy(process: str, policy: ThreadPolicy | None, *,
                        snapshot_path: str | os.PathLike | None = None) -> ThreadPolicyRuntime:
    """Start this process's runtime (one per process) for a policy from
    :func:`load_thread_policy`."""
    global _current
    runtime = ThreadPolicyRuntime(process, policy, snapshot_path=snapshot_path)
    _current = runtime.start()
    return runtime


def current_runtime() -> ThreadPolicyRuntime | None:
    """The runtime :func:`start_thread_policy` started in this process, if any."""
    return _current


def snapshot_sources() -> list:
    """What a frontend's ``/metrics`` shows about threads: this process's runtime (when one
    runs) and the engine's snapshot file (when ``blink serve`` named one), read at scrape."""
    path = blink_env.get(SNAPSHOT_ENV)

    def own() -> dict[str, Any] | None:
        runtime = current_runtime()
        return runtime.snapshot() if runtime is not None else None

    def engines() -> list[dict[str, Any]]:
        """engine.json, or with --disaggregated one engine-<role>-<n>.json per engine, each
        labelled by its file's name so two engines' series never collide."""
        if not path:
            return []
        snaps = []
        for file in sorted(Path(path).parent.glob("engine*.json")):
            snap = read_snapshot(file)
            if snap is not None:
                if file.stem != "engine":
                    snap["process"] = file.stem
                snaps.append(snap)
        return snaps

    return [own, engines]
