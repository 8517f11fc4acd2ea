"""Command-line helpers that more than one command needs (``blink serve``, ``blink engine``,
``blink serve --frontend-only``). Torch-free."""
from __future__ import annotations

import argparse
from pathlib import Path

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
FRONTEND_LIMIT_FLAGS = ("max_request_body_mb", "chat_template_timeout", "grammar_compile_timeout",
                        "grammar_compile_memory_mb", "grammar_cache_mb")
FRONTEND_LIMIT_SWITCHES = ("trust_request_chat_template", "public_docs",
                           "enable_auto_tool_choice", "exclude_tools_when_tool_choice_none")
#: flags handed on only when set
FRONTEND_OPTIONAL_FLAGS = ("tool_call_parser", "reasoning_parser", "scheduling_policy")
#: the HTTP server's connection bounds (blink.dpu.http_server), handed on when given
FRONTEND_CONNECTION_FLAGS = ("http_header_timeout", "http_body_timeout", "max_connections")


def frontend_limit_args(args: argparse.Namespace) -> list[str]:
    """The request-limit flags of ``args`` as ``blink serve --frontend-only`` arguments."""
    out: list[str] = []
    for name in FRONTEND_LIMIT_FLAGS:
        out += [f"--{name.replace('_', '-')}", repr(getattr(args, name))]
    for name in FRONTEND_LIMIT_SWITCHES:
        if getattr(args, name, False):
            out.append(f"--{name.replace('_', '-')}")
    for name in FRONTEND_OPTIONAL_FLAGS + FRONTEND_CONNECTION_FLAGS:
        if getattr(args, name, None) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


# -- vLLM's flags -----------------------------------------------------------------------------

#: frontend flags ``blink serve`` hands on to its frontend process as they are
FRONTEND_PASSED_FLAGS = ("root_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
                         "allowed_origins", "allowed_methods", "allowed_headers", "tokenizer",
                         "chat_template", "seed", "uvicorn_log_level", "log_level",
                         "disable_access_log_for_endpoints", "max_log_len")
FRONTEND_PASSED_SWITCHES = ("allow_credentials", "disable_log_requests",
                            "disable_uvicorn_access_log", "enable_log_requests",
                            "enable_log_outputs")


def frontend_passed_args(args: argparse.Namespace) -> list[str]:
    """The HTTP/tokenizer flags of ``args`` as ``blink serve --frontend-only`` arguments."""
    out: list[str] = []
    for name in FRONTEND_PASSED_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    for name in FRONTEND_PASSED_SWITCHES:
        if getattr(args, name, False):
            out.append(f"--{name.replace('_', '-')}")
    return out


def prefix_caching_enabled(args: argparse.Namespace) -> bool:
    """``--no-prefix-caching`` and vLLM's ``--[no-]enable-prefix-caching``: on unless turned
    off; contradicting each other is an error."""
    vllm_switch = getattr(args, "enable_prefix_caching", None)
    if vllm_switch and args.no_prefix_caching:
        raise BlinkError("--enable-prefix-caching and --no-prefix-caching contradict each other")
    return not args.no_prefix_caching and vllm_switch is not False


def check_removed_flags(args: argparse.Namespace) -> None:
    """Flags Blink once had and no longer takes: refused with what to use instead (never
    silently ignored)."""
    if getattr(args, "grammar_region_mb", None) is not None:
        raise BlinkError("--grammar-region-mb was removed: structured outputs now use one token "
                         "mask per slot (no shared region to size); --no-structured-outputs "
                         "turns them off")


