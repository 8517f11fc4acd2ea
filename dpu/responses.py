"""``POST /v1/responses``: OpenAI's Responses API, stateless.

A request is turned into the chat path's pieces (the conversation rendered with the chat
template, the sampling parameters, one engine request) and the answer into a ``response``
object: one ``message`` output item with one ``output_text`` part. Streaming sends the
Responses event types in their order (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` or ``response.incomplete``), each
with its ``sequence_number``; an engine failure mid-stream is an ``error`` event.

Supported: ``input`` as a string or as message items (roles user, system, developer,
assistant; text content or ``input_text``/``output_text`` parts), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs`` with
``include=["message.output_text.logprobs"]``, ``text.format`` of type ``text``, ``metadata``
(echoed), ``user``, and vLLM's sampling extras (``top_k``, ``min_p``, ``seed``,
``repetition_penalty``, ...). Refused with a 400 naming the field: ``previous_response_id``
and ``conversation`` (nothing is stored), ``store: true``, ``background``, tools (tool calling
is not in this server yet), reasoning, structured ``text.format``, ``truncation: auto``,
prompt templates, and input items other than messages.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import field_validator

from blink.dpu.engine_client import EngineError
from blink.dpu.errors import bad_request
from blink.dpu.protocol import MAX_MESSAGES, ChatMessage, _Request
from blink.dpu.serving import (
    _CLIENT_CLOSED,
    OpenAIServing,
    RequestFanout,
    _SSEResponse,
    engine_error_to_api,
)

#: the one ``include`` value this server honours
INCLUDE_LOGPROBS = "message.output_text.logprobs"
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponsesRequest(_Request):
    """The body of ``POST /v1/responses`` (what this server reads of it)."""

    #: one answer per request in this API (read by the shared sampling-parameter code)
    n: ClassVar[int] = 1

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # refused when set (see unsupported())
    previous_response_id: str | None = None
    conversation: Any = None
    store: bool | None = None
    background: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _bounded_items(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise ValueError(f"input can hold at most {MAX_MESSAGES} items, got {len(value)}")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for the first set field this server cannot honour."""
        if self.previous_response_id is not None:
            return ("previous_response_id", "previous_response_id is not supported: this "
                    "server is stateless and stores no responses; send the whole conversation "
                    "as input items")
        if self.conversation is not None:
            return "conversation", "conversations are not supported: this server is stateless"
        if self.store:
            return "store", "store=true is not supported: this server is stateless (use store=false)"
        if self.background:
            return "background", "background responses are not supported"
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool calling is not supported"
        if self.max_tool_calls is not None:
            return "max_tool_calls", "tool calling is not supported"
        if self.reasoning is not None:
            return "reasoning", "reasoning options are not supported"
        if self.prompt is not None:
            return "prompt", "prompt templates are not supported"
        fmt = (self.text or {}).get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            return "text.format", "only text.format {'type': 'text'} is supported"
        if self.truncation not in (None, "disabled"):
            return "truncation", "only truncation='disabled' is supported"
        for item in self.include or []:
            if item != INCLUDE_LOGPROBS:
                return "include", f"include {item!r} is not supported (only {INCLUDE_LOGPROBS!r})"
        if self.top_logprobs and INCLUDE_LOGPROBS not in (self.include or []):
            return ("top_logprobs", f"top_logprobs needs include=[{INCLUDE_LOGPROBS!r}] (as with "
                    f"OpenAI)")
        return None

    def messages(self) -> list[ChatMessage]:
        """``instructions`` and ``input`` as chat messages; a 400 for what is not a message."""
        out: list[ChatMessage] = []
        if self.instructions:
            out.append(ChatMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            out.append(ChatMessage(role="user", content=self.input))
            return out
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind != "message":
                raise bad_request(f"{where}: input items of type {kind!r} are not supported "
                                  f"(only messages)", param=where)
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                                  param=f"{where}.role")
            out.append(ChatMessage(role=_ROLES[role], content=_text_of(item.get("content"), where)))
        return out


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts",
                          param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]: parts of type {kind!r} are not supported "
                              f"(only input_text and output_text)", param=f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)


