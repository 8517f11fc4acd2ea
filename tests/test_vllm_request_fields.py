"""Every field of vLLM's request models is honoured or refused by name, never accepted and
ignored (issue 33).

The field lists are data, copied from vLLM's source (``tests/fixtures/vllm_request_fields.json``
names the commit). Each field has an entry below: honoured (a request with a non-default value
answers 200 and the check sees its effect: in the answer, or in what reached the engine) or
refused (400 whose ``param`` or message names it). A field vLLM adds that nobody has decided
about fails the walk; so does one we declare honoured that answers 400, or refused that answers
200. Fields the engine implements (``protocol.ENGINE_FIELDS``) are expected to be honoured once
listed there and refused until then.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import MESSAGES, MODEL, asgi_request, make_engine, tiny_tokenizer  # noqa: E402

from blink.dpu.app import create_app  # noqa: E402
from blink.dpu.limits import RequestLimits  # noqa: E402
from blink.dpu.protocol import ENGINE_FIELDS  # noqa: E402
from blink.dpu.tool_calling import ToolCallingConfig  # noqa: E402

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_request_fields.json").read_text())
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
ASSISTANT_LAST = MESSAGES + [{"role": "assistant", "content": "Hi"}]


class Seen:
    """One request's outcome: the JSON (or SSE text), and what reached the fake engine."""

    def __init__(self, status: int, body: Any, text: str, engine: Any, tok: Any) -> None:
        self.status, self.body, self.text = status, body, text
        subs = list(engine.submitted.values())
        self.prompt, self.params = subs[0] if subs else (None, None)
        self.grammar = next(iter(engine.grammars.values()), None)
        self.prompt_text = tok.decode(self.prompt, skip_special_tokens=False) \
            if self.prompt is not None else None

    @property
    def message(self) -> dict[str, Any]:
        return self.body["choices"][0]["message"]

    @property
    def choice(self) -> dict[str, Any]:
        return self.body["choices"][0]


Check = Callable[[Seen], Any]
#: field -> (value, extra request fields, check)
Honoured = dict[str, tuple[Any, dict[str, Any], Check]]


def _ok(_: Seen) -> bool:
    return True


def _param(name: str, value: Any) -> Check:
    return lambda s: getattr(s.params, name) == value


def _engine_field(name: str) -> Check:
    return lambda s: getattr(s.params, name)


