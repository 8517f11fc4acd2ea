"""Serving benchmark against any OpenAI-compatible server (Blink, vLLM, llama.cpp, ...).

Open-loop arrivals (Poisson, or gamma with ``--burstiness``) at a fixed ``--request-rate`` or
over a ``--rate-sweep``, optionally capped by ``--max-concurrency`` (closed loop with
``--request-rate inf``); synthetic random or shipped-prompt datasets; TTFT/TPOT/ITL/E2EL
percentiles, throughputs and goodput defined as in vLLM's ``benchmark_serving.py`` (see
``benchmarks/serve_metrics.py``). Examples::

    # concurrency 16, 128 tokens in, 128 out (fixed by ignore_eos)
    python -m benchmarks.serve --base-url http://127.0.0.1:8765 --dataset random \\
        --random-input-len 128 --random-output-len 128 --ignore-eos \\
        --max-concurrency 16 --num-prompts 64 --result-json out.json

    # Poisson sweep over offered load with the shipped prompt set, SLO goodput
    python -m benchmarks.serve --base-url http://127.0.0.1:8765 --dataset prompts \\
        --rate-sweep 0.5,1,2,4 --num-prompts 100 --goodput ttft:2000 tpot:200 \\
        --label blink --result-json sweep.json
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

from benchmarks.serve_client import build_payload, make_client, send_streaming_request
from benchmarks.serve_datasets import (SampleRequest, load_tokenizer, prompt_set_requests,
                                       random_requests)
from benchmarks.serve_metrics import (DEFAULT_PERCENTILES, RequestOutput, calculate_metrics,
                                      format_report, parse_goodput)


# -- arrivals --------------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of ``n`` requests.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)), i.e. mean 1/rate; burstiness 1
    is a Poisson process, < 1 burstier, > 1 more regular (vLLM's ``get_request``). The first
    request goes at t=0. ``rate=inf`` sends everything at once.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError("request rate must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


# -- one benchmark run -----------------------------------------------------------------------
async def run_requests(requests: Sequence[SampleRequest], *, api_url: str, model: str, chat: bool,
                       rate: float, burstiness: float, max_concurrency: int | None, seed: int,
                       ignore_eos: bool, temperature: float, include_usage: bool,
                       logit_bias: dict[int, float] | None, extra_body: dict[str, Any] | None,
                       headers: dict[str, str] | None, show_progress: bool,
                       desc: str = "") -> tuple[list[RequestOutput], float]:
    """Send ``requests`` on the arrival schedule; return the outputs and the wall duration."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = None
    if show_progress:
        from tqdm import tqdm

        pbar = tqdm(total=len(requests), desc=desc or None, file=sys.stderr, leave=False)
    conns = max_concurrency or len(requests)
    async with make_client(max(conns, 1)) as client:
        async def one(req: SampleRequest) -> RequestOutput:
            payload = build_payload(model=model, prompt=req.prompt,
                                    max_tokens=req.expected_output_len, chat=chat,
                                    ignore_eos=ignore_eos, temperature=temperature,
                                    include_usage=include_usage, logit_bias=logit_bias,
                                    extra_body=extra_body)
            if sem is None:
                out = await send_streaming_request(client, api_url, payload, chat=chat,
                                                   prompt_len=req.prompt_len, headers=headers)
            else:
                async with sem:
                    out = await send_streaming_request(client, api_url, payload, chat=chat,
                                                       prompt_len=req.prompt_len, headers=headers)
            if pbar is not None:
                pbar.update(1)
            return out

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        start = time.perf_counter()
        tasks = []
        for req, off in zip(requests, offsets):
            delay = t0 + float(off) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return list(outputs), duration


