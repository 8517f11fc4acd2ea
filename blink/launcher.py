"""``blink engine`` (the host half) and ``blink serve`` (engine + frontend as two processes).

``blink serve`` is a small supervisor: it generates the bootstrap secret, starts ``blink
engine`` and waits for its bootstrap address, starts the frontend (``blink serve
--frontend-only``) against it, prints the URL, and then watches both. SIGINT/SIGTERM stop the
frontend first (it stops accepting and finishes its responses), then the engine (which drains
what is in flight). If the engine dies it is restarted on the same bootstrap port (bounded
exponential back-off, at most ``--max-engine-restarts`` in ``--engine-restart-window``; off
with ``--no-engine-restart``) while the frontend keeps running, answers 503 + Retry-After and
re-bootstraps to the new engine by itself. If the frontend dies it is restarted on the same
HTTP port while the engines keep running (``--max-frontend-restarts``; off with
``--no-frontend-restart``); the new frontend takes over the slots the dead one left in the
ring. If a child cannot be restarted, everything stops with a non-zero status; an engine with
no frontend attached stops without draining (nobody would read what it finishes).

Both children die with the supervisor, even when it is killed outright (SIGKILL, OOM):
``PR_SET_PDEATHSIG`` is set between fork and exec, and each child also watches its parent pid
(:func:`blink.supervision.watch_supervisor`), which covers the cases where the death signal is not delivered
(it follows the forking *thread*, and is lost if the parent died before it was set).
The engine removes its shared-memory region on every exit path, and removes stale ones left by
a crashed engine at start.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import IO

from blink.cli_args import (
    check_frontend_flags,
    check_port_free,
    check_timeout_flags,
    check_removed_flags,
    check_vllm_flags,
    frontend_limit_args,
    frontend_passed_args,
    parse_host_port,
)
from blink import env as blink_env
from blink.engine_options import SHARED_SERVE_FLAGS, engine_config_kwargs, forwarded_argv
from blink.errors import BlinkError
from blink.gc_freeze import freeze_startup_heap
from blink.logs import configure_logging
from blink.shared import cpu_features
from blink.supervision import (
    SUPERVISOR_PID_ENV,
    child_preexec,
    raise_open_files_limit,
    watch_supervisor,
)
from blink.threads.roles import set_thread_name
from blink.threads.runtime import SNAPSHOT_ENV, load_thread_policy, start_thread_policy

ENGINE_READY_PREFIX = "BLINK_ENGINE_READY "
#: the engine's OpenMP wait policy unless $OMP_WAIT_POLICY is set (see run_engine)
OMP_WAIT_POLICY_DEFAULT = "PASSIVE"
FRONTEND_READY_PREFIX = "Blink frontend ready"
#: restart back-off: first delay, cap, and how long an engine must live to reset it
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_STABLE_S = 60.0
DEFAULT_MAX_ENGINE_RESTARTS = 5
DEFAULT_ENGINE_RESTART_WINDOW_S = 300.0
logger = logging.getLogger("blink.serve")
engine_logger = logging.getLogger("blink.engine")


def engine_config_from_args(args: argparse.Namespace):
    """The :class:`EngineConfig` a ``blink serve`` / ``blink engine`` command line means: every
    field from its declaration in :mod:`blink.engine_options`."""
    from blink.engine.engine import EngineConfig

    check_removed_flags(args)
    return EngineConfig(**engine_config_kwargs(args))


def engine_secret(args: argparse.Namespace) -> tuple[bytes, Path | None, bool]:
    """(secret, file, created) for ``blink engine``: ``$BLINK_BOOTSTRAP_SECRET`` from ``blink
    serve`` (no file), else ``--bootstrap-secret-file`` (read, or created 0600 if missing),
    else a fresh secret that the caller writes to the default path once the port is known."""
    from blink.transport.auth import load_or_create_secret_file, secret_from_env

    from_env = secret_from_env()
    path = getattr(args, "bootstrap_secret_file", None)
    if path is not None:
        secret, created = load_or_create_secret_file(path)
        return secret, Path(path), created
    if from_env is not None:
        return from_env, None, False
    from blink.transport.auth import generate_secret

    return generate_secret(), None, True


def cap_torch_isa(environ: MutableMapping[str, str]) -> str | None:
    """Under ``$BLINK_CPU_ISA``: torch's own ISA caps put in ``environ`` where unset (before
    torch loads, so that its kernels act as on that CPU too); the start log's line, else None."""
    cap = cpu_features.isa_cap()
    if not cap:
        return None
    for name, value in cpu_features.torch_env().items():
        environ.setdefault(name, value)
    return (f"{cpu_features.ISA_ENV}={cap}: the CPU kernels act as on {cpu_features.CAPS[cap].means} "
            f"(torch: {', '.join(f'{k}={environ[k]}' for k in cpu_features.torch_env())})")


