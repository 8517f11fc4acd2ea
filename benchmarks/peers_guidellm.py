"""Blink against its peers with guidellm as the client: the issue-35 table as an outside
reviewer measures it (guidellm's own requests, token counts and statistics, not this repo's
client), round by round so that a shared VM's minute-to-minute drift hits every server.

Each round starts every peer in turn (the order reversed every other round), sends one
warm-up request, then runs guidellm's ``concurrent`` profile at 1 stream and at
``--concurrency`` streams (16) on synthetic ``--input-len``-token prompts with a fixed output
length (128 in / 64 out with ``--model-1b``, 128 / 128 for SmolLM2), and stops it. The table
gives each peer's medians over the rounds of guidellm's output tok/s, TTFT p50 / p99 and ITL
p50, and its one-stream decode against the header's memory-bandwidth limit; then blink's
ratios to llama-server by round, and issue 35's targets against them.

Servers start exactly as ``python -m benchmarks.peers`` starts them: every option not listed
below is that script's (``--peers``, ``--model-1b``, ``--quant``, ``--no-amx``,
``--llamaserver-threads``, ``--blink-args``, ``--concurrency``, ``--input-len``,
``--output-len``, ``--port-base``, ``--log-dir``, ...). guidellm needs an HF tokenizer
directory: ``DIR/hf`` with ``--model-1b``, else the SmolLM2 directory ``setup_peers.sh model``
writes. Install guidellm with ``bash benchmarks/setup_peers.sh guidellm``. Never run it while
anything else loads the machine; guidellm's own worker processes share its cores with the
servers (every peer alike), so its tok/s sit below ``benchmarks.peers``' at 16 streams::

    python -m benchmarks.peers_guidellm --peers blink,llamaserver --llamaserver-threads 2 --no-amx
    python -m benchmarks.peers_guidellm --peers blink,llamaserver --llamaserver-threads 2 --no-amx \\
        --model-1b /opt/blink-peers/models/llama-1b-shaped --quant Q4_1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from benchmarks import peers

#: issue 35's targets, blink against llama-server on the same file (ratios of the medians' rounds)
TARGETS_1B = "1B-class: 16 streams >= 2x output tok/s with a lower P99 TTFT; 1 stream >= 1.2x with ITL p50 no worse"
TARGETS_135M = "135M: 1 stream >= 1.0x; 16 streams >= 1.5x"


def guidellm_command(guidellm: str, base_url: str, model: str, tokenizer: str, *, streams: int,
                     requests: int, input_len: int, output_len: int, out_json: Path) -> list[str]:
    """One guidellm 0.8 run: ``streams`` concurrent streams until ``requests`` are done."""
    return [guidellm, "run",
            "--backend", f"kind=openai_http,target={base_url},model={model},request_format=/v1/completions",
            "--profile", f"kind=concurrent,streams={streams}",
            "--data", f"kind=synthetic_text,prompt_tokens={input_len},output_tokens={output_len}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--output", f"kind=json,path={out_json}", "--disable-progress"]


def read_guidellm(report: dict[str, Any]) -> dict[str, float]:
    """The numbers the table shows, from guidellm's JSON report (its first benchmark): output
    tok/s (guidellm's mean over the run), TTFT p50 / p99 and ITL p50 in ms, the requests done
    and the output tokens each. Raises ValueError where a request failed or none finished."""
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    if totals["errored"] or totals["incomplete"] or not totals["successful"]:
        raise ValueError(f"guidellm: {totals['successful']} requests done, {totals['errored']} "
                         f"failed, {totals['incomplete']} incomplete")

    def stat(name: str, key: str) -> float:
        ok = metrics[name]["successful"]
        return float(ok["percentiles"][key] if key.startswith("p") else ok[key])  # p99: a percentile

    return {"output_tok_s": stat("output_tokens_per_second", "mean"),
            "ttft_p50_ms": stat("time_to_first_token_ms", "median"),
            "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
            "itl_p50_ms": stat("inter_token_latency_ms", "median"),
            "requests": float(totals["successful"]),
            "output_tokens_per_request": stat("output_token_count", "total_sum") / totals["successful"]}


def short_output_note(numbers: dict[str, float], output_len: int) -> str:
    """A warning where the server stopped requests short of the output length asked for (its
    tok/s then compare unlike work), else nothing."""
    got = numbers["output_tokens_per_request"]
    if got >= 0.98 * output_len:
        return ""
    return f"; WARNING: {got:.1f} output tokens a request, not the {output_len} asked for"


def _warm_up(base_url: str, model: str) -> None:
    """One short completion, so that no measured request pays a first call's costs."""
    body = json.dumps({"model": model, "prompt": "Warm up.", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def run_round(names: list[str], args: argparse.Namespace, ns: argparse.Namespace, round_index: int,
              tokenizer: str) -> dict[str, dict[int, dict[str, float]]]:
    """Every peer of ``names`` once, in that order: {peer: {streams: numbers}}."""
    from benchmarks.interference import LaunchedServer

    results: dict[str, dict[int, dict[str, float]]] = {}
    for i, name in enumerate(names):
        port = ns.port_base + i
        argv, env, _ = peers.peer_command(name, port, ns)
        base_url = f"http://127.0.0.1:{port}"
        log_path = Path(ns.log_dir) / f"guidellm-{name}-{round_index}.log"
        print(f"== round {round_index}, {name}: {' '.join(argv)}  (log {log_path})", flush=True)
        with LaunchedServer(argv, base_url, log_path, env=env, ready_timeout_s=ns.ready_timeout, cwd=ns.log_dir):
            _warm_up(base_url, ns.model_name)
            results[name] = {}
            for streams, requests in ((1, args.requests_single), (ns.concurrency, args.requests_concurrent)):
                out_json = Path(ns.log_dir) / f"guidellm-{name}-{round_index}-{streams}.json"
                command = guidellm_command(args.guidellm, base_url, ns.model_name, tokenizer, streams=streams,
                                           requests=requests, input_len=ns.input_len, output_len=ns.output_len,
                                           out_json=out_json)
                done = subprocess.run(command, capture_output=True, text=True, cwd=ns.log_dir,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
                if done.returncode != 0:
                    raise RuntimeError(f"guidellm exited {done.returncode}: {done.stderr[-2000:]}")
                numbers = read_guidellm(json.loads(out_json.read_text()))
                results[name][streams] = numbers
                print(f"   {streams:2d} streams: {numbers['output_tok_s']:.1f} output tok/s, TTFT p50 "
                      f"{numbers['ttft_p50_ms']:.0f} / p99 {numbers['ttft_p99_ms']:.0f} ms, ITL p50 "
                      f"{numbers['itl_p50_ms']:.1f} ms" + short_output_note(numbers, ns.output_len), flush=True)
    return results


def table(rounds: list[dict[str, dict[int, dict[str, float]]]], concurrency: int) -> str:
    """Each peer's medians over the rounds, as the issue's table."""
    lines = ["| system | streams | output tok/s | TTFT p50 / p99 ms | ITL p50 ms |", "|---|---:|---:|---:|---:|"]
    names = list(rounds[0])
    for name in names:
        for streams in (1, concurrency):
            runs = [r[name][streams] for r in rounds if name in r]

            def med(key: str, runs: list[dict[str, float]] = runs) -> float:
                return statistics.median(run[key] for run in runs)

            lines.append(f"| {name} | {streams} | {med('output_tok_s'):.1f} | {med('ttft_p50_ms'):,.0f} / "
                         f"{med('ttft_p99_ms'):,.0f} | {med('itl_p50_ms'):.1f} |")
    return "\n".join(lines)


def decode_lines(rounds: list[dict[str, dict[int, dict[str, float]]]], limit_tok_s: float | None) -> list[str]:
    """Each peer's one-stream decode (1000 / its ITL p50, median over the rounds) against the
    header's memory-bandwidth limit of batch-1 decode."""
    lines = []
    for name in rounds[0]:
        rate = 1000.0 / statistics.median(r[name][1]["itl_p50_ms"] for r in rounds if name in r)
        lines.append(f"- {name}: one-stream decode {rate:.1f} tok/s (1000 / ITL p50)"
                     + (f", {rate / limit_tok_s:.2f} of the bandwidth limit ({limit_tok_s:.1f} tok/s)"
                        if limit_tok_s else ""))
    return lines


def ratios(rounds: list[dict[str, dict[int, dict[str, float]]]], concurrency: int,
           peer: str = "llamaserver") -> dict[str, list[float]]:
    """blink / ``peer`` by round: output tok/s at 1 and ``concurrency`` streams, P99 TTFT at
    ``concurrency``, ITL p50 at 1 (a time: below 1 is blink's lower)."""
    both = [r for r in rounds if "blink" in r and peer in r]
    return {"out_1": [r["blink"][1]["output_tok_s"] / r[peer][1]["output_tok_s"] for r in both],
            "out_n": [r["blink"][concurrency]["output_tok_s"] / r[peer][concurrency]["output_tok_s"] for r in both],
            "ttft_p99_n": [r["blink"][concurrency]["ttft_p99_ms"] / r[peer][concurrency]["ttft_p99_ms"] for r in both],
            "itl_p50_1": [r["blink"][1]["itl_p50_ms"] / r[peer][1]["itl_p50_ms"] for r in both]}


def target_lines(by_round: dict[str, list[float]], *, one_b: bool, concurrency: int) -> list[str]:
    """Issue 35's targets, each met or not in every round."""
    def verdict(values: list[float], ok: Any) -> str:
        met = sum(1 for v in values if ok(v))
        shown = " ".join(f"{v:.2f}" for v in values)
        return f"{shown} (median {statistics.median(values):.2f}x): met in {met} of {len(values)} rounds"

    if one_b:
        return [f"target: {TARGETS_1B}",
                f"- {concurrency} streams, output tok/s blink / llama-server: "
                + verdict(by_round["out_n"], lambda v: v >= 2.0),
                f"- {concurrency} streams, P99 TTFT blink / llama-server (< 1): "
                + verdict(by_round["ttft_p99_n"], lambda v: v < 1.0),
                "- 1 stream, output tok/s: " + verdict(by_round["out_1"], lambda v: v >= 1.2),
                "- 1 stream, ITL p50 blink / llama-server (<= 1): "
                + verdict(by_round["itl_p50_1"], lambda v: v <= 1.0)]
    return [f"target: {TARGETS_135M}",
            "- 1 stream, output tok/s blink / llama-server: " + verdict(by_round["out_1"], lambda v: v >= 1.0),
            f"- {concurrency} streams: " + verdict(by_round["out_n"], lambda v: v >= 1.5)]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers_guidellm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guidellm", default=str(peers.PEERS_DIR / "guidellm" / "bin" / "guidellm"),
                    help="the guidellm executable (default: setup_peers.sh guidellm's)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every peer (default 2)")
    ap.add_argument("--requests-single", type=int, default=4, help="requests of the 1-stream run (default 4)")
    ap.add_argument("--requests-concurrent", type=int, default=32,
                    help="requests of the --concurrency run (default 32: two waves of 16)")
    ap.add_argument("--result-json", default=None, help="also write every round's numbers here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if min(args.rounds, args.requests_single, args.requests_concurrent) < 1:
        parser.error("--rounds, --requests-single and --requests-concurrent must be at least 1")
    if "--peers" not in rest and not any(a.startswith("--peers=") for a in rest):
        rest = ["--peers", "blink,llamaserver", *rest]
    ns = peers.build_parser().parse_args(rest)
    peers.resolve_model_args(ns)
    names = [p.strip() for p in ns.peers.split(",") if p.strip()]
    if not Path(args.guidellm).is_file():
        raise SystemExit(f"no guidellm at {args.guidellm} "
                         "(bash benchmarks/setup_peers.sh guidellm, or --guidellm PATH)")
    for name in names:
        if name not in ("blink", "llamaserver", "vllm"):
            raise SystemExit(f"--peers: {name!r} is not one this script runs (blink, llamaserver, vllm)")
        status = peers.peer_status(name, Path(ns.peers_dir), ns.isa)  # ("ok" for blink)
        if status != "ok":
            raise SystemExit(f"{name}: {status}")
    tokenizer = ns.tokenizer if ns.model_1b else ns.hf_dir
    if not (Path(tokenizer) / "tokenizer.json").is_file():
        raise SystemExit(f"guidellm needs an HF tokenizer directory; {tokenizer} has no tokenizer.json "
                         "(bash benchmarks/setup_peers.sh model, or python -m benchmarks.make_1b_model)")
    Path(ns.log_dir).mkdir(parents=True, exist_ok=True)
    ns.machine = peers.machine_header(ns)
    print(ns.machine["text"], flush=True)
    rounds = []
    for r in range(args.rounds):
        try:
            rounds.append(run_round(names if r % 2 == 0 else names[::-1], args, ns, r, tokenizer))
        except (RuntimeError, ValueError, TimeoutError, OSError) as exc:  # the rounds done still count
            print(f"round {r} failed: {exc}", file=sys.stderr)
            break
        if args.result_json:
            Path(args.result_json).write_text(json.dumps(
                {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "machine": ns.machine,
                 "rounds": [{name: {str(k): v for k, v in by.items()} for name, by in rd.items()} for rd in rounds]},
                indent=2, default=str))
    if not rounds:
        return 1
    print(f"\n{ns.model_name}, {ns.input_len} in / {ns.output_len} out, guidellm, medians over {len(rounds)} rounds:")
    print(table(rounds, ns.concurrency))
    print("\n".join(decode_lines(rounds, ns.machine.get("decode_limit_tok_s"))))
    if "blink" in names and "llamaserver" in names:
        print()
        print("\n".join(target_lines(ratios(rounds, ns.concurrency), one_b=bool(ns.model_1b),
                                     concurrency=ns.concurrency)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
