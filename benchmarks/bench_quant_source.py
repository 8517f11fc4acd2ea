"""Two versions of the kernel without AMX (``kernels/cpu/quant_linear.c``) on a real GGUF's
projections, in one process: the A/B for a change to the C source, where two runs minutes apart
on a shared VM differ by more than the change.

``--before`` is another version of the source (``git show REV:kernels/cpu/quant_linear.c >
/tmp/before.c``), built with the same flags as the build this CPU runs (or ``--build``); "now"
is the checkout's. Both builds multiply the same packed weights (each projection as Blink runs
it: qkv and gate/up fused, the tied head on token_embd's codes) in interleaved rounds; the
script checks that they give the same bits (``--allow-different-bits`` for a change of
arithmetic) and prints per row count the best time, GOPS (2 x rows x weights), the weight
bytes' GB/s and now / before as a speed-up. The weights sit in 2 MB pages, as the engine keeps
them (:mod:`blink.huge_pages`). Never run while anything else loads the machine.

``--read-bands SECONDS``: on a VM whose memory bandwidth moves from second to second (the
Zen 4 VM of sessions 36-42: a plain read of 2 MB pages at ~35 GB/s in some minutes and
~60 in others), a best time says little about a kernel that reads memory. For that long, each
round reads ``--read-mb`` (512) MB of 2 MB pages (torch's sum, as ``benchmarks/peers.py``
measures the read bandwidth) and then runs both versions once at the first ``--rows``; rounds
are grouped by that read's GB/s (tens), and per group the table gives each version's GB/s over
the rounds (``--by-kind``: per projection kind and format too), so each version is set against
what a plain read got in the same second.

``--before-build BUILD``: the before version built as another build (by default of the
checkout's own source), e.g. ``--build avx2_vnni --before-build avx2_int8``: what a CPU gains
from one build over another on the same packed weights.

``--before-pos6``: the before version reads 6-bit codes in another plane order (a source from
before quant_linear.py's ``POS6`` layout: ``0,2,4,6,8,10,12,14``), so its weights are packed
in that order.

    git show HEAD~1:kernels/cpu/quant_linear.c > /tmp/before.c
    python -m benchmarks.bench_quant_source --before /tmp/before.c \\
        --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf --rows 1 16 128 --threads 1
    python -m benchmarks.bench_quant_source --before /tmp/before.c --model ... --layers all \\
        --rows 1 --threads 2 --read-bands 150 --by-kind
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_kquant_bytes import X86_BUILDS


def built_like(native, source: Path, workdir: Path, what: str):
    """``source`` built in ``workdir`` as the NativeLibrary ``native`` builds its own (its flags
    and fallback flags, with copies of its headers beside it) and set up as it sets up (declared,
    handed the pool); SystemExit where it does not build. An A/B's "before" version."""
    from blink.shared.native_build import NativeBuildError, build_library

    copy = workdir / native.source.name
    shutil.copyfile(source, copy)
    headers = tuple(workdir / header.name for header in native.headers)
    for header, mine in zip(native.headers, headers):
        shutil.copyfile(header, mine)
    try:
        library = build_library(copy, native.flags, native.fallback_flags, headers)
        if native.setup is not None:
            native.setup(library)
    except (NativeBuildError, AttributeError) as exc:
        raise SystemExit(f"{source} does not build as {what}: {exc}") from None
    return library


