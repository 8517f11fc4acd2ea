"""Control-plane benchmark: Blink's serving path with the model taken out.

Starts ``blink serve --model null`` (the real frontend, ring, scheduler, sampler and device
loop; the forward pass replaced by :class:`blink.engine.null_model.NullExecutor`, which makes a
fixed token win instantly) and drives it with streaming HTTP clients (httpx + asyncio) at
several concurrency levels. What it measures is the cost of everything except the model:
HTTP + tokenization + ring writes + the loop's scheduling/sampling + output streams + SSE.

For each concurrency C, C workers each send streaming ``/v1/completions`` requests back to back
(``ignore_eos``, ``max_tokens`` output tokens) until ``--requests`` have completed. Reported:
requests/s, output tokens/s, TTFT, TPOT ((e2e - ttft) / (tokens - 1)) and ITL (gap between
streamed tokens), P50/P99, plus the engine's own steps/s and tokens per step read from the
ring's control block counters (the ``/metrics`` endpoint does not expose steps; the ring does).

    python benchmarks/control_plane.py                       # 1, 16, 256 streams
    python benchmarks/control_plane.py --concurrency 1 16 --requests 200 --max-tokens 64
    python benchmarks/control_plane.py --url http://127.0.0.1:8000   # an already running server

The client runs on the same machine as the server: on a small machine, its own CPU use is
part of what limits the numbers (see docs/performance.md#control-plane).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

READY = "Blink is serving"


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    res.tokens = usage["completion_tokens"]
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int,
                    prompt: str, probe: EngineProbe | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    results: list[RequestResult] = []
    remaining = n_requests

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        # warm-up: one request per worker (connections opened, code paths hot)
        await asyncio.gather(*(one_request(client, {**body, "max_tokens": 4})
                               for _ in range(min(concurrency, 32))))
        steps0 = probe.read() if probe else None

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                results.append(await one_request(client, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        steps1 = probe.read() if probe else None

    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    tokens = sum(r.tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    itls = [x for r in ok for x in r.itls]
    out = {
        "concurrency": concurrency, "requests": len(results), "ok": len(ok),
        "errors": len(errors), "first_error": errors[0] if errors else None,
        "wall_s": wall, "req_per_s": len(ok) / wall, "tok_per_s": tokens / wall,
        "tokens_per_request": tokens / max(len(ok), 1),
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1e3 * percentile([r.ttft for r in ok], 99),
        "tpot_p50_ms": 1e3 * percentile(tpots, 50),
        "tpot_p99_ms": 1e3 * percentile(tpots, 99),
        "itl_p50_ms": 1e3 * percentile(itls, 50),
        "itl_p99_ms": 1e3 * percentile(itls, 99),
        "itl_mean_ms": 1e3 * statistics.fmean(itls) if itls else float("nan"),
    }
    if steps0 and steps1:
        steps = steps1["steps"] - steps0["steps"]
        gen = steps1["generated"] - steps0["generated"]
        out["engine_steps_per_s"] = steps / wall
        out["engine_tokens_per_step"] = gen / steps if steps else float("nan")
    return out


class EngineProbe:
    """Reads the engine's step and token counters straight from the ring's control block
    (a read-only attach through the bootstrap handshake; no slot is touched)."""

    def __init__(self, address: str, secret_file: Path) -> None:
        from blink.transport.auth import load_secret_file
        from blink.transport.bootstrap import connect

        host, _, port = address.rpartition(":")
        # role monitor: authenticated like a frontend, but holds no frontend lease
        self.info, self.transport = connect(host, int(port), secret=load_secret_file(secret_file),
                                            role="monitor")

    def read(self) -> dict:
        from blink.ring import C_STAT_GENERATED_TOKENS, C_STAT_STEPS, CONTROL_WORDS

        control = self.transport.read(0, CONTROL_WORDS * 8).view("<i8")
        return {"steps": int(control[C_STAT_STEPS]),
                "generated": int(control[C_STAT_GENERATED_TOKENS])}

    def close(self) -> None:
        self.transport.close()


def start_server(port: int, max_num_seqs: int, max_model_len: int, kv_tokens: int,
                 log_path: Path, secret_file: Path) -> tuple[subprocess.Popen, str | None]:
    """``blink serve --model null``; returns the process and the engine's bootstrap address
    (the probe authenticates with ``secret_file``, which serve creates)."""
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--model", "null", "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
           "--kv-cache-tokens", str(kv_tokens), "--bootstrap-secret-file", str(secret_file)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while READY not in log_path.read_text(errors="replace"):
        if proc.poll() is not None:
            raise SystemExit(f"blink serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("blink serve was not ready within 300 s")
        time.sleep(0.2)
    print(f"# server: {' '.join(cmd[1:])}", file=sys.stderr)
    match = re.search(r"bootstrap at (\S+:\d+)", log_path.read_text(errors="replace"))
    return proc, match.group(1) if match else None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_table(rows: list[dict]) -> str:
    cols = [("concurrency", "streams", "{:d}"), ("ok", "ok", "{:d}"), ("errors", "err", "{:d}"),
            ("req_per_s", "req/s", "{:.1f}"), ("tok_per_s", "tok/s", "{:.0f}"),
            ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"), ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
            ("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"), ("tpot_p99_ms", "TPOT p99 ms", "{:.2f}"),
            ("itl_p50_ms", "ITL p50 ms", "{:.2f}"), ("itl_p99_ms", "ITL p99 ms", "{:.2f}")]
    if any("engine_steps_per_s" in r for r in rows):
        cols += [("engine_steps_per_s", "steps/s", "{:.0f}"),
                 ("engine_tokens_per_step", "tok/step", "{:.1f}")]
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "|".join("---:" for _ in cols) + "|"
    body = ["| " + " | ".join(fmt.format(r[key]) if key in r else "-" for key, _, fmt in cols) + " |"
            for r in rows]
    return "\n".join([head, sep, *body])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--engine", default=None, metavar="HOST:PORT",
                    help="with --url: the engine's bootstrap address, to read its step counters")
    ap.add_argument("--bootstrap-secret-file", type=Path, default=None,
                    help="with --engine: the engine's bootstrap secret file")
    ap.add_argument("--model", default="null", help="model name to send (default: null)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per level (default: max(4 * concurrency, 32))")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--prompt", default="Hello, how are you?")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args()

    top = max(args.concurrency)
    proc = None
    url, engine_address, secret_file = args.url, args.engine, args.bootstrap_secret_file
    if url is None:
        port = free_port()
        kv_tokens = max(65536, 2 * top * args.max_model_len // 4)
        secret_file = Path(tempfile.mkdtemp(prefix="blink-bench-")) / "bootstrap.secret"
        proc, engine_address = start_server(
            port, max(top, 16), args.max_model_len, kv_tokens,
            Path(os.environ.get("TMPDIR", "/tmp")) / "blink-control-plane.log", secret_file)
        url = f"http://127.0.0.1:{port}"
    if engine_address and secret_file is None:
        raise SystemExit("--engine needs --bootstrap-secret-file (the engine's bootstrap secret)")
    probe = EngineProbe(engine_address, secret_file) if engine_address else None
    rows = []
    try:
        print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; "
              f"{args.max_tokens} output tokens per request", file=sys.stderr)
        for c in args.concurrency:
            n = args.requests or max(4 * c, 32)
            row = asyncio.run(run_level(url, args.model, c, n, args.max_tokens, args.prompt, probe))
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in row.items()}), file=sys.stderr, flush=True)
    finally:
        if probe is not None:
            probe.close()
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
