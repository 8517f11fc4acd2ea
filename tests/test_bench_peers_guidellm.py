"""benchmarks/peers_guidellm.py without a server: guidellm's command line, its JSON report
read back, the table and issue 35's targets."""
from pathlib import Path

import pytest

from benchmarks.peers_guidellm import (decode_lines, guidellm_command, ratios, read_guidellm, short_output_note, table,
                                       target_lines)


def _stat(mean=0.0, median=0.0, p99=0.0, total=0.0):
    return {"successful": {"mean": mean, "median": median, "total_sum": total, "percentiles": {"p50": median,
                                                                                                "p99": p99}}}


def _report(*, ok=16, errored=0, incomplete=0, tok_s=100.0, ttft=(300.0, 900.0), itl=40.0, out_tokens=64):
    """The part of a guidellm 0.8 JSON report the script reads (its key layout)."""
    return {"benchmarks": [{"metrics": {
        "request_totals": {"successful": ok, "errored": errored, "incomplete": incomplete, "total": ok + errored},
        "output_tokens_per_second": _stat(mean=tok_s),
        "time_to_first_token_ms": _stat(median=ttft[0], p99=ttft[1]),
        "inter_token_latency_ms": _stat(median=itl),
        "output_token_count": _stat(total=out_tokens * ok)}}]}


def test_the_command_is_guidellm_0_8s_run():
    command = guidellm_command("/x/guidellm", "http://127.0.0.1:8810", "llama-1b-shaped", "/m/hf", streams=16,
                               requests=32, input_len=128, output_len=64, out_json=Path("/tmp/o.json"))
    assert command[:2] == ["/x/guidellm", "run"]
    args = dict(zip(command[2::2], command[3::2]))
    assert args["--profile"] == "kind=concurrent,streams=16"
    assert args["--data"] == "kind=synthetic_text,prompt_tokens=128,output_tokens=64"
    assert args["--constraint"] == "kind=max_requests,count=32"
    assert "target=http://127.0.0.1:8810" in args["--backend"] and "model=llama-1b-shaped" in args["--backend"]
    assert args["--tokenizer"] == "kind=hf_auto,model=/m/hf"
    assert args["--output"] == "kind=json,path=/tmp/o.json"


def test_the_report_read_back():
    numbers = read_guidellm(_report(tok_s=76.5, ttft=(3027.0, 5082.0), itl=167.7))
    assert numbers == {"output_tok_s": 76.5, "ttft_p50_ms": 3027.0, "ttft_p99_ms": 5082.0, "itl_p50_ms": 167.7,
                       "requests": 16.0, "output_tokens_per_request": 64.0}


@pytest.mark.parametrize("bad", [dict(errored=1), dict(incomplete=2), dict(ok=0)])
def test_a_failed_or_empty_run_is_an_error_not_a_number(bad):
    with pytest.raises(ValueError, match="requests done"):
        read_guidellm(_report(**bad))


def _round(blink_1, llama_1, blink_16, llama_16):
    def n(tok_s, p99, itl):
        return {"output_tok_s": tok_s, "ttft_p50_ms": p99 / 2, "ttft_p99_ms": p99, "itl_p50_ms": itl}
    return {"blink": {1: n(*blink_1), 16: n(*blink_16)}, "llamaserver": {1: n(*llama_1), 16: n(*llama_16)}}


def test_table_and_targets_of_two_rounds():
    rounds = [_round((24.8, 324, 34.6), (8.8, 2812, 77.7), (76.0, 5082, 167.7), (15.9, 43649, 413.3)),
              _round((24.0, 318, 40.0), (20.0, 3041, 30.0), (30.0, 5529, 155.5), (16.1, 4000, 413.2))]
    text = table(rounds, 16)
    assert "| blink | 1 | 24.4 | 160 / 321 | 37.3 |" in text
    assert "| llamaserver | 16 | 16.0 |" in text
    by_round = ratios(rounds, 16)
    assert by_round["out_1"] == pytest.approx([24.8 / 8.8, 24.0 / 20.0])
    lines = target_lines(by_round, one_b=True, concurrency=16)
    assert lines[0].startswith("target: 1B-class")
    assert lines[1].endswith("met in 1 of 2 rounds")  # 16 streams: 4.78x, then 1.86x
    assert lines[2].endswith("met in 1 of 2 rounds")  # P99 TTFT: 0.12, then 1.38
    assert lines[3].endswith("met in 2 of 2 rounds")  # 1 stream: 2.82x and 1.20x
    assert lines[4].endswith("met in 1 of 2 rounds")  # ITL: 0.45, then 1.33
    small = target_lines(by_round, one_b=False, concurrency=16)
    assert small[1].endswith("met in 2 of 2 rounds")  # >= 1.0x
    assert small[2].endswith("met in 2 of 2 rounds")  # 4.78x and 1.86x: >= 1.5x


def test_one_stream_decode_against_the_bandwidth_limit():
    rounds = [_round((24.8, 324, 40.0), (8.8, 2812, 80.0), (76.0, 5082, 160.0), (15.9, 43649, 400.0)),
              _round((24.0, 318, 50.0), (20.0, 3041, 80.0), (30.0, 5529, 160.0), (16.1, 4000, 400.0))]
    blink, llama = decode_lines(rounds, 40.0)
    assert blink == "- blink: one-stream decode 22.2 tok/s (1000 / ITL p50), 0.56 of the bandwidth limit (40.0 tok/s)"
    assert llama.startswith("- llamaserver: one-stream decode 12.5 tok/s") and "0.31 of" in llama
    assert decode_lines(rounds, None)[0] == "- blink: one-stream decode 22.2 tok/s (1000 / ITL p50)"


@pytest.mark.parametrize("flag", ["--rounds", "--requests-single", "--requests-concurrent"])
def test_counts_below_one_are_refused(flag, capsys):
    from benchmarks.peers_guidellm import main

    with pytest.raises(SystemExit) as exit_info:
        main([flag, "0"])
    assert exit_info.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_a_run_short_of_its_output_length_is_named():
    assert short_output_note(read_guidellm(_report(out_tokens=64)), 64) == ""
    note = short_output_note(read_guidellm(_report(out_tokens=40)), 64)
    assert note == "; WARNING: 40.0 output tokens a request, not the 64 asked for"
