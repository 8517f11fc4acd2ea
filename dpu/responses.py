"""``POST /v1/responses``: OpenAI's Responses API, stateless.

A request is turned into the chat path's pieces (the conversation rendered with the chat
template, the sampling parameters, one engine request) and the answer into a ``response``
object: one ``message`` output item with one ``output_text`` part. Streaming sends the
Responses event types in their order (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` or ``response.incomplete``), each
with its ``sequence_number``; an engine failure mid-stream is an ``error`` event.

Supported: ``input`` as a string or as items: messages (roles user, system, developer,
assistant; text content or ``input_text``/``output_text`` parts), ``function_call`` and
``function_call_output`` (a previous turn's calls and their results); ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs`` with
``include=["message.output_text.logprobs"]``, ``text.format`` (``text``, ``json_object``,
``json_schema``: structured outputs), function ``tools`` with ``tool_choice`` (``none``,
``auto``, ``required``, ``{"type": "function", "name"}``) and ``parallel_tool_calls``, the
chat path's tool calling underneath (the same flags, parsers and grammars; tools with a
``text.format``: the call grammar while the model calls, the format for its answer), the
calls answered as ``function_call`` output items; ``metadata`` (echoed), ``user``, and
vLLM's sampling extras (``top_k``, ``min_p``, ``seed``, ``repetition_penalty``, ...).
Refused with a 400 naming the field: ``previous_response_id`` and ``conversation``
(nothing is stored), ``store: true``, ``background``, tools other than functions,
``max_tool_calls``, reasoning, ``truncation: auto``, prompt templates, logprobs together
with tools, and input items of other types.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from types import SimpleNamespace
from typing import Any, AsyncIterator, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import field_validator

from blink.dpu.engine_client import EngineError
from blink.dpu.errors import bad_request
from blink.dpu.protocol import ENGINE_FIELDS, MAX_MESSAGES, ChatMessage, _Request
from blink.dpu.reasoning import ReasoningParser
from blink.dpu.structured.request import structured_outputs_of
from blink.dpu.tool_calling import ToolPlan, plan_tools
from blink.shared.sampling_params import SamplingParams, SamplingParamsError
from blink.shared.structured_outputs import StructuredOutputsError
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
    reasoning: dict[str, Any] | None = None  # {"effort": ...} goes to the chat template
    prompt: dict[str, Any] | None = None
    # vLLM's extras
    service_tier: str | None = None  # accepted: bookkeeping, as in the chat API
    request_id: str | None = None  # the response's id (vLLM)
    mm_processor_kwargs: dict[str, Any] | None = None  # refused: text-only models
    priority: int = 0  # honoured under --scheduling-policy priority, else refused unless 0
    cache_salt: str | None = None  # honoured once in protocol.ENGINE_FIELDS (prefix-cache isolation)
    enable_response_messages: bool = False  # refused: gpt-oss (harmony) only in vLLM
    previous_input_messages: list[Any] | None = None  # refused: nothing is stored

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
        for i, tool in enumerate(self.tools or []):
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                return f"tools[{i}]", f"only function tools are supported, got {kind!r}"
        if self.max_tool_calls is not None:
            return "max_tool_calls", "max_tool_calls is not supported (parallel_tool_calls: " \
                "false keeps one call)"
        if self.tools and INCLUDE_LOGPROBS in (self.include or []):
            return "include", "logprobs together with tools are not supported"
        if self.reasoning is not None:
            extra = sorted(k for k, v in self.reasoning.items()
                           if k != "effort" and v is not None)
            if extra:
                return f"reasoning.{extra[0]}", (f"reasoning.{extra[0]} is not supported (only "
                                                 f"reasoning.effort, handed to the chat template)")
            if self.reasoning.get("effort") not in (None, "low", "medium", "high"):
                return "reasoning.effort", "reasoning.effort must be low, medium or high"
        if self.priority != 0:
            return "priority", ("priority scheduling is not enabled on this server; send "
                                "priority 0 or leave it out")
        if self.mm_processor_kwargs:
            return "mm_processor_kwargs", ("mm_processor_kwargs are not supported: Blink serves "
                                           "text-only models")
        if self.cache_salt is not None and "cache_salt" not in ENGINE_FIELDS:
            return "cache_salt", "cache_salt is not supported yet"
        if self.enable_response_messages:
            return "enable_response_messages", ("enable_response_messages is not supported "
                                                "(vLLM has it for gpt-oss only)")
        if self.previous_input_messages is not None:
            return "previous_input_messages", ("previous_input_messages is not supported: send "
                                               "the whole conversation as input items")
        if self.prompt is not None:
            return "prompt", "prompt templates are not supported"
        fmt = (self.text or {}).get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in
                                    ("text", "json_object", "json_schema")):
            return "text.format", "text.format must be of type text, json_object or json_schema"
        if self.truncation not in (None, "disabled"):
            return "truncation", "only truncation='disabled' is supported"
        for item in self.include or []:
            if item != INCLUDE_LOGPROBS:
                return "include", f"include {item!r} is not supported (only {INCLUDE_LOGPROBS!r})"
        if self.top_logprobs and INCLUDE_LOGPROBS not in (self.include or []):
            return ("top_logprobs", f"top_logprobs needs include=[{INCLUDE_LOGPROBS!r}] (as with "
                    f"OpenAI)")
        return None

    def chat_response_format(self) -> dict[str, Any] | None:
        """``text.format`` as the chat API's ``response_format``."""
        fmt = (self.text or {}).get("format")
        if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
            return None
        if fmt["type"] == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}

    def chat_tools(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """``tools`` and ``tool_choice`` in the chat API's shapes."""
        tools = None
        if self.tools:
            tools = [{"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}
                for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return tools, choice

    def messages(self) -> list[ChatMessage]:
        """``instructions`` and ``input`` as chat messages (``function_call`` items become an
        assistant turn's ``tool_calls``, ``function_call_output`` a ``tool`` turn); a 400 for
        any other item."""
        out: list[ChatMessage] = []
        if self.instructions:
            out.append(ChatMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            out.append(ChatMessage(role="user", content=self.input))
            return out
        calls: list[dict[str, Any]] = []  # consecutive function_call items: one assistant turn
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise bad_request(f"{where} must be an object", param=where)
            kind = item.get("type", "message")
            if kind == "function_call":
                if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                    raise bad_request(f"{where}: a function_call needs a 'name' and a 'call_id'",
                                      param=where)
                calls.append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item.get("arguments") or "{}"}})
                continue
            if calls:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=calls))
                calls = []
            if kind == "function_call_output":
                output = item.get("output")
                if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                    raise bad_request(f"{where}: a function_call_output needs a 'call_id' and "
                                      f"an 'output'", param=where)
                out.append(ChatMessage(role="tool", tool_call_id=item["call_id"],
                                       content=_text_of(output, where)))
                continue
            if kind != "message":
                raise bad_request(f"{where}: input items of type {kind!r} are not supported "
                                  f"(only messages, function_call and function_call_output)",
                                  param=where)
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                                  param=f"{where}.role")
            out.append(ChatMessage(role=_ROLES[role], content=_text_of(item.get("content"), where)))
        if calls:
            out.append(ChatMessage(role="assistant", content=None, tool_calls=calls))
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
    rendering, sampling parameters, tool calling and engine fan-out."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: Request) -> Response:
        s = self.serving
        arrival = time.monotonic()
        req = await s._parse(ResponsesRequest, await request.body())
        s.check_model(req.model)
        # Under --scheduling-policy priority the request's priority is honoured.
        problem = (req.model_copy(update={"priority": 0}) if s.priority_scheduling
                   else req).unsupported()
        if problem is None and s.priority_scheduling and not -2**31 <= req.priority < 2**31:
            problem = "priority", f"priority must be a 32-bit signed integer, got {req.priority}"
        if problem is not None:
            raise bad_request(f"{problem[1]}.", param=problem[0])
        messages = req.messages()
        if not messages:
            raise bad_request("input must hold at least one message.", param="input")
        tools, tool_choice = req.chat_tools()
        plan = await s._off_loop(plan_tools, tools, tool_choice, req.parallel_tool_calls,
                                 s.tool_calling) if tools else \
            plan_tools(tools, tool_choice, req.parallel_tool_calls, s.tool_calling)
        s.check_healthy()
        plan = s._fit_tools_to_template(plan, None)
        effort = (req.reasoning or {}).get("effort")
        template_kwargs = {"reasoning_effort": effort} if effort is not None else None
        prompt_ids = await s._encode_chat(messages, add_special_tokens=False,
                                          add_generation_prompt=True,
                                          continue_final_message=False, chat_template=None,
                                          tools=plan.template_tools,
                                          generic_tools=plan.system_tools,
                                          chat_template_kwargs=template_kwargs)
        if not prompt_ids:
            raise bad_request("The rendered prompt is empty.", param="input")
        thinking = s.thinking(None, prompt_ids)
        requested = req.max_output_tokens
        s._check_context(len(prompt_ids), requested)
        max_tokens = requested if requested is not None else s._default_max_tokens(len(prompt_ids))
        want_logprobs = INCLUDE_LOGPROBS in (req.include or [])
        params = s._sampling_params(req, max_tokens,  # type: ignore[arg-type]
                                    (req.top_logprobs or 0) if want_logprobs else None,
                                    {"logprobs": "top_logprobs",
                                     "max_tokens": "max_output_tokens"})
        params = self._with_text_format(req, params)
        params = s._with_tool_plan(params, plan)
        if thinking is not None:
            params = await s._thinking_params(params, plan, SimpleNamespace(
                response_format=req.chat_response_format()), thinking)
        response_id = req.request_id or f"resp_{uuid.uuid4().hex}"
        grammar = await s._compile_grammar(params)
        engine_id = f"{response_id}-{uuid.uuid4().hex[:8]}" if req.request_id else response_id
        runs = s._make_runs(engine_id, [prompt_ids], params, req.include_stop_str_in_output,
                            arrival, grammar)
        fanout = await s._start(request, runs)
        if fanout is None:
            return Response(status_code=_CLIENT_CLOSED)
        answer = _Answer(req, response_id, s.model_name, len(prompt_ids), want_logprobs,
                         plan, thinking() if thinking is not None else None)
        if req.stream:
            return _SSEResponse(self._stream(answer, fanout), fanout.close)
        try:
            async for d in fanout.events():
                answer.add(d.text, s._chat_logprobs(d) if want_logprobs and d.token_ids else [],
                           d.finish_reason, n_tokens=len(d.token_ids))
        except EngineError as e:
            raise engine_error_to_api(e) from None
        if fanout.disconnected:
            return Response(status_code=_CLIENT_CLOSED)
        answer.finish(runs[0].completion_tokens, runs[0].num_cached_tokens)
        return JSONResponse(answer.response())

    @staticmethod
    def _with_text_format(req: ResponsesRequest, params: SamplingParams) -> SamplingParams:
        """``text.format`` as the request's structured-output constraint."""
        rf = req.chat_response_format()
        if rf is None:
            return params
        try:
            so = structured_outputs_of(SimpleNamespace(response_format=rf))
            return dataclasses.replace(params, structured_outputs=so)
        except StructuredOutputsError as e:
            raise bad_request(str(e).replace("response_format", "text.format"),
                              param="text.format") from None
        except SamplingParamsError as e:
            raise bad_request(str(e), param="text.format") from None

    async def _stream(self, answer: "_Answer", fanout: RequestFanout) -> AsyncIterator[str]:
        s = self.serving
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        yield event("response.created", response=answer.response())
        yield event("response.in_progress", response=answer.response())
        try:
            async for d in fanout.events():
                lps = s._chat_logprobs(d) if answer.want_logprobs and d.token_ids else []
                for kind, fields in answer.add(d.text, lps, d.finish_reason,
                                               n_tokens=len(d.token_ids)):
                    yield event(kind, **fields)
            if fanout.disconnected:
                return
            run = fanout.runs[0]
            for kind, fields in answer.finish(run.completion_tokens, run.num_cached_tokens):
                yield event(kind, **fields)
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