def run_engine(args: argparse.Namespace) -> int:
    """``blink engine``: load, create the ring, serve the bootstrap, run the loop until a signal."""

    configure_logging(getattr(args, "log_level", "info"))
    # Before torch (and libgomp) load: idle OpenMP workers sleep instead of spinning unless
    # the user chose otherwise. Measured on this shared 2-core host with the thread policy on:
    # 1.85x the output tok/s of spinning workers quiet, 1.54x beside stress-ng (spinning is
    # ~15 % faster only on an idle dedicated host); docs/performance.md#threads.
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY_DEFAULT)
    isa_note = cap_torch_isa(os.environ)
    if isa_note:
        engine_logger.info("%s", isa_note)
    host, port = parse_host_port(args.listen, "--listen")
    standalone = blink_env.get(SUPERVISOR_PID_ENV) is None
    for note in check_vllm_flags(args):  # blink serve checked them already; blink engine not
        engine_logger.warning("%s", note)
    secret, secret_path, secret_created = engine_secret(args)  # before the slow model load
    if getattr(args, "fabric", None) is not None:  # a bad fabric file: now, not after the load
        from blink.fabric.kv_paths import FabricConfig

        if getattr(args, "role", "both") != "prefill":
            raise BlinkError("--fabric / --fabric-sender are for --role prefill (the KV senders)")

        FabricConfig.load(args.fabric).sender_id(getattr(args, "fabric_sender", None))
    supervisor_gone = watch_supervisor("engine")  # die with the blink serve that started us
    raise_open_files_limit()  # bootstrap peers and KV peers hold descriptors too
    thread_policy = load_thread_policy(getattr(args, "thread_policy", None))  # a bad file: now
    set_thread_name("blink-engine")
    from blink.engine.factory import create_engine
    from blink.transport import BootstrapServer

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = create_engine(engine_config_from_args(args), loop=args.loop)
    # Before the engine starts its threads: each gets its policy as it is named.
    threads = start_thread_policy("engine", thread_policy,
                                  snapshot_path=blink_env.get(SNAPSHOT_ENV))
    server = None
    try:
        model_name = (args.served_model_name or [args.model])[0]
        server = BootstrapServer(
            engine.region, model_name=model_name, max_model_len=engine.max_model_len,
            tokenizer=engine.source, host=host, port=port, secret=secret,
            kv_region=engine.kv_region,
            kv_layout=engine.kv_layout.to_dict() if engine.kv_layout is not None else None,
            extra={"engine_role": engine.config.role, "kv_peers": list(engine.config.kv_peers)},
            on_doorbell=(lambda bell: setattr(engine, "doorbell", bell)) if engine.rings_doorbell else None,
        )
        engine.attach_kv_peers(secret)
        bound_host, bound_port = server.start()
        if standalone and secret_path is None:
            # No secret given: a fresh one, written where only this user can read it.
            from blink.transport.auth import default_secret_path, write_secret_file

            secret_path = write_secret_file(default_secret_path(bound_port), secret)
        if secret_path is not None:
            engine_logger.info(
                "bootstrap secret %s %s (mode 0600); start the frontend with "
                "--bootstrap-secret-file %s", "written to" if secret_created else "read from",
                secret_path, secret_path)
        engine.start()
        freeze_startup_heap(engine_logger, "engine")  # no full collection scans the model (blink.gc_freeze)
        # One write with its newline (print() writes the end apart): the engine's threads log
        # from here on, and a log line written between the two landed on the same line
        # ("...:47447" + "2026-12-07 ..."), which a reader then took for the address.
        sys.stdout.write(f"{ENGINE_READY_PREFIX}{bound_host}:{bound_port}\n")
        sys.stdout.flush()
        engine_logger.info(
            "role %s, model %r (%s), dtype %s (%s), max_model_len %d, %d KV blocks of %d, "
            "%s compute thread(s), bootstrap at %s:%d", engine.config.role, model_name, engine.source,
            str(engine.dtype).removeprefix("torch."), engine.dtype_reason, engine.max_model_len,
            engine.scheduler_config.num_blocks, engine.scheduler_config.block_size,
            getattr(engine, "loop_threads", "?"), bound_host, bound_port)
        while not stop.wait(0.2):
            if not engine.alive:
                raise BlinkError(f"the engine loop stopped: {engine.error!r}")
        # Drain only for a reader: an orphan's frontend dies with the supervisor too, and with
        # no frontend attached (it exited first, or died) nobody reads what would finish.
        orphan = supervisor_gone is not None and supervisor_gone()
        reader = server.frontend_attached()
        if not reader:
            engine_logger.info("stopping without draining: no frontend is attached to read "
                               "the requests in flight")
        engine.stop(drain=reader and not orphan)
        return 0
    finally:
        if server is not None:
            server.stop()
        engine.close()
        threads.stop()


