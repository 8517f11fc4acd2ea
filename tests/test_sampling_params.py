"""SamplingParams: defaults, vLLM-like validation, generation_config defaults, torch-freedom."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blink.shared.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
    draw_seed,
)
from blink.errors import BlinkError


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None and not p.ignore_eos and p.skip_special_tokens
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias == {}
    assert not p.is_greedy
    assert (MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_LOGPROBS) == (16, 32, 20)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1"),
        ({"temperature": -0.1}, "temperature must be non-negative"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be 0 or -1"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"top_k": 2**31}, "top_k must be at most 2147483647"),
        ({"max_tokens": 2**31}, "max_tokens must be at most 2147483647"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0"),
        (
            {"min_tokens": 5, "max_tokens": 4},
            "min_tokens must be less than or equal to max_tokens=4",
        ),
        ({"logprobs": 21}, "logprobs must be between 0 and 20"),
        ({"logprobs": -1}, "logprobs must be between 0 and 20"),
        ({"seed": 2**63}, "seed must fit in a signed 64-bit integer"),
        ({"seed": "7"}, "seed must be an int or None"),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string"),
        ({"stop": [str(i) for i in range(65)]}, "stop can hold at most 64 strings"),
        ({"stop": "x" * 1025}, "stop strings can be at most 1024 characters"),
        ({"stop_token_ids": list(range(17))}, "stop_token_ids can hold at most 16"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative"),
        ({"logit_bias": {i: 1.0 for i in range(33)}}, "logit_bias can hold at most 32"),
        ({"logit_bias": {5: 101.0}}, r"must be in \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be non-negative"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias keys must be token ids"),
        # Python's int() is lenient; a token id key must be a plain decimal integer.
        ({"logit_bias": {" 12 ": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"1_0": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"+5": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"007": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"-0": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"\uff11": 1.0}}, "logit_bias keys must be token ids"),  # full-width 1
        ({"logit_bias": {"1" * 400: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {str(i): 1.0 for i in range(10**5)}}, "logit_bias can hold at most 32"),
        # Bounds for what a JSON body can carry: huge, and non-finite numbers.
        ({"n": 10**7}, "n must be at most 128"),
        ({"temperature": 1e300}, r"temperature must be in \[0, 2\]"),
        ({"temperature": 2.01}, r"temperature must be in \[0, 2\]"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"repetition_penalty": 1e300}, r"repetition_penalty must be in \(0, 2\]"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be finite"),
        ({"top_p": float("nan")}, "top_p must be finite"),
        ({"presence_penalty": float("-inf")}, "presence_penalty must be finite"),
        ({"logit_bias": {5: "x"}}, "must be a number"),
    ],
)
def test_validation_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, BlinkError)


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        max_tokens=None,
        min_tokens=100,
        logprobs=MAX_LOGPROBS,
        seed=-(2**63),
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        logit_bias={i: -100.0 for i in range(MAX_LOGIT_BIAS)},
        n=MAX_N,
        temperature=2.0,
        repetition_penalty=2.0,
    )
    assert p.max_tokens is None and p.min_tokens == 100
    assert SamplingParams(logit_bias={"0": 1, "42": 3}).logit_bias == {0: 1.0, 42: 3.0}


def test_greedy_normalises_filters_and_small_temperature_is_clamped() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    q = SamplingParams(temperature=1e-4)
    assert q.temperature == pytest.approx(0.01) and not q.is_greedy


def test_json_forms_are_normalised() -> None:
    p = SamplingParams(stop="###", logit_bias={"50": 2, 7: -1.5})
    assert p.stop == ["###"]
    assert p.logit_bias == {50: 2.0, 7: -1.5}


def test_check_vocab() -> None:
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1.0}).check_vocab(10)
    with pytest.raises(SamplingParamsError, match="stop_token_ids contains 10"):
        SamplingParams(stop_token_ids=[10]).check_vocab(10)
    with pytest.raises(SamplingParamsError, match="logit_bias contains token 12"):
        SamplingParams(logit_bias={12: 1.0}).check_vocab(10)


def test_from_generation_config() -> None:
    cfg = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_new_tokens": 300,
        "do_sample": True,
        "eos_token_id": [1, 2],
    }
    p = SamplingParams.from_generation_config(cfg)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (
        0.6,
        0.9,
        20,
        1.1,
        300,
    )
    # Request values win; None means "not given" and keeps the model default.
    q = SamplingParams.from_generation_config(cfg, temperature=0.2, top_p=None, seed=3)
    assert (q.temperature, q.top_p, q.seed) == (0.2, 0.9, 3)
    # Without a generation config the vLLM defaults apply.
    assert SamplingParams.from_generation_config(None) == SamplingParams()
    with pytest.raises(SamplingParamsError, match="unknown sampling parameter"):
        SamplingParams.from_generation_config(cfg, temprature=0.3)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 0.0})


def test_draw_seed_is_random_int64() -> None:
    seeds = {draw_seed() for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)


def test_module_is_torch_free() -> None:
    code = (
        "import sys; import blink.shared.sampling_params as m; m.SamplingParams(seed=1); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