SHARED: Honoured = {
    "model": (MODEL, {}, lambda s: s.body["model"] == MODEL),
    "frequency_penalty": (0.5, {}, _param("frequency_penalty", 0.5)),
    "presence_penalty": (0.5, {}, _param("presence_penalty", 0.5)),
    "logit_bias": ({"5": 2.0}, {}, lambda s: s.params.logit_bias == {5: 2.0}),
    "n": (2, {}, lambda s: len(s.body["choices"]) == 2),
    "seed": (7, {}, _param("seed", 7)),
    "stream": (True, {}, lambda s: s.text.startswith("data: ")
               and s.text.rstrip().endswith("[DONE]")),
    "stream_options": ({"include_usage": True}, {"stream": True},
                       lambda s: '"usage":{"prompt_tokens"' in s.text.replace(" ", "")),
    "temperature": (0.5, {}, _param("temperature", 0.5)),
    "top_p": (0.5, {}, _param("top_p", 0.5)),
    # OpenAI's end-user id: bookkeeping, no effect on the answer by definition (as in vLLM)
    "user": ("someone", {}, _ok),
    "top_k": (3, {}, _param("top_k", 3)),
    "min_p": (0.1, {}, lambda s: abs(s.params.min_p - 0.1) < 1e-9),
    "repetition_penalty": (1.2, {}, _param("repetition_penalty", 1.2)),
    "stop_token_ids": ([5], {}, lambda s: 5 in s.params.stop_token_ids),
    "include_stop_str_in_output": (True, {"stop": ["world"]},
                                   lambda s: "world" in json.dumps(s.body["choices"][0])),
    "ignore_eos": (True, {}, _param("ignore_eos", True)),
    "min_tokens": (2, {}, _param("min_tokens", 2)),
    "skip_special_tokens": (False, {}, _param("skip_special_tokens", False)),
    # Blink never puts spaces around special tokens (vLLM's fast-detokenizer path, and what
    # false means): false is honoured, the default differs (docs/vllm-migration.md)
    "spaces_between_special_tokens": (False, {}, _ok),
    "truncate_prompt_tokens": (2, {}, lambda s: len(s.prompt) == 2
                               and s.body["usage"]["prompt_tokens"] == 2),
    "request_id": ("my-id", {}, lambda s: s.body["id"].endswith("-my-id")),
    "return_token_ids": (True, {}, lambda s: "prompt_token_ids" in json.dumps(s.body)),
    "response_format": ({"type": "json_object"}, {}, lambda s: s.grammar is not None),
    "structured_outputs": ({"choice": ["a", "b"]}, {}, lambda s: s.grammar is not None),
    "guided_json": ({"type": "object"}, {}, lambda s: s.grammar is not None),
    "guided_regex": ("a+", {}, lambda s: s.grammar is not None),
    "guided_choice": (["a", "b"], {}, lambda s: s.grammar is not None),
    "guided_grammar": ('start: "a"', {}, lambda s: s.grammar is not None),
    "guided_whitespace_pattern": (" ", {"guided_json": {"type": "object"}},
                                  lambda s: s.grammar is not None),
}
SHARED_REFUSED: dict[str, Any] = {
    "use_beam_search": True, "length_penalty": 0.5, "priority": 1,
    "logits_processors": ["my_module.MyProcessor"], "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"x": 1}, "mm_processor_kwargs": {"x": 1}, "max_repetition_pattern_size": 4,
    "min_repetition_pattern_size": 2, "repetition_min_count": 3, "best_of": 2,
    "guided_decoding_backend": "xgrammar", "structural_tag": {"type": "structural_tag"},
}
#: engine-side fields: honoured once listed in protocol.ENGINE_FIELDS, refused until then
ENGINE: dict[str, Any] = {"prompt_logprobs": 1, "allowed_token_ids": [5, 6],
                          "bad_words": ["world"], "cache_salt": "tenant-a"}

