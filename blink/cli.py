"""The ``blink`` command line: serve, engine, frontend, convert.

Every flag of ``serve``/``engine``/``frontend`` can also come from a config file
(``--config FILE``, YAML or TOML, keys are the flag names with ``-`` or ``_``); flags given
on the command line win over the file. This module imports nothing heavy at import time:
the frontend half runs on machines without torch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from blink.errors import BlinkError
from blink.version import blink_version

from blink.engine_options import (  # noqa: F401 (DEFAULT_MODEL, VLLM_MIGRATION_DOC: re-exported)
    DEFAULT_MODEL,
    VLLM_MIGRATION_DOC,
    add_engine_options,
    add_engine_process_options,
)


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already says its default or
    the default is nothing worth showing (None, False: an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _HelpEnvAction(argparse.Action):
    """``blink --help-env``: the BLINK_* environment variables (blink/env.py), then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from blink.env import help_text

        print(help_text())
        parser.exit()


#: the line ``blink serve --help`` and ``blink engine --help`` end with
ENV_EPILOG = ("Environment variables (BLINK_*): 'blink --help-env' lists them. Threads: "
              "docs/threads.md.")


class ConfigFileError(BlinkError):
    """A --config file cannot be read or names an unknown option."""


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's knobs and vLLM's engine flags, declared once in blink/engine_options.py."""
    add_engine_options(p)


def _add_frontend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP frontend")
    g.add_argument("--host", default="127.0.0.1",
                   help="HTTP bind address (default: %(default)s, this machine only; --host "
                        "0.0.0.0 serves other machines too, as the container images do)")
    g.add_argument("--port", type=int, default=8000,
                   help="HTTP port, checked free before the model loads (default: %(default)s)")
    g.add_argument("--root-path", default=None, metavar="PATH",
                   help="ASGI root_path, when a proxy serves the API under a path prefix")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="serve HTTPS with this private key (with --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (with --ssl-keyfile)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates to verify client certificates with")
    g.add_argument("--allowed-origins", default=None, metavar="JSON",
                   help="CORS: origins allowed to call the API from a browser, as a JSON list, "
                        "e.g. '[\"*\"]' (vLLM's default). Blink's default is no CORS headers: "
                        "a web page could otherwise use a server on localhost")
    g.add_argument("--allowed-methods", default='["*"]', metavar="JSON",
                   help="CORS: allowed methods, a JSON list (with --allowed-origins)")
    g.add_argument("--allowed-headers", default='["*"]', metavar="JSON",
                   help="CORS: allowed request headers, a JSON list (with --allowed-origins)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (with --allowed-origins)")
    g.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="tokenizer to use instead of the model's (an HF directory, a "
                        "tokenizer.json, or a .gguf); the model's by default")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="chat template to use instead of the model's: a file, or the jinja "
                        "text itself")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the random seeds given to requests without one, so that a "
                        "run's sampling repeats (default: fresh random seeds)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="level of the HTTP server's (uvicorn's) log")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="level of Blink's own log")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no access log line per request (on by default: method, path, "
                        "status, duration, x-request-id)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="vLLM's name for --disable-log-requests: no access log")
    g.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                   help="comma-separated paths the access log skips, e.g. /health,/metrics")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each engine request as it is submitted: id, prompt length, the "
                        "sampling parameters that differ from the defaults (INFO), and the "
                        "prompt's token ids (DEBUG)")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests: also log each request's end (tokens "
                        "produced, finish reason; output token ids at DEBUG)")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="token ids kept in the DEBUG request/output lines (default: all)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 endpoints, /tokenize, "
                        "/detokenize and the API docs (/health and /metrics stay open)")
    from blink.dpu.engine_client import DEFAULT_ENGINE_DEAD_TIMEOUT_S, DEFAULT_HEARTBEAT_TIMEOUT_S

    g.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                   metavar="SECONDS",
                   help="seconds without an engine heartbeat, with requests in flight, after "
                        "which the engine counts as stalled: /health answers 503, but requests "
                        "in flight keep waiting and new ones still queue (default: %(default)g)")
    g.add_argument("--engine-dead-timeout", type=float, default=DEFAULT_ENGINE_DEAD_TIMEOUT_S,
                   metavar="SECONDS",
                   help="hard limit: seconds without an engine heartbeat, with requests in "
                        "flight, after which they end with an 'engine unavailable' error and new "
                        "ones are refused until the heartbeat moves again; must be >= "
                        "--heartbeat-timeout (default: %(default)g). A FAILED/stopped engine or "
                        "an exited engine process ends requests at once")
    _add_request_limit_args(g)
    _add_connection_args(g)


def _add_connection_args(g: argparse._ArgumentGroup) -> None:
    """The HTTP server's connection-level bounds (blink.dpu.http_server); torch-free."""
    from blink.dpu.http_server import (
        DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, FD_RESERVE,
    )

    g.add_argument("--http-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   metavar="SECONDS",
                   help="seconds a client has to send a request's head (from connecting, or "
                        "from the first byte of a kept-alive connection's next request); a "
                        "partial head then gets 408 and the connection is closed, one that "
                        "sent nothing is closed (default: %(default)g)")
    g.add_argument("--http-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   metavar="SECONDS",
                   help="seconds a client has to send a request's body once its head is in; "
                        "then it gets 408 and the request is dropped (default: %(default)g)")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help=f"HTTP connections served at once; a connection beyond them gets 503 "
                        f"with Retry-After and is closed (default: {DEFAULT_MAX_CONNECTIONS}, "
                        f"lowered to the open-files limit minus {FD_RESERVE}; the frontend "
                        f"raises its soft limit to the hard one at start)")


