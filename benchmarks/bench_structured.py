"""Structured outputs on CPU: compile time (cold, cached), ring memory per compiled
constraint, and the cost of constrained rows in an engine step.

    python -m benchmarks.bench_structured [--model smollm2-135m] [--steps 48] [--repeats 2]
        [--threads 1]

1. compile: a typical tool schema (get_weather-like, 4 fields, enum, bounded integer),
   a nested schema, ``json_object``, a regex and a choice, with the model's real vocabulary:
   cold (first compile, after the vocabulary is built once) and cached (same constraint again).
2. ops: the grammar mask (torch reference) and advance alone at batch 1 and 16, against the
   sampler's own time on the same logits (the part of a step they add to); and batch 16
   with one constrained row, masked the CPU loop's way (only the rows the host found
   constrained, ``GrammarBatch.rows``).
3. engine: ``LLM.generate`` of B requests x ``--steps`` tokens, all unconstrained vs all
   constrained (a regex long enough that every request ends by length), same prompts,
   greedy: wall time per step, and the ratio.
Numbers on a shared machine are noisy; ratios within one run are the ones to read. Torch
runs ``--threads`` threads (1 by default, as the engine's per-op cost is measured in the
other benchmarks: on a shared CPU a 2-thread OpenMP team waits for a busy core at every op).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from blink.dpu.structured.compiler import GrammarCompiler, GrammarLimits
from blink.dpu.tokenizer import Tokenizer
from blink.engine.grammar import GrammarBatch
from blink.engine.sampler import Sampler, SamplingTensors
from blink.kernels.grammar_reference import advance_grammar, apply_grammar_mask
from blink.ring import G_INITIAL_STATE
from blink.shared.sampling_params import SamplingParams
from blink.shared.structured_outputs import StructuredOutputs as SO

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
    },
    "required": ["location", "unit"],
}
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,12}$"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "tags", "address"],
}
CONSTRAINTS = {
    "tool schema": SO(json=TOOL_SCHEMA),
    "nested schema": SO(json=NESTED_SCHEMA),
    "json_object": SO(json_object=True),
    "regex (date)": SO(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "choice (3)": SO(choice=("positive", "negative", "neutral")),
}


def _best(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_compile(tokenizer: Tokenizer) -> dict:
    # No compile-time limit here: this measures it (the server's default refuses > 10 s).
    compiler = GrammarCompiler(tokenizer, GrammarLimits(max_compile_s=600))
    t = time.perf_counter()
    compiler.vocab_id  # the vocabulary is built once per tokenizer
    out = {"vocab_build_s": time.perf_counter() - t, "vocab": tokenizer.vocab_size}
    for name, so in CONSTRAINTS.items():
        t = time.perf_counter()
        g = compiler.compile(so)
        cold = time.perf_counter() - t
        cached = _best(lambda: compiler.compile(so), 50)
        out[name] = {"cold_s": round(cold, 4), "cached_s": cached, "states": g.num_states,
                     "transitions": g.num_transitions, "stored": g.stored_transitions,
                     "ring_mib": round(g.nbytes / 2**20, 3)}
    return out


def bench_ops(tokenizer: Tokenizer) -> dict:
    g = GrammarCompiler(tokenizer).compile(SO(json=TOOL_SCHEMA))
    words = torch.from_numpy(g.words.astype("int32"))
    vocab = tokenizer.vocab_size
    sampler = Sampler(max_logprobs=0)
    out = {}
    for batch in (1, 16):
        logits = torch.randn(batch, vocab)
        entry = torch.zeros(batch, dtype=torch.int32)
        state = torch.full((batch,), int(g.words[G_INITIAL_STATE]), dtype=torch.int32)
        st = SamplingTensors.empty(batch)
        st.temperature.fill_(0.8)
        hist = torch.zeros(batch, 8, dtype=torch.int32)
        lens = torch.full((batch,), 4)
        t_sampler = _best(lambda: sampler(logits, st, hist, lens, lens, lens))
        t_mask = _best(lambda: apply_grammar_mask(logits, words, entry, state))
        tok = torch.full((batch,), 90)
        t_adv = _best(lambda: advance_grammar(words, entry, state, tok))
        out[f"batch {batch}"] = {"sampler_ms": t_sampler * 1e3, "mask_ms": t_mask * 1e3,
                                 "advance_ms": t_adv * 1e3}
        if batch > 1:  # one constrained row among unconstrained ones, as the CPU loop masks
            mixed_entry = torch.full((batch,), -1, dtype=torch.int32)
            mixed_entry[0] = 0
            g_batch = GrammarBatch(words, mixed_entry, state, (mixed_entry >= 0).nonzero().flatten())
            out[f"batch {batch}"]["mask_one_row_ms"] = _best(
                lambda: g_batch.apply(apply_grammar_mask, logits)) * 1e3
    return out


def bench_engine(model: str, steps: int, repeats: int) -> dict:
    from blink.llm import LLM

    out = {}
    with LLM(model, max_model_len=512, max_num_seqs=16, kv_cache_tokens=16 * 512,
             max_num_batched_tokens=512) as llm:
        prompts = [f"Write item {i} of a list of lowercase words:" for i in range(16)]
        # At least `steps` words (a word and its space are at least one token: SmolLM2's
        # tokens do not span a space), so no request ends before max_tokens: every row
        # decodes every step in both runs.
        constrained = SO(regex=f"([a-z]+ ){{{steps},}}")
        for batch in (1, 16):
            free = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
            fixed = SamplingParams(temperature=0.0, max_tokens=steps, structured_outputs=constrained)
            llm.generate(prompts[:batch], fixed)  # warm-up (and compile once), both kinds
            llm.generate(prompts[:batch], free)
            times = {"unconstrained": [], "constrained": []}
            for _ in range(repeats):  # interleaved, so drift hits both alike
                for name, params in (("unconstrained", free), ("constrained", fixed)):
                    t = time.perf_counter()
                    res = llm.generate(prompts[:batch], params)
                    times[name].append(time.perf_counter() - t)
                    assert all(len(r.outputs[0].token_ids) == steps for r in res), name
            best = {k: min(v) / steps * 1e3 for k, v in times.items()}
            out[f"batch {batch}"] = {"unconstrained_ms_per_step": best["unconstrained"],
                                     "constrained_ms_per_step": best["constrained"],
                                     "ratio": best["constrained"] / best["unconstrained"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_pretrained(args.model)
    result = {"compile": bench_compile(tokenizer), "ops": bench_ops(tokenizer)}
    print(json.dumps(result, indent=1), flush=True)
    if not args.skip_engine:
        print(json.dumps({"engine": bench_engine(args.model, args.steps, args.repeats)}, indent=1))


if __name__ == "__main__":
    main()
