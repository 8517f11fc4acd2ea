"""Per-thread scheduling telemetry from /proc: run-queue wait, context switches, CPU time.

``/proc/PID/task/TID/schedstat`` holds three numbers: nanoseconds on the CPU, nanoseconds
waiting on a run queue (runnable but not running: what CPU interference costs), and the
number of times the thread was put on a CPU ("runs"). ``/proc/PID/task/TID/status`` holds
``voluntary_ctxt_switches`` (the thread blocked or slept) and ``nonvoluntary_ctxt_switches``
(it was preempted). Gthulhu calls a task *interactive* when it gives the CPU up by itself
often: voluntary switches per run >= 0.5 (:data:`INTERACTIVE_RATIO`).

:class:`StepWaitMeter` measures the engine loop's own run-queue wait per step (two reads of
``/proc/thread-self/schedstat``, the file kept open: ~1 us a step).
"""
from __future__ import annotations

import bisect
import os
import threading
from dataclasses import dataclass, field

from blink.threads.roles import role_label, task_ids, task_name

#: Gthulhu's threshold: voluntary context switches per run at or above it = interactive
INTERACTIVE_RATIO = 0.5
#: buckets (seconds) of the per-step run-queue wait histogram
STEP_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0)


@dataclass(frozen=True)
class TaskStats:
    """One thread's counters (cumulative since it started)."""

    tid: int
    comm: str
    cpu_ns: int
    wait_ns: int
    runs: int
    voluntary: int
    involuntary: int

    @property
    def role(self) -> str:
        return role_label(self.comm)