def _add_request_limit_args(g: argparse._ArgumentGroup) -> None:
    """The frontend's per-request bounds (blink.dpu.limits); kept torch-free like the rest."""
    from blink.dpu.chat_template import DEFAULT_RENDER_TIMEOUT_S
    from blink.dpu.limits import DEFAULT_MAX_REQUEST_BODY_MB
    from blink.dpu.structured.workers import (
        DEFAULT_COMPILE_MEMORY_MB, DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_GRAMMAR_CACHE_MB,
    )

    g.add_argument("--max-request-body-mb", type=float, default=DEFAULT_MAX_REQUEST_BODY_MB,
                   metavar="MIB",
                   help="largest request body accepted, in MiB; bigger ones get 413 before "
                        "they are read (default: %(default)g)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a 'chat_template' in chat and /tokenize requests (as vLLM's "
                        "flag of the same name); without it such requests are refused with "
                        "400. Every template, the model's included, renders in a sandbox "
                        "under --chat-template-timeout and a size cap")
    g.add_argument("--chat-template-timeout", type=float, default=DEFAULT_RENDER_TIMEOUT_S,
                   metavar="SECONDS",
                   help="wall-clock limit of one chat-template render; a render past it is "
                        "stopped and the request gets 400 (default: %(default)g)")
    g.add_argument("--grammar-compile-timeout", type=float, default=DEFAULT_COMPILE_TIMEOUT_S,
                   metavar="SECONDS",
                   help="limit of one structured-output grammar check (a JSON schema, regex, "
                        "choice or Lark grammar, checked in a separate worker process that is "
                        "killed past it); over it the request gets 400 (default: %(default)g)")
    g.add_argument("--grammar-compile-memory-mb", type=float, default=DEFAULT_COMPILE_MEMORY_MB,
                   metavar="MIB",
                   help="address-space limit of a grammar worker process; a grammar that needs "
                        "more gets 400 (default: %(default)g)")
    g.add_argument("--grammar-cache-mb", type=float, default=DEFAULT_GRAMMAR_CACHE_MB,
                   metavar="MIB",
                   help="memory for accepted grammars kept for reuse, least recently used "
                        "dropped first; refusals are not cached (default: %(default)g)")
    _add_tool_calling_args(g)
    g.add_argument("--public-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json without the --api-key (by "
                        "default they need it when --api-key is set)")