def before_library(source: Path, build: str, workdir: Path):
    """``source`` built as the checkout's ``build`` is (:func:`built_like`); the A/B runs it in
    the checkout's place (its NativeLibrary's ``using``; benchmarks/bench_step_source.py in the
    recorded calls of whole decode steps)."""
    from blink.kernels.cpu import quant_linear as q

    return built_like(q.LIBRARIES[build], source, workdir, f"the {build} kernel")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, default=None,
                   help="the other version of quant_linear.c (default with --before-build: the checkout's)")
    p.add_argument("--model", required=True, help="a GGUF file whose projections the kernel takes")
    p.add_argument("--build", default=None, choices=X86_BUILDS, help="default: the one this CPU runs")
    p.add_argument("--before-build", default=None, choices=X86_BUILDS,
                   help="build the before version as this build instead of --build's (two builds of one "
                        "source: e.g. --build avx2_vnni --before-build avx2_int8; both int8 builds, or "
                        "neither, so that the bits agree)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--threads", type=int, default=1, help="kernel threads (default 1: the least noisy)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--layers", default="0",
                   help="layers whose projections run (with the head): comma-separated, or 'all' "
                        "(a whole decode step's weights: at 1 row, the bandwidth's figure)")
    p.add_argument("--allow-different-bits", action="store_true",
                   help="time a change of arithmetic (else different outputs stop the run)")
    p.add_argument("--before-pos6", default=None,
                   help="the before version's 6-bit plane order (8 comma-separated bit positions; "
                        "default: the checkout's POS6)")
    p.add_argument("--read-bands", type=float, default=0.0, metavar="SECONDS",
                   help="instead of best times: rounds of a plain read (--read-mb) then both versions "
                        "at the first --rows, for this long, grouped by the read's GB/s")
    p.add_argument("--by-kind", action="store_true", help="with --read-bands: per projection kind too")
    p.add_argument("--read-mb", type=int, default=512, help="with --read-bands: the plain read's size")
    args = p.parse_args(argv)
    if args.before is None and args.before_build is None:
        p.error("--before is required (or --before-build, to time another build of the checkout's source)")
    if args.before is not None and not args.before.is_file():
        p.error(f"--before {args.before}: no such file")
    if args.before_pos6 is not None:
        try:
            order = tuple(int(b) for b in args.before_pos6.split(","))
        except ValueError:
            order = ()
        if sorted(order) != list(range(0, 16, 2)):
            p.error(f"--before-pos6 {args.before_pos6}: not the 8 even bit positions 0..14 in some order")
        args.before_pos6 = order

    import torch

    from benchmarks.bench_kquant_bytes import _pack, _projections
    from blink.huge_pages import HugePageArena
    from blink.kernels.cpu import quant_linear as q
    from blink.kernels.cpu.threads import set_kernel_threads

    build = args.build or q.variant()
    if build is None:
        raise SystemExit("no build of the kernel without AMX runs here")
    set_kernel_threads(args.threads)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="blink-ab-") as tmp:
        # (--before-build alone: the checkout's own source, the one quant_linear.py builds)
        before = before_library(args.before or q._SOURCE, args.before_build or build, Path(tmp))
        wanted = None if args.layers == "all" else {int(x) for x in args.layers.split(",")}
        projections = [(kind, segments) for kind, layer, segments, _ in _projections(args.model)
                       if wanted is None or layer in wanted or layer == -1]
        arena = HugePageArena()

        def packed(pos6: tuple[int, ...]) -> list[tuple[str, list[Any]]]:
            checkout = q.POS6
            q.POS6 = pos6  # (the packer reads it)
            try:
                return [(kind, [dataclasses.replace(w, codes=arena.place(w.codes), scales=arena.place(w.scales))
                                for w in _pack(segments, True)]) for kind, segments in projections]
            finally:
                q.POS6 = checkout

        weights = packed(q.POS6)
        before_weights = weights
        if args.before_pos6 is not None:
            before_weights = packed(args.before_pos6)
        sets = {"before": before_weights, "now": weights}
        before_build = f" (before: {args.before_build})" if args.before_build else ""
        print(f"build {build}{before_build}, {args.threads} thread(s), {len(weights)} projections "
              f"({'all layers' if wanted is None else 'layers ' + args.layers} and the head)")
        torch.manual_seed(0)
        xs = {ps[0].k: torch.randn(max(args.rows), ps[0].k).bfloat16() for _, ps in weights}
        def run(which: str, rows: int, seconds: dict[str, float] | None = None) -> list[torch.Tensor]:
            with q.LIBRARIES[build].using(before) if which == "before" else contextlib.nullcontext():
                out = []
                for kind, ps in sets[which]:
                    t0 = time.perf_counter()
                    out.append(q.linear(xs[ps[0].k][:rows], ps, None, build=build))
                    if seconds is not None:
                        seconds[_label(q, kind, ps)] += time.perf_counter() - t0
                return out

        for rows in args.rows:
            if any(not torch.equal(a, b) for a, b in zip(run("before", rows), run("now", rows))):
                if not args.allow_different_bits:
                    raise SystemExit(f"the two versions give different bits at {rows} rows "
                                     "(--allow-different-bits to time them anyway)")
                print(f"note: different bits at {rows} rows")
        if args.read_bands > 0:
            _read_bands(args, run, weights)
            return
        print("| rows | before ms | now ms | before GOPS | now GOPS | now GB/s | now / before |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        nbytes = sum(w.nbytes() for _, ps in weights for w in ps)
        for rows in args.rows:
            ops = sum(2.0 * rows * w.n * w.k for _, ps in weights for w in ps)
            best = {"before": float("inf"), "now": float("inf")}
            for r in range(args.rounds):
                for which in (("before", "now") if r % 2 == 0 else ("now", "before")):
                    t0 = time.perf_counter()
                    run(which, rows)
                    best[which] = min(best[which], time.perf_counter() - t0)
            b, n = best["before"], best["now"]
            print(f"| {rows} | {b * 1e3:.2f} | {n * 1e3:.2f} | {ops / b / 1e9:.0f} | {ops / n / 1e9:.0f} | "
                  f"{nbytes / n / 1e9:.1f} | {b / n:.3f}x |")


def _label(q: Any, kind: str, parts: list[Any]) -> str:
    """A projection's row label in the tables: its kind and its parts' formats (Q4_K, Q6_K, ...)."""
    def name(fmt: int) -> str:
        bits = 8 if fmt & q.F_BITS8 else 6 if fmt & q.F_BITS6 else 5 if fmt & q.F_BITS5 else 4
        return f"Q{bits}_K" if fmt & q.F_K else f"{bits}-bit"
    return f"{kind} {'+'.join(name(w.format) for w in parts)}"


def _read_bands(args: argparse.Namespace, run: Any, weights: list[tuple[str, list[Any]]]) -> None:
    """``--read-bands``: rounds of a plain read then both versions, grouped by the read's GB/s."""
    from benchmarks.peers import ReadProbe
    from blink.kernels.cpu import quant_linear as q

    plain = ReadProbe(args.read_mb << 20, huge_pages=True)
    plain.once()  # touches the pages
    rows = args.rows[0]
    sizes: dict[str, float] = collections.defaultdict(float)  # the labels run() times under
    for kind, ps in weights:
        sizes[_label(q, kind, ps)] += sum(w.nbytes() for w in ps)
    total = sum(sizes.values())
    bands: dict[int, dict[str, Any]] = {}
    end, rnd = time.monotonic() + args.read_bands, 0
    while time.monotonic() < end:
        read = plain.once()
        band = bands.setdefault(int(read // 10) * 10, {"rounds": 0, "read": 0.0, "before": collections.defaultdict(float),
                                                        "now": collections.defaultdict(float)})
        band["rounds"] += 1
        band["read"] += read
        for which in (("before", "now") if rnd % 2 == 0 else ("now", "before")):
            run(which, rows, band[which])
        rnd += 1
    print(f"{rows} row(s), {rnd} rounds in {args.read_bands:.0f} s; GB/s = the weights' bytes over each version's "
          "time in the rounds whose plain read fell in the band")
    print("| read band GB/s | rounds | plain read GB/s | before GB/s | now GB/s | now / before |")
    print("|---|---:|---:|---:|---:|---:|")
    for lo in sorted(bands):
        b = bands[lo]
        n = b["rounds"]
        tb, tn = sum(b["before"].values()), sum(b["now"].values())
        print(f"| {lo}-{lo + 10} | {n} | {b['read'] / n:.1f} | {total * n / tb / 1e9:.1f} | {total * n / tn / 1e9:.1f} | "
              f"{tb / tn:.3f}x |")
        if args.by_kind:
            for label, nbytes in sizes.items():
                print(f"| &nbsp; {label} ({nbytes / 1e6:.0f} MB) | | | {nbytes * n / b['before'][label] / 1e9:.1f} | "
                      f"{nbytes * n / b['now'][label] / 1e9:.1f} | {b['before'][label] / b['now'][label]:.3f}x |")


if __name__ == "__main__":
    # Before torch loads OpenMP: its threads would spin for a while after --read-bands' parallel
    # sum, on the cores the kernel's threads need next (measured: the kernels ~15% slower right
    # after it), as `blink serve` keeps them passive.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
