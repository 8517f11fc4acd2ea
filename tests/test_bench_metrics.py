"""Serving-benchmark metrics against hand-computed traces (vLLM benchmark_serving definitions),
the SSE parser, arrival schedules, the streaming client on a mock transport, interference
ratios and the peers table."""
from __future__ import annotations

import asyncio
import json
import math
import types

import httpx
import numpy as np
import pytest

from benchmarks.interference import ratios, ratio_table
from benchmarks.serve import arrival_offsets
from benchmarks.serve_client import (STALE_CONNECTION_RETRIES, SSEParser, build_payload, chunk_text,
                                     parse_sse_lines, send_streaming_request)
from benchmarks.serve_metrics import (RequestOutput, calculate_metrics, format_report,
                                      parse_goodput, percentile_label)


def _req(ttft, latency, n_out, itl=(), prompt_len=10, success=True, text=""):
    return RequestOutput(success=success, prompt_len=prompt_len, output_tokens=n_out, ttft=ttft,
                         latency=latency, itl=list(itl), generated_text=text)


# -- metric definitions ------------------------------------------------------------------------
def test_tpot_is_decode_time_over_tokens_minus_one():
    # 0.1 s to first token, 1.0 s end to end, 10 tokens -> (1.0 - 0.1) / 9 = 0.1 s
    m = calculate_metrics([_req(0.1, 1.0, 10)], duration_s=2.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert m["e2el_ms"]["mean"] == pytest.approx(1000.0)


def test_single_token_requests_have_no_tpot():
    # vLLM: output_len <= 1 contributes no TPOT sample (and TPOT 0 for goodput)
    m = calculate_metrics([_req(0.2, 0.2, 1), _req(0.1, 0.5, 5)], duration_s=1.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5-0.1)/4 only
    assert m["tpot_ms"]["max"] == pytest.approx(100.0)


def test_itl_pools_gaps_of_all_requests():
    a = _req(0.1, 0.4, 4, itl=[0.1, 0.1, 0.1])
    b = _req(0.2, 0.9, 3, itl=[0.3, 0.4])
    m = calculate_metrics([a, b], duration_s=1.0, percentiles=[50, 100])
    assert m["itl_ms"]["mean"] == pytest.approx(1000 * (0.3 + 0.7) / 5)
    assert m["itl_ms"]["p50"] == pytest.approx(100.0)
    assert m["itl_ms"]["p100"] == pytest.approx(400.0)


def test_percentiles_are_linear_interpolation():
    outs = [_req(t, 1.0, 2) for t in (0.1, 0.2, 0.3, 0.4)]
    m = calculate_metrics(outs, duration_s=1.0, percentiles=[50, 90, 99, 99.9])
    # positions (n-1)*p: 1.5 -> 250; 2.7 -> 370; 2.97 -> 397; 2.997 -> 399.7
    assert m["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(370.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(397.0)
    assert m["ttft_ms"]["p99.9"] == pytest.approx(399.7)
    assert m["ttft_ms"]["median"] == pytest.approx(250.0)
    ttfts = np.array([0.1, 0.2, 0.3, 0.4]) * 1000
    assert m["ttft_ms"]["std"] == pytest.approx(float(np.std(ttfts)))


def test_throughputs_and_failures():
    outs = [_req(0.1, 1.0, 10, prompt_len=100), _req(0.1, 1.0, 30, prompt_len=50),
            RequestOutput(success=False, prompt_len=70, error="boom")]
    m = calculate_metrics(outs, duration_s=4.0)
    assert (m["completed"], m["failed"], m["num_requests"]) == (2, 1, 3)
    assert m["total_input_tokens"] == 150          # failed requests' prompts not counted
    assert m["total_output_tokens"] == 40
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(10.0)
    assert m["total_token_throughput"] == pytest.approx(190 / 4)
    assert m["request_goodput"] is None


def test_output_tokens_counted_by_tokenizer_without_usage():
    out = _req(0.1, 1.0, None, text="a b c d e")
    m = calculate_metrics([out], duration_s=1.0, count_tokens=lambda s: len(s.split()))
    assert m["total_output_tokens"] == 5
    assert m["output_tokens_counted_by_tokenizer"] == 1
    assert m["tpot_ms"]["mean"] == pytest.approx(1000 * 0.9 / 4)
    with pytest.raises(ValueError):
        calculate_metrics([out], duration_s=1.0)


def test_goodput_all_slos_inclusive():
    outs = [
        _req(0.5, 2.0, 16),   # ttft 500 ok, tpot 100 ok, e2el 2000 ok -> good (bounds inclusive)
        _req(0.6, 2.0, 16),   # ttft 600 > 500 -> bad
        _req(0.1, 3.1, 11),   # tpot 300 > 100 -> bad
        _req(0.1, 0.1, 1),    # single token: tpot counts as 0 -> good
        RequestOutput(success=False),
    ]
    m = calculate_metrics(outs, duration_s=2.0, goodput={"ttft": 500, "tpot": 100, "e2el": 2000})
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    only_e2e = calculate_metrics(outs, duration_s=2.0, goodput={"e2el": 2000})
    assert only_e2e["request_goodput"] == pytest.approx(3 / 2.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_empty_and_labels():
    m = calculate_metrics([RequestOutput(success=False)], duration_s=1.0)
    assert m["completed"] == 0 and m["ttft_ms"]["p99"] == 0.0
    assert percentile_label(99.9) == "p99.9" and percentile_label(50) == "p50"
    text = format_report(calculate_metrics([_req(0.1, 1.0, 10)], duration_s=1.0))
    assert "P99.9 TTFT (ms)" in text and "Output token throughput" in text
    with pytest.raises(ValueError):
        calculate_metrics([], duration_s=0.0)


# -- SSE ---------------------------------------------------------------------------------------
def test_sse_parser_rules():
    lines = [": keep-alive", "data: {\"a\": 1}", "", "data:{\"b\":2}", "", "event: x",
             "data: line1", "data: line2", "", "", "data: [DONE]"]
    assert list(parse_sse_lines(lines)) == ['{"a": 1}', '{"b":2}', "line1\nline2", "[DONE]"]
    p = SSEParser()
    assert p.feed("data: x\r\n") is None
    assert p.feed("\r\n") == "x"
    assert p.close() is None


def test_chunk_text_and_payload():
    assert chunk_text({"choices": [{"text": "hi"}]}, chat=False) == "hi"
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}, chat=True) == "yo"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) == ""
    assert chunk_text({"choices": [], "usage": {}}, chat=False) == ""
    p = build_payload(model="m", prompt="x", max_tokens=4, chat=True, ignore_eos=True,
                      logit_bias={2: -100.0})
    assert p["messages"] == [{"role": "user", "content": "x"}]
    assert p["ignore_eos"] is True and p["logit_bias"] == {"2": -100.0}
    assert p["stream_options"] == {"include_usage": True}


