"""Two versions of the kernel without AMX (``kernels/cpu/quant_linear.c``) on a real GGUF's
projections, in one process: the A/B for a change to the C source, where two runs minutes apart
on a shared VM differ by more than the change.

``--before`` is another version of the source (``git show REV:kernels/cpu/quant_linear.c >
/tmp/before.c``), built with the same flags as the build this CPU runs (or ``--build``); "now"
is the checkout's. Both builds multiply the same packed weights (each projection as Blink runs
it: qkv and gate/up fused, the tied head on token_embd's codes) in interleaved rounds; the
script checks that they give the same bits (``--allow-different-bits`` for a change of
arithmetic) and prints per row count the best time, GOPS (2 x rows x weights), the weight
bytes' GB/s and now / before as a speed-up. Never run while anything else loads the machine.

    git show HEAD~1:kernels/cpu/quant_linear.c > /tmp/before.c
    python -m benchmarks.bench_quant_source --before /tmp/before.c \\
        --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf --rows 1 16 128 --threads 1
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _before_library(source: Path, build: str, workdir: Path):
    """``source`` built as the checkout's ``build`` is (that NativeLibrary's own flags, with a
    copy of kernels.h beside it) and declared as it is declared; the A/B runs it in the
    checkout's place (its NativeLibrary's ``using``)."""
    from blink.kernels.cpu import quant_linear as q
    from blink.shared.native_build import NativeBuildError, build_library

    copy = workdir / "quant_linear.c"
    shutil.copyfile(source, copy)
    shutil.copyfile(Path(q.__file__).with_name("kernels.h"), workdir / "kernels.h")
    try:
        library = build_library(copy, q.LIBRARIES[build].flags, None, (workdir / "kernels.h",))
        q._declare(q.VARIANTS[build][2])(library)
    except (NativeBuildError, AttributeError) as exc:
        raise SystemExit(f"{source} does not build as the {build} kernel: {exc}") from None
    return library


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, type=Path, help="the other version of quant_linear.c")
    p.add_argument("--model", required=True, help="a GGUF file whose projections the kernel takes")
    p.add_argument("--build", default=None, choices=["avx512_vnni", "avx512", "avx2_int8", "avx2"],
                   help="default: the one this CPU runs")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--threads", type=int, default=1, help="kernel threads (default 1: the least noisy)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--layers", default="0",
                   help="layers whose projections run (with the head): comma-separated, or 'all' "
                        "(a whole decode step's weights: at 1 row, the bandwidth's figure)")
    p.add_argument("--allow-different-bits", action="store_true",
                   help="time a change of arithmetic (else different outputs stop the run)")
    args = p.parse_args(argv)
    if not args.before.is_file():
        p.error(f"--before {args.before}: no such file")

    import torch

    from benchmarks.bench_kquant_bytes import _pack, _projections
    from blink.kernels.cpu import quant_linear as q
    from blink.kernels.cpu.threads import set_kernel_threads

    build = args.build or q.variant()
    if build is None:
        raise SystemExit("no build of the kernel without AMX runs here")
    set_kernel_threads(args.threads)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="blink-ab-") as tmp:
        before = _before_library(args.before, build, Path(tmp))
        wanted = None if args.layers == "all" else {int(x) for x in args.layers.split(",")}
        weights: list[tuple[str, list[Any]]] = [
            (kind, _pack(segments, True)) for kind, layer, segments, _ in _projections(args.model)
            if wanted is None or layer in wanted or layer == -1]
        print(f"build {build}, {args.threads} thread(s), {len(weights)} projections "
              f"({'all layers' if wanted is None else 'layers ' + args.layers} and the head)")
        torch.manual_seed(0)
        xs = {ps[0].k: torch.randn(max(args.rows), ps[0].k).bfloat16() for _, ps in weights}
        def run(which: str, rows: int) -> list[torch.Tensor]:
            with q.LIBRARIES[build].using(before) if which == "before" else contextlib.nullcontext():
                return [q.linear(xs[ps[0].k][:rows], ps, None, build=build) for _, ps in weights]

        for rows in args.rows:
            if any(not torch.equal(a, b) for a, b in zip(run("before", rows), run("now", rows))):
                if not args.allow_different_bits:
                    raise SystemExit(f"the two versions give different bits at {rows} rows "
                                     "(--allow-different-bits to time them anyway)")
                print(f"note: different bits at {rows} rows")
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


if __name__ == "__main__":
    main()
