"""Bytes per token and effective bandwidth of the K-quant kernel without AMX, before/after its
compact layout, on a real GGUF file, in one process (interleaved A/B, best of ``--rounds``).

"before": each K-quant group's d (and m) as fp32 (2 bits a weight of scales for Q4_K), Q6_K /
Q5_K codes in 8 bits; "after": the file's own scales (fp16 d/dmin per 256 channels, int8 sc/mn
per group) and 5-bit (Q5_K) / 6-bit (Q6_K) codes (:func:`blink.kernels.cpu.quant_linear.pack`). Both are the same
weights: the script checks the outputs are the same bits.

Projections as Blink runs them (qkv and gate/up fused, each run of one format a part; the tied
head on token_embd's codes), in model order per "token" so every weight comes from memory as in
a decode step. Prints per kind: file / before / after bytes, and at 1 row the seconds, GB/s and
GB/s over the copy bandwidth (:func:`benchmarks.peers.copy_bandwidth`, measured in each round);
at ``--rows`` (16, 128) GFLOPS over the first ``--flops-layers`` layers and the head. Never run
while anything else loads the machine.

    python -m benchmarks.bench_kquant_bytes \\
        --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf --threads 2
"""
from __future__ import annotations

import argparse
import re
import time
from typing import Any

#: the x86 builds of quant_linear.c (its VARIANTS' keys but the Arm one; a literal, so that
#: --help imports no torch: tests/test_bench_forward.py holds it to VARIANTS)
X86_BUILDS = ["avx512_vnni", "avx512", "avx2_vnni", "avx2_int8", "avx2"]


def _projections(path: str) -> list[tuple[str, int, list[Any], int]]:
    """(kind, layer, segments as QuantCodes, file bytes) per projection Blink runs, model order."""
    import gguf
    import numpy as np

    from blink.loader.gguf_weights import CODED_TYPES, unpack_codes

    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors if len(t.shape) == 2 and t.tensor_type.name in CODED_TYPES}

    def seg(name: str) -> tuple[Any, int]:
        t = by_name[name]
        k, n = (int(x) for x in t.shape)
        data = np.asarray(t.data).reshape(n, -1)
        return unpack_codes(data, t.tensor_type.name, n, k), int(t.n_bytes)

    layers = sorted({int(m.group(1)) for name in by_name if (m := re.match(r"blk\.(\d+)\.", name))})
    kinds = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
             "down": ("ffn_down",)}
    out = []
    for i in layers:
        for kind, names in kinds.items():
            parts = [seg(f"blk.{i}.{n}.weight") for n in names]
            out.append((kind, i, [p for p, _ in parts], sum(b for _, b in parts)))
    head = "output.weight" if "output.weight" in by_name else "token_embd.weight"
    codes, nbytes = seg(head)
    out.append(("head", -1, [codes], nbytes))
    return out


