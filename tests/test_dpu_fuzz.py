"""Fuzz the HTTP API: hypothesis-made request bodies for /v1/completions, /v1/chat/completions,
/tokenize and /detokenize (huge and non-finite numbers, wrong types, huge n, odd logit_bias
keys, runaway chat templates, random nested junk, raw bytes) against the frontend over a real
uvicorn on loopback, on one keep-alive connection. No answer may be a 5xx (or a dropped
connection), and the server must still answer a normal request afterwards.

Bounded: a fixed number of examples per endpoint (a few seconds each on a quiet machine).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import MESSAGES, MODEL, make_engine, serve_in_thread, tiny_tokenizer  # noqa: E402

EXAMPLES = 100
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# -- value strategies ---------------------------------------------------------------------------
huge_ints = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**7, 10**30])
odd_floats = st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 1e-300, 5e-324,
                              2.0000001, -0.0])
numbers = st.one_of(st.integers(-300, 300), huge_ints, odd_floats,
                    st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
token_id_keys = st.one_of(
    st.sampled_from([" 12 ", "1_0", "+5", "-1", "007", "0", "5", "\uff11", "1e3", "0x10",
                     "99999999999999999999999", "", "12 ", "-0", "١٢"]),
    st.integers(-5, 500).map(str), st.text(max_size=6))
logit_bias = st.one_of(st.dictionaries(token_id_keys, numbers, max_size=40), junk)
token_ids = st.lists(st.one_of(st.integers(-3, 450), huge_ints), max_size=40)
texts = st.one_of(st.text(max_size=60), st.sampled_from(["", "Say hello", "😀" * 50, "\x00\ud7ff"]))
templates = st.one_of(
    st.sampled_from([
        "{{ 'a' * 100000000 }}", "{% for x in range(100000000) %}x{% endfor %}",
        "{% for x in range(100000) %}{% for y in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'a' | center(1000000000) }}", "{{ 2 ** 1000000000 }}", "{{ 1 / 0 }}",
        "{{ messages[0].content }}", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "{{ raise_exception('no') }}", "{{ ''.__class__.__mro__ }}", "{% macro f() %}{{ f() }}"
        "{% endmacro %}{{ f() }}", "{{", "{% for %}", "{{ x.y.z }}", "{{ none + 1 }}",
        "{{" + "(" * 200 + "1" + ")" * 200 + "}}", "{% for a in b %}" * 150,
        "{{ '%*d' % (100000000, 1) }}", "{{ '{:>999999999}'.format(1) }}",
    ]),
    st.text(alphabet="{}%#()[]|~*+-/ abcxyz0129'\".,=_", max_size=40))
messages = st.one_of(
    st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), junk)},
        optional={"content": st.one_of(texts, st.lists(st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": texts}), junk), max_size=3),
            junk), "name": junk, "tool_calls": junk}), max_size=4),
    junk)

SAMPLING = {
    "n": st.one_of(st.integers(-2, 300), huge_ints, junk),
    "best_of": st.one_of(st.integers(-2, 300), huge_ints),
    "max_tokens": st.one_of(st.integers(-2, 300), huge_ints, junk),
    "min_tokens": st.one_of(st.integers(-2, 300), huge_ints),
    "temperature": st.one_of(numbers, junk),
    "top_p": numbers, "top_k": st.one_of(numbers, junk), "min_p": numbers,
    "repetition_penalty": numbers, "presence_penalty": numbers, "frequency_penalty": numbers,
    "seed": st.one_of(huge_ints, st.integers(), junk),
    "logit_bias": logit_bias,
    "stop": st.one_of(texts, st.lists(texts, max_size=5), junk),
    "stop_token_ids": st.one_of(token_ids, junk),
    "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
        junk),
    "ignore_eos": st.booleans(), "skip_special_tokens": junk, "return_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "echo": junk, "use_beam_search": junk,
    "model": st.one_of(st.just(MODEL), junk), "user": junk, "metadata": junk,
    "some_unknown_field": junk,
}
COMPLETION = {**SAMPLING, "prompt": st.one_of(texts, token_ids, st.lists(texts, max_size=300),
                                               st.lists(token_ids, max_size=5), junk),
              "logprobs": st.one_of(st.integers(-2, 30), junk), "suffix": junk,
              "add_special_tokens": junk}
CHAT = {**SAMPLING, "messages": messages, "logprobs": junk, "top_logprobs": st.one_of(
    st.integers(-2, 30), junk), "max_completion_tokens": st.one_of(huge_ints, junk),
    "chat_template": templates, "chat_template_kwargs": junk, "add_generation_prompt": junk,
    "continue_final_message": junk, "documents": junk, "tools": junk, "tool_choice": junk,
    "response_format": junk}
TOKENIZE = {"prompt": st.one_of(texts, junk), "messages": messages, "chat_template": templates,
            "add_special_tokens": junk, "add_generation_prompt": junk,
            "continue_final_message": junk, "return_token_strs": junk,
            "chat_template_kwargs": junk, "tools": junk, "model": junk}
DETOKENIZE = {"tokens": st.one_of(token_ids, st.lists(st.integers(0, 399), max_size=300), junk),
              "model": junk}


def bodies(fields: dict[str, st.SearchStrategy], base: dict[str, Any]
           ) -> st.SearchStrategy[bytes]:
    """Mostly a valid request (``base``) with one to three fields set to hostile values (the
    likeliest way to reach deep code), sometimes any subset of fields, or raw junk."""
    @st.composite
    def mutate(draw: Any) -> dict[str, Any]:
        chosen = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3,
                               unique=True))
        return {**base, **{k: draw(fields[k]) for k in chosen}}

    mutated = mutate()
    loose = st.fixed_dictionaries({}, optional=fields)
    as_json = st.one_of(mutated, mutated, mutated, loose, junk).map(
        lambda v: json.dumps(v, allow_nan=True).encode())
    raw = st.one_of(st.binary(max_size=60),
                    st.sampled_from([b"", b"{", b"[]", b"null", b'{"n": 1e999999}', b"\xff\xfe",
                                     b'{"prompt": "x"' + b", " * 1000 + b"}"]))
    return st.one_of(as_json, as_json, as_json, as_json, raw)


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    from blink.dpu.app import create_app
    from blink.dpu.limits import RequestLimits

    tok = tiny_tokenizer()
    # Request templates trusted: the sandbox's limits are fuzzed too, not just the refusal.
    limits = RequestLimits(trust_request_chat_template=True, chat_template_timeout_s=0.2,
                           max_request_body_bytes=1 << 20)
    app = create_app(make_engine(tok, max_model_len=512), tok, model_name=MODEL, limits=limits)
    with serve_in_thread(app) as base:
        with httpx.Client(base_url=base, timeout=30,
                          limits=httpx.Limits(max_connections=1)) as c:
            yield c


def check(client: httpx.Client, path: str, body: bytes) -> None:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body[:300], r.text[:500])
    if r.status_code != 200:
        err = r.json()
        assert err["object"] == "error" and err["error"]["message"], r.text
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "internal_error" not in r.text and r.text.endswith("data: [DONE]\n\n"), r.text[-500:]


def still_serves(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert client.get("/health").status_code == 200


def js(**fields: Any) -> bytes:
    return json.dumps(fields, allow_nan=True).encode()


# The worst requests seen in a hostile-user run are always among the examples.
RUNAWAY = ["{{ 'a' * 100000000 }}", "{% for x in range(100000000) %}x{% endfor %}",
           "{% for x in range(100000) %}{% for y in range(100000) %}{% endfor %}{% endfor %}"]


@FUZZ
@example(body=js(prompt="hi", max_tokens=1, n=10_000_000))
@example(body=js(prompt=["hi"] * 300, max_tokens=1, n=128))
@example(body=js(prompt="hi", temperature=1e300, repetition_penalty=math.nan))
@example(body=js(prompt="hi", logit_bias={" 12 ": 1, "1_0": 2}))
@example(body=js(prompt="hi", seed=2**63 - 1, n=2))
@example(body=js(prompt=[10**9] * 600))
@given(body=bodies(COMPLETION, {"prompt": "Say hello", "max_tokens": 4}))
def test_fuzz_completions(client: httpx.Client, body: bytes) -> None:
    check(client, "/v1/completions", body)


@FUZZ
@example(body=js(messages=MESSAGES, max_tokens=1, n=10_000_000))
@example(body=js(messages=MESSAGES, chat_template=RUNAWAY[0]))
@example(body=js(messages=MESSAGES, chat_template=RUNAWAY[1]))
@example(body=js(messages=MESSAGES, chat_template=RUNAWAY[2]))
@example(body=js(messages=MESSAGES, temperature=math.inf, top_p=math.nan))
@given(body=bodies(CHAT, {"messages": MESSAGES, "max_tokens": 4}))
def test_fuzz_chat(client: httpx.Client, body: bytes) -> None:
    check(client, "/v1/chat/completions", body)


@FUZZ
@example(body=js(messages=MESSAGES, chat_template=RUNAWAY[0]))
@example(body=js(messages=MESSAGES, chat_template=RUNAWAY[1]))
@example(body=js(messages=MESSAGES, chat_template=RUNAWAY[2]))
@example(body=js(prompt="a" * 500_000))
@given(body=bodies(TOKENIZE, {"messages": MESSAGES}))
def test_fuzz_tokenize(client: httpx.Client, body: bytes) -> None:
    check(client, "/tokenize", body)


@FUZZ
@example(body=js(tokens=[1] * 200_000))
@example(body=js(tokens=[2**63]))
@given(body=bodies(DETOKENIZE, {"tokens": [1, 2, 3]}))
def test_fuzz_detokenize(client: httpx.Client, body: bytes) -> None:
    check(client, "/detokenize", body)


def test_zz_still_serves_after_the_fuzz(client: httpx.Client) -> None:
    still_serves(client)