# -- arrivals ----------------------------------------------------------------------------------
def test_arrivals_poisson_and_gamma():
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5
    off = arrival_offsets(20001, 4.0, 1.0, seed=1)
    gaps = np.diff(off)
    assert off[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)      # exponential: CV 1
    bursty = np.diff(arrival_offsets(20001, 4.0, 0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.25, rel=0.06)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # gamma: CV 1/sqrt(k)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0)


# -- the client on a mock server ----------------------------------------------------------------
def test_streaming_client_timings_on_mock_server():
    delays = [0.05, 0.1, 0.1, 0.1]  # first chunk after 50 ms, then 3 chunks 100 ms apart

    async def body():
        yield b": ping\n\n"
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            text = ["He", "llo", "", " world"][i]  # an empty chunk is not a token
            yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode()
        yield b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n'
        await asyncio.sleep(0.05)
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        assert payload["stream"] is True
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            payload = build_payload(model="m", prompt="p", max_tokens=3, chat=False)
            return await send_streaming_request(client, "http://x/v1/completions", payload,
                                                chat=False, prompt_len=99)

    out = asyncio.run(go())
    assert out.success, out.error
    assert out.generated_text == "Hello world"
    assert (out.output_tokens, out.prompt_len, out.chunks) == (3, 7, 3)
    assert out.ttft == pytest.approx(0.05, abs=0.03)
    assert len(out.itl) == 2                       # gaps between text chunks only
    assert out.itl[0] == pytest.approx(0.1, abs=0.03)
    assert out.itl[1] == pytest.approx(0.2, abs=0.04)  # spans the empty chunk
    assert out.latency == pytest.approx(0.4, abs=0.06)


def test_streaming_client_http_error():
    def handler(request):
        return httpx.Response(400, json={"error": {"message": "too long"}})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_streaming_request(client, "http://x/v1/completions", {}, chat=False,
                                                prompt_len=1)

    out = asyncio.run(go())
    assert not out.success and "400" in out.error and "too long" in out.error


# -- interference ratios, peers table, plots -----------------------------------------------------
def _metrics(scale: float, tput: float) -> dict:
    m = calculate_metrics([_req(0.1 * scale, 1.0 * scale, 10, itl=[0.1 * scale] * 9)],
                          duration_s=1.0 / tput)
    m["offered_rate"] = 1.0
    return m


def test_interference_ratios():
    rows = {r["metric"]: r for r in ratios(_metrics(1.0, 2.0), _metrics(3.0, 1.0))}
    assert rows["ttft_ms.p99"]["ratio"] == pytest.approx(3.0)
    assert rows["tpot_ms.mean"]["ratio"] == pytest.approx(3.0)
    assert rows["request_throughput"]["ratio"] == pytest.approx(0.5)  # retention
    table = ratio_table(list(rows.values()))
    assert "[3.00]" in table and "[0.50] retention" in table


def test_peers_table_and_plots(tmp_path):
    from benchmarks.peers import markdown_table

    args = types.SimpleNamespace(concurrency=16, input_len=128, output_len=128, num_prompts=4,
                                 single_stream_prompts=2)
    rows = [{"peer": "blink", "status": "ok", "concurrent": _metrics(1.0, 2.0),
             "single": _metrics(1.0, 1.0)},
            {"peer": "vllm", "status": "skipped: not installed"}]
    table = markdown_table(rows, args)
    assert "| blink |" in table and "skipped: not installed" in table
    assert "| 10.0 |" in table  # single-stream decode tok/s = 1000 / 100 ms TPOT

    pytest.importorskip("matplotlib")
    from benchmarks.plot import load_series, plot

    doc = {"label": "blink", "condition": "isolated", "runs": [_metrics(1.0, 2.0)]}
    inter = {"isolated": doc, "interference": dict(doc, condition="interference")}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    (tmp_path / "b.json").write_text(json.dumps(inter))
    series = load_series([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert [s["condition"] for s in series] == ["isolated", "isolated", "interference"]
    paths = plot(series, tmp_path / "plots")
    assert all(p.stat().st_size > 1000 for p in paths)


def test_peers_sweep_and_interference_rows(tmp_path):
    from benchmarks.interference import ratios
    from benchmarks.peers import _client_args, build_parser, markdown_table

    args = build_parser().parse_args(["--rate-sweep", "0.5,2", "--sweep-prompts", "6",
                                      "--interference"])
    args.tokenizer = "smollm2-135m"
    sweep = _client_args(args, "http://x", concurrency=None, num=6, label="blink",
                         overrides={}, condition="interference", sweep=True)
    assert sweep.dataset == "prompts" and sweep.rate_sweep == "0.5,2"
    assert sweep.max_concurrency is None and sweep.condition == "interference"
    fixed = _client_args(args, "http://x", concurrency=16, num=8, label="blink", overrides={})
    assert fixed.dataset == "random" and fixed.max_concurrency == 16 and fixed.rate_sweep is None

    iso, slow = _metrics(1.0, 2.0), _metrics(2.0, 1.0)
    row = {"peer": "blink", "status": "ok", "concurrent": iso, "single": iso, "hog": "stress-ng",
           "concurrent_interference": slow, "interference_ratios": ratios(iso, slow),
           "sweep": {"runs": [dict(iso, offered_rate=0.5), dict(iso, offered_rate=2.0)]},
           "sweep_interference": {"runs": [dict(slow, offered_rate=0.5)]}}
    table = markdown_table([row], args)
    assert "Under interference" in table and "| blink | stress-ng |" in table
    tpot = next(r for r in row["interference_ratios"] if r["metric"] == "tpot_ms.p99")
    assert tpot["ratio"] == pytest.approx(slow["tpot_ms"]["p99"] / iso["tpot_ms"]["p99"])

    pytest.importorskip("matplotlib")
    from benchmarks.plot import load_series

    (tmp_path / "peers.json").write_text(json.dumps({"peers": [row]}))
    series = load_series([str(tmp_path / "peers.json")])
    assert [(s["label"], s["condition"], len(s["runs"])) for s in series] == [
        ("blink", "isolated", 2), ("blink", "interference", 1)]


# -- the interference A/B (benchmarks.interference --arm) ------------------------------------

def test_ab_summary_pairs_each_interfered_run_with_its_own_quiet_run():
    from benchmarks.interference import ab_table, summarize_arm

    def run(rep, cond, tput, ttft):
        return {"repeat": rep, "condition": cond, "load_before": 1.0, "load_after": 2.0,
                "metrics": {"output_throughput": tput, "ttft_ms.p99": ttft, "tpot_ms.p99": 10.0}}

    runs = [run(0, "quiet", 100.0, 50.0), run(0, "hog-all", 50.0, 100.0),
            run(1, "quiet", 200.0, 50.0), run(1, "hog-all", 150.0, 50.0)]
    summary = summarize_arm(runs, ["quiet", "hog-all"])
    hog = summary["hog-all"]
    assert hog["n"] == 2
    assert hog["output_throughput"]["ratio_min_max"] == [0.5, 0.75]  # per repeat, not pooled
    mean, std = hog["output_throughput"]["ratio_mean_std"]
    assert mean == pytest.approx(0.625) and std == pytest.approx(0.1767767)
    assert hog["ttft_ms.p99"]["ratio_min_max"] == [1.0, 2.0]
    table = ab_table({"arms": [{"name": "policy", "summary": summary}]})
    assert "| policy | hog-all | 2 | 1.0-2.0 | 100 ± 71 | 0.62 ± 0.18 [0.50, 0.75] |" in table


def test_ab_shifts_a_blink_arms_policy_by_the_harness_nice(tmp_path):
    import yaml

    from benchmarks.interference import _shift_policies

    cmd = _shift_policies("blink serve --port 9", 15, str(tmp_path))
    path = cmd.split("--thread-policy ")[1]
    doc = yaml.safe_load(open(path))
    nices = [r.get("nice") for r in doc["threads"]]
    assert nices == [5, 5, None, 19]  # -10 -> 5, 10 -> 25 clamped to 19
    assert _shift_policies("blink serve --thread-policy off", 15, str(tmp_path)).endswith("off")
    assert _shift_policies("vllm serve --port 9", 15, str(tmp_path)) == "vllm serve --port 9"


def test_a_connection_closed_before_any_answer_is_sent_again_and_counted():
    """llama-server now and then closes a pooled connection as the next request goes out on it:
    the request is sent again (counted), not failed; a stream cut after its answer began fails,
    and one that keeps being closed fails after the retries."""
    sends = []

    def handler(closes: int):
        def handle(request: httpx.Request) -> httpx.Response:
            sends.append(1)
            if len(sends) <= closes:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=b'data: {"choices":[{"text":"hi"}]}\n\ndata: [DONE]\n\n')
        return handle

    async def go(closes: int):
        sends.clear()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler(closes))) as client:
            payload = build_payload(model="m", prompt="p", max_tokens=1, chat=False)
            return await send_streaming_request(client, "http://x/v1/completions", payload,
                                                chat=False, prompt_len=1)

    out = asyncio.run(go(1))
    assert out.success and out.generated_text == "hi" and out.retries == 1 and len(sends) == 2
    out = asyncio.run(go(STALE_CONNECTION_RETRIES + 1))
    assert not out.success and "RemoteProtocolError" in out.error
    assert len(sends) == STALE_CONNECTION_RETRIES + 1

    async def cut_stream():
        yield b'data: {"choices":[{"text":"hi"}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection")

    async def go_cut():
        sends.clear()

        def handle(request):
            sends.append(1)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=cut_stream())
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            payload = build_payload(model="m", prompt="p", max_tokens=1, chat=False)
            return await send_streaming_request(client, "http://x/v1/completions", payload,
                                                chat=False, prompt_len=1)

    out = asyncio.run(go_cut())
    assert not out.success and out.retries == 0 and len(sends) == 1
    m = calculate_metrics([out, RequestOutput(success=True, prompt_len=1, output_tokens=1, retries=2)], 1.0)
    assert m["resent_after_closed_connection"] == 2 and "Sent again" in format_report(m)
