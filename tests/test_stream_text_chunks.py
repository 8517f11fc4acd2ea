"""Streams' plain-text chunks (blink.dpu.serving._TextChunk): rendered once per choice and
then filled with each new text, they must be the bytes the pydantic models give, whatever the
text and the request's options."""
from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from blink.dpu import serving
from blink.dpu.app import create_app
from blink.dpu.protocol import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from blink.dpu.serving import _TextChunk, _sse
from blink.dpu.tokenizer import Tokenizer
from blink.shared.byte_level import unicode_to_bytes

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from fake_engine_client import FakeEngineClient  # noqa: E402

from dpu_helpers import MESSAGES, MODEL, asgi_request, tiny_tokenizer  # noqa: E402

# quotes, backslashes, every control character, DEL, the JS line separators, HTML-ish text,
# non-BMP characters and combining marks: whatever an encoder might treat differently
TEXTS = ['plain', ' ', '"quoted" \\back\\slash/', "line\nbreak\r\ttab\b\f",
         "".join(chr(c) for c in range(32)) + "\x7f", "\u2028\u2029", "</script><!--",
         "日本語 😀👍🏽 Grüße", "e\u0301\u200d\ufeff", "{\"json\": [1, 2]}", "\\u0041"]


@pytest.mark.parametrize("text", TEXTS)
def test_text_chunk_is_the_models_rendering(text: str) -> None:
    """Both endpoints' chunk shapes, with and without the usage key."""
    for exclude in (None, {"usage"}):
        def chat(t: str) -> str:
            return _sse(ChatCompletionChunk(
                id="chatcmpl-1", created=7, model='m "x"', choices=[ChatCompletionStreamChoice(
                    index=1, delta=DeltaMessage(content=t))]).model_dump_json(exclude=exclude))

        def completion(t: str) -> str:
            return _sse(CompletionResponse(
                id="cmpl-1", created=7, model="m\\y", choices=[CompletionChoice(
                    index=0, text=t)]).model_dump_json(exclude=exclude))

        for render in (chat, completion):
            chunk = _TextChunk.from_rendering(render)
            assert chunk is not None
            assert chunk(text) == render(text)


@pytest.mark.parametrize("counts", [(0, 0, 0, 0), (5, 1, 6, 0), (128, 4000, 4128, 96), (10**9, 7, 10**9 + 7, 3)])
def test_text_chunk_with_usage_is_the_models_rendering(counts: tuple[int, int, int, int]) -> None:
    """Continuous usage stats: the usage's four counts are filled into the template as the text is."""
    from blink.dpu.protocol import PromptTokensDetails, UsageInfo

    def usage(p: int, c: int, t: int, cached: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=t,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def chat(t: str, *n: int) -> str:
        return _sse(ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", usage=usage(*n), choices=[
            ChatCompletionStreamChoice(index=1, delta=DeltaMessage(content=t))]).model_dump_json())

    def completion(t: str, *n: int) -> str:
        return _sse(CompletionResponse(id="cmpl-1", created=7, model="m", usage=usage(*n), choices=[
            CompletionChoice(index=0, text=t)]).model_dump_json())

    for render in (chat, completion):
        chunk = _TextChunk.from_rendering(render, numbers=4)
        assert chunk is not None
        for text in TEXTS[:4]:
            assert chunk(text, *counts) == render(text, *counts)


def test_a_marker_seen_twice_renders_every_chunk() -> None:
    """A rendering holding the marker elsewhere too (a model name could) gives no template."""
    mark = serving._TEXT_MARK
    assert _TextChunk.from_rendering(lambda t: _sse(CompletionResponse(
        id="c", created=1, model=mark, choices=[CompletionChoice(index=0, text=t)]
    ).model_dump_json())) is None


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


def _normalized(body: str) -> str:
    """The body without what differs between two requests: the id and the creation time."""
    return re.sub(r'"created":\d+', '"created":0',
                  re.sub(r'"id":"[^"]*"', '"id":"-"', body))


# (path, extra request fields): plain streams, n=2, usage at the end, and requests whose
# chunks carry more than the text (which must keep rendering every chunk)
CASES = [
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"n": 2, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 1}),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}}),
    ("/v1/chat/completions", {"return_token_ids": True}),
    ("/v1/completions", {}),
    ("/v1/completions", {"n": 2, "echo": True}),
    ("/v1/completions", {"stream_options": {"include_usage": True}}),
    ("/v1/completions", {"n": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/completions", {"logprobs": 1}),
    ("/v1/completions", {"return_token_ids": True}),
]


@pytest.mark.parametrize("path,extra", CASES)
def test_streams_are_the_same_with_and_without_templates(tok: Tokenizer, path: str,
                                                          extra: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each byte of a hard answer as its own token (text held back mid-character, quotes,
    control characters): the streamed body is the same as with every chunk rendered."""
    char_of = {b: c for c, b in unicode_to_bytes().items()}
    answer = "A \"q\" \\ 😀\n\t\x01 Grüße </b>\u2028!"
    ids = [tok._tok.token_to_id(char_of[b]) for b in answer.encode()]
    body: dict[str, Any] = {"stream": True, "max_tokens": len(ids), **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "Say"})

    def stream() -> str:
        engine = FakeEngineClient(model_name=MODEL, responder=lambda p, s: ids,
                                  vocab_size=tok.vocab_size, max_model_len=256)
        r = asyncio.run(asgi_request(create_app(engine, tok, model_name=MODEL), "POST", path,
                                     json=body))
        assert r.status_code == 200, r.text
        return _normalized(r.text)

    used = []
    real = _TextChunk.__call__

    def counting(self: _TextChunk, text: str, *counts: int) -> str:
        used.append(text)
        return real(self, text, *counts)

    monkeypatch.setattr(_TextChunk, "__call__", counting)
    fast = stream()
    monkeypatch.setattr(_TextChunk, "from_rendering", classmethod(lambda cls, render, numbers=0: None))
    slow = stream()
    assert fast == slow
    plain = not any(k in extra for k in ("logprobs", "return_token_ids"))
    assert bool(used) == plain  # the templates serve the plain streams (usage too), and only those
    if plain:  # each choice's texts but the last (with the finish reason) and an echo's first
        texts = answer[1 if extra.get("echo") else 0:-1] * extra.get("n", 1)
        assert sorted("".join(used)) == sorted(texts)
