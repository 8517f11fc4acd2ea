"""The Prometheus series of thread snapshots (:meth:`ThreadPolicyRuntime.snapshot`), one
``process`` label per Blink process (``frontend``, ``engine``):

- ``blink:thread_policy_setting{process,role,setting,value,status}``: threads of the role for
  which the setting was applied / denied / unsupported
- ``blink:thread_policy_capability{process,setting,status}``: the start-up probe (1 per setting)
- ``blink:thread_cpu_seconds_total{process,role}``, ``blink:thread_runqueue_wait_seconds_total``,
  ``blink:thread_runs_total``, ``blink:thread_context_switches_total{...,kind}``
  (voluntary/involuntary), ``blink:thread_count``, ``blink:thread_interactive`` (Gthulhu's
  classification: voluntary switches per run >= 0.5)
- ``blink:engine_step_runqueue_wait_seconds`` (histogram): the engine loop's run-queue wait
  per step
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from blink.threads.telemetry import RoleStats


def families(snapshots: list[dict[str, Any]]) -> list[Metric]:
    """The metric families of one or more process snapshots."""
    setting = GaugeMetricFamily(
        "blink:thread_policy_setting",
        "Threads of a role for which a thread-policy setting was applied, denied (EPERM) or "
        "unsupported.", labels=["process", "role", "setting", "value", "status"])
    capability = GaugeMetricFamily(
        "blink:thread_policy_capability",
        "What the start-up probe found this process may set (1 per setting and status).",
        labels=["process", "setting", "status"])
    policy = GaugeMetricFamily("blink:thread_policy_info", "The thread policy in force.",
                               labels=["process", "policy"])
    count = GaugeMetricFamily("blink:thread_count", "Threads of a role.", labels=["process", "role"])
    cpu = CounterMetricFamily("blink:thread_cpu_seconds", "CPU time of a role's threads.",
                              labels=["process", "role"])
    wait = CounterMetricFamily(
        "blink:thread_runqueue_wait_seconds",
        "Time a role's threads were runnable but waiting for a CPU (schedstat).",
        labels=["process", "role"])
    runs = CounterMetricFamily("blink:thread_runs", "Times a role's threads were put on a CPU.",
                               labels=["process", "role"])
    switches = CounterMetricFamily("blink:thread_context_switches",
                                   "Context switches of a role's threads.",
                                   labels=["process", "role", "kind"])
    interactive = GaugeMetricFamily(
        "blink:thread_interactive",
        "1 if the role is interactive the way Gthulhu classifies tasks (voluntary context "
        "switches per run >= 0.5), else 0.", labels=["process", "role"])
    out: list[Metric] = [policy, setting, capability, count, cpu, wait, runs, switches, interactive]
    for snap in snapshots:
        proc = str(snap.get("process", "?"))
        policy.add_metric([proc, str(snap.get("policy", "off"))], 1)
        for s in snap.get("settings", []):
            setting.add_metric([proc, s["role"], s["setting"], s["value"], s["status"]], s["threads"])
        for name, status in sorted(snap.get("capabilities", {}).items()):
            capability.add_metric([proc, name, status], 1)
        for raw in snap.get("roles", []):
            r = RoleStats.from_dict(raw)
            labels = [proc, r.role]
            count.add_metric(labels, r.threads)
            cpu.add_metric(labels, r.cpu_ns / 1e9)
            wait.add_metric(labels, r.wait_ns / 1e9)
            runs.add_metric(labels, r.runs)
            switches.add_metric(labels + ["voluntary"], r.voluntary)
            switches.add_metric(labels + ["involuntary"], r.involuntary)
            interactive.add_metric(labels, 1 if r.interactive else 0)
        step = snap.get("step_wait")
        if step:
            hist = HistogramMetricFamily(
                "blink:engine_step_runqueue_wait_seconds",
                "Run-queue wait of the engine loop thread per engine step.", labels=["process"])
            cumulative, buckets = 0, []
            for bound, n in zip(step["buckets"], step["counts"]):
                cumulative += n
                buckets.append((repr(float(bound)), cumulative))
            buckets.append(("+Inf", cumulative + step["counts"][-1]))
            hist.add_metric([proc], buckets, step["sum"])
            out.append(hist)
    return out


class ThreadsCollector(Collector):
    """Collects the snapshots ``sources`` return at scrape time (None entries are skipped:
    an engine whose snapshot file is not there yet; a list is several engines')."""

    def __init__(self, sources: list[Callable[[], Any]]) -> None:
        self._sources = sources  # each returns a snapshot, a list of them, or None

    def collect(self) -> Iterator[Metric]:
        snaps: list[dict[str, Any]] = []
        for got in (src() for src in self._sources):
            if isinstance(got, list):
                snaps.extend(got)
            elif got is not None:
                snaps.append(got)
        if snaps:
            yield from families(snaps)
