"""Whole decode steps, two versions of quant_linear.c, in one process.

``bench_quant_source`` times the projections alone; a change can also move what it does not
time: the norms, attention and host work between the projections, whose data a kernel's
loads and prefetches may push out of the caches. Here one ``LLM`` generates greedily with its
decode steps replayed from their CPU graphs, and the graphs' recorded calls of the 4-bit
kernel point at the checkout's build or at ``--before`` (built with the same flags,
``bench_quant_source.before_library``) in alternate rounds, each round timing the same request
(``--tokens`` tokens after a prompt of ``--prompt-words`` words) once with each, the order
reversed every other round, so that the VM's minute-to-minute memory speed falls on both.
Greedy outputs must be the same tokens (else the run stops, unless
``--allow-different-bits``). It prints each version's median ms a token and now / before by
round.

Run it first with the checkout's own source as ``--before``: the spread of that A/A run is
what a difference must exceed (on the 2-vCPU VMs, +-8% a round). ``blink serve`` on two cores
runs the engine with one compute thread, two kernel threads and passive OpenMP waits, as the
defaults here do:

    git show HEAD:kernels/cpu/quant_linear.c > /tmp/before.c
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.bench_step_source --before /tmp/before.c
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.bench_step_source --before /tmp/before.c \\
        --model /opt/blink-peers/models/llama-1b-shaped/model-Q4_K_M.gguf --tokens 64 --rounds 8

Another build than the CPU's own: ``BLINK_CPU_Q4=avx2_int8`` (both versions are built as it).

``--attention-before`` compares two versions of the paged attention (kernels/cpu/attention.c)
the same way, its recorded calls retargeted:

    git show HEAD:kernels/cpu/attention.c > /tmp/attention_before.c
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.bench_step_source --attention-before /tmp/attention_before.c \\
        --prompt-words 40

``--pool-before`` compares two versions of the worker pool (kernels/cpu/pool.c) the same way:
every kernel library is handed one pool or the other between rounds (``blink_use_pool``, as
:func:`blink.kernels.cpu.pool.attach` does at load), each with its own workers:

    git show HEAD:kernels/cpu/pool.c > /tmp/pool_before.c
    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.bench_step_source --pool-before /tmp/pool_before.c
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: the recorded kernel calls that go to one version or the other
KERNELS = frozenset({"blink_quant_linear"})
ATTENTION_KERNELS = frozenset({"blink_paged_attention"})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--before", type=Path, help="the other version of quant_linear.c")
    which.add_argument("--attention-before", type=Path, help="the other version of attention.c")
    which.add_argument("--pool-before", type=Path, help="the other version of pool.c")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="engine compute threads (default 1, as served on 2 cores)")
    p.add_argument("--kernel-threads", type=int, default=2, help="the C kernels' threads (default 2)")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per timed request")
    p.add_argument("--prompt-words", type=int, default=20, help="the prompt: this many 5-word sentences")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--allow-different-bits", action="store_true",
                   help="time a change of arithmetic (else different tokens stop the run)")
    args = p.parse_args(argv)
    source = args.before or args.attention_before or args.pool_before
    if not source.is_file():
        p.error(f"{source}: no such file")
    if args.rounds < 1 or args.tokens < 1 or args.prompt_words < 1:
        p.error("--rounds, --tokens and --prompt-words must be at least 1")

    from benchmarks.bench_quant_source import before_library
    from blink.kernels.cpu import quant_linear as q
    from blink.llm import LLM
    from blink.shared.sampling_params import SamplingParams

    build = q.variant()
    now = None if build is None else q.LIBRARIES[build].get()
    if now is None:
        raise SystemExit("no build of the kernel without AMX runs here")
    llm = LLM(args.model, threads=args.threads, kernel_threads=args.kernel_threads,
              max_model_len=args.max_model_len)
    try:
        decode_graphs = llm.engine.executor.decode_graphs
        graphs = [graph for bucket in (decode_graphs.graphs.values() if decode_graphs is not None else ())
                  for graph in (bucket.layers, bucket.head) if graph is not None]
        calls = sum(call.name in KERNELS for graph in graphs for call in graph.calls)
        if calls == 0:
            raise SystemExit("no decode step replays a call of quant_linear.c here (CPU graphs off, or "
                             "the model's projections run on another kernel): nothing to compare")
        with tempfile.TemporaryDirectory(prefix="blink-ab-") as tmp:
            if args.pool_before is not None:
                use = _pool_switch(args.pool_before, Path(tmp), build)
                what = "the pool's"
            elif args.attention_before is not None:
                use = _attention_switch(args.attention_before, Path(tmp), graphs)
                what = "the attention's"
            else:
                before = before_library(args.before, build, Path(tmp))
                versions = {"before": before, "now": now}

                def use(name: str) -> None:
                    for graph in graphs:
                        graph.retarget(versions[name], KERNELS)
                what = "the kernel's"
            prompt = "The sea and the wind. " * args.prompt_words
            params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            ms: dict[str, list[float]] = {"before": [], "now": []}
            print(f"{args.model}: build {build}, {len(graphs)} CPU graphs, {calls} calls of the kernel, "
                  f"{args.rounds} rounds of {args.tokens} tokens, two versions of {what} source", flush=True)
            try:
                for r in range(args.rounds):
                    tokens = {}
                    for name in (("before", "now") if r % 2 == 0 else ("now", "before")):
                        use(name)
                        # untimed: the first replay after a retarget makes replay.c's arrays again
                        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
                        t0 = time.perf_counter()
                        out = llm.generate([prompt], params)[0]
                        ms[name].append((time.perf_counter() - t0) / args.tokens * 1e3)
                        tokens[name] = list(out.token_ids)
                    if tokens["before"] != tokens["now"]:
                        if not args.allow_different_bits:
                            raise SystemExit(f"round {r}: the two versions generated different tokens "
                                             "(--allow-different-bits to time them anyway)")
                        print(f"note: round {r} generated different tokens")
            finally:
                use("now")  # the checkout's build again, before its temporary twin goes
    finally:
        llm.close()
    ratios = [b / n for b, n in zip(ms["before"], ms["now"])]
    print("| version | median ms a token | fastest |\n|---|---:|---:|")
    for name in ("before", "now"):
        print(f"| {name} | {statistics.median(ms[name]):.3f} | {min(ms[name]):.3f} |")
    print(f"now / before: median {statistics.median(ratios):.3f}x, rounds "
          + " ".join(f"{x:.3f}" for x in ratios))


def _attention_switch(source: Path, workdir: Path, graphs: list) -> Callable[[str], None]:
    """``source`` built as the checkout's attention.c is, and a function that points the
    graphs' recorded attention calls at the checkout's build ("now") or that one ("before")."""
    from benchmarks.bench_quant_source import built_like
    from blink.kernels.cpu import attention

    versions = {"now": attention.LIBRARY.get(), "before": built_like(attention.LIBRARY, source, workdir, "the attention")}
    if sum(call.name in ATTENTION_KERNELS for graph in graphs for call in graph.calls) == 0:
        raise SystemExit("no decode step replays a call of attention.c here: nothing to compare")

    def use(name: str) -> None:
        for graph in graphs:
            graph.retarget(versions[name], ATTENTION_KERNELS)
    return use


def _pool_switch(source: Path, workdir: Path, build: str) -> Callable[[str], None]:
    """``source`` built as the checkout's pool is, and a function that hands every loaded
    kernel library the checkout's pool ("now") or that one ("before")."""
    import ctypes

    from benchmarks.bench_quant_source import built_like
    from blink.kernels.cpu import attention, fused, pool, q4_linear, quant_linear, sampling

    before = built_like(pool.LIBRARY, source, workdir, "the pool")
    now = pool.LIBRARY.get()
    entry = {name: ctypes.cast(library.blink_pool_split, ctypes.c_void_p).value
             for name, library in (("now", now), ("before", before))}
    libraries = [library for library in (attention.LIBRARY.get(), fused.LIBRARY.get(), sampling.LIBRARY.get(),
                                         q4_linear.LIBRARY.get(), quant_linear.LIBRARIES[build].get())
                 if library is not None]

    def use(name: str) -> None:
        for library in libraries:
            library.blink_use_pool(entry[name])
    return use


if __name__ == "__main__":
    main()