def _add_tool_calling_args(g: argparse._ArgumentGroup) -> None:
    """vLLM's tool-calling flags (blink.dpu.tool_calling), with vLLM's names."""
    from blink.dpu.tool_parsers import TOOL_PARSERS

    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto', the "
                        "default when a request has tools); needs --tool-call-parser. "
                        "'required' and named functions work without it: the grammar "
                        "enforces them")
    formats = "; ".join(f"{name}: {cls.families}" for name, cls in TOOL_PARSERS.items())
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help=f"the format the model writes tool calls in ({formats}). With a "
                        "chat template that never renders tools, 'auto' uses 'generic' "
                        "whatever this names: the tools go into the system prompt and the "
                        "answer is constrained to JSON")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="do not render a request's tools into the prompt when its "
                        "tool_choice is 'none' (by default they are, as in vLLM)")


def _add_thread_policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--thread-policy", default=None, metavar="FILE",
                   help="scheduling policy of Blink's host threads (YAML: per thread role its "
                        "CPUs, nice, class, EEVDF slice, I/O priority; docs/threads.md). A file, "
                        "a preset name from configs/threads/, or 'off'. Each setting is "
                        "reported applied / denied / unsupported in the log and in /metrics "
                        "(default: configs/threads/default.yaml)")


def _add_thread_policy_command(sub: Any) -> None:
    tp = sub.add_parser(
        "thread-policy", formatter_class=HelpFormatter,
        help="check a thread policy, report live thread telemetry, export it for Gthulhu",
        description="Without --report/--export: validate the policy file and show what this "
                    "host allows (the capability probe) and which roles each rule reaches. "
                    "--report: per-role run-queue wait, context switches and CPU time of the "
                    "running Blink processes, with Gthulhu's interactive classification. "
                    "--export gthulhu: the policy as Gthulhu scheduling-strategy objects.")
    tp.add_argument("policy", nargs="?", default="default", metavar="FILE",
                    help="the policy file or preset name (default: %(default)s)")
    tp.add_argument("--report", action="store_true",
                    help="report the threads of the running blink processes (or --pid)")
    tp.add_argument("--pid", type=int, action="append", default=None,
                    help="with --report: this process instead of every blink process")
    tp.add_argument("--export", choices=["gthulhu"], default=None,
                    help="write the policy as Gthulhu objects (YAML) to stdout")
    tp.add_argument("--gthulhu-kind", choices=["node", "pod"], default="node",
                    help="node: NodeSchedulingPolicy (matches threads on the named nodes); "
                         "pod: SchedulingStrategy (matches threads of pods with the labels)")
    tp.add_argument("--node", action="append", default=None, metavar="NAME",
                    help="node name(s) for --gthulhu-kind node")
    tp.add_argument("--namespace", default="default",
                    help="Kubernetes namespace of the exported objects")
    tp.add_argument("--label", action="append", default=None, metavar="KEY=VALUE",
                    help="pod label selector(s) for --gthulhu-kind pod "
                         "(default: app.kubernetes.io/name=blink)")


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None,
                   help="YAML or TOML file with any of these flags (command-line flags win)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blink",
        description="Blink: LLM serving whose steady-state inference path needs no host CPU.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"blink {blink_version()}")
    parser.add_argument("--help-env", action=_HelpEnvAction,
                        help="list the BLINK_* environment variables Blink reads, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="serve a model with an OpenAI-compatible API (engine + frontend)",
        description="Start the engine and the HTTP frontend as two processes talking over the "
                    "ring transport, and print the URL when ready. Ctrl-C drains and exits. "
                    f"Takes 'vllm serve' command lines ({VLLM_MIGRATION_DOC}).",
        epilog=ENV_EPILOG, formatter_class=HelpFormatter,
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as vllm serve takes it: the same as --model")
    _add_config_arg(serve)
    _add_engine_args(serve)
    _add_frontend_args(serve)
    _add_thread_policy_arg(serve)
    serve.add_argument("--engine-port", type=int, default=0,
                       help="TCP port of the engine's bootstrap listener (default: any free port)")
    serve.add_argument("--frontend-only", action="store_true",
                       help="run only the frontend, connecting to a running 'blink engine' at --engine")
    serve.add_argument("--engine", default=None, metavar="HOST:PORT", action="append",
                       help="bootstrap address of the engine (with --frontend-only). Repeat it "
                            "for several engines: the frontend then routes each request by load "
                            "and by the engines' roles (--role prefill/decode: disaggregated, "
                            "docs/disaggregation.md); a config file takes a list")
    serve.add_argument("--disaggregated", action="store_true",
                       help="start one decode engine (--role decode) and one prefill engine "
                            "(--role prefill) instead of one engine; the frontend sends each "
                            "prompt's prefill to the prefill engine, which writes its KV into "
                            "the decode engine's memory, and falls back to either engine alone "
                            "when the other is lost (docs/disaggregation.md). CPU loop only")
    serve.add_argument("--prefill-engines", type=int, default=1, metavar="N",
                       help="with --disaggregated: how many prefill engines to start")
    serve.add_argument("--decode-engines", type=int, default=1, metavar="N",
                       help="with --disaggregated: how many decode engines to start (every "
                            "prefill engine may write into every decode engine)")
    serve.add_argument("--fabric", type=Path, default=None, metavar="FILE",
                       help="with --disaggregated: ARK path selection for the KV transfers "
                            "(docs/disaggregation.md, 'Path selection'): the fabric file (the "
                            "leaf-spine topology, the switches' ECMP hash and seed, every "
                            "prefill engine's leaf and ARK bus address, every decode engine's "
                            "leaf). Prefill engine i is the file's i-th sender. Off by default")
    serve.add_argument("--bootstrap-secret-file", type=Path, default=None, metavar="FILE",
                       help="file holding the engine's bootstrap secret (mode 0600). With "
                            "--frontend-only: the file 'blink engine' printed (or was given), "
                            "needed to attach. Without: use this secret instead of a fresh "
                            "one per start (created if missing), so that monitoring tools can "
                            "attach too")
    restart = serve.add_argument_group("engine restarts (blink serve)")
    restart.add_argument("--no-engine-restart", action="store_true",
                         help="exit when the engine dies instead of restarting it (by default "
                              "it is restarted on the same bootstrap port with an exponential "
                              "back-off of 1 s doubling up to 30 s, while the frontend answers "
                              "503 + Retry-After and reconnects by itself)")
    restart.add_argument("--max-engine-restarts", type=int, default=5, metavar="N",
                         help="give up (and exit non-zero) when the engine would be restarted "
                              "more than N times within --engine-restart-window (default: "
                              "%(default)s)")
    restart.add_argument("--engine-restart-window", type=float, default=300.0, metavar="SECONDS",
                         help="the window --max-engine-restarts and --max-frontend-restarts "
                              "count in (default: %(default)g)")
    restart.add_argument("--no-frontend-restart", action="store_true",
                         help="exit when the frontend process dies instead of restarting it "
                              "(by default it is restarted on the same HTTP port with the same "
                              "back-off while the engine keeps running; the new frontend takes "
                              "over the slots the dead one left in the ring)")
    restart.add_argument("--max-frontend-restarts", type=int, default=5, metavar="N",
                         help="give up (and exit non-zero) when the frontend would be restarted "
                              "more than N times within --engine-restart-window (default: "
                              "%(default)s)")

    engine = sub.add_parser(
        "engine", help="run only the engine (the host half of a DPU deployment)",
        description="Load the model, create the ring, run the device loop and wait for a frontend "
                    "to connect through the bootstrap listener.",
        epilog=ENV_EPILOG, formatter_class=HelpFormatter,
    )
    _add_config_arg(engine)
    _add_engine_args(engine)
    _add_thread_policy_arg(engine)
    engine.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="level of the engine's log")
    engine.add_argument("--listen", default="127.0.0.1:7000", metavar="HOST:PORT",
                        help="bootstrap listener address (default: %(default)s)")
    add_engine_process_options(engine)  # --role, --kv-peer, --fabric, --fabric-sender
    engine.add_argument("--bootstrap-secret-file", type=Path, default=None, metavar="FILE",
                        help="the secret a frontend must prove it knows to attach (the "
                             "challenge-response never sends it). Read from FILE, or created "
                             "there (mode 0600) if missing; the frontend takes the same FILE. "
                             "Without this flag a fresh secret is written to "
                             "$XDG_RUNTIME_DIR/blink/bootstrap-PORT.secret (else "
                             "~/.blink/bootstrap-PORT.secret) and its path printed")

    _add_thread_policy_command(sub)

    convert = sub.add_parser(
        "convert", help="write a GGUF model as a Hugging Face directory", formatter_class=HelpFormatter,
        description="Dequantise a GGUF file into an HF-format directory (safetensors, config, "
                    "tokenizer files) that transformers and vLLM can load.",
    )
    convert.add_argument("gguf", help="the .gguf file, or a model name such as smollm2-135m")
    convert.add_argument("outdir", type=Path, help="output directory (created)")
    convert.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                         help="dtype of the written weights (float32 keeps the dequantised "
                              "values exact; default: %(default)s)")
    return parser