CHAT: Honoured = {
    **SHARED,
    "messages": (MESSAGES, {}, lambda s: "Say hello" in s.prompt_text),
    "logprobs": (True, {}, lambda s: s.choice["logprobs"]["content"]),
    "top_logprobs": (2, {"logprobs": True},
                     lambda s: len(s.choice["logprobs"]["content"][0]["top_logprobs"]) == 2),
    "max_tokens": (2, {}, lambda s: s.body["usage"]["completion_tokens"] == 2),
    "max_completion_tokens": (2, {}, lambda s: s.body["usage"]["completion_tokens"] == 2),
    "stop": (["world"], {}, lambda s: "world" not in s.message["content"]),
    "tools": ([TOOL], {}, lambda s: s.status == 200),
    "tool_choice": ("required", {"tools": [TOOL]}, lambda s: s.grammar is not None),
    "parallel_tool_calls": (False, {"tools": [TOOL]}, _ok),  # test_tool_calling.py: one call kept
    "reasoning_effort": ("low", {"chat_template": "{{ reasoning_effort }}"},
                         lambda s: s.prompt_text == "low"),
    # without --reasoning-parser there is no reasoning to leave out (test_reasoning.py)
    "include_reasoning": (False, {}, lambda s: "reasoning" not in s.message),
    "echo": (True, {"messages": ASSISTANT_LAST, "add_generation_prompt": False,
                    "continue_final_message": True},
             lambda s: s.message["content"].startswith("Hi")),
    "add_generation_prompt": (False, {}, lambda s: not s.prompt_text.endswith("assistant\n")),
    "continue_final_message": (True, {"messages": ASSISTANT_LAST, "add_generation_prompt": False},
                               lambda s: s.prompt_text.endswith("Hi")),
    # the tiny tokenizer has no bos/eos post-processing: nothing to add, the flag reaches encode
    "add_special_tokens": (True, {}, _ok),
    "documents": ([{"title": "t", "text": "doc text"}],
                  {"chat_template": "{{ documents[0]['text'] }}"},
                  lambda s: s.prompt_text == "doc text"),
    "chat_template": ("{{ messages[0]['content'] }}!", {}, lambda s: s.prompt_text == "Say hello!"),
    "chat_template_kwargs": ({"greeting": "Hey"}, {"chat_template": "{{ greeting }}"},
                             lambda s: s.prompt_text == "Hey"),
    "return_tokens_as_token_ids": (True, {"logprobs": True}, lambda s: s.choice["logprobs"][
        "content"][0]["token"].startswith("token_id:")),
}
COMPLETIONS: Honoured = {
    **SHARED,
    "prompt": ("Say hello", {}, lambda s: s.prompt_text.startswith("Say hello")),
    "echo": (True, {}, lambda s: s.choice["text"].startswith("Say hello to the world")),
    "logprobs": (1, {}, lambda s: s.choice["logprobs"]["tokens"]),
    "max_tokens": (2, {}, lambda s: s.body["usage"]["completion_tokens"] == 2),
    "stop": (["world"], {}, lambda s: "world" not in s.choice["text"]),
    "add_special_tokens": (False, {}, _ok),  # as in chat: the tiny tokenizer adds nothing
    "return_tokens_as_token_ids": (True, {"logprobs": 1}, lambda s: s.choice["logprobs"][
        "tokens"][0].startswith("token_id:")),
}
COMPLETIONS_REFUSED = {**SHARED_REFUSED, "suffix": "tail", "prompt_embeds": "AAAA"}
RESPONSES: Honoured = {
    "input": ("Say hello", {}, lambda s: "Say hello" in s.prompt_text),
    "include": (["message.output_text.logprobs"], {},
                lambda s: s.body["output"][0]["content"][0]["logprobs"]),
    "instructions": ("Be brief", {}, lambda s: "Be brief" in s.prompt_text),
    "max_output_tokens": (2, {}, lambda s: s.body["usage"]["output_tokens"] == 2),
    "metadata": ({"k": "v"}, {}, lambda s: s.body["metadata"] == {"k": "v"}),
    "model": (MODEL, {}, lambda s: s.body["model"] == MODEL),
    "logit_bias": ({"5": 2.0}, {}, lambda s: s.params.logit_bias == {5: 2.0}),
    "parallel_tool_calls": (False, {"tools": [RESPONSES_TOOL]},
                            lambda s: s.body["parallel_tool_calls"] is False),
    "reasoning": ({"effort": "low"}, {}, _ok),  # to the template (this one does not use it)
    "service_tier": ("flex", {}, _ok),  # bookkeeping, as vLLM (which ignores it too)
    "store": (False, {}, lambda s: s.body["store"] is False),
    "stream": (True, {}, lambda s: "event: response.output_text.delta" in s.text),
    "temperature": (0.5, {}, _param("temperature", 0.5)),
    "text": ({"format": {"type": "json_object"}}, {}, lambda s: s.grammar is not None),
    "tool_choice": ("required", {"tools": [RESPONSES_TOOL]}, lambda s: s.grammar is not None),
    "tools": ([RESPONSES_TOOL], {}, lambda s: s.body["tools"]),
    "top_logprobs": (2, {"include": ["message.output_text.logprobs"]}, lambda s: len(
        s.body["output"][0]["content"][0]["logprobs"][0]["top_logprobs"]) == 2),
    "top_p": (0.5, {}, _param("top_p", 0.5)),
    "top_k": (3, {}, _param("top_k", 3)),
    "truncation": ("disabled", {}, _ok),  # "auto" is refused (below, by its own check)
    "user": ("someone", {}, _ok),
    "skip_special_tokens": (False, {}, _param("skip_special_tokens", False)),
    "request_id": ("resp_mine", {}, lambda s: s.body["id"] == "resp_mine"),
}
RESPONSES_REFUSED = {
    "background": True, "max_tool_calls": 1, "previous_response_id": "resp_1",
    "prompt": {"id": "pmpt_1"}, "mm_processor_kwargs": {"x": 1}, "priority": 1,
    "enable_response_messages": True,
    "previous_input_messages": [{"role": "user", "content": "x"}],
}
# not the default, so they get a refusal test of their own
EXTRA_REFUSALS = [("responses", "truncation", "auto"), ("responses", "store", True),
                  ("responses", "reasoning", {"summary": "auto"})]