def check_vllm_flags(args: argparse.Namespace, *, device_known: str | None = None) -> list[str]:
    """Refuse the ``vllm serve`` flags Blink cannot honour (a :class:`BlinkError` naming the
    flag and what to do instead); return notes for those that have no effect here, for the
    start log. ``device_known``: the resolved device, where the caller knows it. Removed
    flags are refused too (:func:`check_removed_flags`)."""
    check_removed_flags(args)
    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(args, flag, 1)
        if value != 1:
            what = flag.removesuffix("_size").replace("_", " ")
            hint = (" For more throughput run one 'blink serve' per device behind a load "
                    "balancer (deploy/README.md)." if flag == "data_parallel_size" else "")
            raise BlinkError(f"--{flag.replace('_', '-')} {value}: Blink has no {what} yet; "
                             f"a model runs on one device (only 1 is accepted).{hint}")
    from blink.shared.sampling_params import MAX_LOGPROBS

    if not 0 <= getattr(args, "max_logprobs", 0) <= MAX_LOGPROBS:
        raise BlinkError(f"--max-logprobs must be between 0 and {MAX_LOGPROBS} (what the "
                         f"sampler computes), got {args.max_logprobs}")
    prefix_caching_enabled(args)
    notes: list[str] = []
    if getattr(args, "enable_chunked_prefill", None) is False:
        raise BlinkError("--no-enable-chunked-prefill: Blink always chunks long prefills (it "
                         "cannot be turned off); drop the flag, and bound a step's prefill "
                         "with --max-num-batched-tokens N")
    notes += _check_vllm_frontend_flags(args)
    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    if kv_dtype not in ("auto", "bfloat16"):
        raise BlinkError(f"--kv-cache-dtype {kv_dtype}: Blink's KV cache has the model's dtype "
                         f"(no fp8 or other quantized cache); use --kv-cache-dtype auto, or "
                         f"bfloat16 with --dtype bfloat16")
    if kv_dtype == "bfloat16":
        if getattr(args, "dtype", "auto") == "float32":
            raise BlinkError("--kv-cache-dtype bfloat16 with --dtype float32: Blink's KV cache "
                             "has the model's dtype; use --dtype bfloat16, or --kv-cache-dtype "
                             "auto for a float32 cache")
        if getattr(args, "dtype", "auto") == "auto":
            args.dtype = "bfloat16"
            notes.append("--kv-cache-dtype bfloat16: the model runs in bfloat16 (--dtype "
                         "bfloat16; Blink's KV cache has the model's dtype)")
    utilization = getattr(args, "gpu_memory_utilization", None)
    if utilization is not None:
        if not 0 < utilization <= 1:
            raise BlinkError(f"--gpu-memory-utilization must be in (0, 1], got {utilization:g}")
        device = device_known or getattr(args, "device", "auto")
        if device == "auto":
            import torch  # only where the flag was given: the frontend never gets here

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device != "cpu":
            raise BlinkError(
                f"--gpu-memory-utilization {utilization:g}: Blink does not size the KV cache "
                f"as a fraction of GPU memory; give its size instead with --kv-cache-memory "
                f"GIB (default 1) or --kv-cache-tokens N")
        notes.append(f"--gpu-memory-utilization {utilization:g} has no effect on the CPU; the "
                     f"KV cache is sized by --kv-cache-memory ({args.kv_cache_memory:g} GiB) or "
                     f"--kv-cache-tokens")
    if getattr(args, "trust_remote_code", False):
        notes.append("--trust-remote-code has no effect: Blink never runs code shipped with a "
                     "checkpoint (its model classes are built in)")
    return notes


