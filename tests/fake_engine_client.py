"""A deterministic in-process :class:`EngineClient` for the frontend's tests (a test double:
it lives with the tests, not in the product; tests import it as ``fake_engine_client``).

It produces a scripted token stream per request (by default it echoes the prompt), honours
``max_tokens``, ``min_tokens`` and ``stop_token_ids`` like the real engine, and can be made
slow, "full" (every submit raises :class:`EngineOverloadedError`), "stalled" (unhealthy, but
new requests are taken and every stream just waits until :meth:`FakeEngineClient.resume`, like
the ring client during a slow engine step) or "dead" (new and in-flight requests raise
:class:`EngineDeadError`).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Sequence

from blink.dpu.engine_client import (
    EngineDeadError,
    EngineOutput,
    EngineOverloadedError,
    EngineStats,
)
from blink.shared.sampling_params import SamplingParams

#: Given (prompt ids, params), the tokens the fake engine will "generate", in order. When the
#: script runs out before ``max_tokens`` the request finishes with "stop" (as if EOS).
Responder = Callable[[list[int], SamplingParams], Sequence[int]]


def echo_responder(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Default script: repeat the prompt, forever (so ``max_tokens`` decides the length)."""
    if not prompt_ids:
        return []
    reps = (params.max_tokens or len(prompt_ids)) // len(prompt_ids) + 1
    return list(prompt_ids) * reps


