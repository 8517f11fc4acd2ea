"""Priority scheduling under saturation (issue 33 item 3): does a high-priority request keep
its idle TTFT while low-priority streams saturate the engine, and do the low ones keep
flowing?

Against a server started with ``--scheduling-policy priority`` (Blink or vLLM)::

    blink serve --model MODEL --scheduling-policy priority --port 8765 &
    python -m benchmarks.bench_priority --base-url http://127.0.0.1:8765 \\
        --low-streams 16 --high-requests 400 --result-json priority.json

One run, three phases:

1. idle: ``--high-requests`` high-priority requests, one at a time: their TTFT (P50/P99).
2. saturated: ``--low-streams`` closed-loop low-priority streams (each sends its next request
   when the last one ends) and, once they run, the same number of high-priority requests,
   one every ``--high-interval`` seconds: their TTFT (P50/P99). The low streams run in a child
   process (``--low-in-process``: in the timing loop), so the loop that times the high
   requests does no more work than in the idle phase.
3. the report: high-priority P99 TTFT saturated / idle (the issue's target: within 2x) with
   the sample counts and a 95% confidence interval for that ratio (:func:`p99_ratio_ci`), and
   the low-priority streams' output throughput (tokens/s) and completed requests while the
   high ones ran (low-priority requests must keep finishing).

A P99 from n samples is an order statistic near the maximum: below ~370 samples not even the
maximum bounds it from above with 97.5% confidence, so the interval's upper end is then
infinite and the report says the target is not shown. Hence the default of 400 high requests
(~200 s saturated at the default interval).

Priorities are vLLM's: lower value = more urgent (``--high-priority`` 0, ``--low-priority``
10 by default). ``--smoke`` shrinks everything for a correctness run (not a measurement).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import httpx
import numpy as np

from benchmarks.serve_client import send_streaming_request


@dataclass
class Result:
    ttft_s: float | None = None  # None: no token came back
    output_tokens: int = 0
    ok: bool = False
    error: str = ""


@dataclass
class Report:
    idle_ttft_p50_s: float
    idle_ttft_p99_s: float
    saturated_ttft_p50_s: float
    saturated_ttft_p99_s: float
    p99_ratio: float  # saturated / idle: the target is <= 2
    low_tokens_per_s: float
    low_completed: int
    low_failed: int
    high_failed: int
    window_s: float
    idle_samples: int = 0  # high-priority TTFTs measured idle
    saturated_samples: int = 0  # and saturated
    p99_ratio_ci: tuple[float, float] = (float("nan"), float("nan"))  # 95%, p99_ratio_ci()
    config: dict[str, Any] = field(default_factory=dict)

    def verdict(self) -> str:
        """Whether the 95% interval shows the target (ratio <= 2), shows it missed, or neither."""
        lo, hi = self.p99_ratio_ci
        if hi <= TARGET_RATIO:
            return "target shown"
        if lo > TARGET_RATIO:
            return "target missed"
        return "not conclusive (more samples, --high-requests, narrow the interval)"

    def text(self) -> str:
        return "\n".join([
            f"high-priority TTFT idle:      P50 {self.idle_ttft_p50_s * 1e3:8.1f} ms  "
            f"P99 {self.idle_ttft_p99_s * 1e3:8.1f} ms",
            f"high-priority TTFT saturated: P50 {self.saturated_ttft_p50_s * 1e3:8.1f} ms  "
            f"P99 {self.saturated_ttft_p99_s * 1e3:8.1f} ms",
            f"P99 ratio saturated/idle:     {self.p99_ratio:.2f}x (target <= {TARGET_RATIO:g}x); "
            f"95% CI [{self.p99_ratio_ci[0]:.2f}, {self.p99_ratio_ci[1]:.2f}] from "
            f"{self.idle_samples} idle / {self.saturated_samples} saturated samples: {self.verdict()}",
            f"low-priority throughput:      {self.low_tokens_per_s:.1f} tokens/s, "
            f"{self.low_completed} requests completed in {self.window_s:.1f} s "
            f"({self.low_failed} failed)",
            f"high-priority failures:       {self.high_failed}",
        ])


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      priority: int) -> Result:
    """One streamed completion through the serving benchmark's client; TTFT = time to the
    first chunk with text. A request fails on an HTTP error, an error chunk or a broken
    stream."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "priority": priority,
            "stream_options": {"include_usage": True}}
    out = await send_streaming_request(http, "/v1/completions", body, chat=False, prompt_len=0)
    ok = out.success and out.chunks > 0
    return Result(ttft_s=out.ttft if ok else None, output_tokens=out.output_tokens or 0, ok=ok,
                  error=out.error)


_WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light", "paper"]


def random_prompt(rng: np.random.Generator, words: int) -> str:
    """``words`` random words: distinct prompts, so no prefix-cache shortcut for the TTFT."""
    return " ".join(rng.choice(_WORDS, words))


