"""The frontend process: bootstrap with a running engine, attach the ring, serve HTTP.

Torch-free: this is what runs on the DPU (``blink serve --frontend-only --engine HOST:PORT``),
and what ``blink serve`` starts as its second process.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import resource
import signal

from blink.cli_args import (
    check_frontend_flags,
    check_port_free,
    check_timeout_flags,
    connection_limits,
    parse_host_port,
)
from blink import env as blink_env
from blink.errors import BlinkError
from blink.gc_freeze import freeze_startup_heap
from blink.logs import configure_logging
from blink.supervision import raise_open_files_limit, watch_supervisor
from blink.threads.roles import set_thread_name
from blink.threads.runtime import load_thread_policy, start_thread_policy

logger = logging.getLogger("blink.frontend")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, which skips our cleanup and
        exits with -15; we handle the signals ourselves instead."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    return Server


async def _serve(args: argparse.Namespace, addresses: list[tuple[str, int]]) -> None:
    _Server = _server_class()
    from blink.dpu.app import app_options, create_app
    from blink.dpu.http_server import uvicorn_config
    from blink.dpu.ring_engine_client import ReconnectingEngineClient, RingEngineClient
    from blink.dpu.tokenizer import Tokenizer, read_chat_template
    from blink.shared.sampling_params import seed_unseeded_requests

    secret = frontend_secret(args)

    async def connect_one(host: str, port: int):
        async def attach() -> RingEngineClient:
            return await RingEngineClient.connect(
                host, port, secret=secret, expect_transport=args.transport,
                heartbeat_timeout_s=args.heartbeat_timeout,
                engine_dead_timeout_s=args.engine_dead_timeout,
                align_to_steps=blink_env.is_true("BLINK_FRONTEND_POLL_ALIGN", default=True),
                doorbell=blink_env.is_true("BLINK_FRONTEND_DOORBELL", default=True),
            )

        # The first attach must work (a wrong address or secret is a start-up error); after
        # that a dead engine is reconnected to (blink serve restarts it on the same port).
        return ReconnectingEngineClient(await attach(), attach, where=f"{host}:{port}")

    clients = []
    try:
        for host, port in addresses:
            clients.append(await connect_one(host, port))
    except BaseException:
        for c in clients:
            await c.close()
        raise
    if len(clients) == 1 and (clients[0].info.connection.get("engine_role", "both") == "both"):
        engine = clients[0]
    else:  # several engines, or a prefill/decode one: the router (docs/disaggregation.md)
        from blink.dpu.disaggregated import DisaggregatedEngineClient, EngineInstance

        engine = DisaggregatedEngineClient(
            [EngineInstance(f"{h}:{p}", c) for (h, p), c in zip(addresses, clients)])
    engines_text = ", ".join(f"{h}:{p}" for h, p in addresses)
    try:
        tokenizer = Tokenizer.from_pretrained(args.tokenizer or engine.info.tokenizer)
        if args.chat_template is not None:
            tokenizer.use_chat_template(read_chat_template(args.chat_template))
        seed_unseeded_requests(args.seed)
        model_name = getattr(args, "served_model_name", None) or engine.model_name  # a list
        api_key = args.api_key or blink_env.get("BLINK_API_KEY") or None
        app = create_app(engine, tokenizer, model_name=model_name, api_key=api_key,
                         **app_options(args))  # request limits, docs (blink.dpu.limits)
        # log_config=None: uvicorn's loggers go to Blink's handler (blink.logs); the access
        # log is Blink's own (blink.access, with the request id), uvicorn's stays off.
        # h11 with header/body deadlines and a connection cap (blink.dpu.http_server)
        config = uvicorn_config(
            app, connection_limits(args), host=args.host, port=args.port, log_config=None,
            log_level=args.uvicorn_log_level, access_log=False, timeout_graceful_shutdown=10,
            root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
        )
        server = _Server(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # graceful stop, then a normal exit 0
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        engine.start()
        serve_task = asyncio.create_task(server.serve())
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.05)
        if server.started:
            freeze_startup_heap(logger, "frontend")  # (blink.gc_freeze)
            scheme = "https" if args.ssl_certfile else "http"
            print(f"Blink frontend ready: {scheme}://{args.host}:{args.port}"
                  f"{args.root_path or ''}/v1 (model {model_name!r}, engine {engines_text})",
                  flush=True)
        await serve_task
        if not server.started:
            raise BlinkError(f"the HTTP server could not start on {args.host}:{args.port} "
                             f"(is the port in use?)")
    finally:
        await engine.close()


def frontend_secret(args: argparse.Namespace) -> bytes | None:
    """The bootstrap secret: ``--bootstrap-secret-file``, else what ``blink serve`` passed in
    ``$BLINK_BOOTSTRAP_SECRET`` (removed from the environment as it is read), else None (the
    engine then refuses, and the error says how to pass it)."""
    from blink.transport.auth import load_secret_file, secret_from_env

    from_env = secret_from_env()
    path = getattr(args, "bootstrap_secret_file", None)
    if path is not None:
        return load_secret_file(path)
    return from_env


def http_capacity(args: argparse.Namespace) -> int:
    """Raise the soft open-files limit to the hard one (each connection holds a descriptor;
    the usual soft default, 1024, is what ~1,000 idle connections exhaust), then the
    connection cap it leaves: said in one line, or a :class:`BlinkError` if too few."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft, hard = raise_open_files_limit()
    limits = connection_limits(args)
    try:
        cap = limits.connection_cap(soft)
    except ValueError as exc:
        raise BlinkError(f"--max-connections: {exc}") from None
    logger.info("HTTP: at most %d connections at once (open-files limit %d%s), request heads "
                "within %g s, bodies within %g s", cap, soft,
                f", raised from {before}" if soft != before else "", limits.header_timeout_s,
                limits.body_timeout_s)
    return cap


def run_frontend(args: argparse.Namespace) -> int:
    """Entry point of ``blink serve --frontend-only --engine HOST:PORT``."""
    if not args.engine:
        raise BlinkError("--frontend-only needs --engine HOST:PORT (the engine's bootstrap address)")
    if getattr(args, "disaggregated", False):
        raise BlinkError("--disaggregated starts engines, --frontend-only none: give the frontend "
                         "one --engine HOST:PORT per running engine instead")
    configure_logging(args.log_level, uvicorn_level=args.uvicorn_log_level)
    engines = [args.engine] if isinstance(args.engine, str) else list(args.engine)
    addresses = [parse_host_port(e) for e in engines]
    check_timeout_flags(args)
    check_frontend_flags(args)
    check_port_free(args.host, args.port)  # before the engine handshake and tokenizer load
    http_capacity(args)
    thread_policy = load_thread_policy(getattr(args, "thread_policy", None))
    watch_supervisor("frontend")  # die with the blink serve that started us
    set_thread_name("blink-http")  # the event loop runs on this thread (asyncio.run below)
    threads = start_thread_policy("frontend", thread_policy)
    try:
        asyncio.run(_serve(args, addresses))
    except KeyboardInterrupt:
        pass
    finally:
        threads.stop()
    return 0