ENDPOINTS = {
    "chat_completions": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4},
                         CHAT, SHARED_REFUSED),
    "completions": ("/v1/completions", {"prompt": "Say hello to the world", "max_tokens": 4},
                    COMPLETIONS, COMPLETIONS_REFUSED),
    "responses": ("/v1/responses", {"input": "Say hello", "max_output_tokens": 4},
                  RESPONSES, RESPONSES_REFUSED),
}


def _send(path: str, body: dict[str, Any]) -> Seen:
    tok = tiny_tokenizer()
    engine = make_engine(tok, max_model_len=2048)  # room for the tools' system prompt
    app = create_app(engine, tok, model_name=MODEL,
                     limits=RequestLimits(trust_request_chat_template=True),
                     tool_calling=ToolCallingConfig(enable_auto_tool_choice=True,
                                                    tool_call_parser="hermes"))
    r = asyncio.run(asgi_request(app, "POST", path, json=body))
    try:
        parsed = r.json()
    except ValueError:
        parsed = None
    return Seen(r.status_code, parsed, r.text, engine, tok)


def _cases() -> list[Any]:
    cases = []
    for endpoint in ("chat_completions", "completions", "responses"):
        for field in FIXTURE[endpoint] + FIXTURE["legacy"]["fields"] * (endpoint != "responses"):
            cases.append(pytest.param(endpoint, field, id=f"{endpoint}.{field}"))
    return cases


def test_fixture_names_its_source() -> None:
    vllm = FIXTURE["vllm"]
    for endpoint in ("chat_completions", "completions", "responses"):
        assert len(vllm[endpoint]["commit"]) == 40 and vllm[endpoint]["path"].endswith(".py")
        assert len(set(FIXTURE[endpoint])) == len(FIXTURE[endpoint]) > 20


@pytest.mark.parametrize(("endpoint", "field"), _cases())
def test_every_vllm_field_is_honoured_or_refused(endpoint: str, field: str) -> None:
    path, base, honoured, refused = ENDPOINTS[endpoint]
    if field in ENGINE:
        if field in ENGINE_FIELDS:
            honoured = {field: (ENGINE[field], {}, _engine_field(field))}
        else:
            refused = {field: ENGINE[field]}
    if field in honoured:
        value, extra, check = honoured[field]
        seen = _send(path, {**base, **extra, field: value})
        assert seen.status == 200, f"{field} is declared honoured but answered {seen.text}"
        assert check(seen), f"{field}={value!r} had no visible effect: {seen.text[:800]}"
        return
    assert field in refused, (f"vLLM's {endpoint} field {field!r} is neither honoured nor "
                              f"refused here: decide (and document it in docs/vllm-migration.md)")
    seen = _send(path, {**base, field: refused[field]})
    assert seen.status == 400, f"{field} is declared refused but answered {seen.text[:500]}"
    error = seen.body["error"]
    assert field in (error.get("param") or "") or field in error["message"], error


@pytest.mark.parametrize(("endpoint", "field", "value"), EXTRA_REFUSALS)
def test_unsupported_values_are_refused_by_name(endpoint: str, field: str, value: Any) -> None:
    path, base, _, _ = ENDPOINTS[endpoint]
    seen = _send(path, {**base, field: value})
    assert seen.status == 400, seen.text
    error = seen.body["error"]
    assert field in (error.get("param") or "") or field in error["message"], error


