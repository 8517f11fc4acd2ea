"""``blink engine`` (the host half) and ``blink serve`` (engine + frontend as two processes).

``blink serve`` is a small supervisor: it starts ``blink engine`` and waits for its bootstrap
address, starts the frontend (``blink serve --frontend-only``) against it, prints the URL, and
then watches both. SIGINT/SIGTERM stop the frontend first (it stops accepting and finishes
its responses), then the engine (which drains what is in flight); if either child dies, the
other is stopped too and the exit status is non-zero. The engine removes its shared-memory
region on every exit path, and removes stale ones left by a crashed engine at start.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from blink.errors import BlinkError

ENGINE_READY_PREFIX = "BLINK_ENGINE_READY "
FRONTEND_READY_PREFIX = "Blink frontend ready"


def engine_config_from_args(args: argparse.Namespace):
    from blink.engine.engine import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_gib=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        transport=args.transport,
        threads=args.threads,
    )


def run_engine(args: argparse.Namespace) -> int:
    """``blink engine``: load, create the ring, serve the bootstrap, run the loop until a signal."""
    from blink.frontend_main import parse_host_port

    host, port = parse_host_port(args.listen, "--listen")
    from blink.engine.gpu_loop import create_engine
    from blink.transport import BootstrapServer

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = create_engine(engine_config_from_args(args), loop=args.loop)
    server = None
    try:
        model_name = args.served_model_name or args.model
        server = BootstrapServer(
            engine.region, model_name=model_name, max_model_len=engine.max_model_len,
            tokenizer=engine.source, host=host, port=port,
        )
        bound_host, bound_port = server.start()
        engine.start()
        print(f"{ENGINE_READY_PREFIX}{bound_host}:{bound_port}", flush=True)
        print(f"blink engine: model {model_name!r} ({engine.source}), "
              f"dtype {str(engine.dtype).removeprefix('torch.')} ({engine.dtype_reason}), max_model_len "
              f"{engine.max_model_len}, {engine.scheduler_config.num_blocks} KV blocks of "
              f"{engine.scheduler_config.block_size}, bootstrap at {bound_host}:{bound_port}",
              file=sys.stderr, flush=True)
        while not stop.wait(0.2):
            if not engine.alive:
                raise BlinkError(f"the engine loop stopped: {engine.error!r}")
        engine.stop(drain=True)
        return 0
    finally:
        if server is not None:
            server.stop()
        engine.close()


# ------------------------------------------------------------------------------ supervisor

_ENGINE_FLAGS = (
    "model", "served_model_name", "dtype", "device", "max_model_len", "block_size",
    "kv_cache_tokens", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "loop",
    "threads", "transport",
)


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def _wait_for_line(proc: subprocess.Popen, prefix: str, what: str, timeout_s: float,
                   forward_to: IO[str]) -> str:
    """Read ``proc``'s stdout until a line starting with ``prefix``; forward the rest."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    result: list[str] = []

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if not result and line.startswith(prefix):
                result.append(line.strip())
            else:
                forward_to.write(line)
                forward_to.flush()

    thread = threading.Thread(target=reader, name=f"blink-{what}-out", daemon=True)
    thread.start()
    while not result:
        if proc.poll() is not None:
            thread.join(1.0)
            raise BlinkError(f"the {what} exited with status {proc.returncode} before it was ready "
                             f"(its messages are above)")
        if time.monotonic() > deadline:
            raise BlinkError(f"the {what} was not ready after {timeout_s:.0f} s")
        time.sleep(0.05)
    return result[0]


def _stop_child(proc: subprocess.Popen | None, timeout_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def frontend_args(args: argparse.Namespace, address: str) -> list[str]:
    """The ``blink serve --frontend-only`` arguments ``blink serve`` starts its frontend with
    (the API key goes through the environment instead)."""
    out = ["serve", "--frontend-only", "--engine", address, "--host", args.host,
           "--port", str(args.port), "--transport", args.transport,
           "--heartbeat-timeout", repr(args.heartbeat_timeout),
           "--engine-dead-timeout", repr(args.engine_dead_timeout)]
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    return out


def run_serve(args: argparse.Namespace) -> int:
    """``blink serve``: engine and frontend as two processes over the loopback ring."""
    from blink.frontend_main import check_timeout_flags

    check_timeout_flags(args)  # fail at once with one clear line, before starting anything
    if args.model != "null":
        from blink.loader import resolve_model

        resolve_model(args.model)
    python = [sys.executable, "-m", "blink.cli"]
    env = dict(os.environ)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda s, f: stop.set())
    signal.signal(signal.SIGINT, lambda s, f: stop.set())
    engine = frontend = None
    try:
        engine_port = args.engine_port or 0
        engine = subprocess.Popen(
            [*python, "engine", "--listen", f"127.0.0.1:{engine_port}",
             *_flags(args, _ENGINE_FLAGS), *(["--no-prefix-caching"] if args.no_prefix_caching else [])],
            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )
        ready = _wait_for_line(engine, ENGINE_READY_PREFIX, "engine", 600, sys.stderr)
        address = ready[len(ENGINE_READY_PREFIX):]
        frontend_cmd = [*python, *frontend_args(args, address)]
        if args.api_key:
            env["BLINK_API_KEY"] = args.api_key  # not on the command line, where ps shows it
        frontend = subprocess.Popen(frontend_cmd, stdout=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
        _wait_for_line(frontend, FRONTEND_READY_PREFIX, "frontend", 120, sys.stderr)
        print(f"Blink is serving {args.served_model_name or args.model!r} at "
              f"http://{args.host}:{args.port}/v1  (Ctrl-C to stop)", flush=True)
        while not stop.wait(0.2):
            for name, proc in (("engine", engine), ("frontend", frontend)):
                if proc.poll() is not None:
                    raise BlinkError(f"the {name} process exited unexpectedly (status {proc.returncode})")
        return 0
    finally:
        _stop_child(frontend, 15)
        _stop_child(engine, 40)