class FakeEngineClient:
    """Scripted engine; see the module docstring. All knobs are plain attributes."""

    def __init__(
        self,
        *,
        model_name: str = "fake-model",
        max_model_len: int = 2048,
        responder: Responder = echo_responder,
        first_token_delay_s: float = 0.0,
        token_delay_s: float = 0.0,
        tokens_per_delta: int = 1,
        num_cached_tokens: int = 0,
        queue_time_s: float | None = None,
        vocab_size: int = 50_000,
        retry_after_s: float = 2.0,
    ) -> None:
        if tokens_per_delta < 1:
            raise ValueError(f"tokens_per_delta must be >= 1, got {tokens_per_delta}")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.responder = responder
        self.first_token_delay_s = first_token_delay_s
        self.token_delay_s = token_delay_s
        self.tokens_per_delta = tokens_per_delta
        self.num_cached_tokens = num_cached_tokens
        self.queue_time_s = queue_time_s
        self.vocab_size = vocab_size
        self.retry_after_s = retry_after_s
        #: as the ring's: requests with prompt_logprobs are taken (0: the serving layer refuses)
        self.prompt_logprob_lanes = 2
        self.full = False  # every submit raises EngineOverloadedError while set
        self.dead = False  # heartbeat stopped for good while set
        self.stalled = False  # heartbeat stale while set: unhealthy, streams wait
        #: request id -> (prompt ids, params), in submission order
        self.submitted: dict[str, tuple[list[int], SamplingParams]] = {}
        self.grammars: dict[str, Any] = {}  # request id -> the compiled grammar it came with
        self.aborted: list[str] = []
        self.finished: dict[str, str] = {}  # request id -> finish reason
        self.running: set[str] = set()
        self.kv_usage = 0.0
        self.preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    # -- failure injection -------------------------------------------------------------
    def die(self) -> None:
        """Stop the heartbeat: in-flight streams raise at their next step, new ones at submit."""
        self.dead = True

    def revive(self) -> None:
        self.dead = False

    def stall(self) -> None:
        """A slow step: unhealthy, new requests still taken, every stream waits for resume()."""
        self.stalled = True

    def resume(self) -> None:
        self.stalled = False

    # -- EngineClient --------------------------------------------------------------------
    def is_healthy(self) -> bool:
        return not self.dead and not self.stalled

    def is_accepting(self) -> bool:
        return not self.dead

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       grammar: Any = None) -> AsyncIterator[EngineOutput]:
        # A compiled structured-output grammar is recorded, not enforced (a test double).
        self.grammars[request_id] = grammar
        if self.dead:
            raise EngineDeadError()
        if self.full:
            raise EngineOverloadedError(retry_after_s=self.retry_after_s)
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already running")
        if params.n != 1:
            raise ValueError(f"the engine takes one sequence per request, got n={params.n}")
        self.submitted[request_id] = (list(prompt_ids), params)
        self.running.add(request_id)
        cached = min(self.num_cached_tokens, len(prompt_ids))
        self._prefix_queries += len(prompt_ids)
        self._prefix_hits += cached
        script = list(self.responder(list(prompt_ids), params))
        # As the ring client: admitted queue_time_s after the submission (now), on its clock.
        admitted_at = None if self.queue_time_s is None else time.monotonic() + self.queue_time_s
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt_ids))
        stop_ids = set(params.stop_token_ids)
        try:
            produced = 0
            first = True
            while True:
                await asyncio.sleep(self.first_token_delay_s if first else self.token_delay_s)
                while self.stalled and not self.dead:
                    await asyncio.sleep(0.005)
                if self.dead:
                    raise EngineDeadError()
                if request_id in self.aborted:
                    self.finished[request_id] = "abort"
                    yield self._output([], params, True, "abort", len(prompt_ids), cached, first,
                                       admitted_at)
                    return
                tokens: list[int] = []
                reason: str | None = None
                while len(tokens) < self.tokens_per_delta:
                    if produced >= len(script):
                        reason = "stop"  # script exhausted: as if the model emitted EOS
                        break
                    token = script[produced]
                    tokens.append(token)
                    produced += 1
                    if token in stop_ids and produced > params.min_tokens:
                        reason = "stop"
                        break
                    if produced >= max_tokens:
                        reason = "length"
                        break
                if reason is not None:
                    self.finished[request_id] = reason
                out = self._output(tokens, params, reason is not None, reason,
                                   len(prompt_ids), cached, first, admitted_at)
                if first and tokens and params.prompt_logprobs is not None:
                    out.prompt_logprobs = self._prompt_logprobs(list(prompt_ids),
                                                                params.prompt_logprobs)
                yield out
                first = False
                if reason is not None:
                    return
        finally:
            self.running.discard(request_id)

    def _output(self, tokens: list[int], params: SamplingParams, finished: bool,
                reason: str | None, n_prompt: int, cached: int, first: bool,
                admitted_at: float | None = None) -> EngineOutput:
        logprobs = top = None
        if params.logprobs is not None:
            # Deterministic, plausible-looking values: a distinct negative number per token.
            logprobs = [-((t % 7) + 1) / 8.0 for t in tokens]
            top = [
                [(t, lp)] + [((t + k + 1) % self.vocab_size, lp - k - 1.0)
                             for k in range(params.logprobs - 1)]
                for t, lp in zip(tokens, logprobs)
            ]
            top = [row[: params.logprobs] for row in top]
        return EngineOutput(
            token_ids=tokens, logprobs=logprobs, top_logprobs=top, finished=finished,
            finish_reason=reason,  # type: ignore[arg-type]
            num_prompt_tokens=n_prompt, num_cached_tokens=cached,
            queue_time_s=self.queue_time_s if first else None,
            admitted_at=admitted_at if first else None,
        )

    def _prompt_logprobs(self, prompt: list[int], top: int
                         ) -> list[dict[int, tuple[float, int]] | None]:
        """As the ring client returns them: None first, then per position the prompt token
        (logprob -(i % 5) - 0.5, rank i % 3 + 1) and ``top`` alternatives (ids after it)."""
        out: list[dict[int, tuple[float, int]] | None] = [None]
        for i, t in enumerate(prompt[1:], 1):
            entry = {t: (-(i % 5) - 0.5, i % 3 + 1)}
            for k in range(top):
                entry.setdefault((t + k + 1) % self.vocab_size, (-0.25 * (k + 1), k + 1))
            out.append(entry)
        return out

    async def abort(self, request_id: str) -> None:
        if request_id not in self.aborted:
            self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.running), waiting=0, kv_usage=self.kv_usage,
            prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
            preemptions=self.preemptions,
        )
