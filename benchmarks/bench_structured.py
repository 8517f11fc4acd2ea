"""Structured outputs (issue 30): the frontend's per-token mask cost and constrained vs
unconstrained serving throughput.

    python -m benchmarks.bench_structured [--mask-only | --serve-only]
        [--corpus-limit N] [--instances 2]                     # (a) mask cost
        [--streams 16] [--requests 48] [--max-tokens 128] [--rounds 2]
        [--base-url URL | --serve-args "..."] [--json OUT]    # (b) throughput

(a) **Mask cost in the frontend.** What the ring client does for each token of a constrained
request (``RingClient._follow_mask``): ``TokenMasker.advance`` (the engine's token) then
``TokenMasker.mask`` (the next token's mask), timed per token, and ``RingClient._write_mask``
(the mask row into the ring, fence, the epoch word) on a loopback ring of SmolLM2's width.
The generations walked: valid instances (``benchmarks/grammar_instances.py``, checked by
``jsonschema``) of the committed tool and pydantic schemas (``benchmarks/grammar_corpus_own.py``)
and, with ``--corpus-limit N`` > 0, of the first N schemas of the real-world corpus
(``benchmarks/grammar_corpus.py``, from its cache), laid out as Blink lays JSON out
(``json.dumps``'s separators), tokenized by SmolLM2's tokenizer, compiled by Blink's own
``GrammarService`` (the frontend's path: worker check, template, one matcher per walk). A token
the mask does not allow ends that walk (counted: a non-canonical tokenization the grammar's
layout refuses, e.g. ``ensure_ascii`` escapes).

(b) **Constrained throughput.** One ``blink serve`` (started here on SmolLM2 with
``--serve-args``, or the server at ``--base-url``), ``--streams`` requests in flight, the same
chat prompts (asking for a JSON object) sent three ways: unconstrained, ``response_format``
``json_schema`` (a tool-like object) and ``json_object``; ``--rounds`` rounds, the modes
interleaved within each (the machine's load drifts). Output tok/s = output tokens / wall time of
the mode's runs; the ratio constrained / unconstrained is the figure (issue 30's target: >= 0.9).
Constrained outputs end when their grammar does (no ``ignore_eos`` with a constraint), so the
mean output length and TPOT are printed beside each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

for _var in ("OMP_NUM_THREADS", "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_var, "false" if _var == "TOKENIZERS_PARALLELISM" else "1")

TOOL_SCHEMA = {  # a tool-like object, as an agent asks for a typed result
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 60},
        "email": {"type": "string", "format": "email"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "bio": {"type": "string", "maxLength": 400},
    },
    "required": ["name", "age", "city", "hobbies", "bio"],
}
PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Nikola Tesla",
          "Rosalind Franklin", "Charles Darwin", "Emmy Noether", "Isaac Newton", "Hedy Lamarr",
          "Carl Sagan", "Katherine Johnson", "Leonardo da Vinci", "Frida Kahlo", "Jane Goodall",
          "Richard Feynman"]


def prompts() -> list[str]:
    return [f"Describe {p} as a JSON object with the fields name, age, city, email, hobbies "
            f"(a list) and bio (two sentences)." for p in PEOPLE]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def pct(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


# --- (a) mask cost ----------------------------------------------------------------------------

def schemas(corpus_limit: int) -> list[dict]:
    from benchmarks.grammar_corpus_own import own_schemas

    items = own_schemas()
    if corpus_limit > 0:
        from benchmarks.grammar_corpus import load_corpus

        items = load_corpus(own=False)[:corpus_limit] + items
    return items


def ring_for(vocab_size: int):
    """A loopback ring of ``vocab_size``'s mask width and its frontend client."""
    from blink.dpu.ring_protocol import RingClient
    from blink.ring import Ring, RingConfig, RingLayout, mask_words_for
    from blink.transport.loopback import LoopbackRegion, LoopbackTransport

    cfg = RingConfig(n_slots=16, arena_tokens=4096, stream_capacity=8, max_logprobs=1,
                     max_stop_ids=2, max_logit_bias=2, max_model_len=2048,
                     mask_words=mask_words_for(vocab_size))
    region = LoopbackRegion(RingLayout(cfg).total_bytes)
    Ring.create(region.buffer, cfg)
    client = RingClient(LoopbackTransport(region.name, region.total_bytes))
    return region, client


