"""Plots of serving results: latency percentiles and throughput vs offered load, several systems
on one figure (the paper's Figures 6 and 7; solid = isolated, dashed = interference).

Inputs are result JSON files of ``benchmarks.serve`` (one system/condition each, typically a
``--rate-sweep``), of ``benchmarks.interference`` (both conditions) or of ``benchmarks.peers``::

    python -m benchmarks.plot blink.json vllm.json interference.json -o plots/ \\
        --percentile 99

writes ``latency_p99.png`` (TTFT and TPOT vs offered load) and ``throughput.png`` (achieved
request and output-token throughput vs offered load). Runs without an offered rate (closed-loop
``--max-concurrency`` runs) are placed at their achieved request rate.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from benchmarks.serve_metrics import percentile_label


def load_series(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Flatten result files into series: {label, condition, runs}."""
    series: list[dict[str, Any]] = []

    def add(doc: dict[str, Any]) -> None:
        if doc.get("runs"):
            series.append({"label": doc.get("label", "?"), "condition": doc.get("condition", "isolated"),
                           "runs": doc["runs"]})

    for p in paths:
        doc = json.loads(Path(p).read_text())
        if "isolated" in doc and "interference" in doc:      # benchmarks.interference
            add(doc["isolated"])
            add(doc["interference"])
        elif "peers" in doc:                                  # benchmarks.peers
            # the rate sweeps when the run had them, else the single concurrency run
            for row in doc["peers"]:
                for cond in ("isolated", "interference"):
                    suffix = "" if cond == "isolated" else "_interference"
                    if row.get("sweep" + suffix):
                        series.append({"label": row["peer"], "condition": cond,
                                       "runs": row["sweep" + suffix]["runs"]})
                    elif row.get("concurrent" + suffix):
                        series.append({"label": row["peer"], "condition": cond,
                                       "runs": [row["concurrent" + suffix]]})
        else:                                                 # benchmarks.serve
            add(doc)
    return series


def _x(run: dict[str, Any]) -> float:
    rate = run.get("offered_rate")
    return float(rate) if rate is not None else float(run["request_throughput"])


def plot(series: list[dict[str, Any]], outdir: Path, percentile: float = 99.0,
         title: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    lab = percentile_label(percentile)
    labels = sorted({s["label"] for s in series})
    colors = {name: f"C{i}" for i, name in enumerate(labels)}
    style = {"isolated": "-", "interference": "--"}

    def line(ax: Any, s: dict[str, Any], ykey: Any) -> None:
        runs = sorted(s["runs"], key=_x)
        xs = [_x(r) for r in runs]
        ys = [ykey(r) for r in runs]
        ax.plot(xs, ys, style.get(s["condition"], ":"), marker="o", ms=4, color=colors[s["label"]],
                label=f"{s['label']} ({s['condition']})")

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for s in series:
            line(ax, s, lambda r, m=metric: r[m].get(lab, float("nan")))
        ax.set_xlabel("offered load (req/s; achieved for closed-loop runs)")
        ax.set_ylabel(f"{lab.upper()} {name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or f"{lab.upper()} latency vs offered load (solid: isolated, dashed: interference)")
    fig.tight_layout()
    p = outdir / f"latency_{lab}.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in series:
        line(axes[0], s, lambda r: r["request_throughput"])
        line(axes[1], s, lambda r: r["output_throughput"])
    axes[0].set_ylabel("achieved throughput (req/s)")
    axes[1].set_ylabel("output throughput (tok/s)")
    for ax in axes:
        ax.set_xlabel("offered load (req/s; achieved for closed-loop runs)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "Throughput vs offered load (solid: isolated, dashed: interference)")
    fig.tight_layout()
    p = outdir / "throughput.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="result JSON files")
    ap.add_argument("-o", "--outdir", default="bench-plots")
    ap.add_argument("--percentile", type=float, default=99.0)
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    series = load_series(args.results)
    if not series:
        raise SystemExit("no runs found in the given files")
    try:
        paths = plot(series, Path(args.outdir), args.percentile, args.title)
    except ImportError:
        raise SystemExit("matplotlib is not installed: pip install matplotlib (or the 'bench' extra)")
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