# -- CLI -------------------------------------------------------------------------------------
def add_serve_args(ap: argparse.ArgumentParser, *, with_target: bool = True) -> None:
    """The client options, shared by benchmarks.serve, .interference and .peers."""
    if with_target:
        t = ap.add_argument_group("target")
        t.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="server root, e.g. http://127.0.0.1:8765 (default: %(default)s)")
        t.add_argument("--model", default=None,
                       help="model name sent in requests (default: the server's first /v1/models id)")
    g = ap.add_argument_group("client")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for building prompts and counting tokens when a server sends "
                        "no usage: HF dir, .gguf or preset name (default: --model, else smollm2-135m)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to ignore EOS so outputs have exactly the requested length")
    g.add_argument("--eos-logit-bias", action="store_true",
                   help="also send logit_bias -100 on the tokenizer's EOS ids (fixed lengths on "
                        "servers without ignore_eos, e.g. llama-cpp-python)")
    g.add_argument("--no-usage", action="store_true",
                   help="do not request stream_options.include_usage; count output tokens with "
                        "the tokenizer")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    d = ap.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=["random", "prompts"],
                   help="random synthetic prompts, or the shipped prompt set (default: %(default)s)")
    d.add_argument("--dataset-path", default=None, help="another JSONL file like data/prompts.jsonl")
    d.add_argument("--num-prompts", type=int, default=64)
    d.add_argument("--random-input-len", type=int, default=128)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-dist", default="uniform", choices=["fixed", "uniform", "lognormal"],
                   help="length distribution of the random dataset (uniform with range ratio 0 = "
                        "fixed lengths)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="uniform lengths in [len*(1-r), len*(1+r)] (vLLM's rule)")
    d.add_argument("--random-sigma", type=float, default=0.5, help="sigma of the log-normal lengths")
    d.add_argument("--random-prefix-len", type=int, default=0, help="shared prefix tokens")
    d.add_argument("--prompts-output-len", type=int, default=None,
                   help="override the prompt set's per-prompt output lengths")
    d.add_argument("--max-model-len", type=int, default=None,
                   help="keep prompt+output within this many tokens")
    d.add_argument("--seed", type=int, default=0)
    l = ap.add_argument_group("load")
    l.add_argument("--request-rate", type=float, default=float("inf"),
                   help="offered load in requests/s (default inf: all at t=0)")
    l.add_argument("--rate-sweep", default=None,
                   help="comma-separated request rates, one run each (overrides --request-rate)")
    l.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier, >1 smoother")
    l.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (closed loop with rate inf)")
    l.add_argument("--warmup", type=int, default=2,
                   help="requests sent (and discarded) before measuring (default: %(default)s)")
    m = ap.add_argument_group("metrics and output")
    m.add_argument("--percentiles", default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES))
    m.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:1000 tpot:100 e2el:20000")
    m.add_argument("--label", default=None, help="system name recorded in the result (plots)")
    m.add_argument("--condition", default="isolated",
                   help="condition recorded in the result, e.g. isolated / interference")
    m.add_argument("--result-json", default=None, help="write config + metrics of every run here")
    m.add_argument("--save-detailed", action="store_true",
                   help="also store per-request start (s after the first), ttft, itl and latency in the result JSON")
    m.add_argument("--disable-tqdm", action="store_true")
    m.add_argument("--quiet", action="store_true", help="print only the one-line summary per run")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(ap)
    return ap


