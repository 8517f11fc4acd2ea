"""Request handling for the OpenAI endpoints: validate, tokenize, fan out, stream back.

One HTTP request becomes ``len(prompts) * n`` engine requests (:class:`ChoiceRun`), run
concurrently by a :class:`RequestFanout`, which also watches the connection: when the client
goes away (streaming or not) every unfinished engine request is aborted at once, instead of
generating to ``max_tokens`` for nobody.

Every request is bounded before work is done for it (:class:`blink.dpu.limits.RequestLimits`):
``n`` and the fan-out, prompt lengths (refused unencoded when they surely exceed the context),
request-supplied chat templates (refused unless trusted). Chat-template rendering, and encoding
or decoding of long texts, run in a small worker pool so the event loop keeps serving others.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from blink.dpu import errors
from blink.dpu.chat_template import (
    DEFAULT_MAX_RENDER_CHARS,
    ChatTemplateError,
    RenderedTooLongError,
    RenderLimits,
    template_uses_tools,
)
from blink.dpu.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
)
from blink.dpu.errors import APIError, bad_request
from blink.dpu.generation import ChoiceDelta, ChoiceRun
from blink.dpu.limits import (
    DEFAULT_MAX_FANOUT,
    INLINE_ENCODE_CHARS,
    INLINE_PARSE_BYTES,
    MAX_JSON_ITEMS,
    RequestLimits,
    json_item_count,
)
from blink.dpu.metrics import FrontendMetrics
from blink.dpu.protocol import (
    IGNORED_FIELDS,
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    ToolCall,
    TopLogprob,
    UsageInfo,
    ignored_fields_warning,
)
from blink.dpu.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    after_thinking,
    prompt_opens_thinking,
)
from blink.dpu.tokenizer import Tokenizer
from blink.dpu.tool_calling import (
    ToolCallingConfig, ToolPlan, plan_tools, validate_tools, with_response_format,
)
from blink.dpu.tool_parsers import generic_messages
from blink.dpu.tool_parsers import ToolCallStream
from blink.shared.sampling_params import MAX_N, SamplingParams, SamplingParamsError
from blink.threads.roles import set_thread_name
from blink.shared.structured_outputs import StructuredOutputsError
from blink.dpu.structured.workers import CompiledGrammar, GrammarService
from blink.dpu.structured.request import StructuredRequestError, structured_outputs_of

logger = logging.getLogger(__name__)
_M = TypeVar("_M", bound=BaseModel)
_DONE = object()
_DISCONNECTED = object()
# JSON has no -inf; vLLM clamps logprobs the same way.
_MIN_LOGPROB = -9999.0
# Status for "client closed the request" (nginx's convention; nobody reads it).
_CLIENT_CLOSED = 499
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_INT64_SPAN = 2**64
# vLLM's wording, so clients that recognise it keep working.
_UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template "
                       "is not set. Refused request with untrusted chat template.")
_T = TypeVar("_T")
#: a client's X-Request-Id names the answer when it is this tame (blink.dpu.app echoes it then)
_TAME_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
#: the request fields that put a grammar on the output (named in the refusal with reasoning)
_GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar")


def _constraint_param(plan: ToolPlan, req: Any) -> str:
    """The request field that put a grammar on the output (named when it is refused): the
    tool choice, else the structured-output field the request set."""
    if plan.structured_outputs is not None:
        return "tool_choice"
    return next((f for f in _GRAMMAR_FIELDS if getattr(req, f, None) is not None),
                "response_format")


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


def parse_request(model: type[_M], body: bytes) -> _M:
    """Validate a JSON body; malformed JSON and wrong types become 400s. Unknown fields are
    ignored (as vLLM does), with one warning per request naming them."""
    ignored: list[str] = []
    try:
        req = model.model_validate_json(body, context={IGNORED_FIELDS: ignored})
    except ValidationError as e:
        raise errors.from_validation_error(e) from None
    if ignored:
        logger.warning("%s", ignored_fields_warning(ignored))
    return req


def _tokenize_request(body: bytes) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """/tokenize takes either shape; "messages" tells them apart (as in vLLM)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply
        data = None  # parse_request reports the JSON error
    is_chat = isinstance(data, dict) and "messages" in data
    return parse_request(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@functools.lru_cache(maxsize=1)
def _worker_pool() -> ThreadPoolExecutor:
    """The process's pool for chat-template renders and long encodes/decodes. Few threads:
    they share the GIL with the event loop, and more would only queue there."""
    numbers = itertools.count()
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="blink-tok",
                              initializer=lambda: set_thread_name(f"blink-tok-{next(numbers)}"))


def engine_slot_count(engine: EngineClient) -> int | None:
    """How many requests the engine holds at once, when its client can tell (the ring's slot
    count); ``None`` otherwise (a test engine)."""
    ring = getattr(engine, "ring", None)
    n = getattr(getattr(ring, "config", None), "n_slots", None)
    return n if isinstance(n, int) and n > 0 else None


def choice_seed(seed: int, index: int) -> int:
    """A request's seed offset for its ``index``-th choice, wrapped to a signed int64 (the
    ring's type), so a seed near the int64 limit with n > 1 still works."""
    return (seed + index + 2**63) % _INT64_SPAN - 2**63


def engine_error_to_api(exc: BaseException) -> APIError:
    if isinstance(exc, EngineOverloadedError):
        return errors.overloaded(str(exc), exc.retry_after_s)
    if isinstance(exc, EngineDeadError):
        return errors.engine_unavailable(str(exc), exc.retry_after_s)
    return errors.internal_error(str(exc) or type(exc).__name__)