Event = tuple[str, dict[str, Any]]


class _MessageItem:
    """One ``message`` output item (its one ``output_text`` part) as it fills up."""

    def __init__(self) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.texts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.status = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def part(self, empty: bool = False) -> dict[str, Any]:
        return {"type": "output_text", "text": "" if empty else self.text, "annotations": [],
                "logprobs": [] if empty else self.logprobs}

    def item(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        return {"type": "message", "id": self.id, "role": "assistant", "status": self.status,
                "content": [self.part()] if done else []}


class _ReasoningItem:
    """One ``reasoning`` output item (``--reasoning-parser``): the thinking as one
    ``reasoning_text`` part, as vLLM answers it."""

    def __init__(self) -> None:
        self.id = f"rs_{uuid.uuid4().hex}"
        self.texts: list[str] = []
        self.status = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def part(self, empty: bool = False) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": "" if empty else self.text}

    def item(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        return {"type": "reasoning", "id": self.id, "summary": [], "status": self.status,
                "content": [self.part()] if done else []}


class _Answer:
    """One response object as it fills up (for both the full answer and the stream's events):
    ``message`` items for text, ``function_call`` items for calls, in output order.
    :meth:`add` and :meth:`finish` return the stream events of what they added."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, n_prompt: int,
                 want_logprobs: bool, plan: ToolPlan | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created_at = int(time.time())
        self.n_prompt = n_prompt
        self.want_logprobs = want_logprobs
        self.plan = plan
        self.tools = plan.new_stream() if plan is not None else None
        self.items: list[dict[str, Any] | _MessageItem | _ReasoningItem] = []
        self.message: _MessageItem | None = None  # the open message item
        self.reasoning = reasoning  # splits the thinking off (--reasoning-parser)
        self.thought: _ReasoningItem | None = None  # the open reasoning item
        self.reasoning_tokens = 0
        self.made_calls = False
        self.finish_reason: str | None = None
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None

    def _index(self, item: Any) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def _open_message(self) -> list[Event]:
        self.message = _MessageItem()
        self.items.append(self.message)
        index = len(self.items) - 1
        return [("response.output_item.added",
                 {"output_index": index, "item": self.message.item()}),
                ("response.content_part.added",
                 {"item_id": self.message.id, "output_index": index, "content_index": 0,
                  "part": self.message.part(empty=True)})]

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        if not text and not logprobs:
            return []
        events = self._open_message() if self.message is None else []
        m = self.message
        assert m is not None
        m.texts.append(text)
        m.logprobs += logprobs
        events.append(("response.output_text.delta",
                       {"item_id": m.id, "output_index": self._index(m), "content_index": 0,
                        "delta": text, "logprobs": logprobs}))
        return events

    def _thinking(self, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if self.thought is None:
            self.thought = _ReasoningItem()
            self.items.append(self.thought)
            index = len(self.items) - 1
            events += [("response.output_item.added",
                        {"output_index": index, "item": self.thought.item()}),
                       ("response.content_part.added",
                        {"item_id": self.thought.id, "output_index": index, "content_index": 0,
                         "part": self.thought.part(empty=True)})]
        t = self.thought
        t.texts.append(text)
        events.append(("response.reasoning_text.delta",
                       {"item_id": t.id, "output_index": self._index(t), "content_index": 0,
                        "delta": text}))
        return events

    def _close_thinking(self) -> list[Event]:
        t, self.thought = self.thought, None
        if t is None:
            return []
        t.status = "completed"
        ids = {"item_id": t.id, "output_index": self._index(t), "content_index": 0}
        return [("response.reasoning_text.done", {**ids, "text": t.text}),
                ("response.content_part.done", {**ids, "part": t.part()}),
                ("response.output_item.done",
                 {"output_index": ids["output_index"], "item": t.item()})]

    def _close_message(self) -> list[Event]:
        m, self.message = self.message, None
        if m is None:
            return []
        m.status = "incomplete" if self.finish_reason in ("length", "abort") else "completed"
        ids = {"item_id": m.id, "output_index": self._index(m), "content_index": 0}
        return [("response.output_text.done", {**ids, "text": m.text, "logprobs": m.logprobs}),
                ("response.content_part.done", {**ids, "part": m.part()}),
                ("response.output_item.done",
                 {"output_index": ids["output_index"], "item": m.item()})]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events = self._close_message()
        function = call["function"]
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": "completed"}
        self.items.append(item)
        self.made_calls = True
        index = len(self.items) - 1
        ids = {"item_id": item["id"], "output_index": index}
        events += [("response.output_item.added",
                    {"output_index": index, "item": {**item, "arguments": "",
                                                     "status": "in_progress"}}),
                   ("response.function_call_arguments.delta", {**ids, "delta": item["arguments"]}),
                   ("response.function_call_arguments.done", {**ids, "arguments": item["arguments"]}),
                   ("response.output_item.done", {"output_index": index, "item": item})]
        return events

    def add(self, text: str, logprobs: list[Any], finish_reason: str | None,
            n_tokens: int = 0) -> list[Event]:
        self.finish_reason = finish_reason or self.finish_reason
        lps = [lp.model_dump(mode="json") for lp in logprobs]
        events: list[Event] = []
        if self.reasoning is not None:
            before = self.reasoning.ended
            thought, text = self.reasoning.feed(text, final=finish_reason is not None)
            if thought or (self.reasoning.ended and not before and self.reasoning.reasoning):
                self.reasoning_tokens += n_tokens  # the reasoning's tokens (and </think>'s)
            events += self._thinking(thought)
            if self.reasoning.ended or finish_reason is not None:
                events += self._close_thinking()
        if self.tools is None:
            return events + self._text(text, lps)
        step = self.tools.step(text, final=finish_reason is not None)
        events += self._text(step.content, [])
        for delta in step.tool_calls:
            function = delta["function"]
            events += self._call({"id": delta["id"], "function": function})
        return events

    def finish(self, completion_tokens: int, cached_tokens: int) -> list[Event]:
        if self.tools is not None and not self.tools.parser.finished:
            events = self.add("", [], self.finish_reason or "stop")
        else:
            events = []
        events += self._close_thinking()
        if not any(isinstance(x, (_MessageItem, dict)) for x in self.items):
            events += self._open_message()  # an empty answer is still one (empty) message
        events += self._close_message()
        # "length" is the max_output_tokens (or context) limit: OpenAI's "incomplete".
        self.status = "incomplete" if self.finish_reason in ("length", "abort") else "completed"
        self.usage = {
            "input_tokens": self.n_prompt,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.n_prompt + completion_tokens,
        }
        return events

    @property
    def text(self) -> str:
        return "".join(x.text for x in self.items if isinstance(x, _MessageItem))

    def response(self) -> dict[str, Any]:
        req = self.req
        incomplete = None
        if self.status == "incomplete":
            reason = "max_output_tokens" if self.finish_reason == "length" else "cancelled"
            incomplete = {"reason": reason}
        done = self.status != "in_progress"
        output = [x if isinstance(x, dict) else x.item() for x in self.items] if done else []
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": None, "incomplete_details": incomplete,
            "model": self.model, "instructions": req.instructions,
            "output": output, "output_text": self.text if done else "",
            "usage": self.usage, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "top_logprobs": req.top_logprobs,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice if req.tool_choice is not None else
            ("auto" if req.tools else "none"),
            "tools": req.tools or [], "text": {"format": fmt},
            "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "metadata": req.metadata or {}, "user": req.user,
        }