def _pack(segments: list[Any], compact: bool) -> list[Any]:
    """A projection's parts (runs of one format, as int4_linear.pack_codes), in the layout after
    (``compact``) or before."""
    import torch

    from blink.kernels.cpu import quant_linear as q

    parts, run = [], [segments[0]]
    for seg in segments[1:] + [None]:
        if seg is not None and seg.qtype == run[0].qtype:
            run.append(seg)
            continue
        cat = lambda name: None if getattr(run[0], name) is None else torch.cat([getattr(s, name) for s in run])  # noqa: E731
        k_scales = None
        if compact and run[0].k_scales is not None:
            from blink.models.int4_linear import _k_scales
            k_scales = _k_scales(run)
        part = q.pack(cat("codes"), cat("d"), cat("m"), run[0].group, run[0].bits, k_scales, narrow=compact)
        if part is None:
            raise SystemExit(f"the kernel does not take a {run[0].qtype} {tuple(run[0].codes.shape)} part")
        parts.append(part)
        run = [seg]
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (K-quants: Q4_K_M, Q5_K_M, Q6_K)")
    p.add_argument("--build", default=None, choices=X86_BUILDS, help="default: the CPU's")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, nargs="*", default=[16, 128], help="row counts timed for GFLOPS")
    p.add_argument("--flops-layers", type=int, default=4)
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (a smoke run)")
    args = p.parse_args()

    import torch

    from benchmarks.peers import copy_bandwidth
    from blink.kernels.cpu import quant_linear as q

    if args.threads:
        torch.set_num_threads(args.threads)
    build = args.build or q.variant()
    if build is None:
        raise SystemExit("no build of the kernel without AMX runs here")
    projections = []
    for kind, layer, segments, file_bytes in _projections(args.model):
        if args.layers is not None and layer >= args.layers:
            continue
        before, after = _pack(segments, False), _pack(segments, True)
        projections.append((kind, layer, before, after, file_bytes, segments[0].codes.shape[1]))
        del segments
    print(f"build {build}, torch threads {torch.get_num_threads()}, {len(projections)} projections")

    kinds = list(dict.fromkeys(kind for kind, *_ in projections))
    size = {kind: [0, 0, 0] for kind in kinds}  # file, before, after
    for kind, _, before, after, file_bytes, _ in projections:
        size[kind][0] += file_bytes
        size[kind][1] += sum(w.nbytes() for w in before)
        size[kind][2] += sum(w.nbytes() for w in after)
    total = [sum(v[i] for v in size.values()) for i in range(3)]
    print(f"\nbytes per token (MB)   file    before  after   after/file")
    for kind in kinds + ["total"]:
        f, b, a = total if kind == "total" else size[kind]
        print(f"  {kind:8s}  {f / 1e6:10.1f} {b / 1e6:8.1f} {a / 1e6:8.1f}   {a / f:.3f}")

    torch.manual_seed(0)
    xs = {k: torch.randn(max([1, *args.rows]), k).bfloat16() for k in {k for *_, k in projections}}
    # the same bits: a layer's and the head's outputs at 1 and 16 rows
    for kind, layer, before, after, _, k in projections:
        if layer in (0, -1):
            for rows in (1, 16):
                x = xs[k][:rows]
                if not torch.equal(q.linear(x, before, None, build=build), q.linear(x, after, None, build=build)):
                    raise SystemExit(f"{kind}: the layouts give different bits at {rows} rows")
    print("outputs: the same bits before and after (layer 0 and the head, 1 and 16 rows)")

    def step(layout: int, rows: int, which: list) -> dict[str, float]:
        spent = dict.fromkeys(kinds, 0.0)
        for kind, _, before, after, _, k in which:
            x = xs[k][:rows]
            t0 = time.perf_counter()
            q.linear(x, (before, after)[layout], None, build=build)
            spent[kind] += time.perf_counter() - t0
        return spent

    best = [dict.fromkeys(kinds, float("inf")) for _ in range(2)]
    copy_gbs = 0.0
    for r in range(args.rounds):
        for layout in ((0, 1) if r % 2 == 0 else (1, 0)):
            spent = step(layout, 1, projections)
            for kind in kinds:
                best[layout][kind] = min(best[layout][kind], spent[kind])
            best[layout]["total"] = min(best[layout].get("total", float("inf")), sum(spent.values()))
        copy_gbs = max(copy_gbs, copy_bandwidth(repeats=1)["best_gbs"])
    print(f"\n1 row (best of {args.rounds}; copy bandwidth {copy_gbs:.1f} GB/s, best in the same rounds)")
    print("  kind      before ms  GB/s  /copy   after ms  GB/s  /copy")
    for kind in kinds + ["total"]:
        line = f"  {kind:8s}"
        for layout in (0, 1):
            t = best[layout][kind]
            nbytes = (total if kind == "total" else size[kind])[1 + layout]
            line += f"  {t * 1e3:8.2f} {nbytes / t / 1e9:6.1f} {nbytes / t / 1e9 / copy_gbs:5.2f}"
        print(line)
    file_total = total[0]
    limit = copy_gbs * 1e9 / file_total
    print(f"  token limit (file bytes / copy bandwidth) {limit:.1f} tok/s; projections alone: "
          f"before {1 / best[0]['total']:.1f} tok/s ({1 / best[0]['total'] / limit:.2f} of it), "
          f"after {1 / best[1]['total']:.1f} ({1 / best[1]['total'] / limit:.2f})")

    some = [p for p in projections if p[1] < args.flops_layers]  # the head has layer -1: in
    for rows in args.rows:
        flops = dict.fromkeys(kinds, 0.0)
        for kind, _, before, _, _, k in some:
            flops[kind] += 2.0 * rows * k * sum(w.n for w in before)
        best_r = [dict.fromkeys(kinds, float("inf")) for _ in range(2)]
        for r in range(args.rounds):
            for layout in ((0, 1) if r % 2 == 0 else (1, 0)):
                spent = step(layout, rows, some)
                for kind in kinds:
                    best_r[layout][kind] = min(best_r[layout][kind], spent[kind])
        print(f"\n{rows} rows, GFLOPS (layers < {args.flops_layers} and the head): kind  before  after  after/before")
        for kind in kinds:
            b, a = (flops[kind] / best_r[layout][kind] / 1e9 for layout in (0, 1))
            print(f"  {kind:8s}  {b:7.1f} {a:7.1f}   {a / b:.2f}")


if __name__ == "__main__":
    main()