def bench_masks(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_grammar_engines import smollm2_gguf
    from benchmarks.grammar_instances import valid_instances
    from blink.dpu.structured.workers import GrammarService
    from blink.dpu.tokenizer import Tokenizer
    from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError

    tok = Tokenizer.from_pretrained(str(smollm2_gguf()))
    service = GrammarService(tok, timeout_s=args.compile_timeout, workers=1)
    region, ring = ring_for(tok.vocab_size)
    step_s: list[float] = []  # advance + mask, per token
    first_s: list[float] = []  # the first mask of a walk (no advance)
    write_s: list[float] = []
    worst: list[tuple[float, str, int]] = []  # (max advance + mask, schema id, tokens)
    n_schemas = refused = no_instance = walks = cut = 0
    try:
        for item in schemas(args.corpus_limit):
            schema = item["schema"]
            try:
                so = StructuredOutputs(json=schema)
                grammar = service.compile(so)
            except (StructuredOutputsError, ValueError, TypeError):
                refused += 1
                continue
            instances = valid_instances(schema, n=args.instances, seed=1)
            if not instances:
                no_instance += 1
                continue
            n_schemas += 1
            first_step = len(step_s)
            for value in instances:
                ids = tok.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)
                masker = grammar.new_masker()
                t0 = time.perf_counter()
                words = masker.mask()
                first_s.append(time.perf_counter() - t0)
                walks += 1
                for token in ids:
                    if not (int(words[token >> 5]) >> (token & 31)) & 1:
                        cut += 1  # the grammar's layout refuses this tokenization
                        break
                    t0 = time.perf_counter()
                    masker.advance([token])
                    words = masker.mask()
                    step_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    ring._write_mask(walks % 16, words, len(step_s))
                    write_s.append(time.perf_counter() - t0)
            if len(step_s) > first_step:
                worst.append((max(step_s[first_step:]), str(item.get("id")), len(step_s) - first_step))
    finally:
        service.close()
        ring.close()
        region.close()
    out = {"schemas_walked": n_schemas, "refused": refused, "no_instance": no_instance,
           "walks": walks, "walks_cut": cut, "tokens": len(step_s),
           "mask_step_us": {q: pct(step_s, q) * 1e6 for q in (50, 90, 99, 99.9)},
           "mask_step_max_us": max(step_s) * 1e6 if step_s else float("nan"),
           "mask_step_mean_us": float(np.mean(step_s)) * 1e6 if step_s else float("nan"),
           "first_mask_us": {q: pct(first_s, q) * 1e6 for q in (50, 99)},
           "ring_write_us": {q: pct(write_s, q) * 1e6 for q in (50, 99)},
           "vocab": tok.vocab_size,
           "worst_schemas": [{"id": i, "max_us": m * 1e6, "tokens": n}
                             for m, i, n in sorted(worst, reverse=True)[:8]]}
    print(f"(a) mask cost: {n_schemas} schemas ({refused} refused, {no_instance} without an "
          f"instance), {walks} walks ({cut} cut by a refused tokenization), {len(step_s)} tokens, "
          f"vocab {tok.vocab_size}")
    m = out["mask_step_us"]
    print(f"    advance + mask per token: p50 {m[50]:.0f} us, p90 {m[90]:.0f} us, p99 {m[99]:.0f} us,"
          f" p99.9 {m[99.9]:.0f} us, max {out['mask_step_max_us']:.0f} us, mean "
          f"{out['mask_step_mean_us']:.0f} us")
    f = out["first_mask_us"]
    w = out["ring_write_us"]
    print(f"    first mask of a request: p50 {f[50]:.0f} us, p99 {f[99]:.0f} us;"
          f" ring write (_write_mask) per token: p50 {w[50]:.1f} us, p99 {w[99]:.1f} us")
    print("    slowest tokens: " + "; ".join(f"{x['id']} {x['max_us'] / 1e3:.1f} ms ({x['tokens']} tokens)"
                                         for x in out["worst_schemas"][:5]))
    return out


