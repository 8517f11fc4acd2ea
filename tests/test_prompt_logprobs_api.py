"""vLLM's ``prompt_logprobs`` and completions' ``echo`` with ``logprobs`` through the HTTP
layer (a scripted engine: blink.dpu.serving's formatting and refusals; the values themselves
are tests/test_prompt_logprobs.py's, and the end-to-end test here runs the real engine)."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import MESSAGES, MODEL, asgi_request, make_engine, tiny_tokenizer  # noqa: E402

from blink.dpu.app import create_app  # noqa: E402


def _send(path: str, body: dict[str, Any], lanes: int = 2) -> tuple[int, Any, str, list[int]]:
    tok = tiny_tokenizer()
    engine = make_engine(tok)
    engine.prompt_logprob_lanes = lanes
    app = create_app(engine, tok, model_name=MODEL)
    r = asyncio.run(asgi_request(app, "POST", path, json=body))
    prompt = next(iter(engine.submitted.values()))[0] if engine.submitted else []
    try:
        parsed = r.json()
    except ValueError:
        parsed = None
    return r.status_code, parsed, r.text, prompt


def _check_prompt_logprobs(plp: list, prompt: list[int], top: int) -> None:
    """vLLM's shape: None first, then {token id (str): {logprob, rank, decoded_token}} with the
    prompt token first and ``top`` more (the fake engine's values)."""
    assert len(plp) == len(prompt) and plp[0] is None
    for i, entry in enumerate(plp[1:], 1):
        keys = list(entry)
        assert keys[0] == str(prompt[i]) and len(keys) == top + 1
        first = entry[keys[0]]
        assert first["logprob"] == -(i % 5) - 0.5 and first["rank"] == i % 3 + 1
        assert isinstance(first["decoded_token"], str)
        assert [entry[k]["rank"] for k in keys[1:]] == list(range(1, top + 1))


def test_completions_prompt_logprobs_per_choice() -> None:
    status, body, text, prompt = _send("/v1/completions", {
        "prompt": "Say hello", "max_tokens": 2, "prompt_logprobs": 2, "n": 2})
    assert status == 200, text
    for choice in body["choices"]:
        _check_prompt_logprobs(choice["prompt_logprobs"], prompt, 2)


def test_chat_prompt_logprobs_at_the_top_level() -> None:
    status, body, text, prompt = _send("/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200, text
    _check_prompt_logprobs(body["prompt_logprobs"], prompt, 0)
    assert "prompt_logprobs" not in body["choices"][0]


def test_no_prompt_logprobs_unless_asked() -> None:
    for path, body in (("/v1/completions", {"prompt": "Say hello", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})):
        status, out, text, _ = _send(path, body)
        assert status == 200 and "prompt_logprobs" not in text


def test_prompt_logprobs_refused_by_name() -> None:
    """With stream (as vLLM) and where the engine has no lanes (the GPU loops...)."""
    for path, base in (("/v1/completions", {"prompt": "Say hello"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        status, body, text, _ = _send(path, {**base, "prompt_logprobs": 1, "stream": True})
        assert status == 400 and body["error"]["param"] == "prompt_logprobs", text
        assert "stream" in body["error"]["message"]
        status, body, text, _ = _send(path, {**base, "prompt_logprobs": 1}, lanes=0)
        assert status == 400 and body["error"]["param"] == "prompt_logprobs", text
        assert "not available on this engine" in body["error"]["message"]
        status, body, text, _ = _send(path, {**base, "prompt_logprobs": 21})
        assert status == 400 and "prompt_logprobs" in body["error"]["message"], text
    status, body, text, _ = _send("/v1/completions", {
        "prompt": "Say hello", "echo": True, "logprobs": 1}, lanes=0)
    assert status == 400 and body["error"]["param"] == "echo", text


def _check_echo_logprobs(lp: dict, prompt: list[int], tok: Any, n_out: int, top: int) -> None:
    n = len(prompt)
    assert len(lp["tokens"]) == n + n_out
    assert lp["tokens"][:n] == [tok.token_text(t) for t in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [-(i % 5) - 0.5 for i in range(1, n)]
    assert all(len(t) <= top + 1 for t in lp["top_logprobs"][1:n])
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert offsets[n] == sum(len(tok.token_text(t)) for t in prompt)  # the answer follows


def test_completions_echo_with_logprobs() -> None:
    tok = tiny_tokenizer()
    status, body, text, prompt = _send("/v1/completions", {
        "prompt": "Say hello", "max_tokens": 3, "echo": True, "logprobs": 1})
    assert status == 200, text
    choice = body["choices"][0]
    assert choice["text"].startswith("Say hello")
    _check_echo_logprobs(choice["logprobs"], prompt, tok, 3, 1)
    _check_prompt_logprobs(choice["prompt_logprobs"], prompt, 1)  # vLLM sets both


def test_completions_echo_with_logprobs_streamed() -> None:
    tok = tiny_tokenizer()
    status, _, text, prompt = _send("/v1/completions", {
        "prompt": "Say hello", "max_tokens": 3, "echo": True, "logprobs": 1, "stream": True})
    assert status == 200, text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for c in chunks:
        for choice in c["choices"]:
            assert "prompt_logprobs" not in choice
            for k in merged:
                merged[k] += (choice["logprobs"] or {}).get(k, [])
    assert chunks[0]["choices"][0]["text"].startswith("Say hello")
    _check_echo_logprobs(merged, prompt, tok, 3, 1)
