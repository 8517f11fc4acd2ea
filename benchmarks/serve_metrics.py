"""Serving-benchmark metrics, defined exactly as vLLM's ``benchmarks/benchmark_serving.py``.

Per successful request the client records (all times in seconds, from the moment the request
was sent):

- ``ttft``: arrival of the first streamed chunk that carries text;
- ``itl``: the gaps between consecutive text-carrying chunks (one entry per gap, so a chunk
  that bundles several tokens counts as one gap);
- ``latency`` (E2EL): arrival of ``data: [DONE]`` (the end of the stream);
- ``output_tokens``: from the server's ``usage`` (``include_usage``), else counted by
  re-tokenizing the generated text.

From these, over the successful requests:

- TPOT of a request = ``(latency - ttft) / (output_tokens - 1)``, only for requests with more
  than one output token (goodput treats the others' TPOT as 0);
- ITL = all gaps of all requests pooled together;
- percentiles are ``numpy.percentile`` (linear interpolation), reported in milliseconds;
- throughputs divide by the benchmark's wall-clock duration (first send to last completion);
- goodput = requests meeting every given SLO (``ttft``, ``tpot``, ``e2el`` in ms, inclusive)
  per second.

This module is pure numpy and has no I/O, so the unit tests can check it on hand-made traces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

#: Percentiles reported by default (the paper's P50/P90/P95/P99/P99.9).
DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0, 99.9)
#: Latency metrics that get mean/median/std/percentiles.
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    """What the client observed for one request."""

    success: bool = False
    prompt_len: int = 0             # prompt tokens (usage, else the dataset's count)
    output_tokens: int | None = None  # from usage; None -> count generated_text
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    start_time: float = 0.0         # perf_counter at send (for timelines)
    chunks: int = 0                 # text-carrying chunks received
    retries: int = 0                # sends again after a pooled connection closed unanswered


def percentile_label(p: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9' (the key used in result JSON)."""
    return "p" + (str(int(p)) if float(p).is_integer() else repr(float(p)))


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"invalid --goodput item {item!r}: expected NAME:MS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid --goodput value in {item!r}: not a number") from None
        if ms < 0:
            raise ValueError(f"invalid --goodput value in {item!r}: must be >= 0")
        out[name] = ms
    return out


def request_tpot(output: RequestOutput, output_len: int) -> float | None:
    """vLLM's TPOT of one request, or None when it has at most one output token."""
    if output_len > 1:
        return (output.latency - output.ttft) / (output_len - 1)
    return None


def _stats(values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/std/min/max/percentiles in ms; zeros for an empty list (as vLLM's ``or 0``)."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    out = {
        "mean": float(np.mean(arr)),
        "median": float(np.median(arr)),
        "std": float(np.std(arr)),
        "min": float(np.min(arr)),
        "max": float(np.max(arr)),
    }
    for p in percentiles:
        out[percentile_label(p)] = float(np.percentile(arr, p))
    return out


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    *,
    count_tokens: Any = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Aggregate per-request observations into the benchmark's metrics.

    ``count_tokens(text) -> int`` counts output tokens of requests whose server gave no usage.
    Returns a flat-ish dict: counts and throughputs at top level, and ``{metric}_ms`` dicts with
    mean/median/std/min/max/pXX for ttft, tpot, itl and e2el.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    goodput = dict(goodput or {})
    output_lens: list[int] = []
    total_input = 0
    completed = 0
    good = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    counted_by_tokenizer = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        n = out.output_tokens
        if n is None:
            if count_tokens is None:
                raise ValueError("a request has no usage and no tokenizer was given to count it")
            n = int(count_tokens(out.generated_text))
            counted_by_tokenizer += 1
        output_lens.append(n)
        total_input += out.prompt_len
        tpot = request_tpot(out, n)
        if tpot is not None:
            tpots.append(tpot)
        itls.extend(out.itl)
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1
        if goodput:
            observed = {"ttft": out.ttft, "tpot": tpot or 0.0, "e2el": out.latency}
            if all(observed[k] <= v / 1000.0 for k, v in goodput.items()):
                good += 1
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "num_requests": len(outputs),
        "completed": completed,
        "failed": len(outputs) - completed,
        "resent_after_closed_connection": sum(out.retries for out in outputs),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "output_tokens_counted_by_tokenizer": counted_by_tokenizer,
        "request_throughput": completed / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": (good / duration_s) if goodput else None,
        "goodput_slo_ms": goodput or None,
        "percentiles": list(percentiles),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result[f"{name}_ms"] = _stats(values, percentiles)
    return result


def format_report(m: Mapping[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The human-readable block printed after a run (vLLM's layout)."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = fmt.format(value) if isinstance(value, (int, float)) and value is not None else str(value)
        lines.append(f"{label:<44} {text}")

    if m.get("offered_rate") is not None:
        row("Offered request rate (req/s):", m["offered_rate"])
    if m.get("max_concurrency") is not None:
        row("Max concurrency:", m["max_concurrency"], "{}")
    row("Successful requests:", m["completed"], "{}")
    row("Failed requests:", m["failed"], "{}")
    if m.get("resent_after_closed_connection"):
        row("Sent again (connection closed unanswered):", m["resent_after_closed_connection"], "{}")
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"], "{}")
    row("Total generated tokens:", m["total_output_tokens"], "{}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    heads = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in LATENCY_METRICS:
        s = m[f"{name}_ms"]
        lines.append(f"{heads[name]:-^60}")
        row(f"Mean {name.upper()} (ms):", s["mean"])
        for p in m["percentiles"]:
            lab = percentile_label(p)
            row(f"{lab.upper()} {name.upper()} (ms):", s[lab])
    lines.append("=" * 60)
    return "\n".join(lines)