# ------------------------------------------------------------------------------ supervisor

def serve_engine_threads(engines: int = 1) -> int:
    """``blink serve``'s default ``--threads`` per engine: the cores this process may use
    minus one, which the frontend (and, on a test box, the client) needs, shared by the
    engines. Measured on a 2-core host, one engine, passive OpenMP waits: on SmolLM2-135M
    1 compute thread gave 1.25x the output tok/s of 2 at 16 streams and 1.34x single-stream
    (2026-12-01); since the int8 projection kernel runs every step on the kernel pool, a
    second thread gives 0.99x at 1B and 1.06x at 135M (one run), so the rule does not depend
    on the model's size (docs/performance.md#threads). ``blink engine`` alone (its frontend
    elsewhere, as on a DPU) and the offline ``LLM`` keep torch's default, every core."""
    return max(1, (_cores() - 1) // max(1, engines))


def serve_kernel_threads(engines: int = 1) -> int:
    """``blink serve``'s default ``--kernel-threads`` per engine: every core this process may
    use, shared by the engines. The kernels split prefills' and decode steps' calls; a call's
    parts go to whichever thread is free and the workers sleep between steps
    (kernels/cpu/pool.c), so the frontend's core is borrowed, never waited for: on 2 threads a
    4 x 128-token prefill step ran 1.6x faster, and a 16-stream serve 1.16-1.22x
    (docs/performance.md#kernel-threads)."""
    return max(1, _cores() // max(1, engines))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def engine_child_argv(args: argparse.Namespace, engines: int = 1) -> list[str]:
    """The flags ``blink serve`` hands on to each of its ``blink engine`` children: every
    engine knob declared ``forward`` (blink.engine_options), the shared flags, and the thread
    counts ``blink serve`` picks where they were not given."""
    return [*forwarded_argv(args), *_flags(args, SHARED_SERVE_FLAGS),
            *([] if args.threads is not None else ["--threads", str(serve_engine_threads(engines))]),
            *([] if args.kernel_threads is not None
              else ["--kernel-threads", str(serve_kernel_threads(engines))])]


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            values = value if isinstance(value, list) else [value]  # nargs="+" flags
            out += [f"--{name.replace('_', '-')}", *(str(v) for v in values)]
    return out


class _Stopped(Exception):
    """SIGINT/SIGTERM arrived while the supervisor was waiting for something."""


class _NotReady(BlinkError):
    """A child exited (or timed out) before it printed its ready line."""


def _wait_for_line(proc: subprocess.Popen, prefix: str, what: str, timeout_s: float,
                   forward_to: IO[str], stop: threading.Event | None = None,
                   watch: tuple[tuple[str, subprocess.Popen], ...] = ()) -> str:
    """Read ``proc``'s stdout until a line starting with ``prefix``; forward the rest (also
    after it, for the life of the process). Raises :class:`_Stopped` when ``stop`` is set,
    :class:`_NotReady` if ``proc`` exits or times out first, :class:`BlinkError` if a
    ``watch``ed process exits meanwhile."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    result: list[str] = []

    def reader() -> None:
        set_thread_name("blink-eng-log" if what == "engine" else "blink-fe-log")
        for line in proc.stdout:  # type: ignore[union-attr]
            if not result and line.startswith(prefix):
                result.append(line.strip())
            else:
                forward_to.write(line)
                forward_to.flush()

    thread = threading.Thread(target=reader, name=f"blink-{what}-log", daemon=True)
    thread.start()
    while not result:
        if stop is not None and stop.is_set():
            raise _Stopped()
        if proc.poll() is not None:
            thread.join(1.0)
            raise _NotReady(f"the {what} exited with status {proc.returncode} before it was ready "
                            f"(its messages are above)")
        for name, other in watch:
            if other.poll() is not None:
                raise BlinkError(f"the {name} process exited unexpectedly (status {other.returncode})")
        if time.monotonic() > deadline:
            raise _NotReady(f"the {what} was not ready after {timeout_s:.0f} s")
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


def frontend_args(args: argparse.Namespace, addresses: list[str] | str) -> list[str]:
    """The ``blink serve --frontend-only`` arguments ``blink serve`` starts its frontend with
    (the API key and the bootstrap secret go through the environment instead)."""
    engines = [addresses] if isinstance(addresses, str) else addresses
    out = ["serve", "--frontend-only", *(a for e in engines for a in ("--engine", e)),
           "--host", args.host,
           "--port", str(args.port), "--transport", args.transport,
           "--heartbeat-timeout", repr(args.heartbeat_timeout),
           "--engine-dead-timeout", repr(args.engine_dead_timeout)]
    if args.served_model_name:
        out += ["--served-model-name", *args.served_model_name]
    if getattr(args, "thread_policy", None) is not None:
        out += ["--thread-policy", str(args.thread_policy)]
    return out + frontend_limit_args(args) + frontend_passed_args(args)


def check_disaggregation_flags(args: argparse.Namespace) -> None:
    """``--disaggregated`` and its engine counts: one clear line if they do not fit."""
    if not getattr(args, "disaggregated", False):
        for name in ("prefill_engines", "decode_engines"):
            if getattr(args, name, 1) != 1:
                raise BlinkError(f"--{name.replace('_', '-')} is for --disaggregated")
        fabric_senders(args)  # --fabric without --disaggregated: refused there
        return
    for name in ("prefill_engines", "decode_engines"):
        if getattr(args, name) < 1:
            raise BlinkError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if getattr(args, "loop", "auto") not in ("auto", "cpu"):
        raise BlinkError("--disaggregated runs on the CPU loop only in this release (--loop cpu)")
    fabric_senders(args)  # a bad fabric file: now, before any engine starts


def fabric_senders(args: argparse.Namespace) -> list[str]:
    """``blink serve --disaggregated --fabric FILE``: the sender id of each prefill engine, in
    start order (the file's first ``--prefill-engines`` senders); [] without ``--fabric``."""
    path = getattr(args, "fabric", None)
    if path is None:
        return []
    if not getattr(args, "disaggregated", False):
        raise BlinkError("--fabric is for --disaggregated (or blink engine --role prefill)")
    from blink.fabric.kv_paths import FabricConfig

    config = FabricConfig.load(path)
    if len(config.senders) < args.prefill_engines or len(config.decode) != args.decode_engines:
        raise BlinkError(f"fabric file {path}: {len(config.senders)} senders and {len(config.decode)} "
                         f"decode placements; --disaggregated starts {args.prefill_engines} prefill "
                         f"and {args.decode_engines} decode engines (one sender per prefill engine, "
                         f"exactly one placement per decode engine)")
    return list(config.senders)[: args.prefill_engines]


def check_restart_flags(args: argparse.Namespace) -> None:
    """``--max-engine-restarts`` / ``--engine-restart-window``: one clear line if they do not fit."""
    if getattr(args, "max_engine_restarts", 0) < 0:
        raise BlinkError(f"--max-engine-restarts must be >= 0, got {args.max_engine_restarts}")
    if getattr(args, "max_frontend_restarts", 0) < 0:
        raise BlinkError(f"--max-frontend-restarts must be >= 0, got {args.max_frontend_restarts}")
    if not getattr(args, "engine_restart_window", 1.0) > 0:
        raise BlinkError(f"--engine-restart-window must be positive, got {args.engine_restart_window:g}")


class RestartPolicy:
    """When to restart a dead engine: exponential back-off from ``RESTART_BACKOFF_S`` up to
    ``RESTART_BACKOFF_MAX_S`` (reset once an engine has lived ``RESTART_STABLE_S``), and at
    most ``max_restarts`` restarts within any ``window_s`` seconds."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()
        self._quick_deaths = 0

    def next_delay(self, now: float, engine_lived_s: float) -> float | None:
        """Seconds to wait before the next restart, or None: give up. Records the restart."""
        if engine_lived_s >= RESTART_STABLE_S:
            self._quick_deaths = 0
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return None
        self._times.append(now)
        delay = min(RESTART_BACKOFF_S * 2 ** self._quick_deaths, RESTART_BACKOFF_MAX_S)
        self._quick_deaths += 1
        return delay

    @property
    def recent(self) -> int:
        """Restarts counted in the current window."""
        return len(self._times)


def serve_secret(args: argparse.Namespace) -> bytes:
    """``blink serve``'s bootstrap secret: from ``--bootstrap-secret-file`` (created 0600 if
    missing; lets monitoring tools attach), else fresh for this start."""
    from blink.transport.auth import generate_secret, load_or_create_secret_file

    path = getattr(args, "bootstrap_secret_file", None)
    if path is not None:
        return load_or_create_secret_file(path)[0]
    return generate_secret()


@dataclasses.dataclass(eq=False)
class _EngineChild:
    """One ``blink engine`` child: its role, bootstrap port (fixed after the first start, so
    restarts keep the address the frontend and prefill engines know) and restart policy."""

    role: str
    port: int
    extra: list[str]
    policy: RestartPolicy
    proc: subprocess.Popen | None = None
    started: float = 0.0

    @property
    def name(self) -> str:
        return "engine" if self.role == "both" else f"{self.role} engine"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class _Supervisor:
    """The children of one ``blink serve`` and what to do when one of them dies: one engine, or
    with ``--disaggregated`` a decode and a prefill engine (docs/disaggregation.md)."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], stop: threading.Event) -> None:
        self.args = args
        self.env = env
        self.stop = stop
        self.python = [sys.executable, "-m", "blink.cli"]
        self.engines: list[_EngineChild] = []
        self.frontend: subprocess.Popen | None = None
        self.frontend_argv: list[str] = []
        self.frontend_env: dict[str, str] = {}
        self.frontend_policy = RestartPolicy(getattr(args, "max_frontend_restarts", 5),
                                             args.engine_restart_window)
        self.frontend_started = 0.0

    def _frontend_restarts(self) -> bool:
        """Whether a dead frontend is restarted (then the engines need not watch it)."""
        return not getattr(self.args, "no_frontend_restart", False)

    @property
    def engine(self) -> subprocess.Popen | None:
        """The first engine's process (the only one without --disaggregated)."""
        return self.engines[0].proc if self.engines else None

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        # start_new_session: a terminal's Ctrl-C reaches only us; we stop the children in order.
        return subprocess.Popen([*self.python, *argv], stdout=subprocess.PIPE, text=True,
                                env=env or self.env, start_new_session=True,
                                preexec_fn=child_preexec)

    def _start_engine(self, child: _EngineChild) -> str:
        """Start ``child`` listening on 127.0.0.1:``child.port``; its address once ready."""
        args = self.args
        env = self.env
        if getattr(args, "disaggregated", False) and env.get(SNAPSHOT_ENV):
            # one thread-snapshot file per engine (blink.threads.runtime.snapshot_sources)
            name = f"engine-{child.role}-{self.engines.index(child)}.json"
            env = {**env, SNAPSHOT_ENV: os.path.join(os.path.dirname(env[SNAPSHOT_ENV]), name)}
        child.proc = self._spawn(
            ["engine", "--listen", f"127.0.0.1:{child.port}", "--role", child.role, *child.extra,
             *engine_child_argv(args, self._engine_count())], env)
        watch = (("frontend", self.frontend),) \
            if self.frontend is not None and not self._frontend_restarts() else ()
        # A first start compiles every bucket (blink.engine.compiled): >10 min on 2 busy cores.
        ready = _wait_for_line(child.proc, ENGINE_READY_PREFIX, child.name, 1800, sys.stderr,
                               self.stop, watch)
        address = ready[len(ENGINE_READY_PREFIX):]
        child.port = int(address.rpartition(":")[2])  # restarts reuse it
        child.started = time.monotonic()
        return address

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                raise _Stopped()
            if self.frontend is not None and self.frontend.poll() is not None \
                    and not self._frontend_restarts():
                raise BlinkError(f"the frontend process exited unexpectedly "
                                 f"(status {self.frontend.returncode}; --no-frontend-restart)")

    def _engine_count(self) -> int:
        """How many engines this supervisor runs (all of them, also while the first start)."""
        args = self.args
        if getattr(args, "disaggregated", False):
            return args.decode_engines + args.prefill_engines
        return 1

    def _policy(self) -> RestartPolicy:
        return RestartPolicy(self.args.max_engine_restarts, self.args.engine_restart_window)

    def run(self) -> int:
        args = self.args
        if getattr(args, "disaggregated", False):
            decodes = []
            for i in range(args.decode_engines):  # first: the prefill engines name them
                decode = _EngineChild("decode", (args.engine_port or 0) if i == 0 else 0, [],
                                      self._policy())
                self.engines.append(decode)
                self._start_engine(decode)
                decodes.append(decode)
            peers = [flag for d in decodes for flag in ("--kv-peer", d.address)]
            senders = fabric_senders(args)
            for i in range(args.prefill_engines):
                ark = ["--fabric", str(Path(args.fabric).resolve()), "--fabric-sender", senders[i]] \
                    if senders else []
                prefill = _EngineChild("prefill", 0, peers + ark, self._policy())
                self.engines.append(prefill)
                self._start_engine(prefill)
            addresses = [c.address for c in self.engines]
        else:
            only = _EngineChild("both", args.engine_port or 0, [], self._policy())
            self.engines.append(only)
            addresses = [self._start_engine(only)]
        env = dict(self.env)
        if args.api_key:
            env["BLINK_API_KEY"] = args.api_key  # only the frontend needs it
        self.frontend_argv, self.frontend_env = frontend_args(args, addresses), env
        self._start_frontend()
        scheme = "https" if args.ssl_certfile else "http"
        print(f"Blink is serving {(args.served_model_name or [args.model])[0]!r} at "
              f"{scheme}://{args.host}:{args.port}{args.root_path or ''}/v1  (Ctrl-C to stop)",
              flush=True)
        while not self.stop.wait(0.2):
            if self.frontend.poll() is not None:
                self._restart_frontend()
            for child in self.engines:
                assert child.proc is not None
                if child.proc.poll() is not None:
                    self._restart(child)
        return 0

    def _restart(self, child: _EngineChild) -> None:
        """``child`` died: restart it on its port, within its policy, or give up (raise)."""
        args, policy = self.args, child.policy
        assert child.proc is not None
        status = child.proc.returncode
        if args.no_engine_restart:
            raise BlinkError(f"the {child.name} process exited unexpectedly (status {status}; "
                             f"--no-engine-restart)")
        while True:  # restart until one is ready, within the policy
            now = time.monotonic()
            delay = policy.next_delay(now, now - child.started)
            if delay is None:
                raise BlinkError(
                    f"the {child.name} process exited (status {status}) and was already restarted "
                    f"{policy.recent} times within {policy.window_s:g} s "
                    f"(--max-engine-restarts / --engine-restart-window); giving up")
            logger.warning(
                "the %s exited (status %s); restarting it in %g s (restart %d of at "
                "most %d within %g s); %s", child.name, status, delay, policy.recent,
                policy.max_restarts, policy.window_s,
                "the frontend answers 503 meanwhile" if len(self.engines) == 1 else
                "the frontend serves from the other engine meanwhile")
            self._sleep(delay)
            try:
                self._start_engine(child)
            except _NotReady as exc:
                logger.error("the restarted %s failed: %s", child.name, exc)
                status = child.proc.returncode if child.proc.poll() is not None else "timeout"
                _stop_child(child.proc, 10)
                child.started = time.monotonic()
                continue
            logger.info("the %s is back (pid %d, %s); the frontend reconnects to it",
                        child.name, child.proc.pid, child.address)
            return

    def _start_frontend(self) -> None:
        """Start the frontend against the engines; return once it serves."""
        self.frontend = self._spawn(self.frontend_argv, self.frontend_env)
        self.frontend_started = time.monotonic()
        _wait_for_line(self.frontend, FRONTEND_READY_PREFIX, "frontend", 120, sys.stderr,
                       self.stop, tuple((c.name, c.proc) for c in self.engines))

    def _restart_frontend(self) -> None:
        """The frontend died (a crash, SIGKILL, OOM): start a new one on the same HTTP port
        while the engines keep running (the new one attaches and takes over the slots the dead
        one left in the ring, as any new frontend does), within ``--max-frontend-restarts``;
        or give up (raise)."""
        assert self.frontend is not None
        status = self.frontend.returncode
        if not self._frontend_restarts():
            raise BlinkError(f"the frontend process exited unexpectedly (status {status}; "
                             f"--no-frontend-restart)")
        policy = self.frontend_policy
        while True:
            now = time.monotonic()
            delay = policy.next_delay(now, now - self.frontend_started)
            if delay is None:
                raise BlinkError(
                    f"the frontend process exited (status {status}) and was already restarted "
                    f"{policy.recent} times within {policy.window_s:g} s "
                    f"(--max-frontend-restarts / --engine-restart-window); giving up")
            logger.warning(
                "the frontend exited (status %s); restarting it in %g s (restart %d of at most "
                "%d within %g s); the engine keeps running, clients get connection refused "
                "meanwhile", status, delay, policy.recent, policy.max_restarts, policy.window_s)
            self._sleep(delay)
            try:
                self._start_frontend()
            except _NotReady as exc:
                logger.error("the restarted frontend failed: %s", exc)
                status = self.frontend.returncode if self.frontend.poll() is not None else "timeout"
                _stop_child(self.frontend, 10)
                continue
            logger.info("the frontend is back (pid %d)", self.frontend.pid)
            return

    def shutdown(self) -> None:
        _stop_child(self.frontend, 15)
        for child in reversed(self.engines):  # prefill first: it writes into the decode engine
            _stop_child(child.proc, 40)


def run_serve(args: argparse.Namespace) -> int:
    """``blink serve``: engine and frontend as two processes over the loopback ring."""
    from blink.transport.auth import SECRET_ENV

    configure_logging(args.log_level)
    check_timeout_flags(args)  # fail at once with one clear line, before starting anything
    check_restart_flags(args)
    check_disaggregation_flags(args)
    check_frontend_flags(args)
    notes = check_vllm_flags(args)
    check_port_free(args.host, args.port)  # before the model load, which can take minutes
    for note in notes:
        logger.warning("%s", note)
    from blink.dpu.app import app_options

    app_options(args)  # the frontend's own flags (tool calling) too
    if args.model != "null":
        from blink.loader import resolve_model

        resolve_model(args.model)
    set_thread_name("blink-serve")
    raise_open_files_limit()  # the children inherit it (the frontend's connections need it)
    # A bad policy file fails here, before anything starts; the supervisor's own threads get
    # it too. The engine publishes its threads' snapshot in a file the frontend's /metrics reads.
    threads = start_thread_policy("supervisor", load_thread_policy(getattr(args, "thread_policy", None)))
    snapshot_dir = tempfile.mkdtemp(prefix="blink-threads-")
    env = dict(os.environ)
    env[SNAPSHOT_ENV] = os.path.join(snapshot_dir, "engine.json")
    # numpy's OpenBLAS starts an idle worker per extra core at import; neither child does
    # BLAS through numpy (torch has its own), so that unnamed thread is left out.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY_DEFAULT)  # see run_engine
    # Private to the children: in their environment (readable only by this user), never on
    # a command line (which ps shows to everyone).
    env[SECRET_ENV] = serve_secret(args).decode()
    env[SUPERVISOR_PID_ENV] = str(os.getpid())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda s, f: stop.set())
    signal.signal(signal.SIGINT, lambda s, f: stop.set())
    supervisor = _Supervisor(args, env, stop)
    try:
        return supervisor.run()
    except _Stopped:
        return 0
    finally:
        supervisor.shutdown()
        threads.stop()
        shutil.rmtree(snapshot_dir, ignore_errors=True)
