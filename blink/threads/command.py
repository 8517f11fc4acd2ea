"""``blink thread-policy``: check a policy against this host, report live thread telemetry,
export the policy for Gthulhu."""
from __future__ import annotations

import argparse
import socket
import sys

from blink.errors import BlinkError
from blink.threads.policy import load_policy, resolve_policy_path
from blink.threads.roles import ROLES
from blink.threads.syscalls import Syscalls, predict, probe
from blink.threads.telemetry import blink_process_pids, process_roles, report_table


def _labels(items: list[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BlinkError(f"--label {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def run_thread_policy_command(args: argparse.Namespace, out=sys.stdout) -> int:
    if args.report:
        pids = {f"pid {p}": [p] for p in args.pid} if args.pid else blink_process_pids()
        if not pids:
            raise BlinkError("no running blink process found (blink-engine, blink-http, "
                             "blink-serve); give --pid")
        for name, plist in sorted(pids.items()):
            for pid in plist:
                print(report_table(process_roles(pid), f"\n### {name} (pid {pid})\n"), file=out)
        print("\nGthulhu class: interactive = voluntary context switches per run >= 0.5", file=out)
        return 0
    path = resolve_policy_path(args.policy)
    if path is None:
        raise BlinkError("'off' is not a policy to check or export")
    if args.export == "gthulhu":
        from blink.threads.gthulhu import export_yaml

        policy = load_policy(path, check_cpus=False)
        nodes = args.node or ([socket.gethostname()] if args.gthulhu_kind == "node" else None)
        out.write(export_yaml(policy, kind=args.gthulhu_kind, node_names=nodes,
                              namespace=args.namespace, labels=_labels(args.label)))
        return 0
    policy = load_policy(path)
    caps = probe()
    print(f"{path}: valid. {policy.description}", file=out)
    print(f"this host allows (privileged forms): {caps.summary()}", file=out)
    for rule in policy.rules:
        roles = ", ".join(r.name + ("N" if r.numbered else "") for r in rule.roles())
        sets = ", ".join(f"{s}={v} ({predict(caps, s, v)})" for s, v in rule.settings())
        print(f"  line {rule.line}: {rule.match} -> roles {roles}: {sets}", file=out)
    if policy.autogroup:
        enabled = Syscalls().autogroup_enabled()
        print(f"  autogroup nice {policy.autogroup} (kernel.sched_autogroup_enabled = {enabled}"
              f"{': no effect' if enabled != 1 else ''})", file=out)
    untouched = [r.name + ("N" if r.numbered else "") for r in ROLES
                 if policy.rule_for(r.name + ("0" if r.numbered else "")) is None]
    if untouched:
        print(f"  roles no rule reaches (default scheduling): {', '.join(untouched)}", file=out)
    return 0