# --- (b) throughput ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="bench-structured-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--port", str(port),
           *shlex.split(serve_args)]
    print(f"starting: {shlex.join(cmd)} (log {log})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}", log


MODES = {
    "unconstrained": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": TOOL_SCHEMA, "strict": True}}},
    "json_object": {"response_format": {"type": "json_object"}},
}


async def one_mode(base_url: str, model: str, mode: str, args: argparse.Namespace) -> dict:
    from benchmarks.serve_client import build_payload, make_client, send_streaming_request

    texts = prompts()
    sem = asyncio.Semaphore(args.streams)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    async with make_client(args.streams) as client:
        async def one(i: int):
            payload = build_payload(model=model, prompt=texts[i % len(texts)],
                                    max_tokens=args.max_tokens, chat=True,
                                    temperature=args.temperature, extra_body=MODES[mode])
            async with sem:
                return await send_streaming_request(client, url, payload, chat=True, prompt_len=0)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    errors = [o.error for o in outs if not o.success]
    tokens = sum(o.output_tokens for o in outs if o.success)
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in outs
            if o.success and o.output_tokens > 1 and o.ttft]
    valid = None
    if mode != "unconstrained":
        valid = 0
        for o in outs:
            try:
                value = json.loads(o.generated_text)
                valid += isinstance(value, dict)
            except ValueError:
                pass
    return {"wall_s": wall, "tokens": tokens, "errors": errors[:3], "n_errors": len(errors),
            "mean_tokens": tokens / max(1, len(outs) - len(errors)),
            "tpot_ms": float(np.median(tpot)) * 1e3 if tpot else float("nan"),
            "json_parsed": valid}


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from benchmarks.serve import discover_model, wait_for_server

    proc = log = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url, log = start_server(args.serve_args)
    try:
        try:
            wait_for_server(base_url, timeout_s=600, proc=proc)
        except (RuntimeError, TimeoutError):
            if log is not None:
                print(log.read_text()[-3000:], file=sys.stderr)
            raise
        model = discover_model(base_url)
        # warm-up: the grammars compiled (and cached), the CPU kernels touched
        for mode in MODES:
            body = {"model": model, "max_tokens": 4, "messages": [
                {"role": "user", "content": prompts()[0]}], **MODES[mode]}
            r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300,
                           trust_env=False)
            r.raise_for_status()
        totals = {m: {"wall_s": 0.0, "tokens": 0, "runs": []} for m in MODES}
        for rnd in range(args.rounds):
            order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))
            for mode in order:
                res = asyncio.run(one_mode(base_url, model, mode, args))
                totals[mode]["wall_s"] += res["wall_s"]
                totals[mode]["tokens"] += res["tokens"]
                totals[mode]["runs"].append(res)
                print(f"    round {rnd + 1} {mode:>13}: {res['tokens'] / res['wall_s']:7.1f} tok/s "
                      f"({res['tokens']} tokens in {res['wall_s']:.1f} s, mean "
                      f"{res['mean_tokens']:.0f} tokens/request, TPOT p50 {res['tpot_ms']:.0f} ms"
                      + (f", {res['json_parsed']}/{args.requests} parse as JSON objects"
                         if res["json_parsed"] is not None else "")
                      + (f", {res['n_errors']} errors: {res['errors']}" if res["n_errors"] else "")
                      + ")", flush=True)
        base = totals["unconstrained"]["tokens"] / totals["unconstrained"]["wall_s"]
        out: dict[str, Any] = {"base_url": base_url, "model": model}
        print(f"(b) c{args.streams}, {args.requests} requests x {args.rounds} rounds per mode, "
              f"max_tokens {args.max_tokens}:")
        for mode, t in totals.items():
            rate = t["tokens"] / t["wall_s"]
            tpot = float(np.median([r["tpot_ms"] for r in t["runs"]]))
            out[mode] = {"tok_s": rate, "ratio": rate / base, "tpot_ms": tpot,
                         "mean_tokens": t["tokens"] / (args.requests * args.rounds),
                         "runs": t["runs"]}
            print(f"    {mode:>13}: {rate:7.1f} output tok/s, {rate / base:.2f}x unconstrained "
                  f"(TPOT p50 {tpot:.0f} ms, mean {out[mode]['mean_tokens']:.0f} tokens/request)")
        return out
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_structured",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--mask-only", action="store_true", help="only (a), the mask cost")
    part.add_argument("--serve-only", action="store_true", help="only (b), the throughput")
    a = ap.add_argument_group("(a) mask cost")
    a.add_argument("--corpus-limit", type=int, default=0, metavar="N",
                   help="also walk the first N real-world corpus schemas (default 0: only the "
                        "committed tool and pydantic schemas)")
    a.add_argument("--instances", type=int, default=2, help="valid instances walked per schema")
    a.add_argument("--compile-timeout", type=float, default=10.0,
                   help="the grammar check's limit here (generous: the machine is shared)")
    b = ap.add_argument_group("(b) constrained vs unconstrained throughput")
    b.add_argument("--streams", type=int, default=16, help="requests in flight")
    b.add_argument("--requests", type=int, default=48, help="requests per mode and round")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--rounds", type=int, default=2, help="rounds (the modes interleaved)")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--base-url", default=None, help="a running server (else one is started)")
    b.add_argument("--serve-args", default="--max-num-seqs 16 --max-model-len 1024",
                   help="flags of the blink serve started here (default: %(default)s; SmolLM2)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} CPUs visible), Python {platform.python_version()}")
    results: dict[str, Any] = {"cpu": cpu_model(), "argv": sys.argv}
    if not args.serve_only:
        results["mask"] = bench_masks(args)
    if not args.mask_only:
        results["serve"] = bench_serve(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
