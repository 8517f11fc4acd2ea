"""OpenAI API request/response models (chat completions, completions, models) and vLLM's
``/tokenize`` / ``/detokenize``.

Known fields are strict: a wrong JSON type is a 400, as with OpenAI. Unknown fields are
ignored, as vLLM does (clients written for vLLM or other servers send extras such as
``cache_prompt``): validation collects their names and :func:`blink.dpu.serving.parse_request`
logs one warning per request naming them ("The following fields were present in the request
but ignored: ..."). vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ...) and ``return_token_ids`` are
implemented, and so are ``tools`` / ``tool_choice`` (:mod:`blink.dpu.tool_calling`).
Parameters OpenAI or vLLM define but this server does not implement (``functions``,
``priority``, ``logits_processors``, ...) are declared as fields so that a request that sets
them gets a clear "not supported" error naming them instead of being silently ignored
(``tests/test_vllm_request_fields.py`` walks vLLM's field lists, ``tests/fixtures/
vllm_request_fields.json``).
Numeric ranges are checked by :class:`blink.shared.sampling_params.SamplingParams`.
"""
from __future__ import annotations

import logging
import time
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

logger = logging.getLogger(__name__)

#: Most messages one chat request may carry: far above real conversations, and it keeps
#: validating one request well under a second.
MAX_MESSAGES = 1 << 14
#: Most prompts one completions request may batch (the engine's slots bound it further).
MAX_PROMPTS = 1 << 12

#: Key of the validation ``context`` dict under which request models append the names of the
#: fields they ignored (a list); without it they log the warning themselves.
IGNORED_FIELDS = "ignored_fields"


#: vLLM request fields the engine implements (SamplingParams carries them and
#: ``blink.dpu.serving`` passes them on): ``prompt_logprobs``, ``allowed_token_ids``,
#: ``bad_words``, ``cache_salt``. Until a name is listed here a request that sets it is refused
#: with a 400 naming it (never accepted and ignored); whoever wires one adds its name.
#: ``prompt_logprobs`` also needs an engine whose ring has prompt-logprob lanes (the serving
#: layer refuses it by name otherwise: ``OpenAIServing.prompt_logprob_lanes``).
ENGINE_FIELDS: frozenset[str] = frozenset({"allowed_token_ids", "bad_words", "cache_salt",
                                           "prompt_logprobs"})


def ignored_fields_warning(names: list[str]) -> str:
    """vLLM's wording for the fields a request carried but the server ignored."""
    return ("The following fields were present in the request but ignored: {"
            + ", ".join(repr(n) for n in sorted(set(names))) + "}")


class _Request(BaseModel):
    # Unknown fields are dropped (vLLM's policy); known fields keep strict types.
    model_config = ConfigDict(strict=True, extra="ignore")
    #: How this model's fields are named in a request (for nested models' warnings).
    _ignored_prefix: ClassVar[str] = ""

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler,
                             info: ValidationInfo) -> Any:
        result = handler(data)  # only a request that validates gets here
        if isinstance(data, dict):
            ignored = [cls._ignored_prefix + str(k) for k in data if k not in cls.model_fields]
            if ignored:
                sink = info.context.get(IGNORED_FIELDS) if isinstance(info.context, dict) \
                    else None
                if isinstance(sink, list):
                    sink.extend(ignored)
                else:
                    logger.warning("%s", ignored_fields_warning(ignored))
        return result

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI treats an explicit null as "not given"; many clients send them.
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].default is None}
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _TokenIdsResponse(_Response):
    """A response part with vLLM's ``return_token_ids`` fields, which are left out of the JSON
    unless set (so a request that does not ask for them gets plain OpenAI shapes)."""

    @model_serializer(mode="wrap")
    def _drop_unset_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in ("prompt_token_ids", "token_ids", "prompt_logprobs"):
            if key in out and out[key] is None:
                del out[key]
        return out


