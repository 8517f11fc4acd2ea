"""One choice of a completion: an engine request turned into text deltas.

:class:`ChoiceRun` owns everything per choice: the engine stream, the incremental detokenizer,
the stop-string matcher, token accounting and latency metrics. It aborts the engine request
when it ends early (stop string matched, client gone, error), so no engine slot is left
generating for nobody.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio

from blink.dpu.engine_client import EngineClient, EngineError, EngineOutput
from blink.dpu.metrics import FrontendMetrics
from blink.dpu.output_processor import ChoiceText
from blink.dpu.structured.workers import CompiledGrammar
from blink.dpu.tokenizer import Tokenizer
from blink.shared.sampling_params import SamplingParams


class EngineRequestError(EngineError):
    """The engine ended a request with finish_reason "error" (or ended it without output)."""


class FinalCheckError(EngineRequestError):
    """A structured output finished ``stop`` but fails its JSON schema's final check (a keyword
    the grammar cannot enforce): the choice fails like an engine error, never a plain
    ``stop`` (docs/architecture.md, "Structured outputs")."""


@dataclass
class ChoiceDelta:
    """What one engine delta contributes to a choice (the ``token_ids`` are those counted as
    completion tokens; tokens past a matched stop string are dropped)."""

    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None


class ChoiceRun:
    """Drive one engine request (one choice): :meth:`start`, then iterate :meth:`deltas`."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, metrics: FrontendMetrics, *,
                 request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                 include_stop_str_in_output: bool = False, arrival_time: float | None = None,
                 grammar: CompiledGrammar | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_id = request_id
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.grammar = grammar  # the compiled structured-output constraint, if any
        self.include_stop_str_in_output = include_stop_str_in_output
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._text = ChoiceText(tokenizer, prompt_ids, params, include_stop_str_in_output,
                                final_check=grammar is not None and grammar.needs_final_check)
        self._stream: AsyncIterator[EngineOutput] | None = None
        self._first: EngineOutput | None = None
        self._last_token_time: float | None = None
        self._first_token_time: float | None = None
        self._admitted_at: float | None = None  # the engine's admission, in monotonic time
        self.num_cached_tokens = 0
        #: the prompt's logprobs (EngineOutput.prompt_logprobs), once the first token came
        self.prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
        self.engine_finished = False  # the engine side is done (no abort needed)

    @property
    def completion_tokens(self) -> int:
        return self._text.completion_tokens

    @property
    def finish_reason(self) -> str | None:
        return self._text.finish_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def start(self) -> None:
        """Submit the request and wait for its first delta.

        Raises :class:`EngineOverloadedError` / :class:`EngineDeadError` from the engine, so a
        streaming response can still answer 503 before its headers are sent.
        """
        if self.grammar is not None:
            self._stream = self.engine.generate(self.request_id, self.prompt_ids, self.params,
                                                grammar=self.grammar)
        else:
            self._stream = self.engine.generate(self.request_id, self.prompt_ids, self.params)
        try:
            self._first = await self._stream.__anext__()
        except StopAsyncIteration:
            self.engine_finished = True
            raise EngineRequestError(
                f"the engine ended request {self.request_id} without any output") from None
        except EngineError:
            self.engine_finished = True  # not admitted (full) or the engine is gone: no abort
            raise

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Text deltas until the choice finishes; aborts the engine request if cut short."""
        if self._stream is None or self._first is None:
            raise RuntimeError("start() must complete before deltas()")
        try:
            out: EngineOutput | None = self._first
            self._first = None
            while out is not None:
                delta = self._process(out)
                if self._text.needs_final_check:
                    await self._final_check()  # raises FinalCheckError if the output fails
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield delta
                if self.finished:
                    return
                try:
                    out = await self._stream.__anext__()
                except StopAsyncIteration:
                    self.engine_finished = True
                    raise EngineRequestError(
                        f"the engine stream of {self.request_id} ended before it finished"
                    ) from None
        finally:
            await self.close()

    async def _final_check(self) -> None:
        """Validate the finished output against its original schema (in a worker process,
        bounded; awaited in a thread so the event loop goes on)."""
        assert self.grammar is not None
        problem = await anyio.to_thread.run_sync(self.grammar.check_output, self._text.text)
        self._text.final_check_done(problem)
        self._observe_finished(time.monotonic())
        if problem is not None:
            raise FinalCheckError(f"choice {self.index}: {problem}")

    async def close(self) -> None:
        """Abort the engine request unless the engine already finished it. Idempotent."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        # Shielded: this runs while the task is being cancelled (client disconnect), and the
        # abort must still reach the engine.
        with anyio.CancelScope(shield=True):
            if not self.engine_finished:
                self.engine_finished = True
                await self.engine.abort(self.request_id)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def _observe_timing(self, n_tokens: int, now: float) -> None:
        if self._last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival_time)
            self._first_token_time = now
        else:
            # Tokens read together (the frontend polls the ring) share the wait equally.
            gap = (now - self._last_token_time) / n_tokens
            for _ in range(n_tokens):
                self.metrics.itl.observe(gap)
                self.metrics.tpot.observe(gap)
        self._last_token_time = now

    def _observe_finished(self, now: float) -> None:
        """The per-request series (vLLM's): token counts, parameters and phase times."""
        m = self.metrics
        generated = self.completion_tokens
        m.prompt_tokens.inc(len(self.prompt_ids))
        m.prompt_tokens_cached.inc(self.num_cached_tokens)
        m.e2e.observe(now - self.arrival_time)
        m.request_prompt_tokens.observe(len(self.prompt_ids))
        m.request_generation_tokens.observe(generated)
        m.request_max_generation_tokens.observe(generated)
        if self.params.max_tokens is not None:
            m.params_max_tokens.observe(self.params.max_tokens)
        first = self._first_token_time
        if self._admitted_at is not None:
            m.inference_time.observe(now - self._admitted_at)
            if first is not None:
                m.prefill_time.observe(max(0.0, first - self._admitted_at))
        if first is not None:
            m.decode_time.observe(now - first)
            if generated > 1:
                m.request_tpot.observe((now - first) / (generated - 1))
        self.metrics.request_finished(self.finish_reason or "stop")

    def _process(self, out: EngineOutput) -> ChoiceDelta:
        now = time.monotonic()
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.queue_time_s is not None:
            self.metrics.queue_time.observe(out.queue_time_s)
        if out.admitted_at is not None:
            self._admitted_at = out.admitted_at
        if out.token_ids:
            self._observe_timing(len(out.token_ids), now)
        if out.finished and out.finish_reason == "error":
            self.engine_finished = True
            raise EngineRequestError(out.error or f"the engine failed request {self.request_id}")

        delta = self._text.feed(out.token_ids, out.finished, out.finish_reason)
        kept = delta.kept
        if out.finished:
            self.engine_finished = True

        self.metrics.generation_tokens.inc(kept)
        if self.finished and not self._text.needs_final_check:  # else after the check
            self._observe_finished(now)
        return ChoiceDelta(
            index=self.index, text=delta.text, token_ids=out.token_ids[:kept],
            logprobs=out.logprobs[:kept] if out.logprobs is not None else None,
            top_logprobs=out.top_logprobs[:kept] if out.top_logprobs is not None else None,
            finish_reason=self.finish_reason,
        )