TARGET_RATIO = 2.0  # the target: saturated high-priority P99 TTFT within 2x of idle


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _binom_cdfs(n: int, p: float) -> list[float]:
    """P(Binomial(n, p) <= k) for k = 0 .. n - 1: the point probabilities added up in one
    pass (each value the same sum, term by term, as adding its own k + 1 terms)."""
    return list(itertools.accumulate(
        math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                 + i * math.log(p) + (n - i) * math.log1p(-p)) for i in range(n)))


def quantile_bounds(values: list[float], q: float = 0.99, alpha: float = 0.025) -> tuple[float, float]:
    """Distribution-free bounds for the ``q`` quantile from the sorted sample (order
    statistics): the lower one is below it, the upper one above it, each with probability
    at least ``1 - alpha`` (the count of samples below the quantile is Binomial(n, q)).
    An end the sample cannot give (too few values) is -inf / inf."""
    x, n = sorted(values), len(values)
    cdf = _binom_cdfs(n, q)  # cdf[rank - 1]: P(fewer than rank samples below the quantile)
    # lower: X_(l) (1-based) <= quantile when at least l samples are below it
    lo = max((rank for rank in range(1, n + 1) if 1.0 - cdf[rank - 1] >= 1.0 - alpha), default=None)
    # upper: X_(u) >= quantile when at most u - 1 samples are below it
    hi = min((rank for rank in range(1, n + 1) if cdf[rank - 1] >= 1.0 - alpha), default=None)
    return (x[lo - 1] if lo else -math.inf), (x[hi - 1] if hi else math.inf)


def p99_ratio_ci(idle: list[float], saturated: list[float]) -> tuple[float, float]:
    """A 95% confidence interval for P99(saturated) / P99(idle): each P99 bounded from both
    sides at 97.5% (:func:`quantile_bounds`), the ratio's ends from the opposite ends (so
    the interval holds with at least 95% probability, without assuming a distribution)."""
    if not idle or not saturated:
        return float("nan"), float("nan")
    idle_lo, idle_hi = quantile_bounds(idle)
    sat_lo, sat_hi = quantile_bounds(saturated)
    lo = sat_lo / idle_hi if idle_hi > 0 and sat_lo > -math.inf else 0.0
    hi = sat_hi / idle_lo if idle_lo > 0 else math.inf
    return lo, hi


async def run(http: httpx.AsyncClient, *, model: str, low_streams: int = 16,
              high_requests: int = 400, high_interval_s: float = 0.5, prompt_words: int = 200,
              low_max_tokens: int = 256, high_max_tokens: int = 16, low_priority: int = 10,
              high_priority: int = 0, warmup_s: float = 2.0, low_url: str | None = None) -> Report:
    """The three phases over ``http`` (any httpx client: a server's URL or an ASGI app).

    ``low_url``: run the low-priority streams in a child process against that URL, so the
    event loop that times the high-priority requests does only that, as in the idle phase
    (with the streams in the same loop, each high request's first chunk waits behind the
    parsing of the low streams' chunks: client time the idle phase does not have). None:
    every stream in this loop (what an ASGI app needs)."""
    rng = np.random.default_rng(0)

    def prompt() -> str:
        return random_prompt(rng, prompt_words)

    # 1. idle
    idle = [await one_request(http, model, prompt(), high_max_tokens, high_priority)
            for _ in range(high_requests)]
    idle_ttft = [r.ttft_s for r in idle if r.ok]

    # 2. saturated
    def highs() -> Awaitable[list[Result]]:
        return _highs(http, model, prompt, high_requests, high_interval_s, high_max_tokens,
                      high_priority)

    if low_url is None:
        high, done, tokens, window = await _saturated_in_process(
            http, model, prompt, low_streams=low_streams, low_max_tokens=low_max_tokens,
            low_priority=low_priority, warmup_s=warmup_s, highs=highs)
    else:
        high, done, tokens, window = await _saturated_other_process(
            low_url, model, low_streams=low_streams, prompt_words=prompt_words,
            low_max_tokens=low_max_tokens, low_priority=low_priority, warmup_s=warmup_s,
            highs=highs)
    sat_ttft = [r.ttft_s for r in high if r.ok]
    idle_p99, sat_p99 = _pct(idle_ttft, 99), _pct(sat_ttft, 99)
    return Report(
        idle_ttft_p50_s=_pct(idle_ttft, 50), idle_ttft_p99_s=idle_p99,
        saturated_ttft_p50_s=_pct(sat_ttft, 50), saturated_ttft_p99_s=sat_p99,
        p99_ratio=sat_p99 / idle_p99 if idle_p99 > 0 else float("nan"),
        low_tokens_per_s=tokens / window if window > 0 else 0.0,
        low_completed=sum(r.ok for r in done), low_failed=sum(not r.ok for r in done),
        high_failed=sum(not r.ok for r in high) + sum(not r.ok for r in idle),
        window_s=window, idle_samples=len(idle_ttft), saturated_samples=len(sat_ttft),
        p99_ratio_ci=p99_ratio_ci(idle_ttft, sat_ttft),
        config=dict(low_streams=low_streams, high_requests=high_requests,
                    high_interval_s=high_interval_s, prompt_words=prompt_words,
                    low_max_tokens=low_max_tokens, high_max_tokens=high_max_tokens,
                    low_priority=low_priority, high_priority=high_priority,
                    low_streams_in=("this process" if low_url is None else "a child process")))


