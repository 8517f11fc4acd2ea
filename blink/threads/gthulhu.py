"""A thread policy as Gthulhu scheduling-strategy objects, so a cluster running Gthulhu (a
sched_ext scheduler, https://gthulhu.org) targets Blink's threads by their role names.

Gthulhu (api ``gthulhu.io/v1alpha1``) matches ``spec.commandRegex`` against every thread's
``/proc/<tgid>/task/<tid>/comm`` and gives the matches ``spec.priority`` (> 0: boosted; 0:
not boosted, only a custom slice) and ``spec.executionTime`` (the time slice, nanoseconds).
Two kinds select where: ``NodeSchedulingPolicy`` (``spec.nodeNames``: host processes, Blink
outside Kubernetes or in it) and ``SchedulingStrategy`` (``spec.labelSelectors`` +
``spec.k8sNamespaces``: a pod's threads). Field names from Gthulhu's CRDs
(``api/deployment/crds/nodeschedulingpolicy-crd.yaml``, ``schedulingstrategy-crd.yaml``).

Mapping of one policy rule: ``priority: 1`` when the rule raises the threads' priority (a
negative nice or a real-time class), else 0; ``executionTime`` = ``slice_us`` x 1000 when set.
A rule with neither (e.g. nice 10 for housekeeping) has no Gthulhu equivalent and is left out
(Gthulhu has no "lower than normal" tier), named in a comment.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

from blink.threads.policy import Rule, ThreadPolicy, ThreadPolicyError

API_VERSION = "gthulhu.io/v1alpha1"
NODE_KIND = "NodeSchedulingPolicy"
POD_KIND = "SchedulingStrategy"
#: regex syntax Python has and Go's RE2 (Gthulhu's) has not
_NOT_RE2 = re.compile(r"\(\?[=!]|\(\?<[=!]|\\[1-9]|\(\?P=")


def boosted(rule: Rule) -> bool:
    """Whether the rule gives its threads more than a normal thread's priority."""
    return (rule.nice is not None and rule.nice < 0) or rule.sched_class in ("FIFO", "RR")


def _slug(rule: Rule, index: int) -> str:
    roles = rule.roles()
    first = roles[0].name.removeprefix("blink-").rstrip("-") if roles else "rule"
    return re.sub(r"[^a-z0-9-]", "-", f"blink-threads-{index}-{first}".lower())


def strategy_spec(rule: Rule) -> dict[str, Any] | None:
    """The Gthulhu ``spec`` fields of one rule, or None when it has no Gthulhu meaning."""
    if _NOT_RE2.search(rule.match):
        raise ThreadPolicyError(f"{rule.match!r} (line {rule.line}) uses regex syntax Go's RE2 "
                                f"lacks (lookaround, backreferences): Gthulhu cannot take it")
    priority = 1 if boosted(rule) else 0
    if priority == 0 and rule.slice_us is None:
        return None
    spec: dict[str, Any] = {"commandRegex": rule.match, "priority": priority}
    if rule.slice_us is not None:
        spec["executionTime"] = rule.slice_us * 1000
    return spec


def export(policy: ThreadPolicy, *, kind: str = "node", node_names: list[str] | None = None,
           namespace: str = "default", labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The Kubernetes objects (dicts) for ``policy``; ``kind`` is ``node`` or ``pod``."""
    if kind == "node" and not node_names:
        raise ThreadPolicyError("a NodeSchedulingPolicy needs the node name(s) (--node)")
    objects = []
    for index, rule in enumerate(policy.rules, 1):
        spec = strategy_spec(rule)
        if spec is None:
            continue
        if kind == "node":
            spec = {"nodeNames": list(node_names or []), **spec}
        else:
            selectors = labels or {"app.kubernetes.io/name": "blink"}
            spec = {"k8sNamespaces": [namespace],
                    "labelSelectors": [{"key": k, "value": v} for k, v in selectors.items()],
                    **spec}
        objects.append({
            "apiVersion": API_VERSION,
            "kind": NODE_KIND if kind == "node" else POD_KIND,
            "metadata": {"name": _slug(rule, index), "namespace": namespace,
                         "labels": {"app.kubernetes.io/part-of": "blink"}},
            "spec": spec,
        })
    return objects


def export_yaml(policy: ThreadPolicy, **kwargs: Any) -> str:
    """:func:`export` as a multi-document YAML stream, with a comment per rule left out."""
    skipped = [r for r in policy.rules if strategy_spec(r) is None]
    head = [f"# Gthulhu objects for Blink's thread policy {policy.source}",
            "# (blink thread-policy --export gthulhu; docs/threads.md)"]
    head += [f"# left out (no Gthulhu equivalent): {r.match} "
             f"{', '.join(f'{s}={v}' for s, v in r.settings())}" for r in skipped]
    if policy.autogroup:  # sched_ext schedules threads itself: the fair class's groups go
        head.append(f"# left out: autogroup {policy.autogroup} (a fair-class setting)")
    docs = yaml.safe_dump_all(export(policy, **kwargs), sort_keys=False)
    return "\n".join(head) + "\n" + docs