def discover_model(base_url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> str:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout,
                  trust_env=False)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise SystemExit(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def wait_for_server(base_url: str, timeout_s: float = 300.0, proc: Any = None) -> None:
    """Poll /v1/models until the server answers (or ``proc`` exits, or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was ready")
        try:
            r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=5.0, trust_env=False)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f}s ({last})")


def resolve_tokenizer(name: str | None, served_model: str | None = None) -> Any:
    """``name`` if given; else the served model's name/path, else SmolLM2 (the default model)."""
    if name:
        return load_tokenizer(name)
    for cand in (served_model, "smollm2-135m"):
        if not cand:
            continue
        try:
            return load_tokenizer(cand)
        except SystemExit:
            continue
    raise SystemExit("cannot find a tokenizer; pass --tokenizer")


def _rates(args: argparse.Namespace) -> list[float]:
    if args.rate_sweep:
        return [float(x) for x in args.rate_sweep.split(",") if x.strip()]
    return [args.request_rate]


def make_requests(args: argparse.Namespace, tok: Any) -> list[SampleRequest]:
    if args.dataset == "random":
        return random_requests(tok, args.num_prompts, args.random_input_len, args.random_output_len,
                               seed=args.seed, dist=args.random_dist,
                               range_ratio=args.random_range_ratio, sigma=args.random_sigma,
                               prefix_len=args.random_prefix_len, max_model_len=args.max_model_len)
    kw: dict[str, Any] = {}
    if args.dataset_path:
        kw["path"] = args.dataset_path
    return prompt_set_requests(tok, args.num_prompts, seed=args.seed,
                               output_len=args.prompts_output_len,
                               max_model_len=args.max_model_len, **kw)


def run_benchmark(args: argparse.Namespace, *, tokenizer: Any = None,
                  log: Any = print) -> dict[str, Any]:
    """Run every rate of ``args`` against ``args.base_url``; return the result document."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    model = args.model or discover_model(args.base_url, headers)
    tok = tokenizer or resolve_tokenizer(args.tokenizer, model)
    chat = "chat" in args.endpoint
    api_url = args.base_url.rstrip("/") + args.endpoint
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    goodput = parse_goodput(args.goodput)
    extra = json.loads(args.extra_body) if args.extra_body else None
    bias = {i: -100.0 for i in getattr(tok, "eos_ids", [])} if args.eos_logit_bias else None
    requests = make_requests(args, tok)

    common = dict(api_url=api_url, model=model, chat=chat, ignore_eos=args.ignore_eos,
                  temperature=args.temperature, include_usage=not args.no_usage,
                  logit_bias=bias, extra_body=extra, headers=headers)
    if args.warmup > 0:
        warm, _ = asyncio.run(run_requests(requests[:args.warmup], rate=math.inf, burstiness=1.0,
                                           max_concurrency=None, seed=args.seed,
                                           show_progress=False, **common))
        bad = [o.error for o in warm if not o.success]
        if len(bad) == len(warm):
            raise SystemExit(f"warm-up requests failed: {bad[0]}")

    runs = []
    for rate in _rates(args):
        desc = f"rate={rate:g}" + (f" conc={args.max_concurrency}" if args.max_concurrency else "")
        outputs, duration = asyncio.run(run_requests(
            requests, rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
            seed=args.seed, show_progress=not args.disable_tqdm, desc=desc, **common))
        metrics = calculate_metrics(outputs, duration, count_tokens=lambda s: len(tok.encode(s)),
                                    percentiles=percentiles, goodput=goodput)
        metrics["offered_rate"] = None if math.isinf(rate) else rate
        metrics["max_concurrency"] = args.max_concurrency
        metrics["burstiness"] = args.burstiness
        errors = sorted({o.error for o in outputs if not o.success})
        metrics["errors"] = errors[:5]
        if args.save_detailed:
            first = min((o.start_time for o in outputs), default=0.0)
            metrics["requests"] = [
                {"success": o.success, "prompt_len": o.prompt_len, "output_tokens": o.output_tokens,
                 "start": o.start_time - first, "ttft": o.ttft, "latency": o.latency, "itl": o.itl,
                 "error": o.error}
                for o in outputs]
        runs.append(metrics)
        if log is not None:
            if args.quiet:
                log(summary_line(metrics, args.label))
            else:
                log(format_report(metrics, title=f"{args.label or 'Serving'} {desc}"))
            if errors:
                log(f"errors ({metrics['failed']} failed): {errors[:3]}")
    return {
        "label": args.label or model,
        "condition": args.condition,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "python": platform.python_version()},
        "config": {k: v for k, v in vars(args).items() if _jsonable(v)} | {"served_model": model},
        "runs": runs,
    }


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def summary_line(m: dict[str, Any], label: str | None = None) -> str:
    rate = "inf" if m.get("offered_rate") is None else f"{m['offered_rate']:g}"
    return (f"{label or ''} rate={rate} conc={m.get('max_concurrency')} ok={m['completed']}/"
            f"{m['num_requests']} req/s={m['request_throughput']:.2f} "
            f"out_tok/s={m['output_throughput']:.1f} "
            f"TTFT p50/p99={m['ttft_ms']['p50']:.0f}/{m['ttft_ms']['p99']:.0f}ms "
            f"TPOT p50/p99={m['tpot_ms']['p50']:.1f}/{m['tpot_ms']['p99']:.1f}ms "
            f"ITL p99={m['itl_ms']['p99']:.1f}ms E2E p99={m['e2el_ms']['p99']:.0f}ms"
            + (f" resent={m['resent_after_closed_connection']}" if m.get("resent_after_closed_connection") else ""))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run_benchmark(args)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.result_json}")
    return 0 if all(r["completed"] > 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