async def _highs(http: httpx.AsyncClient, model: str, prompt: Callable[[], str], n: int,
                 interval_s: float, max_tokens: int, priority: int) -> list[Result]:
    """``n`` high-priority requests, one every ``interval_s`` seconds (open loop)."""
    async def high_at(delay: float) -> Result:
        await asyncio.sleep(delay)
        return await one_request(http, model, prompt(), max_tokens, priority)

    return list(await asyncio.gather(*(high_at(i * interval_s) for i in range(n))))


async def _saturated_in_process(http, model, prompt, *, low_streams, low_max_tokens, low_priority,
                                warmup_s, highs):
    """Phase 2 with the closed-loop low streams in this event loop: (high results, low
    results finished in the window, their output tokens, window seconds)."""
    stop = asyncio.Event()
    low: list[Result] = []

    async def low_stream() -> None:
        while not stop.is_set():
            low.append(await one_request(http, model, prompt(), low_max_tokens, low_priority))

    streams = [asyncio.create_task(low_stream()) for _ in range(low_streams)]
    await asyncio.sleep(warmup_s)  # the low streams fill the engine
    start, done_before = time.perf_counter(), len(low)
    tokens_before = sum(r.output_tokens for r in low)
    high = await highs()
    window = time.perf_counter() - start
    done = low[done_before:]
    tokens = sum(r.output_tokens for r in low) - tokens_before
    stop.set()
    await asyncio.gather(*streams)
    return high, done, tokens, window


def _low_load_main(url: str, model: str, streams: int, prompt_words: int, max_tokens: int,
                   priority: int, stop: Any, out: Any) -> None:
    """The child process of :func:`_saturated_other_process`: ``streams`` closed-loop
    low-priority streams until ``stop`` is set; puts [(monotonic end time, Result)] on ``out``."""
    rng = np.random.default_rng(1)

    async def go() -> list[tuple[float, Result]]:
        finished: list[tuple[float, Result]] = []
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            async def low_stream() -> None:
                while not stop.is_set():
                    r = await one_request(http, model, random_prompt(rng, prompt_words),
                                          max_tokens, priority)
                    finished.append((time.monotonic(), r))
            await asyncio.gather(*(low_stream() for _ in range(streams)))
        return finished

    out.put(asyncio.run(go()))


async def _saturated_other_process(url, model, *, low_streams, prompt_words, low_max_tokens,
                                   low_priority, warmup_s, highs):
    """Phase 2 with the low streams in a child process (``run``'s ``low_url``); same return
    as :func:`_saturated_in_process` (CLOCK_MONOTONIC is one clock for both processes)."""
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_low_load_main, daemon=True,
                        args=(url, model, low_streams, prompt_words, low_max_tokens,
                              low_priority, stop, out))
    child.start()
    try:
        await asyncio.sleep(warmup_s)  # the low streams fill the engine
        start = time.monotonic()
        high = await highs()
        end = time.monotonic()
        stop.set()
        finished = await asyncio.to_thread(out.get, True, 900)
    finally:
        stop.set()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    done = [r for t, r in finished if start < t <= end]
    return high, done, sum(r.output_tokens for r in done), end - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8765")
    p.add_argument("--model", default=None, help="the 'model' field (default: the server's first)")
    p.add_argument("--low-streams", type=int, default=16)
    p.add_argument("--high-requests", type=int, default=400,
                   help="high-priority requests per phase (400: enough for a bounded P99 interval)")
    p.add_argument("--high-interval", type=float, default=0.5, help="seconds between high requests")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--low-max-tokens", type=int, default=256)
    p.add_argument("--high-max-tokens", type=int, default=16)
    p.add_argument("--low-priority", type=int, default=10)
    p.add_argument("--high-priority", type=int, default=0)
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of low load before measuring")
    p.add_argument("--low-in-process", action="store_true",
                   help="run the low-priority streams in the event loop that times the high ones "
                        "(default: a child process, so that loop waits on nothing the idle phase lacks)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a correctness run only")
    p.add_argument("--result-json", default=None)
    a = p.parse_args(argv)
    sizes = dict(low_streams=a.low_streams, high_requests=a.high_requests,
                 high_interval_s=a.high_interval, prompt_words=a.prompt_words,
                 low_max_tokens=a.low_max_tokens, high_max_tokens=a.high_max_tokens,
                 warmup_s=a.warmup)
    if a.smoke:
        sizes = dict(low_streams=4, high_requests=3, high_interval_s=0.05, prompt_words=8,
                     low_max_tokens=8, high_max_tokens=2, warmup_s=0.2)

    async def go() -> Report:
        async with httpx.AsyncClient(base_url=a.base_url, timeout=600) as http:
            model = a.model or (await http.get("/v1/models")).json()["data"][0]["id"]
            return await run(http, model=model, low_priority=a.low_priority,
                             high_priority=a.high_priority,
                             low_url=None if a.low_in_process else a.base_url, **sizes)

    report = asyncio.run(go())
    print(report.text())
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return 0 if report.high_failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
