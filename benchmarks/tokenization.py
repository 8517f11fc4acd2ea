"""Frontend tokenization and detokenization microbenchmark (the paper's Figure 4 analogue).

Per request, across input lengths (default 10..2048 tokens), the time the frontend spends
turning a request into token ids:

- Blink: ``blink.dpu.tokenizer.Tokenizer`` (``encode`` for /v1/completions, ``encode_chat`` =
  chat template render + encode for /v1/chat/completions). Its exact fast path
  (``blink.dpu.fast_encode``) is timed with its word cache warm (the same text again, as
  ``tokenizers``' own BPE cache is for both sides) and emptied before every call ("cold"), and
  ``Tokenizer(fast=False)`` (plain ``tokenizers.Tokenizer.encode``) shows what the wrapper alone
  gives;
- Hugging Face: ``transformers.AutoTokenizer`` loaded from the same tokenizer files
  (``tok(text).input_ids`` and ``apply_chat_template(..., tokenize=True)``).

``--corpus multilingual`` uses mixed-script text (Latin with diacritics, Greek, Cyrillic, CJK,
Hangul, emoji) instead of English. ``--threads 1`` pins the process to one CPU and Rust's
thread pool to one thread.

Both load the tokenizer from the same model (the GGUF by default: its tokenizer files are
written to a temporary directory for AutoTokenizer, exactly what ``blink convert`` writes). Then
the detokenization cost per output token at long outputs: Blink's ``IncrementalDetokenizer.step``
against re-decoding the whole output after every token (the naive way, O(n) per token).

    python -m benchmarks.tokenization --model smollm2-135m --threads 1 --result-json tok.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.serve_datasets import _SENTENCES

MULTILINGUAL_SENTENCES = [
    "Grüße aus München, die Straße ist heute ruhig und schön.",
    "Le café était délicieux, mais la crème brûlée était encore meilleure.",
    "Привет, как дела? Сегодня хорошая погода для прогулки.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "今日はとても良い天気ですね。散歩に行きましょう。",
    "我们明天一起去图书馆学习中文吧。",
    "안녕하세요, 오늘 날씨가 정말 좋네요.",
    "Emoji time 😀🚀 👍🏽 and flags 🇫🇷🇯🇵 — ça marche!",
    "Ελληνικά, русский, español: ¿qué tal? ñandú, año, pingüino.",
]


def natural_text(tok: Any, n_tokens: int, offset: int = 0,
                 sentences: Sequence[str] = _SENTENCES) -> str:
    """Text of ``n_tokens`` tokens (without special tokens; one or two fewer when the cut
    falls inside a character), from ``sentences``."""
    parts: list[str] = []
    i = offset
    while True:
        parts.append(sentences[i % len(sentences)])
        i += 7
        text = " ".join(parts)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= n_tokens:
            # (a cut inside a multi-byte character would leave a U+FFFD: drop it)
            return tok.decode(ids[:n_tokens], skip_special_tokens=False).rstrip("\ufffd")


def _time_per_call(fn: Callable[[], Any], min_time_s: float, min_reps: int,
                   setup: Callable[[], Any] | None = None) -> list[float]:
    """Per-call times in microseconds, repeated for at least ``min_time_s`` and ``min_reps``;
    ``setup`` (untimed) runs before each call."""
    fn()  # warm
    times: list[float] = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t_end = time.perf_counter() + min_time_s
        while len(times) < min_reps or time.perf_counter() < t_end:
            if setup is not None:
                setup()
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1000.0)
    finally:
        if gc_was:
            gc.enable()
    return times


def _summ(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"median_us": statistics.median(s), "mean_us": statistics.fmean(s),
            "p90_us": s[int(0.9 * (len(s) - 1))], "reps": len(s)}


def load_both(model: str, hf_dir: str | None) -> tuple[Any, Any, str]:
    from transformers import AutoTokenizer

    from blink.dpu.tokenizer import Tokenizer
    from blink.loader import load_tokenizer_files

    blink_tok = Tokenizer.from_pretrained(model)
    if hf_dir is None:
        tokenizer_json, tokenizer_config, _ = load_tokenizer_files(model)
        hf_dir = tempfile.mkdtemp(prefix="blink-tok-")
        Path(hf_dir, "tokenizer.json").write_text(tokenizer_json)
        Path(hf_dir, "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    hf_tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    return blink_tok, hf_tok, hf_dir


def bench_tokenize(blink_tok: Any, hf_tok: Any, lengths: Sequence[int], min_time_s: float,
                   min_reps: int, sentences: Sequence[str] = _SENTENCES) -> list[dict[str, Any]]:
    import copy

    # the same tokenizer without the fast path: plain tokenizers.Tokenizer.encode
    plain_tok = copy.copy(blink_tok)
    plain_tok._fast = None
    fast = blink_tok._fast
    clear_cache = fast._cache.clear if fast is not None else None
    rows = []
    for n in lengths:
        text = natural_text(blink_tok, n, sentences=sentences)
        msgs = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text}]
        # same ids on both sides (correctness first)
        b_ids = blink_tok.encode(text)
        h_ids = hf_tok(text).input_ids
        b_chat = blink_tok.encode_chat(msgs)
        h_chat = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if isinstance(h_chat, dict) or hasattr(h_chat, "input_ids"):
            h_chat = h_chat["input_ids"]
        row: dict[str, Any] = {
            "tokens": n, "chars": len(text),
            "ids_equal": b_ids == list(h_ids) == plain_tok.encode(text),
            "chat_ids_equal": b_chat == list(h_chat) == plain_tok.encode_chat(msgs),
            "fast_path": fast is not None and fast.encode(text) is not None}
        cases: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {
            "blink_encode": (lambda: blink_tok.encode(text), None),
            "blink_encode_cold": (lambda: blink_tok.encode(text), clear_cache),
            "blink_plain_encode": (lambda: plain_tok.encode(text), None),
            "hf_encode": (lambda: hf_tok(text).input_ids, None),
            "blink_chat": (lambda: blink_tok.encode_chat(msgs), None),
            "hf_chat": (lambda: hf_tok.apply_chat_template(msgs, tokenize=True,
                                                           add_generation_prompt=True), None),
        }
        for name, (fn, setup) in cases.items():
            row[name] = _summ(_time_per_call(fn, min_time_s, min_reps, setup))
        hf_us = row["hf_encode"]["median_us"]
        row["speedup_encode"] = hf_us / row["blink_encode"]["median_us"]
        row["speedup_encode_cold"] = hf_us / row["blink_encode_cold"]["median_us"]
        row["speedup_plain_encode"] = hf_us / row["blink_plain_encode"]["median_us"]
        row["speedup_chat"] = row["hf_chat"]["median_us"] / row["blink_chat"]["median_us"]
        rows.append(row)
    return rows


def bench_detokenize(blink_tok: Any, hf_tok: Any, out_lens: Sequence[int]) -> list[dict[str, Any]]:
    from blink.dpu.detokenizer import IncrementalDetokenizer

    rows = []
    prompt = blink_tok.encode(natural_text(blink_tok, 64, offset=3))
    for n in out_lens:
        ids = blink_tok.encode(natural_text(blink_tok, n, offset=11), add_special_tokens=False)[:n]
        # Blink: one IncrementalDetokenizer per request, one step per token
        best = float("inf")
        text = ""
        for _ in range(3):
            det = IncrementalDetokenizer(blink_tok, prompt)
            t0 = time.perf_counter_ns()
            text = "".join(det.step(t) for t in ids) + det.flush()
            best = min(best, time.perf_counter_ns() - t0)
        row: dict[str, Any] = {"output_tokens": n, "blink_incremental_us_per_token": best / 1000 / n,
                               "text_equal": text == blink_tok.decode(ids)}
        # naive: decode everything so far after every token (what a frontend without
        # incremental detokenization does to find the new text); capped to keep it short
        m = min(n, 2048)
        t0 = time.perf_counter_ns()
        prev = ""
        for k in range(1, m + 1):
            cur = hf_tok.decode(ids[:k], skip_special_tokens=True)
            _ = cur[len(prev):]
            prev = cur
        row["hf_full_redecode_us_per_token"] = (time.perf_counter_ns() - t0) / 1000 / m
        row["hf_full_redecode_tokens_measured"] = m
        rows.append(row)
    return rows


def print_tables(tok_rows: list[dict[str, Any]], det_rows: list[dict[str, Any]]) -> str:
    out = ["| input tokens | Blink encode µs | cold cache µs | tokenizers only µs | HF encode µs "
           "| speedup (cold, tokenizers only) | Blink chat µs | HF chat µs | speedup | same ids |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in tok_rows:
        same = "yes" if r["ids_equal"] and r["chat_ids_equal"] else "NO"
        if not r["fast_path"]:
            same += " (no fast path)"
        out.append(f"| {r['tokens']} | {r['blink_encode']['median_us']:.1f} | "
                   f"{r['blink_encode_cold']['median_us']:.1f} | "
                   f"{r['blink_plain_encode']['median_us']:.1f} | "
                   f"{r['hf_encode']['median_us']:.1f} | **{r['speedup_encode']:.2f}×** "
                   f"({r['speedup_encode_cold']:.2f}×, {r['speedup_plain_encode']:.2f}×) | "
                   f"{r['blink_chat']['median_us']:.1f} | {r['hf_chat']['median_us']:.1f} | "
                   f"**{r['speedup_chat']:.2f}×** | {same} |")
    if not det_rows:
        return "\n".join(out)
    out += ["", "| output tokens | Blink incremental µs/token | HF full re-decode µs/token | same text |",
            "|---:|---:|---:|---|"]
    for r in det_rows:
        out.append(f"| {r['output_tokens']} | {r['blink_incremental_us_per_token']:.2f} | "
                   f"{r['hf_full_redecode_us_per_token']:.2f} | {'yes' if r['text_equal'] else 'NO'} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tokenization", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="HF dir, .gguf or preset name")
    ap.add_argument("--hf-dir", default=None,
                    help="directory AutoTokenizer loads (default: the model's tokenizer files "
                         "written to a temporary directory)")
    ap.add_argument("--lengths", default="10,32,128,512,1024,2048")
    ap.add_argument("--corpus", choices=("english", "multilingual"), default="english")
    ap.add_argument("--threads", type=int, default=None,
                    help="pin the process to this many CPUs and Rust's thread pool (rayon) to "
                         "as many threads (default: no pinning)")
    ap.add_argument("--no-detok", action="store_true", help="skip the detokenization table")
    ap.add_argument("--detok-lengths", default="128,1024,4096")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per measured case")
    ap.add_argument("--min-reps", type=int, default=30)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args(argv)
    pinned: list[int] | None = None
    if args.threads:
        import os

        # before tokenizers starts its thread pool (it is imported by load_both)
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
        if args.threads == 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if hasattr(os, "sched_setaffinity"):
            pinned = sorted(os.sched_getaffinity(0))[: args.threads]
            os.sched_setaffinity(0, pinned)
    blink_tok, hf_tok, hf_dir = load_both(args.model, args.hf_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    sentences = _SENTENCES if args.corpus == "english" else MULTILINGUAL_SENTENCES
    tok_rows = bench_tokenize(blink_tok, hf_tok, lengths, args.min_time, args.min_reps,
                              sentences)
    det_rows = [] if args.no_detok else bench_detokenize(
        blink_tok, hf_tok, [int(x) for x in args.detok_lengths.split(",")])
    table = print_tables(tok_rows, det_rows)
    print(table)
    if args.result_json:
        import transformers
        import tokenizers

        Path(args.result_json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, "hf_dir": hf_dir,
            "corpus": args.corpus, "threads": args.threads, "pinned_cpus": pinned,
            "versions": {"transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__},
            "tokenize": tok_rows, "detokenize": det_rows, "table": table}, indent=2))
        print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
