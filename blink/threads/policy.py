"""The thread policy file (``--thread-policy FILE``): which scheduling settings each Blink
thread role gets, validated at start, applied per thread.

The file (YAML)::

    description: what this preset is for           # optional
    threads:                                        # rules; the first that matches a thread wins
      - match: '^blink-(loop|omp-[0-9]+)$'          # regex on the thread's OS name (ROLES)
        cpus: 0-1                                    # affinity: a CPU list, or "all"
        nice: -10                                    # -20..19
        class: OTHER                                 # OTHER | BATCH | IDLE | FIFO | RR
        priority: 10                                 # 1..99, FIFO/RR only (and required there)
        slice_us: 3000                               # EEVDF slice hint (OTHER/BATCH), 100..100000
        ioprio: be:0                                 # rt:N | be:N (N 0..7) | idle

Every mistake is a :class:`ThreadPolicyError` naming the file and line: not YAML, an unknown
key, a value out of range, a regex that does not compile or matches no Blink role, a CPU this
process may not use, and a real-time class for a role that busy-polls while the kernel's RT
bound is off (``sched_rt_runtime_us = -1``: such a thread could take a core from everything,
kernel threads included; with the default bound, 950 ms of each second, the rest is kept for
other classes).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from blink.errors import BlinkError
from blink.threads.roles import ROLES, Role
from blink.threads.syscalls import (
    APPLIED,
    DENIED,
    IOPRIO_CLASSES,
    REALTIME_CLASSES,
    SCHED_CLASSES,
    UNSUPPORTED,
    Capabilities,
    Syscalls,
    status_of,
)

#: ``--thread-policy`` values that are not files
OFF = "off"
DEFAULT = "default"
_RULE_KEYS = ("match", "cpus", "nice", "class", "priority", "slice_us", "ioprio")
_TOP_KEYS = ("description", "autogroup", "threads")
#: processes whose autogroup a policy may set
AUTOGROUP_PROCESSES = ("supervisor", "engine", "frontend")
SLICE_US_RANGE = (100, 100_000)  # the kernel clamps sched_runtime of fair tasks to 0.1..100 ms


class ThreadPolicyError(BlinkError):
    """A thread policy file that cannot be used, with the file and line."""


@dataclass(frozen=True)
class Rule:
    """One ``threads:`` entry."""

    match: str
    line: int
    cpus: frozenset[int] | None = None
    nice: int | None = None
    sched_class: str | None = None
    priority: int | None = None
    slice_us: int | None = None
    ioprio: tuple[str, int] | None = None

    def matches(self, comm: str) -> bool:
        return re.search(self.match, comm) is not None

    def roles(self) -> list[Role]:
        """The Blink roles this rule reaches (checked against the role names)."""
        return [r for r in ROLES if self.matches(r.name + ("0" if r.numbered else ""))]

    def settings(self) -> list[tuple[str, str]]:
        """(setting, value as written in reports) of what this rule sets, in apply order."""
        out = []
        if self.cpus is not None:
            out.append(("cpus", format_cpus(self.cpus)))
        if self.sched_class is not None:
            out.append(("class", self.sched_class + (f":{self.priority}" if self.priority else "")))
        if self.nice is not None:
            out.append(("nice", str(self.nice)))
        if self.slice_us is not None:
            out.append(("slice", f"{self.slice_us}us"))
        if self.ioprio is not None:
            io_class, level = self.ioprio
            out.append(("ioprio", io_class if io_class == "idle" else f"{io_class}:{level}"))
        return out


@dataclass(frozen=True)
class ThreadPolicy:
    """A validated policy: rules in file order (the first match wins)."""

    source: str
    rules: tuple[Rule, ...]
    description: str = ""
    #: process -> nice of its autogroup (the session's scheduling group; see apply_autogroup)
    autogroup: dict[str, int] = field(default_factory=dict)

    def rule_for(self, comm: str) -> Rule | None:
        for rule in self.rules:
            if rule.matches(comm):
                return rule
        return None


@dataclass(frozen=True)
class SettingResult:
    """What happened to one setting on one thread."""

    tid: int
    comm: str
    setting: str
    value: str
    status: str  # applied | denied | unsupported
    detail: str = ""


# -- CPU lists -------------------------------------------------------------------------------

def parse_cpus(text: str) -> frozenset[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}. Raises ValueError with the reason."""
    cpus: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in CPU list {text!r}")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range (like 0-3)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"range {part!r} goes backwards")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 6} -> ``"0-2,6"``."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask: a container's cpuset)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