class ResponsesServing:
    """The handler behind ``POST /v1/responses``; shares :class:`OpenAIServing`'s checks,
    rendering, sampling parameters and engine fan-out."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: Request) -> Response:
        s = self.serving
        arrival = time.monotonic()
        req = await s._parse(ResponsesRequest, await request.body())
        s.check_model(req.model)
        problem = req.unsupported()
        if problem is not None:
            raise bad_request(f"{problem[1]}.", param=problem[0])
        messages = req.messages()
        if not messages:
            raise bad_request("input must hold at least one message.", param="input")
        s.check_healthy()
        prompt_ids = await s._encode_chat(messages, add_special_tokens=False,
                                          add_generation_prompt=True,
                                          continue_final_message=False, chat_template=None)
        if not prompt_ids:
            raise bad_request("The rendered prompt is empty.", param="input")
        requested = req.max_output_tokens
        s._check_context(len(prompt_ids), requested)
        max_tokens = requested if requested is not None else s._default_max_tokens(len(prompt_ids))
        want_logprobs = INCLUDE_LOGPROBS in (req.include or [])
        params = s._sampling_params(req, max_tokens,  # type: ignore[arg-type]
                                    (req.top_logprobs or 0) if want_logprobs else None,
                                    {"logprobs": "top_logprobs",
                                     "max_tokens": "max_output_tokens"})
        response_id = f"resp_{uuid.uuid4().hex}"
        runs = s._make_runs(response_id, [prompt_ids], params, req.include_stop_str_in_output,
                            arrival)
        fanout = await s._start(request, runs)
        if fanout is None:
            return Response(status_code=_CLIENT_CLOSED)
        answer = _Answer(req, response_id, s.model_name, len(prompt_ids), want_logprobs)
        if req.stream:
            return _SSEResponse(self._stream(answer, fanout), fanout.close)
        try:
            async for d in fanout.events():
                answer.add(d.text, s._chat_logprobs(d) if want_logprobs and d.token_ids else [],
                           d.finish_reason)
        except EngineError as e:
            raise engine_error_to_api(e) from None
        if fanout.disconnected:
            return Response(status_code=_CLIENT_CLOSED)
        answer.finish(runs[0].completion_tokens, runs[0].num_cached_tokens)
        return JSONResponse(answer.response())

    async def _stream(self, answer: "_Answer", fanout: RequestFanout) -> AsyncIterator[str]:
        s = self.serving
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        ids = {"item_id": answer.item_id, "output_index": 0}
        yield event("response.created", response=answer.response())
        yield event("response.in_progress", response=answer.response())
        yield event("response.output_item.added", output_index=0, item=answer.item())
        yield event("response.content_part.added", content_index=0,
                    part=answer.part(empty=True), **ids)
        try:
            async for d in fanout.events():
                lps = s._chat_logprobs(d) if answer.want_logprobs and d.token_ids else []
                answer.add(d.text, lps, d.finish_reason)
                if d.text or lps:
                    yield event("response.output_text.delta", content_index=0, delta=d.text,
                                logprobs=[lp.model_dump(mode="json") for lp in lps], **ids)
            if fanout.disconnected:
                return
            run = fanout.runs[0]
            answer.finish(run.completion_tokens, run.num_cached_tokens)
            yield event("response.output_text.done", content_index=0, text=answer.text,
                        logprobs=answer.part()["logprobs"], **ids)
            yield event("response.content_part.done", content_index=0, part=answer.part(), **ids)
            yield event("response.output_item.done", output_index=0, item=answer.item())
            yield event(f"response.{answer.status}", response=answer.response())
        except EngineError as e:
            body = engine_error_to_api(e).body()["error"]
            yield event("error", code=body.get("code"), message=body["message"],
                        param=body.get("param"))
        except Exception as e:  # headers are out: report it in the stream, end it cleanly
            yield event("error", code="internal_error",
                        message=f"Internal server error: {type(e).__name__}", param=None)
        finally:
            await fanout.close()


class _Answer:
    """One response object as it fills up (for both the full answer and the stream's events)."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, n_prompt: int,
                 want_logprobs: bool) -> None:
        self.req = req
        self.id = response_id
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())
        self.n_prompt = n_prompt
        self.want_logprobs = want_logprobs
        self.texts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, text: str, logprobs: list[Any], finish_reason: str | None) -> None:
        self.texts.append(text)
        self.logprobs += [lp.model_dump(mode="json") for lp in logprobs]
        self.finish_reason = finish_reason or self.finish_reason

    def finish(self, completion_tokens: int, cached_tokens: int) -> None:
        # "length" is the max_output_tokens (or context) limit: OpenAI's "incomplete".
        self.status = "incomplete" if self.finish_reason in ("length", "abort") else "completed"
        self.usage = {
            "input_tokens": self.n_prompt,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.n_prompt + completion_tokens,
        }

    def part(self, empty: bool = False) -> dict[str, Any]:
        return {"type": "output_text", "text": "" if empty else self.text, "annotations": [],
                "logprobs": [] if empty else self.logprobs}

    def item(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        return {"type": "message", "id": self.item_id, "role": "assistant",
                "status": "completed" if self.status == "completed" else
                ("incomplete" if done else "in_progress"),
                "content": [self.part()] if done else []}

    def response(self) -> dict[str, Any]:
        req = self.req
        incomplete = None
        if self.status == "incomplete":
            reason = "max_output_tokens" if self.finish_reason == "length" else "cancelled"
            incomplete = {"reason": reason}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": None, "incomplete_details": incomplete,
            "model": self.model, "instructions": req.instructions,
            "output": [self.item()] if self.status != "in_progress" else [],
            "usage": self.usage, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "top_logprobs": req.top_logprobs, "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
            "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "metadata": req.metadata or {}, "user": req.user,
        }