def _load_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigFileError(f"{path}: config file not found")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # the parsers raise many types; all mean "not a valid file"
        raise ConfigFileError(f"{path}: cannot parse config file: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: config file must hold a mapping of option: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    if command is None:
        return parser
    return parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]


def _strict_parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parse_args``, but an unknown flag is reported with the usage of the command it was
    given to (``blink serve``'s, not the top level's), naming the migration table."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = _subparser(parser, args.command)
        hint = (f" (flags of 'vllm serve' that Blink takes are listed in {VLLM_MIGRATION_DOC}; "
                f"'blink {args.command} --help' lists all)") if args.command else ""
        sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return args


def _model_from_positional(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``blink serve MODEL`` (vLLM's form) is ``--model MODEL``; both at once must agree."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model not in (DEFAULT_MODEL, tag):
        _subparser(parser, args.command).error(
            f"the model is given twice, as MODEL ({tag!r}) and as --model ({args.model!r}); "
            f"give one")
    args.model = tag


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``, filling unset flags from ``--config`` when given."""
    parser = build_parser()
    args = _strict_parse(parser, argv)
    config_path = getattr(args, "config", None)
    if config_path is None:
        _model_from_positional(parser, args)
        return args
    values = _load_config_file(config_path)
    sub = _subparser(parser, args.command)
    known = {a.dest: a for a in sub._actions}
    unknown = sorted(set(values) - set(known) - {"config"})
    if unknown:
        raise ConfigFileError(f"{config_path}: unknown option(s): {', '.join(unknown)}")
    for dest, value in values.items():
        action = known[dest]
        if action.nargs == "+" and not isinstance(value, list):  # one name, or a list
            value = [value]
        if action.nargs == 0 and not isinstance(value, bool):  # an on/off flag
            raise ConfigFileError(f"{config_path}: {dest} must be true or false, got {value!r}")
        if action.type is not None and value is not None and not isinstance(value, bool):
            try:
                value = action.type(value)
            except (TypeError, ValueError):
                kind = getattr(action.type, "__name__", str(action.type))
                raise ConfigFileError(f"{config_path}: {dest} must be of type {kind}, got {value!r}") from None
        if action.choices is not None and value not in action.choices:
            raise ConfigFileError(
                f"{config_path}: {dest} must be one of {', '.join(map(str, action.choices))}, got {value!r}"
            )
        sub.set_defaults(**{dest: value})
    args = _strict_parse(parser, argv)
    _model_from_positional(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.command is None:
            build_parser().print_help()
            return 2
        if args.command == "convert":
            from blink.loader import convert_gguf_to_hf

            import torch

            out = convert_gguf_to_hf(args.gguf, args.outdir, dtype=getattr(torch, args.dtype))
            print(f"wrote {out}")
            return 0
        if args.command == "thread-policy":
            from blink.threads.command import run_thread_policy_command

            return run_thread_policy_command(args)
        if args.command == "engine":
            from blink.launcher import run_engine

            return run_engine(args)
        if args.command == "serve":
            if args.frontend_only:
                from blink.frontend_main import run_frontend

                return run_frontend(args)
            from blink.launcher import run_serve

            return run_serve(args)
        raise AssertionError(f"unhandled command {args.command}")  # argparse restricts choices
    except BlinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