class StreamOptions(_Request):
    _ignored_prefix: ClassVar[str] = "stream_options."
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class ChatMessage(BaseModel):
    """An input message. Extra keys (``tool_calls``, ``reasoning_content``, ...) go to the
    template untouched; content parts are checked when the template is rendered."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _SamplingFields(_Request):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM: prompt_token_ids and the generated token_ids in the response
    return_token_ids: bool = False
    # accepted and ignored: bookkeeping that does not change the answer
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extras honoured by the frontend
    echo: bool = False
    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens (-1: the context)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    spaces_between_special_tokens: bool = True  # see docs/vllm-migration.md
    request_id: str | None = None  # the answer's id (after the X-Request-Id header, as vLLM)
    guided_decoding_backend: str | None = None  # only llguidance's names (auto, guidance)
    # vLLM extras refused unless they keep their default (see unsupported())
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0
    # engine-side fields: honoured once listed in ENGINE_FIELDS (allowed_token_ids: a sampler
    # mask; cache_salt: prefix-cache isolation; prompt_logprobs: the engine's prompt-logprob
    # lanes), refused by name until then (see unsupported())
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    cache_salt: str | None = None
    # structured outputs (blink.dpu.structured.request turns these into one constraint)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # a Lark or GBNF/EBNF grammar
    guided_whitespace_pattern: str | None = None  # JSON whitespace (with guided_json)
    structural_tag: Any = None  # earlier vLLM's; refused (see unsupported())

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for the first set parameter this server cannot honour."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of different from n is not supported"
        if self.use_beam_search:
            return "use_beam_search", "beam search is not supported"
        if self.length_penalty != 1.0:
            return "length_penalty", ("length_penalty only applies to beam search, which is "
                                      "not supported")
        if self.priority != 0:
            return "priority", ("priority scheduling is not enabled on this server (vLLM "
                                "answers the same without --scheduling-policy priority); "
                                "send priority 0 or leave it out")
        if self.logits_processors:
            return "logits_processors", ("logits_processors are not supported: Blink runs no "
                                         "code named by a request")
        if self.vllm_xargs:
            return "vllm_xargs", "vllm_xargs are not supported: Blink has no request extensions"
        if self.kv_transfer_params:
            return "kv_transfer_params", ("kv_transfer_params are not supported: Blink's "
                                          "disaggregated serving is its own router (blink serve "
                                          "--role), not vLLM's KV connectors")
        if self.mm_processor_kwargs:
            return "mm_processor_kwargs", ("mm_processor_kwargs are not supported: Blink serves "
                                           "text-only models")
        for name in ("max_repetition_pattern_size", "min_repetition_pattern_size",
                     "repetition_min_count"):
            if getattr(self, name):
                return name, f"{name} (repetition-pattern stopping) is not supported"
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in (
                "auto", "guidance", "llguidance"):
            return "guided_decoding_backend", (
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: "
                f"Blink's structured outputs run on llguidance ('auto' or 'guidance')")
        if self.truncate_prompt_tokens is not None and (
                self.truncate_prompt_tokens < -1 or self.truncate_prompt_tokens == 0):
            return "truncate_prompt_tokens", ("truncate_prompt_tokens must be -1 (the model's "
                                              "context) or a positive number of tokens")
        if self.structural_tag is not None:
            return "structural_tag", "structural tags are not supported"
        if self.prompt_logprobs is not None and not self._engine_field("prompt_logprobs"):
            return "prompt_logprobs", "prompt_logprobs are not supported yet"
        if self.allowed_token_ids is not None and not self._engine_field("allowed_token_ids"):
            return "allowed_token_ids", "allowed_token_ids is not supported yet"
        if self.cache_salt is not None and not self._engine_field("cache_salt"):
            return "cache_salt", "cache_salt is not supported yet"
        return None

    @staticmethod
    def _engine_field(name: str) -> bool:
        """Whether the engine-side field ``name`` is wired end to end (:data:`ENGINE_FIELDS`);
        until it is, a request setting it is refused by name."""
        return name in ENGINE_FIELDS


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    # vLLM extras for templates
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # tool calling (blink.dpu.tool_calling checks tools and tool_choice)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated form of tools: refused (see unsupported())
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # to the chat template
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the reasoning out
    bad_words: list[str] | None = None  # engine-side: a sampler mask (vLLM: chat requests)

    def unsupported(self) -> tuple[str, str] | None:
        base = super().unsupported()
        if base:
            return base
        if self.functions:
            return "functions", "'functions' is deprecated and not supported; use 'tools'"
        if self.function_call not in (None, "none"):
            return "function_call", ("'function_call' is deprecated and not supported; use "
                                     "'tool_choice'")
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", "only the 'text' modality is supported"
        if self.audio is not None:
            return "audio", "audio output is not supported"
        if self.prediction is not None:
            return "prediction", "predicted outputs are not supported"
        if self.bad_words and not self._engine_field("bad_words"):
            return "bad_words", "bad_words is not supported yet"
        if self.add_generation_prompt and self.continue_final_message:
            return ("continue_final_message",
                    "continue_final_message requires add_generation_prompt=false")
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None  # refused: Blink takes text or token ids

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_batch(cls, value: Any) -> Any:
        # Before the union tries its branches on every item (~2 µs per item, GIL held).
        if isinstance(value, list) and len(value) > MAX_PROMPTS and \
                isinstance(value[0], (str, list)):
            raise ValueError(f"a request can batch at most {MAX_PROMPTS} prompts, "
                             f"got {len(value)}")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        base = super().unsupported()
        if base:
            return base
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.prompt_embeds is not None:
            return "prompt_embeds", "prompt_embeds are not supported: send text or token ids"
        return None

    def effective_prompt_logprobs(self) -> int | None:
        """vLLM's rule: ``echo`` with ``logprobs`` asks for the prompt's logprobs too (they
        lead the answer's), ``prompt_logprobs`` unless given is then ``logprobs``."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs


# -- responses ---------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when there are none
    # with --reasoning-parser: the model's thinking, under both of vLLM's names (recent vLLM
    # says "reasoning", earlier releases and most clients "reasoning_content"); left out
    # of the JSON without a parser
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in ("tool_calls", "reasoning_content", "reasoning"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatCompletionChoice(_TokenIdsResponse):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM, with return_token_ids: the generated ids


class PromptLogprob(_Response):
    """One entry of vLLM's ``prompt_logprobs``: a token's logprob at a prompt position, its
    rank (1 = the likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's ``prompt_logprobs``: None for the first prompt token, then per position the prompt
#: token and the top N, keyed by token id (a string in JSON)
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatCompletionResponse(_TokenIdsResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # vLLM, with prompt_logprobs


class DeltaFunctionCall(_Response):
    """``name`` only in a call's first delta; then ``arguments`` fragments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(_Response):
    """One tool call's part of a stream delta: ``index`` always; ``id`` and ``type`` in the
    call's first delta only (as OpenAI streams them)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(_Response):
    """A streamed message delta; unset fields are left out (``{}`` for the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser (also as "reasoning")
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(_TokenIdsResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM, with return_token_ids: this chunk's new ids


class ChatCompletionChunk(_TokenIdsResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids: first chunk only


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_TokenIdsResponse):
    """A completion choice, also used for streamed chunks. With ``return_token_ids`` (vLLM)
    ``prompt_token_ids`` is set on it (on a stream's first chunk of that choice only) and
    ``token_ids`` holds the generated ids (a chunk's new ids when streaming)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM, with prompt_logprobs (not streamed)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "blink"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's tokenizer endpoints ------------------------------------------------------------
class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