class RequestFanout:
    """The engine requests of one HTTP request, run concurrently, plus disconnect watching."""

    def __init__(self, request: Request, runs: list[ChoiceRun]) -> None:
        self.request = request
        self.runs = runs
        self.disconnected = False
        self._watcher: asyncio.Task[None] | None = None
        self._pumps: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Submit every run and wait for each one's first delta.

        Raises :class:`ClientDisconnected` if the client leaves meanwhile, or the first engine
        error (then no run is left running).
        """
        self._watcher = asyncio.ensure_future(wait_for_disconnect(self.request))
        starter = asyncio.ensure_future(
            asyncio.gather(*(run.start() for run in self.runs), return_exceptions=True))
        try:
            await asyncio.wait({starter, self._watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            starter.cancel()
            await self.close()
            raise
        if not starter.done():
            self.disconnected = True
            starter.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(starter, return_exceptions=True)
            await self.close()
            raise ClientDisconnected()
        failures = [r for r in starter.result() if isinstance(r, BaseException)]
        if failures:
            await self.close()
            raise failures[0]

    @staticmethod
    async def _pump(run: ChoiceRun, queue: asyncio.Queue[Any]) -> None:
        try:
            async for delta in run.deltas():
                queue.put_nowait(delta)
        except Exception as e:  # handed to the consumer, which turns it into an error answer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all runs as they arrive. Ends when all finish, or early (with
        :attr:`disconnected` set) when the client leaves; re-raises a run's engine error."""
        assert self._watcher is not None, "start() first"
        # Unbounded (like vLLM's output queues): a slow client's tokens wait here instead of
        # stalling the engine client's poller, which serves every request.
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def on_disconnect(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is None:
                queue.put_nowait(_DISCONNECTED)

        self._watcher.add_done_callback(on_disconnect)  # also fires if it is already done
        self._pumps = [asyncio.ensure_future(self._pump(run, queue)) for run in self.runs]
        remaining = len(self._pumps)
        try:
            while remaining:
                item = await queue.get()
                if item is _DISCONNECTED:
                    self.disconnected = True
                    return
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop watching; abort every unfinished run. Safe to call more than once."""
        with anyio.CancelScope(shield=True):
            if self._watcher is not None:
                self._watcher.cancel()
            for pump in self._pumps:
                pump.cancel()
            if self._pumps:
                await asyncio.gather(*self._pumps, return_exceptions=True)
            for run in self.runs:
                await run.close()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close``, even if the body never started
    (the client vanished before the headers went out)."""

    def __init__(self, content: AsyncIterator[str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


_TEXT_MARK = "\x00blink-text\x00"
#: marker numbers for a template's usage counts (``_TextChunk``): 13 digits no count reaches
_NUMBER_MARK = 7_346_912_805_000


class _TextChunk:
    """A stream's plain-text chunk for one choice, as text around the new text.

    Most chunks of a stream carry nothing but a choice's new text, and apart from that text
    their JSON is the same every time. One chunk is rendered through the pydantic models with
    a marker for the text; afterwards a chunk is that rendering with the marker replaced by
    the new text serialized by pydantic-core (``to_json``, the encoder ``model_dump_json``
    uses, so the bytes are the same): the frontend's CPU per streamed token 0.46 -> 0.41 ms
    (docs/performance.md#frontend-text-chunks). With ``continuous_usage_stats`` (guidellm
    always asks for it) each chunk also carries the stream's usage, whose counts change from
    chunk to chunk: they are rendered as marker numbers too and filled the same way (``str``
    of an int, as pydantic writes one).
    """

    def __init__(self, pieces: tuple[str, ...], slots: tuple[int, ...]) -> None:
        # pieces[0] value[slots[0]] pieces[1] value[slots[1]] ... pieces[-1]; value 0 the text
        self._pieces, self._slots = pieces, slots

    @classmethod
    def from_rendering(cls, render: Callable[..., str], numbers: int = 0) -> _TextChunk | None:
        """From ``render(text, *numbers)``, the chunk's full rendering; None if a marker is not
        found exactly once (then the caller renders every chunk)."""
        marks = [to_json(_TEXT_MARK).decode(), *(str(_NUMBER_MARK + i) for i in range(numbers))]
        rendered = render(_TEXT_MARK, *(_NUMBER_MARK + i for i in range(numbers)))
        if any(rendered.count(mark) != 1 for mark in marks):
            return None
        pieces, slots, start = [], [], 0
        for at, slot in sorted((rendered.index(mark), slot) for slot, mark in enumerate(marks)):
            pieces.append(rendered[start:at])
            slots.append(slot)
            start = at + len(marks[slot])
        pieces.append(rendered[start:])
        return cls(tuple(pieces), tuple(slots))

    def __call__(self, text: str, *numbers: int) -> str:
        if not numbers:
            return self._pieces[0] + to_json(text).decode() + self._pieces[1]
        values = (to_json(text).decode(), *map(str, numbers))
        out = [self._pieces[0]]
        for slot, piece in zip(self._slots, self._pieces[1:]):
            out += (values[slot], piece)
        return "".join(out)


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _prompt_logprobs_of(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The prompt logprobs a request asks for (completions: echo with logprobs asks too)."""
    if isinstance(req, CompletionRequest):
        return req.effective_prompt_logprobs()
    return getattr(req, "prompt_logprobs", None)  # (the Responses API has none)


def _prompt_logprob_lanes(engine: EngineClient) -> int:
    """The engine's prompt-logprob lanes: its ``prompt_logprob_lanes`` (optional, as a test
    double says), else its ring's; 0 for an engine client without one ring, such as the
    disaggregated router (its decode engines compute none)."""
    lanes = getattr(engine, "prompt_logprob_lanes", None)
    if lanes is None:
        config = getattr(getattr(engine, "ring", None), "config", None)
        lanes = getattr(config, "prompt_logprob_lanes", 0)
    return int(lanes or 0)


def _sampling_param_name(exc: SamplingParamsError, renames: dict[str, str]) -> str | None:
    """SamplingParams messages start with the field name; map it to the request's name."""
    word = str(exc).split(" ", 1)[0]
    if word in {f.name for f in dataclasses.fields(SamplingParams)}:
        return renames.get(word, word)
    return None


class OpenAIServing:
    """The handlers behind the routes in :mod:`blink.dpu.app`."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, metrics: FrontendMetrics,
                 model_name: str, limits: RequestLimits | None = None,
                 tool_calling: ToolCallingConfig | None = None) -> None:
        self.engine = engine
        lim = limits or RequestLimits()
        #: structured outputs: constraints checked in worker processes, cached by content
        self.grammars = GrammarService(tokenizer, timeout_s=lim.grammar_compile_timeout_s,
                                       memory_mb=lim.grammar_compile_memory_mb,
                                       cache_mb=lim.grammar_cache_mb)
        self.tool_calling = tool_calling or ToolCallingConfig()
        #: ``--reasoning-parser``: the class splitting thinking from the answer (None: off)
        self.reasoning_parser: type[ReasoningParser] | None = None
        #: --scheduling-policy priority: a request's ``priority`` reaches the engine (else a
        #: non-zero one is a 400, as vLLM answers without priority scheduling)
        self.priority_scheduling = False
        #: lanes of the engine's ring for prompt logprobs (0: the engine computes none, so
        #: ``prompt_logprobs`` and completions' echo with logprobs are refused by name)
        self.prompt_logprob_lanes = _prompt_logprob_lanes(engine)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model_name = model_name
        #: the names requests may use (create_app sets every --served-model-name)
        self.served_names: frozenset[str] = frozenset([model_name])
        self.max_model_len = engine.max_model_len
        self.limits = limits or RequestLimits()
        # Anything above what the ring holds at once could never run as one request.
        caps = [c for c in (self.limits.max_fanout, engine_slot_count(engine)) if c]
        self.max_fanout = min(caps) if caps else DEFAULT_MAX_FANOUT
        #: JSON values a body may hold: a token-id prompt as long as the context, and more
        self.max_json_items = MAX_JSON_ITEMS + 2 * self.max_model_len
        #: a text longer than this is refused unencoded (None: no such bound for this tokenizer)
        self.max_prompt_chars = tokenizer.max_prompt_chars(self.max_model_len)
        self.render_limits = RenderLimits(
            timeout_s=self.limits.chat_template_timeout_s,
            max_chars=self.max_prompt_chars or DEFAULT_MAX_RENDER_CHARS)

    async def _parse(self, model: Callable[[bytes], _M] | type[_M], body: bytes) -> _M:
        """:func:`parse_request` (or ``model(body)`` for a parsing function), in the worker
        pool for big bodies: 8 MiB of small JSON objects take a second to validate."""
        parse = functools.partial(parse_request, model) if isinstance(model, type) else model
        if len(body) <= INLINE_PARSE_BYTES:  # too small to hold MAX_JSON_ITEMS
            return parse(body)
        items = json_item_count(body, self.max_json_items)
        if items > self.max_json_items:
            raise bad_request(f"The request body holds more than {self.max_json_items} JSON "
                              f"values (array items, object members), the most accepted.")
        return await self._off_loop(parse, body)

    async def _off_loop(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``fn`` in the worker pool: renders and long encodes never block the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_worker_pool(), functools.partial(fn, *args, **kwargs))

    # -- shared checks ---------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise errors.model_not_found(name)

    @staticmethod
    def base_request_id(request: Request, field: str | None) -> tuple[str, str]:
        """(the id an answer is named after, the base of its engine requests' ids). The first
        as vLLM picks it: the client's ``X-Request-Id`` header, else the request's
        ``request_id`` field, else a new one; the engine's ids get a random part when the
        client chose, so two requests naming the same id never collide in the engine."""
        header = request.headers.get("x-request-id")
        if header is not None and not _TAME_ID.fullmatch(header):
            header = None  # the answer's x-request-id is a new one then (blink.dpu.app)
        given = header or field
        if not given:
            fresh = uuid.uuid4().hex
            return fresh, fresh
        return given, f"{given}-{uuid.uuid4().hex[:8]}"

    def check_healthy(self) -> None:
        # is_accepting, not is_healthy: a stalled engine (one slow step) still takes requests,
        # which queue in the ring; only a dead or given-up engine refuses them.
        if not self.engine.is_accepting():
            # an engine being restarted (ReconnectingEngineClient) says when to retry
            retry = getattr(self.engine, "unavailable_retry_after_s", lambda: None)()
            raise errors.engine_unavailable(
                "The engine is restarting; retry shortly." if retry is not None else
                "The engine is not available (not responding or stopped); try again later.", retry)

    def _check_request(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        self.check_model(req.model)
        # Under the priority policy the request's priority is honoured: checked without it.
        problem = (req.model_copy(update={"priority": 0}) if self.priority_scheduling
                   else req).unsupported()
        if problem is not None:
            raise bad_request(f"{problem[1]}.", param=problem[0])
        if self.priority_scheduling and not -2**31 <= req.priority < 2**31:
            raise bad_request(f"priority must be a 32-bit signed integer, got {req.priority}.",
                              param="priority")
        self._check_prompt_logprobs(req)
        # Before anything is built per choice: n=10**7 must cost nothing.
        if req.n > MAX_N:
            raise bad_request(f"n must be at most {MAX_N}, got {req.n}.", param="n")

    def _check_prompt_logprobs(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """``prompt_logprobs`` (and completions' echo with logprobs, which asks for them):
        refused by name where the engine computes none, and with ``stream`` as vLLM does
        (except echo's, which lead a completions stream's logprobs)."""
        wanted = _prompt_logprobs_of(req)
        if wanted is None:
            return
        param = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        if self.prompt_logprob_lanes == 0:
            raise bad_request(
                f"{'prompt_logprobs are' if param == 'prompt_logprobs' else 'echo with logprobs needs the prompt logprobs, which are'} "
                "not available on this engine: only the CPU loop computes them (not the GPU "
                "loops, speculative decoding, disaggregated prefill/decode or --model null), "
                "with --prompt-logprobs-lanes above 0.", param=param)
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.",
                              param="prompt_logprobs")

    def _prompt_logprobs_json(self, plp: list[dict[int, tuple[float, int]] | None] | None
                              ) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of one request (the engine's per-position entries)."""
        if plp is None:
            return None
        return [None if entry is None else {
            t: PromptLogprob(logprob=_clamp(v), rank=rank,
                             decoded_token=self.tokenizer.token_text(t))
            for t, (v, rank) in entry.items()} for entry in plp]

    def _echo_logprobs(self, prompt_ids: list[int],
                       plp: list[dict[int, tuple[float, int]] | None] | None, top: int,
                       as_ids: bool) -> tuple[CompletionLogprobs, int]:
        """Completions' echo with logprobs: the prompt's part of ``logprobs`` (vLLM's: the
        first token has none; each position's top_logprobs are the prompt token and the top
        ``top``), and the text offset where the answer's part starts."""
        out = CompletionLogprobs()
        offset = 0
        for i, token_id in enumerate(prompt_ids):
            text = self._token_text(token_id, as_ids)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            entry = plp[i] if plp is not None and i < len(plp) else None
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_clamp(entry[token_id][0]))
            alternatives: dict[str, float] = {}
            for t, (v, _) in list(entry.items())[: top + 1]:
                key = self._token_text(t, as_ids)
                alternatives[key] = max(alternatives.get(key, _MIN_LOGPROB), _clamp(v))
            out.top_logprobs.append(alternatives)
        return out, offset

    def _check_fanout(self, n_prompts: int, n: int) -> None:
        total = n_prompts * max(n, 1)
        if total > self.max_fanout:
            what = f"{n_prompts} prompts x n={n}" if n_prompts > 1 else f"n={n}"
            raise bad_request(
                f"This request asks for {total} completions ({what}), but the server runs at "
                f"most {self.max_fanout} at once. Please reduce n or the number of prompts.",
                param="n" if n_prompts == 1 else "prompt")

    def _check_prompt_chars(self, n_chars: int, param: str) -> None:
        """Refuse, without encoding it, a text that surely exceeds the context."""
        cap = self.max_prompt_chars
        if cap is not None and n_chars > cap:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, the prompt has {n_chars} characters, more than "
                f"{self.max_model_len} tokens can hold ({cap} characters at most with this "
                f"tokenizer). Please reduce the length of the prompt.",
                param=param, code="context_length_exceeded")

    async def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        self._check_prompt_chars(len(text), param)
        if len(text) <= INLINE_ENCODE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self._off_loop(self.tokenizer.encode, text,
                                    add_special_tokens=add_special_tokens)

    def _check_chat_template(self, template: str | None) -> None:
        if template is None:
            return
        if not self.limits.trust_request_chat_template:
            raise bad_request(_UNTRUSTED_TEMPLATE, param="chat_template")
        if len(template) > self.limits.max_chat_template_chars:
            raise bad_request(
                f"The chat template is too long: {len(template)} characters; at most "
                f"{self.limits.max_chat_template_chars} are accepted.", param="chat_template")

    async def _encode_chat(self, messages: Sequence[ChatMessage], *,
                           chat_template: str | None,
                           generic_tools: list[dict[str, Any]] | None = None,
                           **kwargs: Any) -> list[int]:
        """Render (in the worker pool, under the render limits) and encode a conversation;
        a template failure or limit is a 400. ``generic_tools``: tools to write into the
        system prompt (the generic tool-call format) instead of the template's ``tools``."""
        self._check_chat_template(chat_template)

        def work() -> list[int]:
            dicts = [m.model_dump(exclude_none=True) for m in messages]
            if generic_tools is not None:
                dicts = generic_messages(dicts, generic_tools)
            return self.tokenizer.encode_chat(dicts, chat_template=chat_template,
                                              limits=self.render_limits, **kwargs)

        try:
            return await self._off_loop(work)
        except RenderedTooLongError as e:
            if self.max_prompt_chars is None:  # the cap is only a memory bound then
                raise bad_request(f"chat template error: {e}", param="messages") from None
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, the rendered conversation has more than {e.max_chars} characters, "
                f"more than {self.max_model_len} tokens can hold. Please reduce the length of "
                f"the messages.", param="messages", code="context_length_exceeded") from None
        except ChatTemplateError as e:
            raise bad_request(str(e), param="chat_template" if chat_template else "messages"
                              ) from None

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """``truncate_prompt_tokens``: the last ``keep`` prompt tokens (-1: the context)."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens value ({keep}) is greater than "
                              f"max_model_len ({self.max_model_len}). Please request a smaller "
                              f"truncation size.", param="truncate_prompt_tokens")
        return ids[-keep:]

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        for token_id in ids:
            if not 0 <= token_id < vocab:
                raise bad_request(f"Token id {token_id} is out of vocabulary "
                                  f"(the vocabulary has {vocab} tokens).", param=param)

    def _sampling_params(self, req: ChatCompletionRequest | CompletionRequest,
                         max_tokens: int, logprobs: int | None,
                         renames: dict[str, str]) -> SamplingParams:
        stop_ids = list(req.stop_token_ids or [])
        if not req.ignore_eos:
            # The engine stops on stop_token_ids; eos is one unless the client ignores it.
            stop_ids += [t for t in self.tokenizer.eos_token_ids if t not in stop_ids]
        try:
            params = SamplingParams.from_generation_config(
                self.tokenizer.generation_config,
                n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                seed=req.seed, stop=req.stop, stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs, logit_bias=req.logit_bias,
                skip_special_tokens=req.skip_special_tokens,
                structured_outputs=structured_outputs_of(req),
                # engine-side fields (protocol.ENGINE_FIELDS); not every request model has each
                allowed_token_ids=getattr(req, "allowed_token_ids", None),
                bad_words=getattr(req, "bad_words", None) or [],
                cache_salt=getattr(req, "cache_salt", None),
                priority=req.priority if self.priority_scheduling else 0,
                prompt_logprobs=_prompt_logprobs_of(req),
            )
            if params.bad_words:
                params.update_from_tokenizer(
                    lambda text: self.tokenizer.encode(text, add_special_tokens=False))
            params.check_vocab(self.tokenizer.vocab_size)
        except StructuredRequestError as e:
            raise bad_request(str(e), param=e.param) from None
        except SamplingParamsError as e:
            raise bad_request(str(e), param=_sampling_param_name(e, renames)) from None
        return params

    async def _compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's structured-output grammar (checked in a worker process, cached), or
        None; a constraint that cannot be enforced or passes a limit is a 400."""
        so = params.structured_outputs
        if so is None:
            return None
        try:
            grammar = await self.grammars.compile_async(so)
        except StructuredOutputsError as e:
            raise bad_request(str(e), param=getattr(e, "param", None)) from None
        return grammar

    def _check_context(self, prompt_len: int, max_tokens: int | None) -> None:
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise errors.context_length_exceeded(self.max_model_len, prompt_len, None)
        elif prompt_len + max_tokens > self.max_model_len:
            raise errors.context_length_exceeded(self.max_model_len, prompt_len, max_tokens)

    def _default_max_tokens(self, prompt_len: int) -> int:
        """Chat without max_tokens: the rest of the context (capped by generation_config's
        max_new_tokens, as vLLM does)."""
        room = self.max_model_len - prompt_len
        cap = self.tokenizer.generation_config.get("max_new_tokens")
        return min(room, cap) if isinstance(cap, int) and cap > 0 else room

    def _make_runs(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                   include_stop: bool, arrival: float,
                   grammar: CompiledGrammar | None = None) -> list[ChoiceRun]:
        runs = []
        for p, prompt_ids in enumerate(prompts):
            self.metrics.params_n.observe(params.n)
            for i in range(params.n):
                # One engine request per choice; a given seed is offset per choice so the
                # choices differ but stay reproducible.
                seed = None if params.seed is None else choice_seed(params.seed, i)
                choice_params = dataclasses.replace(params, n=1, seed=seed)
                index = p * params.n + i
                suffix = f"{p}-{i}" if len(prompts) > 1 else str(i)
                runs.append(ChoiceRun(
                    self.engine, self.tokenizer, self.metrics,
                    request_id=f"{request_id}-{suffix}", index=index, prompt_ids=prompt_ids,
                    params=choice_params, include_stop_str_in_output=include_stop, grammar=grammar,
                    arrival_time=arrival))
        return runs

    @staticmethod
    async def _start(request: Request, runs: list[ChoiceRun]) -> RequestFanout | None:
        """Start a fanout; ``None`` if the client left while waiting for the first tokens."""
        fanout = RequestFanout(request, runs)
        try:
            await fanout.start()
        except ClientDisconnected:
            return None
        except EngineError as e:
            raise engine_error_to_api(e) from None
        return fanout

    @staticmethod
    def _usage_counts(prompts: list[list[int]], runs: list[ChoiceRun], n: int) -> tuple[int, int, int, int]:
        """(prompt, completion, total, cached) tokens: a prompt counts once however many
        choices it has (as with OpenAI)."""
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(r.completion_tokens for r in runs)
        cached = sum(runs[p * n].num_cached_tokens for p in range(len(prompts)))
        return prompt_tokens, completion, prompt_tokens + completion, cached

    @staticmethod
    def _usage_of(prompt_tokens: int, completion: int, total: int, cached: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=total,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _usage(self, prompts: list[list[int]], runs: list[ChoiceRun], n: int) -> UsageInfo:
        return self._usage_of(*self._usage_counts(prompts, runs, n))

    # -- logprobs formatting ---------------------------------------------------------------
    def _token_text(self, token_id: int, as_ids: bool) -> str:
        """A logprob's token: its text, or (``return_tokens_as_token_ids``) ``token_id:N``."""
        return f"token_id:{token_id}" if as_ids else self.tokenizer.token_text(token_id)

    def _token_bytes(self, token_id: int, as_ids: bool) -> list[int]:
        if as_ids:
            return list(f"token_id:{token_id}".encode())
        return list(self.tokenizer.token_bytes(token_id))

    def _chat_logprobs(self, d: ChoiceDelta, as_ids: bool = False) -> list[ChatTokenLogprob]:
        assert d.logprobs is not None and d.top_logprobs is not None
        out = []
        for token_id, lp, top in zip(d.token_ids, d.logprobs, d.top_logprobs):
            out.append(ChatTokenLogprob(
                token=self._token_text(token_id, as_ids), logprob=_clamp(lp),
                bytes=self._token_bytes(token_id, as_ids),
                top_logprobs=[TopLogprob(token=self._token_text(t, as_ids), logprob=_clamp(v),
                                         bytes=self._token_bytes(t, as_ids)) for t, v in top]))
        return out

    def _completion_logprobs(self, d: ChoiceDelta, offset: int, as_ids: bool = False
                             ) -> tuple[CompletionLogprobs, int]:
        assert d.logprobs is not None and d.top_logprobs is not None
        out = CompletionLogprobs()
        for token_id, lp, top in zip(d.token_ids, d.logprobs, d.top_logprobs):
            text = self._token_text(token_id, as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(_clamp(lp))
            out.text_offset.append(offset)
            offset += len(text)
            alternatives: dict[str, float] = {}
            for t, v in top:  # two ids can share a text; keep the likelier
                key = self._token_text(t, as_ids)
                alternatives[key] = max(alternatives.get(key, _MIN_LOGPROB), _clamp(v))
            out.top_logprobs.append(alternatives)
        return out, offset

    # -- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = await self._parse(ChatCompletionRequest, await request.body())
        self._check_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if not req.messages:
            raise bad_request("messages must contain at least one message.", param="messages")
        self._check_fanout(1, req.n)
        # Checking tool schemas takes milliseconds each the first time (then cached): off the loop.
        plan = await self._off_loop(plan_tools, req.tools, req.tool_choice,
                                    req.parallel_tool_calls, self.tool_calling) if req.tools \
            else plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                            self.tool_calling)
        self.check_healthy()
        plan = self._fit_tools_to_template(plan, req.chat_template)
        template_kwargs = req.chat_template_kwargs
        if req.reasoning_effort is not None:  # vLLM hands it to the template
            template_kwargs = {"reasoning_effort": req.reasoning_effort, **(template_kwargs or {})}
        prompt_ids = await self._encode_chat(
            req.messages, generic_tools=plan.system_tools,
            add_special_tokens=req.add_special_tokens,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tools=plan.template_tools,
            documents=req.documents, chat_template_kwargs=template_kwargs,
            chat_template=req.chat_template)
        prompt_ids = self._truncate(prompt_ids, req.truncate_prompt_tokens)
        if not prompt_ids:
            raise bad_request("The rendered prompt is empty.", param="messages")
        thinking = self.thinking(req.chat_template_kwargs, prompt_ids)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        if requested is None:
            self._check_context(len(prompt_ids), None)
        max_tokens = requested if requested is not None \
            else self._default_max_tokens(len(prompt_ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs,
                                       {"logprobs": "top_logprobs", "max_tokens": max_param})
        params = self._with_tool_plan(params, plan)
        if thinking is not None:
            params = await self._thinking_params(params, plan, req, thinking)
        self._check_context(len(prompt_ids), requested)

        base, engine_base = self.base_request_id(request, req.request_id)
        request_id = f"chatcmpl-{base}"
        grammar = await self._compile_grammar(params)
        runs = self._make_runs(f"chatcmpl-{engine_base}", [prompt_ids], params,
                               req.include_stop_str_in_output, arrival, grammar)
        fanout = await self._start(request, runs)
        if fanout is None:
            return Response(status_code=_CLIENT_CLOSED)
        if req.stream:
            return _SSEResponse(self._chat_stream(req, request_id, fanout, [prompt_ids], plan,
                                                  thinking),
                                fanout.close)
        return await self._chat_full(req, request_id, fanout, [prompt_ids], plan, thinking)

    # -- reasoning (blink.dpu.reasoning) ------------------------------------------------------
    def thinking(self, chat_template_kwargs: dict[str, Any] | None,
                 prompt_ids: list[int]) -> Callable[[], ReasoningParser] | None:
        """A maker of the per-choice reasoning parser, when ``--reasoning-parser`` is set and
        this request's output holds reasoning (not with ``enable_thinking: false``)."""
        cls = self.reasoning_parser
        if cls is None or not cls.active(chat_template_kwargs):
            return None
        tail = self.tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
        return functools.partial(cls, prompt_opens_thinking=prompt_opens_thinking(tail))

    async def _thinking_params(self, params: SamplingParams, plan: ToolPlan, req: Any,
                               thinking: Callable[[], ReasoningParser]) -> SamplingParams:
        """:meth:`_with_thinking`, after checking that the request's own constraint needs no
        final check: a schema keyword the grammar cannot enforce is checked on the whole
        output, which here holds the reasoning too, so such a schema is refused by name."""
        original = params.structured_outputs
        out = self._with_thinking(params, plan, req, thinking)
        if original is not None and out.structured_outputs is not original:
            checked = await self._compile_grammar(params)
            if checked is not None and checked.needs_final_check:
                param = _constraint_param(plan, req)
                raise bad_request(
                    f"{param}: this JSON schema has keywords the grammar cannot enforce (checked "
                    f"on the finished output), which Blink cannot check after the reasoning of "
                    f"--reasoning-parser yet; drop those keywords or turn thinking off for this "
                    f"request.", param=param)
        return out

    def _with_thinking(self, params: SamplingParams, plan: ToolPlan, req: Any,
                       thinking: Callable[[], ReasoningParser]) -> SamplingParams:
        """A reasoning parser needs the ``<think>`` tags decoded, and a grammar (structured
        outputs, a forced tool choice) starts at ``</think>`` (:func:`after_thinking`); one
        that cannot be put there is refused by name."""
        so = params.structured_outputs
        if so is not None:
            wrapped = after_thinking(so, self.tokenizer.special_token_id,
                                     thinking().opens_at_start)
            if wrapped is not None:
                params = dataclasses.replace(params, structured_outputs=wrapped)
                so = None
        if so is not None:
            param = _constraint_param(plan, req)
            raise bad_request(
                f"{param} cannot be used with --reasoning-parser here: after the reasoning "
                f"Blink can constrain the answer to a JSON schema or json_object, not to this "
                f"kind of constraint (a regex, a choice, a grammar, tools together with a "
                f"response format). Turn thinking off for this request (chat_template_kwargs: "
                f"{{\"enable_thinking\": false}} where the template has it) or serve without "
                f"--reasoning-parser.", param=param)
        tags = [self.tokenizer.special_token_id(t) for t in ("<think>", "</think>")]
        if any(t is not None for t in tags) and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    @staticmethod
    def _echo_text(req: ChatCompletionRequest) -> str:
        """vLLM's chat ``echo``: the last message's content when it is the assistant's."""
        if not req.echo or not req.messages or req.messages[-1].role != "assistant":
            return ""
        content = req.messages[-1].content
        if isinstance(content, list):
            return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return content or ""

    # -- tool calling (blink.dpu.tool_calling) ----------------------------------------------
    def _fit_tools_to_template(self, plan: ToolPlan, chat_template: str | None) -> ToolPlan:
        """``auto`` relies on the model seeing the tools: when the chat template never
        renders them, Blink writes them into the system prompt itself (the generic format,
        :mod:`blink.dpu.tool_parsers.generic`; forced choices are enforced by the grammar)."""
        if plan.choice != "auto" or plan.system_tools is not None:
            return plan
        source = self.tokenizer.template_source(tools=True, chat_template=chat_template)
        try:
            sees = source is None or template_uses_tools(source)
        except ChatTemplateError:
            return plan  # rendering reports the template's own error
        return plan if sees else plan.as_generic()

    def _with_tool_plan(self, params: SamplingParams, plan: ToolPlan) -> SamplingParams:
        """The grammar of a forced tool choice, or of tools and a response format together
        (:func:`blink.dpu.tool_calling.with_response_format`: the call grammar while the
        model calls tools, the response schema for its answer); special tokens kept for
        parsers that read them (vLLM does both)."""
        if params.structured_outputs is not None and plan.choice != "none":
            combined = with_response_format(plan, params.structured_outputs,
                                            self.tokenizer.special_token_id)
            params = dataclasses.replace(params, structured_outputs=combined)
        elif plan.structured_outputs is not None:
            params = dataclasses.replace(params, structured_outputs=plan.structured_outputs)
        if plan.needs_special_tokens and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    @staticmethod
    def _tool_delta(stream: ToolCallStream | None, plan: ToolPlan, text: str,
                    finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        """One stream delta's message part and finish reason, through the choice's parser."""
        if stream is None:
            return (DeltaMessage(content=text) if text else DeltaMessage()), finish_reason
        step = stream.step(text, final=finish_reason is not None)
        calls = [DeltaToolCall.model_validate(c) for c in step.tool_calls]
        delta = DeltaMessage(content=step.content or None, tool_calls=calls or None)
        if finish_reason is not None:
            finish_reason = plan.finish_reason(finish_reason, bool(stream.calls))
        return delta, finish_reason

    async def _chat_full(self, req: ChatCompletionRequest, request_id: str,
                         fanout: RequestFanout, prompts: list[list[int]],
                         plan: ToolPlan,
                         thinking: Callable[[], ReasoningParser] | None = None) -> Response:
        n = len(fanout.runs)
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[ChatTokenLogprob]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        try:
            async for d in fanout.events():
                texts[d.index].append(d.text)
                token_ids[d.index] += d.token_ids
                if req.logprobs and d.token_ids:
                    logprobs[d.index] += self._chat_logprobs(d, req.return_tokens_as_token_ids)
                finish[d.index] = d.finish_reason or finish[d.index]
        except EngineError as e:
            raise engine_error_to_api(e) from None
        if fanout.disconnected:
            return Response(status_code=_CLIENT_CLOSED)
        want_ids = req.return_token_ids
        echo = self._echo_text(req)
        messages = []
        for i in range(n):
            text, stream = "".join(texts[i]), plan.new_stream()
            reasoning = None
            if thinking is not None:
                parser = thinking()
                parser.feed(text, final=True)
                text = parser.content
                reasoning = (parser.reasoning or None) if req.include_reasoning else None
            if stream is None:
                messages.append(AssistantMessage(content=echo + text, reasoning_content=reasoning,
                                                 reasoning=reasoning))
                continue
            stream.step(text, final=True)
            calls = stream.message_tool_calls()
            content = stream.content or (None if calls else "")
            messages.append(AssistantMessage(
                content=echo + content if echo else content,
                tool_calls=[ToolCall.model_validate(c) for c in calls] or None,
                reasoning_content=reasoning, reasoning=reasoning))
            finish[i] = plan.finish_reason(finish[i], bool(calls))
        choices = [ChatCompletionChoice(
            index=i, message=messages[i],
            logprobs=ChatChoiceLogprobs(content=logprobs[i]) if req.logprobs else None,
            finish_reason=finish[i], token_ids=token_ids[i] if want_ids else None)
            for i in range(n)]
        body = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=self._usage(prompts, fanout.runs, req.n),
                                      prompt_token_ids=prompts[0] if want_ids else None,
                                      prompt_logprobs=self._prompt_logprobs_json(
                                          fanout.runs[0].prompt_logprobs))
        return JSONResponse(body.model_dump(mode="json"))

    def _chat_stream(self, req: ChatCompletionRequest, request_id: str,
                     fanout: RequestFanout, prompts: list[list[int]],
                     plan: ToolPlan,
                     thinking: Callable[[], ReasoningParser] | None = None
                     ) -> AsyncIterator[str]:
        created = int(time.time())
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        exclude = None if include_usage else {"usage"}
        want_ids = req.return_token_ids

        def chunk(choice: ChatCompletionStreamChoice,
                  prompt_token_ids: list[int] | None = None, counts: Sequence[int] = ()) -> str:
            usage = None
            if continuous:
                usage = self._usage_of(*(counts or self._usage_counts(prompts, fanout.runs, req.n)))
            c = ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                    choices=[choice], usage=usage,
                                    prompt_token_ids=prompt_token_ids)
            return _sse(c.model_dump_json(exclude=exclude))

        def usage_chunk() -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                    choices=[], usage=self._usage(prompts, fanout.runs, req.n))
            return _sse(c.model_dump_json())

        async def chunks() -> AsyncIterator[str]:
            for run in fanout.runs:
                # vLLM: with return_token_ids the prompt ids ride on the first (role) chunk.
                yield chunk(ChatCompletionStreamChoice(
                    index=run.index, delta=DeltaMessage(role="assistant", content="")),
                    prompt_token_ids=run.prompt_ids if want_ids else None)
            echo = self._echo_text(req)
            if echo:  # vLLM: the echoed message is the first content
                for run in fanout.runs:
                    yield chunk(ChatCompletionStreamChoice(index=run.index,
                                                           delta=DeltaMessage(content=echo)))
            tool_streams = {run.index: plan.new_stream() for run in fanout.runs}
            reasoners = {run.index: thinking() for run in fanout.runs} if thinking else {}
            # chunks of text alone (and the usage, with continuous usage stats), while no
            # parser, logprobs or ids ride on them
            plain: dict[int, _TextChunk | None] = {}
            if not (req.logprobs or want_ids or thinking is not None
                    or any(s is not None for s in tool_streams.values())):
                plain = {run.index: _TextChunk.from_rendering(
                    lambda text, *counts, i=run.index: chunk(ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(content=text)), counts=counts),
                    numbers=4 if continuous else 0)
                    for run in fanout.runs}
            async for d in fanout.events():
                text_chunk = plain.get(d.index)
                if text_chunk is not None and d.finish_reason is None:
                    if d.text:
                        yield text_chunk(d.text, *(self._usage_counts(prompts, fanout.runs, req.n)
                                                   if continuous else ()))
                    continue
                lp = ChatChoiceLogprobs(
                    content=self._chat_logprobs(d, req.return_tokens_as_token_ids)) \
                    if req.logprobs and d.token_ids else None
                text, parts = d.text, []
                if thinking is not None:
                    reasoning, text = reasoners[d.index].feed(
                        d.text, final=d.finish_reason is not None)
                    if reasoning and req.include_reasoning:
                        # reasoning deltas, then content deltas: never both in one chunk
                        parts.append(DeltaMessage(reasoning_content=reasoning,
                                                  reasoning=reasoning))
                delta, finish_reason = self._tool_delta(tool_streams[d.index], plan, text,
                                                        d.finish_reason)
                if delta.content or delta.tool_calls or finish_reason:
                    parts.append(delta)
                if not parts:
                    if not (lp or (want_ids and d.token_ids)):
                        # Tokens whose text is still held back: nothing to send yet (unless
                        # the client wants every token id, as vLLM sends them).
                        continue
                    parts.append(delta)
                for k, part in enumerate(parts):
                    yield chunk(ChatCompletionStreamChoice(
                        index=d.index, delta=part, logprobs=lp if k == 0 else None,
                        finish_reason=finish_reason if k == len(parts) - 1 else None,
                        token_ids=d.token_ids if want_ids and k == 0 else None))

        return self._framed_stream(fanout, chunks(), usage_chunk if include_usage else None)

    # -- /v1/completions -------------------------------------------------------------------
    async def _completion_prompts(self, req: CompletionRequest, max_tokens: int
                                  ) -> tuple[list[list[int]], list[str | None]]:
        """The prompts' token ids (each truncated to ``truncate_prompt_tokens``), and their
        texts as given (None for token ids or a truncated text: ``echo`` decodes those)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            texts_or_ids: list[Any] = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            texts_or_ids = [prompt]
        else:
            texts_or_ids = list(prompt)
        if not texts_or_ids:
            raise bad_request("The prompt cannot be empty.", param="prompt")
        self._check_fanout(len(texts_or_ids), req.n)  # before any prompt is encoded
        prompts: list[list[int]] = []
        texts: list[str | None] = []
        keep = req.truncate_prompt_tokens
        for item in texts_or_ids:
            if isinstance(item, str):
                if not item:
                    raise bad_request("The prompt cannot be empty.", param="prompt")
                ids = await self._encode(item, req.add_special_tokens, "prompt")
                whole = self._truncate(ids, keep)
                texts.append(item if len(whole) == len(ids) else None)
                ids = whole
            else:
                ids = self._truncate(list(item), keep)
                texts.append(None)
                if len(ids) + max_tokens > self.max_model_len:  # before a per-id Python loop
                    raise errors.context_length_exceeded(self.max_model_len, len(ids),
                                                         max_tokens)
                self._check_token_ids(ids, "prompt")
            if not ids:
                raise bad_request("The prompt cannot be empty.", param="prompt")
            prompts.append(ids)
        return prompts, texts

    def _echo_prompts(self, req: CompletionRequest, prompts: list[list[int]],
                      texts: list[str | None]) -> list[str] | None:
        """``echo``: each prompt's text, to put before its choices' text (None: no echo)."""
        if not req.echo:
            return None
        return [t if t is not None else self.tokenizer.decode(
            ids, skip_special_tokens=req.skip_special_tokens) for ids, t in zip(prompts, texts)]

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = await self._parse(CompletionRequest, await request.body())
        self._check_request(req)
        self.check_healthy()
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        prompts, texts = await self._completion_prompts(req, max(max_tokens, 0))
        echo = self._echo_prompts(req, prompts, texts)
        params = self._sampling_params(req, max_tokens, req.logprobs, {})
        for ids in prompts:
            self._check_context(len(ids), max_tokens)

        base, engine_base = self.base_request_id(request, req.request_id)
        request_id = f"cmpl-{base}"
        grammar = await self._compile_grammar(params)
        runs = self._make_runs(f"cmpl-{engine_base}", prompts, params,
                               req.include_stop_str_in_output, arrival, grammar)
        fanout = await self._start(request, runs)
        if fanout is None:
            return Response(status_code=_CLIENT_CLOSED)
        if req.stream:
            return _SSEResponse(self._completion_stream(req, request_id, fanout, prompts, echo),
                                fanout.close)
        return await self._completion_full(req, request_id, fanout, prompts, echo)

    async def _completion_full(self, req: CompletionRequest, request_id: str,
                               fanout: RequestFanout, prompts: list[list[int]],
                               echo: list[str] | None = None) -> Response:
        n = len(fanout.runs)
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs = [CompletionLogprobs() for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        offsets = [0] * n
        finish: list[str | None] = [None] * n
        echo_logprobs = req.echo and req.logprobs is not None
        try:
            async for d in fanout.events():
                texts[d.index].append(d.text)
                token_ids[d.index] += d.token_ids
                if echo_logprobs and d.token_ids and not logprobs[d.index].tokens:
                    # the prompt's logprobs lead the answer's (they came with its first token)
                    run = fanout.runs[d.index]
                    logprobs[d.index], offsets[d.index] = self._echo_logprobs(
                        run.prompt_ids, run.prompt_logprobs, req.logprobs or 0,
                        req.return_tokens_as_token_ids)
                if req.logprobs is not None and d.token_ids:
                    part, offsets[d.index] = self._completion_logprobs(
                        d, offsets[d.index], req.return_tokens_as_token_ids)
                    acc = logprobs[d.index]
                    acc.tokens += part.tokens
                    acc.token_logprobs += part.token_logprobs
                    acc.top_logprobs += part.top_logprobs
                    acc.text_offset += part.text_offset
                finish[d.index] = d.finish_reason or finish[d.index]
        except EngineError as e:
            raise engine_error_to_api(e) from None
        if fanout.disconnected:
            return Response(status_code=_CLIENT_CLOSED)
        want_ids = req.return_token_ids
        per_prompt = max(req.n, 1)
        choices = [CompletionChoice(
            index=i, text=(echo[i // per_prompt] if echo else "") + "".join(texts[i]),
            logprobs=logprobs[i] if req.logprobs is not None else None,
            finish_reason=finish[i],
            prompt_token_ids=fanout.runs[i].prompt_ids if want_ids else None,
            token_ids=token_ids[i] if want_ids else None,
            prompt_logprobs=self._prompt_logprobs_json(fanout.runs[i].prompt_logprobs))
            for i in range(n)]
        body = CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=self._usage(prompts, fanout.runs, req.n))
        return JSONResponse(body.model_dump(mode="json"))

    def _completion_stream(self, req: CompletionRequest, request_id: str,
                           fanout: RequestFanout, prompts: list[list[int]],
                           echo: list[str] | None = None) -> AsyncIterator[str]:
        created = int(time.time())
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        exclude = None if include_usage else {"usage"}
        offsets = [0] * len(fanout.runs)
        want_ids = req.return_token_ids
        prompt_sent = [False] * len(fanout.runs)  # vLLM: prompt ids on a choice's first chunk
        echo_sent = [not echo] * len(fanout.runs)  # echo: the prompt text leads the first chunk
        per_prompt = max(req.n, 1)

        def chunk(choice: CompletionChoice, usage: UsageInfo | None = None) -> str:
            c = CompletionResponse(id=request_id, created=created, model=self.model_name,
                                   usage=usage, choices=[choice])
            return _sse(c.model_dump_json(exclude=exclude))

        def usage_chunk() -> str:
            c = CompletionResponse(id=request_id, created=created, model=self.model_name,
                                   choices=[], usage=self._usage(prompts, fanout.runs, req.n))
            return _sse(c.model_dump_json())

        # chunks of text alone (and the usage, with continuous usage stats), while no logprobs
        # or ids ride on them
        plain: dict[int, _TextChunk | None] = {}
        if not (req.logprobs is not None or want_ids):
            plain = {run.index: _TextChunk.from_rendering(
                lambda text, *counts, i=run.index: chunk(CompletionChoice(index=i, text=text),
                                                         self._usage_of(*counts) if counts else None),
                numbers=4 if continuous else 0)
                for run in fanout.runs}

        async def chunks() -> AsyncIterator[str]:
            async for d in fanout.events():
                text_chunk = plain.get(d.index)
                if text_chunk is not None and echo_sent[d.index] and d.finish_reason is None:
                    if d.text:
                        yield text_chunk(d.text, *(self._usage_counts(prompts, fanout.runs, req.n)
                                                   if continuous else ()))
                    continue
                lp = None
                if req.logprobs is not None and d.token_ids:
                    lp, offsets[d.index] = self._completion_logprobs(
                        d, offsets[d.index], req.return_tokens_as_token_ids)
                text = d.text
                if not echo_sent[d.index]:
                    assert echo is not None
                    echo_sent[d.index] = True
                    text = echo[d.index // per_prompt] + text
                    if req.logprobs is not None:  # the prompt's logprobs lead the answer's
                        run = fanout.runs[d.index]
                        head, end = self._echo_logprobs(run.prompt_ids, run.prompt_logprobs,
                                                        req.logprobs, req.return_tokens_as_token_ids)
                        if lp is not None:
                            head.tokens += lp.tokens
                            head.token_logprobs += lp.token_logprobs
                            head.top_logprobs += lp.top_logprobs
                            head.text_offset += [o + end for o in lp.text_offset]
                        offsets[d.index] += end
                        lp = head
                if not (text or d.finish_reason or lp or (want_ids and d.token_ids)):
                    continue  # tokens whose text is still held back: nothing to send yet
                usage = self._usage(prompts, fanout.runs, req.n) if continuous else None
                prompt_ids = None
                if want_ids and not prompt_sent[d.index]:
                    prompt_sent[d.index] = True
                    prompt_ids = fanout.runs[d.index].prompt_ids
                yield chunk(CompletionChoice(
                    index=d.index, text=text, logprobs=lp, finish_reason=d.finish_reason,
                    prompt_token_ids=prompt_ids, token_ids=d.token_ids if want_ids else None),
                    usage)

        return self._framed_stream(fanout, chunks(), usage_chunk if include_usage else None)

    @staticmethod
    async def _framed_stream(fanout: RequestFanout, chunks: AsyncIterator[str],
                             usage_chunk: Callable[[], str] | None) -> AsyncIterator[str]:
        """The SSE framing both endpoints share: the choice chunks, then (unless the client
        left) the usage-only chunk, an engine error as an error event, and ``[DONE]``; the
        fan-out is closed (its engine requests aborted) however the stream ends."""
        try:
            async for item in chunks:
                yield item
            if fanout.disconnected:
                return
            if usage_chunk is not None:
                yield usage_chunk()
        except EngineError as e:
            yield _sse(json.dumps(engine_error_to_api(e).body()))
        except Exception as e:  # headers are out: report it in the stream, end it cleanly
            logger.exception("unexpected error while streaming a response")
            yield _sse(json.dumps(errors.internal_error(
                f"Internal server error: {type(e).__name__}").body()))
        finally:
            await fanout.close()
        yield "data: [DONE]\n\n"

    # -- /tokenize, /detokenize --------------------------------------------------------------
    async def tokenize(self, request: Request) -> TokenizeResponse:
        body = await request.body()
        parsed = await self._parse(_tokenize_request, body)
        if isinstance(parsed, TokenizeChatRequest):
            chat = parsed
            self.check_model(chat.model)
            if not chat.messages:
                raise bad_request("messages must contain at least one message.",
                                  param="messages")
            ids = await self._encode_chat(
                chat.messages,
                add_special_tokens=chat.add_special_tokens,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tools=await self._off_loop(validate_tools, chat.tools) if chat.tools else None,
                chat_template_kwargs=chat.chat_template_kwargs,
                chat_template=chat.chat_template)
            want_strs, param = chat.return_token_strs, "messages"
        else:
            plain = parsed
            self.check_model(plain.model)
            ids = await self._encode(plain.prompt, plain.add_special_tokens, "prompt")
            want_strs, param = plain.return_token_strs, "prompt"
        if len(ids) > self.max_model_len:
            # What no request could use is not returned either (it could be millions of ids).
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, the prompt has {len(ids)} tokens. /tokenize returns at most "
                f"{self.max_model_len} tokens; please reduce the length of the prompt.",
                param=param, code="context_length_exceeded")
        strs = [self.tokenizer.id_to_token(t) or "" for t in ids] if want_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        req = await self._parse(DetokenizeRequest, await request.body())
        self.check_model(req.model)
        if len(req.tokens) > self.max_model_len:
            raise bad_request(
                f"/detokenize takes at most {self.max_model_len} tokens (the model's maximum "
                f"context length), got {len(req.tokens)}.", param="tokens")
        self._check_token_ids(req.tokens, "tokens")
        if len(req.tokens) <= INLINE_ENCODE_CHARS:
            return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
        return DetokenizeResponse(prompt=await self._off_loop(self.tokenizer.decode, req.tokens))