def _check_vllm_frontend_flags(args: argparse.Namespace) -> list[str]:
    """Issue 33's ``vllm serve`` flags: honoured where they mean something here, else refused
    naming the flag and what to do; the notes of those that have no effect."""
    import json

    notes: list[str] = []
    if getattr(args, "dtype", "auto") in ("half", "float16"):
        raise BlinkError(f"--dtype {args.dtype}: Blink's kernels run bfloat16 or float32, not "
                         f"float16; use --dtype bfloat16 (the same memory) or --dtype auto")
    if getattr(args, "generation_config", "auto") != "auto":
        raise BlinkError(f"--generation-config {args.generation_config}: Blink always takes "
                         f"request defaults from the model's own generation_config.json (vLLM's "
                         f"'auto'); drop the flag, or set the values per request")
    parser = getattr(args, "reasoning_parser", None)
    if parser is not None:
        from blink.dpu.reasoning import REASONING_PARSERS

        if parser not in REASONING_PARSERS:
            raise BlinkError(f"--reasoning-parser {parser}: Blink has the reasoning parsers "
                             f"{', '.join(REASONING_PARSERS)} (the <think>...</think> "
                             f"families); drop the flag for other models")
    backends = ("auto", "guidance")
    config = getattr(args, "structured_outputs_config", None)
    if config is not None:
        try:
            parsed = json.loads(config)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BlinkError(f"--structured-outputs-config must be a JSON object, got {config!r}")
        extra = sorted(set(parsed) - {"backend"})
        if extra or parsed.get("backend", "auto") not in backends:
            raise BlinkError(f"--structured-outputs-config {config}: Blink's structured outputs "
                             f"run on llguidance; only {{\"backend\": \"auto\"}} or "
                             f"{{\"backend\": \"guidance\"}} is taken; drop the flag")
    backend = getattr(args, "guided_decoding_backend", None)
    if backend is not None and backend not in backends:
        raise BlinkError(f"--guided-decoding-backend {backend}: Blink's structured outputs run "
                         f"on llguidance; use auto or guidance, or drop the flag")
    content_format = getattr(args, "chat_template_content_format", "auto")
    if content_format != "auto":
        raise BlinkError(f"--chat-template-content-format {content_format}: Blink detects the "
                         f"content format from the chat template; use auto or drop the flag")
    role = getattr(args, "response_role", "assistant")
    if role != "assistant":
        raise BlinkError(f"--response-role {role}: Blink's answers have the role 'assistant' "
                         f"only; drop the flag")
    if getattr(args, "limit_mm_per_prompt", None) is not None:
        raise BlinkError("--limit-mm-per-prompt: Blink serves text-only models (no images, "
                         "audio or video inputs); drop the flag")
    if getattr(args, "swap_space", None) is not None:
        notes.append(f"--swap-space {args.swap_space:g} has no effect: Blink preempts by "
                     f"recomputing (as vLLM V1) and swaps no KV blocks to host memory")
    if getattr(args, "disable_frontend_multiprocessing", False):
        notes.append("--disable-frontend-multiprocessing has no effect: Blink's frontend always "
                     "runs in its own process")
    return notes


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and let go: a port in use is an error before the model loads
    (minutes, for a big one), not after."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # What uvicorn sets too: a port in TIME_WAIT from a previous run is not "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise BlinkError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is "
                             f"another server using the port? pick another with --port)") from None


def check_frontend_flags(args: argparse.Namespace) -> None:
    """The HTTP flags that can be wrong on their own: one clear line before anything starts
    (the frontend checks them again where it runs alone)."""
    from blink.dpu.app import json_list_flag

    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        json_list_flag(args, name)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise BlinkError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path and not Path(path).is_file():
            raise BlinkError(f"--{name.replace('_', '-')} {path}: no such file")
    if args.root_path and not args.root_path.startswith("/"):
        raise BlinkError(f"--root-path must start with '/', got {args.root_path!r}")
    connection_limits(args)


def connection_limits(args: argparse.Namespace):
    """The HTTP server's :class:`blink.dpu.http_server.ConnectionLimits` from
    ``--http-header-timeout``, ``--http-body-timeout`` and ``--max-connections``; a bad value
    is one clear line naming the flag."""
    from blink.dpu.http_server import ConnectionLimits

    for name in ("http_header_timeout", "http_body_timeout"):
        value = getattr(args, name, 1.0)
        if not value > 0:
            raise BlinkError(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    cap = getattr(args, "max_connections", None)
    if cap is not None and cap < 1:
        raise BlinkError(f"--max-connections must be at least 1, got {cap}")
    defaults = ConnectionLimits()
    return ConnectionLimits(
        header_timeout_s=getattr(args, "http_header_timeout", defaults.header_timeout_s),
        body_timeout_s=getattr(args, "http_body_timeout", defaults.body_timeout_s),
        max_connections=cap)