def test_guided_decoding_backend_llguidance_is_honoured() -> None:
    seen = _send("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                          "guided_decoding_backend": "guidance",
                                          "guided_regex": "a+"})
    assert seen.status == 200 and seen.grammar is not None


def test_no_vllm_field_is_dropped_as_unknown() -> None:
    """Every vLLM field is declared (a declared field is honoured or refused); an undeclared one
    would be dropped with only a log warning."""
    from blink.dpu.protocol import ChatCompletionRequest, CompletionRequest
    from blink.dpu.responses import ResponsesRequest

    legacy = FIXTURE["legacy"]["fields"]
    for model, names in ((ChatCompletionRequest, FIXTURE["chat_completions"] + legacy),
                         (CompletionRequest, FIXTURE["completions"] + legacy),
                         (ResponsesRequest, FIXTURE["responses"])):
        missing = [n for n in names if n not in model.model_fields and n not in ENGINE]
        assert not missing, f"{model.__name__} does not declare {missing}"


def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    tok = tiny_tokenizer()
    full = tok.encode("Say hello to the world", add_special_tokens=True)
    seen = _send("/v1/completions", {"prompt": "Say hello to the world", "max_tokens": 2,
                                     "truncate_prompt_tokens": 3})
    assert seen.prompt == full[-3:] and seen.body["usage"]["prompt_tokens"] == 3
    seen = _send("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 10**6})
    assert seen.status == 400 and seen.body["error"]["param"] == "truncate_prompt_tokens"
    seen = _send("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -1})
    assert seen.status == 200


def test_completion_echo_streams_the_prompt_first() -> None:
    seen = _send("/v1/completions", {"prompt": "Say hello", "max_tokens": 3, "echo": True,
                                     "stream": True})
    chunks = [json.loads(line[6:]) for line in seen.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith("Say hello")
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(
        "Say helloHello")


def test_request_id_header_names_the_answer_as_in_vllm() -> None:
    tok = tiny_tokenizer()
    app = create_app(make_engine(tok), tok, model_name=MODEL)

    async def twice() -> list[Any]:
        # the same id twice at once: the engine's ids still differ
        return await asyncio.gather(*(asgi_request(
            app, "POST", "/v1/chat/completions", headers={"x-request-id": "abc"},
            json={"messages": MESSAGES, "max_tokens": 2}) for _ in range(2)))

    for r in asyncio.run(twice()):
        assert r.status_code == 200 and r.json()["id"] == "chatcmpl-abc"
        assert r.headers["x-request-id"] == "abc"
    # an id the server does not echo (not a plain token) does not name the answer either
    r = asyncio.run(asgi_request(app, "POST", "/v1/completions",
                                 headers={"x-request-id": "a b"},
                                 json={"prompt": "x", "max_tokens": 1, "request_id": "mine"}))
    assert r.json()["id"] == "cmpl-mine" and r.headers["x-request-id"] != "a b"


def test_chat_echo_and_token_id_logprobs_when_streamed() -> None:
    seen = _send("/v1/chat/completions", {
        "messages": ASSISTANT_LAST, "add_generation_prompt": False,
        "continue_final_message": True, "echo": True, "stream": True, "max_tokens": 3,
        "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True})
    chunks = [json.loads(line[6:]) for line in seen.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    texts = [d["delta"].get("content") for d in deltas if d["delta"].get("content")]
    assert texts[0] == "Hi"  # the echoed message comes first, on its own
    tokens = [t for d in deltas if d.get("logprobs") for t in d["logprobs"]["content"]]
    assert tokens and all(t["token"].startswith("token_id:") for t in tokens)
    assert all(a["token"].startswith("token_id:") for t in tokens for a in t["top_logprobs"])


def test_include_reasoning_false_streams_no_reasoning() -> None:
    tok = tiny_tokenizer()
    engine = make_engine(tok, answer="<think>Hmm.</think>Hello")
    app = create_app(engine, tok, model_name=MODEL, reasoning_parser="qwen3")
    r = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json={
        "messages": MESSAGES, "stream": True, "include_reasoning": False}))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "reasoning" not in r.text
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hello"
