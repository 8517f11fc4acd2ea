"""Command-line helpers that more than one command needs (``blink serve``, ``blink engine``,
``blink serve --frontend-only``). Torch-free."""
from __future__ import annotations

import argparse

from blink.errors import BlinkError


def parse_host_port(value: str, what: str = "--engine") -> tuple[str, int]:
    """``HOST:PORT`` → (host, port), with a clear error for anything else."""
    host, sep, port = (value or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise BlinkError(f"{what} must be HOST:PORT (for example 127.0.0.1:7000), got {value!r}")
    return host, int(port)


def check_timeout_flags(args: argparse.Namespace) -> None:
    """``--heartbeat-timeout`` / ``--engine-dead-timeout``: one clear line if they do not fit."""
    from blink.dpu.engine_client import check_engine_timeouts

    try:
        check_engine_timeouts(args.heartbeat_timeout, args.engine_dead_timeout)
    except ValueError as exc:
        raise BlinkError(f"--heartbeat-timeout / --engine-dead-timeout: {exc}") from None


#: the request-limit flags ``blink serve`` hands on to its frontend process
FRONTEND_LIMIT_FLAGS = ("max_request_body_mb", "chat_template_timeout")
FRONTEND_LIMIT_SWITCHES = ("trust_request_chat_template", "public_docs",
                           "enable_auto_tool_choice", "exclude_tools_when_tool_choice_none")
#: flags handed on only when set
FRONTEND_OPTIONAL_FLAGS = ("tool_call_parser",)


def frontend_limit_args(args: argparse.Namespace) -> list[str]:
    """The request-limit flags of ``args`` as ``blink serve --frontend-only`` arguments."""
    out: list[str] = []
    for name in FRONTEND_LIMIT_FLAGS:
        out += [f"--{name.replace('_', '-')}", repr(getattr(args, name))]
    for name in FRONTEND_LIMIT_SWITCHES:
        if getattr(args, name, False):
            out.append(f"--{name.replace('_', '-')}")
    for name in FRONTEND_OPTIONAL_FLAGS:
        if getattr(args, name, None) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out