def parse_schedstat(text: str) -> tuple[int, int, int]:
    """``"cpu_ns wait_ns runs"`` -> the three ints."""
    parts = text.split()
    if len(parts) < 3:
        raise ValueError(f"unexpected schedstat line {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def parse_status_switches(text: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches from a ``/proc/.../status`` text."""
    vol = invol = 0
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            vol = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            invol = int(line.split()[1])
    return vol, invol


def read_task(tid: int, pid: int | str = "self") -> TaskStats | None:
    """A thread's counters, or None if it is gone (or schedstat is not compiled in)."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/schedstat") as f:
            cpu, wait, runs = parse_schedstat(f.read())
        with open(f"{base}/status") as f:
            vol, invol = parse_status_switches(f.read())
    except (OSError, ValueError):
        return None
    comm = task_name(tid, pid)
    if comm is None:
        return None
    return TaskStats(tid, comm, cpu, wait, runs, vol, invol)


def read_tasks(pid: int | str = "self") -> list[TaskStats]:
    """Counters of every thread of a process."""
    out = []
    for tid in task_ids(pid):
        stats = read_task(tid, pid)
        if stats is not None:
            out.append(stats)
    return out


@dataclass
class RoleStats:
    """The threads of one role added up."""

    role: str
    threads: int = 0
    cpu_ns: int = 0
    wait_ns: int = 0
    runs: int = 0
    voluntary: int = 0
    involuntary: int = 0

    @property
    def voluntary_per_run(self) -> float:
        return self.voluntary / self.runs if self.runs else 0.0

    @property
    def interactive(self) -> bool:
        """Gthulhu's classification (voluntary switches per run >= 0.5)."""
        return self.runs > 0 and self.voluntary_per_run >= INTERACTIVE_RATIO

    @property
    def wait_per_run_us(self) -> float:
        return self.wait_ns / self.runs / 1e3 if self.runs else 0.0

    def to_dict(self) -> dict[str, float | int | str | bool]:
        return {"role": self.role, "threads": self.threads, "cpu_ns": self.cpu_ns,
                "wait_ns": self.wait_ns, "runs": self.runs, "voluntary": self.voluntary,
                "involuntary": self.involuntary}

    @classmethod
    def from_dict(cls, d: dict) -> "RoleStats":
        return cls(str(d["role"]), int(d["threads"]), int(d["cpu_ns"]), int(d["wait_ns"]),
                   int(d["runs"]), int(d["voluntary"]), int(d["involuntary"]))


def by_role(tasks: list[TaskStats]) -> list[RoleStats]:
    """Per-role sums, sorted by role name."""
    roles: dict[str, RoleStats] = {}
    for t in tasks:
        r = roles.setdefault(t.role, RoleStats(t.role))
        r.threads += 1
        r.cpu_ns += t.cpu_ns
        r.wait_ns += t.wait_ns
        r.runs += t.runs
        r.voluntary += t.voluntary
        r.involuntary += t.involuntary
    return [roles[k] for k in sorted(roles)]


def delta(after: list[RoleStats], before: list[RoleStats]) -> list[RoleStats]:
    """``after - before`` per role (a role that appeared counts from zero); for reports over
    a time window (the interference harness)."""
    old = {r.role: r for r in before}
    out = []
    for a in after:
        b = old.get(a.role, RoleStats(a.role))
        out.append(RoleStats(a.role, a.threads, a.cpu_ns - b.cpu_ns, a.wait_ns - b.wait_ns,
                             a.runs - b.runs, a.voluntary - b.voluntary,
                             a.involuntary - b.involuntary))
    return out


def report_table(roles: list[RoleStats], title: str = "") -> str:
    """A markdown table of per-role telemetry with Gthulhu's interactive classification."""
    lines = [title] if title else []
    lines += ["| role | threads | CPU s | run-queue wait s | wait/run us | voluntary | "
              "involuntary | vol/run | Gthulhu class |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in roles:
        lines.append(f"| {r.role} | {r.threads} | {r.cpu_ns / 1e9:.2f} | {r.wait_ns / 1e9:.2f} | "
                     f"{r.wait_per_run_us:.0f} | {r.voluntary} | {r.involuntary} | "
                     f"{r.voluntary_per_run:.2f} | "
                     f"{'interactive' if r.interactive else 'batch'} |")
    return "\n".join(lines)


# -- the engine loop's per-step wait -------------------------------------------------------

def _thread_wait_ns() -> int:
    with open("/proc/thread-self/schedstat") as f:
        return parse_schedstat(f.read())[1]


@dataclass
class StepWaitMeter:
    """The run-queue wait of one thread per step, as a histogram (cumulative counts per
    :data:`STEP_WAIT_BUCKETS` upper bound, like Prometheus's). ``begin()`` and ``end()`` run
    on the measured thread; ``snapshot()`` from any thread."""

    buckets: tuple[float, ...] = STEP_WAIT_BUCKETS
    counts: list[int] = field(default_factory=list)
    total_s: float = 0.0
    steps: int = 0
    _start: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    available: bool = True
    #: the measured thread's schedstat file, kept open: a pread per reading (~0.5 us) instead
    #: of an open, a read and a close (~8 us, twice a step); (fd, the thread it names)
    _file: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: above every bound
        try:
            _thread_wait_ns()
        except (OSError, ValueError):
            self.available = False  # no schedstat (not Linux, or not compiled in)

    def _wait_ns(self) -> int:
        """The calling thread's run-queue wait so far (its own file: thread-self is resolved
        when it is opened, so another thread opens its own)."""
        me = threading.get_ident()
        if self._file is None or self._file[1] != me:
            self.close()
            self._file = (os.open("/proc/thread-self/schedstat", os.O_RDONLY), me)
        return parse_schedstat(os.pread(self._file[0], 256, 0).decode())[1]

    def close(self) -> None:
        """Close the schedstat file (a later reading opens it again)."""
        if self._file is not None:
            os.close(self._file[0])
            self._file = None

    def __del__(self) -> None:
        self.close()

    def begin(self) -> None:
        if self.available:
            self._start = self._wait_ns()

    def end(self) -> None:
        if self._start is None:
            return
        waited = (self._wait_ns() - self._start) / 1e9
        self._start = None
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, waited)] += 1
            self.total_s += waited
            self.steps += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"buckets": list(self.buckets), "counts": list(self.counts),
                    "sum": self.total_s, "count": self.steps}


def process_roles(pid: int | str = "self") -> list[RoleStats]:
    """Per-role telemetry of a process."""
    return by_role(read_tasks(pid))


def blink_process_pids() -> dict[str, list[int]]:
    """Running Blink processes by main-thread name (``blink-engine``, ``blink-http``,
    ``blink-serve``), for ``blink thread-policy --report``."""
    out: dict[str, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        comm = task_name(int(entry), int(entry))
        if comm in ("blink-engine", "blink-http", "blink-serve"):
            out.setdefault(comm, []).append(int(entry))
    return out