# -- loading ---------------------------------------------------------------------------------

def presets_dir() -> Path:
    """``configs/threads`` of the checkout (or the installed copy of it)."""
    here = Path(__file__).resolve().parents[2] / "configs" / "threads"
    if here.is_dir():
        return here
    from importlib.resources import files

    return Path(str(files("blink.threads.presets")))


def resolve_policy_path(value: str | os.PathLike | None) -> Path | None:
    """``--thread-policy`` -> the file to load: None for ``off``; ``default`` (or not given)
    is ``configs/threads/default.yaml``; a bare preset name (``isolated``) is that preset."""
    if value is None or str(value) == DEFAULT:
        return presets_dir() / "default.yaml"
    if str(value) == OFF:
        return None
    path = Path(value)
    if not path.exists() and re.fullmatch(r"[A-Za-z0-9_-]+", str(value)):
        preset = presets_dir() / f"{value}.yaml"
        if preset.exists():
            return preset
        names = ", ".join(sorted(p.stem for p in presets_dir().glob("*.yaml")))
        raise ThreadPolicyError(f"--thread-policy {value}: no such file, and no preset of that "
                                f"name (presets: {names}; or 'off')")
    return path


class _DuplicateKey(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


class _Loader(yaml.SafeLoader):
    """Keeps the line of every mapping (1-based) under the key ``__line__``."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[str, Any]:
    mapping = yaml.SafeLoader.construct_mapping(loader, node)
    lines: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in lines:  # YAML allows it (the last wins): here it is a mistake
            raise _DuplicateKey(key_node.start_mark.line + 1, f"key {key!r} given twice")
        lines[key] = key_node.start_mark.line + 1
    mapping["__line__"] = node.start_mark.line + 1
    mapping["__lines__"] = lines
    return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_policy(path: str | os.PathLike, *, check_cpus: bool = True,
                rt_runtime_us: int | None = None) -> ThreadPolicy:
    """Read and validate a policy file. ``check_cpus``: refuse CPUs this process may not use
    (off for ``--export``, which describes another host). ``rt_runtime_us``: the kernel's RT
    bound (default: read from /proc)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ThreadPolicyError(f"thread policy {path}: cannot read it ({exc.strerror})") from None
    try:
        doc = yaml.load(text, Loader=_Loader)
    except _DuplicateKey as exc:
        raise ThreadPolicyError(f"{path}:{exc.line}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ThreadPolicyError(f"{path}{where}: not valid YAML: {problem}") from None
    return policy_from_document(doc, str(path), check_cpus=check_cpus, rt_runtime_us=rt_runtime_us)


def policy_from_document(doc: Any, source: str, *, check_cpus: bool = True,
                         rt_runtime_us: int | None = None) -> ThreadPolicy:
    """Validate a parsed policy document (see the module docstring)."""
    if not isinstance(doc, dict):
        raise ThreadPolicyError(f"{source}: a thread policy is a mapping with a 'threads:' list")
    lines = doc.get("__lines__", {})
    for key in doc:
        if key not in _TOP_KEYS and not str(key).startswith("__"):
            raise ThreadPolicyError(f"{source}:{lines.get(key, doc.get('__line__', 1))}: unknown key "
                                    f"{key!r} (expected: {', '.join(_TOP_KEYS)})")
    entries = doc.get("threads")
    if not isinstance(entries, list) or not entries:
        raise ThreadPolicyError(f"{source}:{lines.get('threads', 1)}: 'threads' must be a non-empty "
                                f"list of rules")
    if rt_runtime_us is None:
        rt_runtime_us = Syscalls().rt_runtime_us()
    cpus_ok = usable_cpus() if check_cpus else None
    rules = tuple(_rule(e, source, cpus_ok, rt_runtime_us) for e in entries)
    description = doc.get("description") or ""
    autogroup: dict[str, int] = {}
    raw = doc.get("autogroup")
    if raw is not None:
        line = lines.get("autogroup", 1)
        if not isinstance(raw, dict):
            raise ThreadPolicyError(f"{source}:{line}: 'autogroup' maps a process "
                                    f"({', '.join(AUTOGROUP_PROCESSES)}) to a nice value")
        sub_lines = raw.get("__lines__", {})
        for proc, nice in raw.items():
            if str(proc).startswith("__"):
                continue
            where = f"{source}:{sub_lines.get(proc, line)}"
            if proc not in AUTOGROUP_PROCESSES:
                raise ThreadPolicyError(f"{where}: autogroup: unknown process {proc!r} "
                                        f"(expected: {', '.join(AUTOGROUP_PROCESSES)})")
            if isinstance(nice, bool) or not isinstance(nice, int) or not -20 <= nice <= 19:
                raise ThreadPolicyError(f"{where}: autogroup {proc} must be a nice value in "
                                        f"[-20, 19], got {nice!r}")
            autogroup[proc] = nice
    return ThreadPolicy(source=source, rules=rules, description=str(description).strip(),
                        autogroup=autogroup)


def _rule(entry: Any, source: str, cpus_ok: frozenset[int] | None,
          rt_runtime_us: int | None) -> Rule:
    if not isinstance(entry, dict):
        raise ThreadPolicyError(f"{source}: each 'threads' entry is a mapping with 'match:' "
                                f"and settings, got {entry!r}")
    line = entry["__line__"]
    lines = entry["__lines__"]

    def fail(key: str, message: str) -> ThreadPolicyError:
        return ThreadPolicyError(f"{source}:{lines.get(key, line)}: {message}")

    for key in entry:
        if key not in _RULE_KEYS and not str(key).startswith("__"):
            raise fail(key, f"unknown key {key!r} (expected: {', '.join(_RULE_KEYS)})")
    pattern = entry.get("match")
    if not isinstance(pattern, str) or not pattern:
        raise fail("match", "every rule needs 'match:', a regex on the thread name")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise fail("match", f"match {pattern!r} is not a valid regex: {exc}") from None

    def integer(key: str, lo: int, hi: int) -> int | None:
        value = entry.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise fail(key, f"{key} must be an integer in [{lo}, {hi}], got {value!r}")
        return value

    cpus = None
    if "cpus" in entry:
        raw = entry["cpus"]
        if raw == "all":
            cpus = usable_cpus()
        else:
            if isinstance(raw, list):
                raw = ",".join(str(c) for c in raw)
            try:
                cpus = parse_cpus(str(raw))
            except ValueError as exc:
                raise fail("cpus", f"cpus: {exc}") from None
            if cpus_ok is not None and not cpus <= cpus_ok:
                raise fail("cpus", f"cpus {format_cpus(cpus)}: CPU(s) "
                                   f"{format_cpus(cpus - cpus_ok)} are not available to this "
                                   f"process (it may use {format_cpus(cpus_ok)})")
    nice = integer("nice", -20, 19)
    sched_class = entry.get("class")
    if sched_class is not None:
        sched_class = str(sched_class).upper()
        if sched_class not in SCHED_CLASSES:
            raise fail("class", f"class must be one of {', '.join(SCHED_CLASSES)}, got "
                                f"{entry['class']!r}")
    priority = integer("priority", 1, 99)
    realtime = sched_class in REALTIME_CLASSES
    if realtime and priority is None:
        raise fail("class", f"class {sched_class} needs 'priority:' (1..99)")
    if priority is not None and not realtime:
        raise fail("priority", "priority is for class FIFO or RR only (use nice for the others)")
    if nice is not None and sched_class in ("FIFO", "RR", "IDLE"):
        raise fail("nice", f"nice has no effect in class {sched_class}")
    slice_us = integer("slice_us", *SLICE_US_RANGE)
    if slice_us is not None and sched_class not in (None, "OTHER", "BATCH"):
        raise fail("slice_us", f"slice_us (the EEVDF slice) is for class OTHER or BATCH, "
                               f"not {sched_class}")
    ioprio = None
    if "ioprio" in entry:
        raw = str(entry["ioprio"])
        io_class, _, level = raw.partition(":")
        if io_class not in IOPRIO_CLASSES or (io_class != "idle" and not (
                level.isdigit() and 0 <= int(level) <= 7)) or (io_class == "idle" and level):
            raise fail("ioprio", f"ioprio must be rt:N, be:N (N in 0..7) or idle, got {raw!r}")
        ioprio = (io_class, int(level) if level else 0)
    rule = Rule(match=pattern, line=line, cpus=cpus, nice=nice, sched_class=sched_class,
                priority=priority, slice_us=slice_us, ioprio=ioprio)
    roles = rule.roles()
    if not roles:
        names = ", ".join(r.name + ("N" if r.numbered else "") for r in ROLES)
        raise fail("match", f"match {pattern!r} matches no Blink thread role (roles: {names})")
    if realtime and rt_runtime_us == -1:
        spinning = [r.name for r in roles if r.busy_polls]
        if spinning:
            raise fail("class", f"class {sched_class} for busy-polling role(s) "
                                f"{', '.join(spinning)} while the kernel's RT bound is off "
                                f"(/proc/sys/kernel/sched_rt_runtime_us = -1): they could keep "
                                f"a core from every other thread, kernel threads included. Set "
                                f"the bound (e.g. 950000) or use nice/slice_us instead")
    if not rule.settings():
        raise fail("match", f"the rule for {pattern!r} sets nothing")
    return rule


# -- applying --------------------------------------------------------------------------------

def apply_autogroup(nice: int, calls: Syscalls) -> SettingResult:
    """Set this process's autogroup nice. With ``kernel.sched_autogroup_enabled = 1`` (most
    desktop and many server kernels) and the process in the root CPU cgroup, the fair
    scheduler first shares a CPU between *sessions* (autogroups), then between the threads
    of one: a thread's nice only ranks it against threads of its own session, so against a
    hog started elsewhere only the autogroup's nice counts. ``blink serve`` starts each
    child in its own session, so this is the weight of that one process. ``unsupported``
    where autogroup is off (then thread nice values compete directly)."""
    pid = os.getpid()
    if calls.autogroup_enabled() != 1:
        return SettingResult(pid, "autogroup", "autogroup", str(nice), UNSUPPORTED,
                             "kernel.sched_autogroup_enabled is not 1")
    try:
        calls.set_autogroup(nice)
    except OSError as exc:
        return SettingResult(pid, "autogroup", "autogroup", str(nice), status_of(exc),
                             exc.strerror or str(exc))
    return SettingResult(pid, "autogroup", "autogroup", str(nice), APPLIED)


def apply_rule(rule: Rule, tid: int, comm: str, calls: Syscalls,
               caps: Capabilities | None = None) -> list[SettingResult]:
    """Apply ``rule`` to thread ``tid``; one result per setting. Never raises for a refused
    setting: a denied or unsupported one is reported and the others still applied. Settings
    the probe found unsupported are not tried again."""
    out: list[SettingResult] = []

    def run(setting: str, value: str, fn) -> None:  # type: ignore[no-untyped-def]
        if caps is not None and caps.status.get(setting) == UNSUPPORTED:
            out.append(SettingResult(tid, comm, setting, value, UNSUPPORTED,
                                     caps.detail.get(setting, "")))
            return
        try:
            fn()
        except OSError as exc:
            out.append(SettingResult(tid, comm, setting, value, status_of(exc),
                                     exc.strerror or str(exc)))
        else:
            out.append(SettingResult(tid, comm, setting, value, APPLIED))

    for setting, value in rule.settings():
        if setting == "cpus":
            run(setting, value, lambda: calls.setaffinity(tid, set(rule.cpus or ())))
        elif setting == "class":
            policy = SCHED_CLASSES[rule.sched_class or "OTHER"]
            run(setting, value, lambda: calls.setscheduler(tid, policy, rule.priority or 0))
        elif setting == "nice":
            run(setting, value, lambda: calls.setpriority(tid, rule.nice or 0))
        elif setting == "slice":
            def set_slice() -> None:
                # sched_setattr sets class and nice too: pass the ones the thread has now
                calls.set_slice(tid, calls.getscheduler(tid), calls.getpriority(tid),
                                (rule.slice_us or 0) * 1000)

            run(setting, value, set_slice)
        elif setting == "ioprio":
            io_class, level = rule.ioprio or ("be", 0)
            run(setting, value, lambda: calls.ioprio_set(tid, io_class, level))
    return out


__all__ = [
    "APPLIED", "DENIED", "UNSUPPORTED", "OFF", "DEFAULT", "Rule", "ThreadPolicy",
    "ThreadPolicyError", "SettingResult", "load_policy", "policy_from_document",
    "resolve_policy_path", "apply_rule", "parse_cpus", "format_cpus", "presets_dir",
]
