"""The frontend's view of the engine: one small async interface, whatever carries the bytes.

The HTTP layer (:mod:`blink.dpu.app`) talks only to an :class:`EngineClient`. The production
implementation writes requests into the ring and polls the output streams
(:mod:`blink.dpu.ring_engine_client`); ``tests/fake_engine_client.py`` stands in for it in
tests. Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Literal, NotRequired, Protocol, TypedDict, runtime_checkable

from blink.shared.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]

#: Seconds without a heartbeat move, with requests in flight, before the engine counts as
#: stalled: ``/health`` answers 503, but in-flight requests keep waiting.
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
#: Seconds without a heartbeat move, with requests in flight, before they are given up:
#: each ends with :class:`EngineDeadError` (the hard limit; a slow step must stay under it).
DEFAULT_ENGINE_DEAD_TIMEOUT_S = 60.0


def check_engine_timeouts(heartbeat_timeout_s: float, engine_dead_timeout_s: float) -> None:
    """Raise ``ValueError`` unless 0 < heartbeat timeout <= engine-dead timeout."""
    if not heartbeat_timeout_s > 0:
        raise ValueError(f"the heartbeat timeout must be positive, got {heartbeat_timeout_s:g} s")
    if not engine_dead_timeout_s >= heartbeat_timeout_s:
        raise ValueError(
            f"the engine-dead timeout ({engine_dead_timeout_s:g} s) must be at least the heartbeat "
            f"timeout ({heartbeat_timeout_s:g} s)"
        )


class EngineError(Exception):
    """Base class of the errors an :class:`EngineClient` raises to the HTTP layer."""


class EngineOverloadedError(EngineError):
    """No request slot / prompt-arena space became free within the bounded wait.

    The HTTP layer answers 503 with a ``Retry-After`` header of ``retry_after_s`` seconds.
    """

    def __init__(self, message: str = "The engine is overloaded; retry later.",
                 retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine is gone (state FAILED/STOPPED, process exited) or has not moved its heartbeat
    for the hard limit: no request can make progress."""

    def __init__(self, message: str = "The engine is not responding (heartbeat stale).",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        #: set while the engine is being restarted: the HTTP layer adds ``Retry-After``
        self.retry_after_s = retry_after_s


@dataclass
class EngineOutput:
    """One delta of a request's output stream: the tokens produced since the previous delta.

    ``logprobs[i]`` is the logprob of ``token_ids[i]``; ``top_logprobs[i]`` lists the
    ``SamplingParams.logprobs`` most likely (token id, logprob) pairs at that position. Both are
    ``None`` unless the request asked for logprobs. ``num_prompt_tokens`` and
    ``num_cached_tokens`` (prompt tokens served from the prefix cache) are repeated on every
    delta, so a consumer can read them from whichever it sees first.

    ``queue_time_s`` (optional): seconds the request waited between being written to the ring
    and being admitted by the scheduler. The ring client measures it from the engine: the
    request's ``admitted_step`` stamp, placed in time by the engine's step clock
    (:mod:`blink.dpu.step_clock`). ``admitted_at`` is that admission in ``time.monotonic()``
    terms. Both are set on the first delta only and feed ``blink:request_queue_time_seconds``
    and the prefill / decode / inference-time histograms.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    admitted_at: float | None = None
    #: a KV reservation's first delta (decode role, docs/disaggregation.md): (slot, seq,
    #: reserved block ids); None otherwise
    kv_reservation: tuple[int, int, list[int]] | None = None
    #: finish_reason "error": what went wrong, when the ring client knows (a structured-output
    #: matcher's error, a mask that never reached the engine)
    error: str | None = None
    #: the request's prompt logprobs (``SamplingParams.prompt_logprobs``), on the delta with
    #: its first token only: None for the first prompt token, then per prompt position
    #: {token id: (logprob, rank)}, the prompt token first, then the top N
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None


class EngineStats(TypedDict):
    """What :meth:`EngineClient.stats` returns (read by ``/metrics`` at every scrape).

    Counters are cumulative since engine start; prefix-cache counters count tokens (as vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits`` do).
    """

    running: int
    waiting: int
    kv_usage: float  # fraction of KV-cache blocks in use, 0..1
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    # Blink's own series (``blink:engine_*``, ``blink:ring_*``), where the client can tell:
    steps: NotRequired[int]  # engine steps since start
    step_tokens: NotRequired[int]  # prompt + generated tokens the steps processed
    kv_blocks_total: NotRequired[int]
    heartbeat_age_s: NotRequired[float]  # seconds since the heartbeat was last seen moving
    slots_used: NotRequired[int]  # ring request slots holding a request
    slots_total: NotRequired[int]
    arena_used: NotRequired[int]  # prompt-arena tokens in use
    arena_total: NotRequired[int]
    kv_transfer_bytes: NotRequired[int]  # prefill engines: KV bytes written into decode engines
    kv_transfers: NotRequired[int]  # prefill engines: requests whose KV was sent
    # speculative decoding (--speculative-config), vLLM's spec_decode_* counters:
    spec_decode_num_drafts: NotRequired[int]
    spec_decode_num_draft_tokens: NotRequired[int]
    spec_decode_num_accepted_tokens: NotRequired[int]
    spec_decode_num_accepted_tokens_per_pos: NotRequired[list[int]]  # per draft position


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the frontend sees it."""

    model_name: str
    max_model_len: int

    def is_healthy(self) -> bool:
        """True while the engine's heartbeat is live (and its state is READY): ``/health``."""
        ...

    def is_accepting(self) -> bool:
        """True while new requests are taken. Also True while the engine is merely stalled
        (unhealthy, heartbeat stale for a while but under the hard limit): the request queues
        and runs when the engine moves again. False once the engine is dead."""
        ...

    # Optional (not part of the protocol check): ``unavailable_retry_after_s() -> float | None``,
    # the seconds a refused client should wait while the engine is being restarted (the HTTP
    # layer then adds ``Retry-After`` to its 503); ``ReconnectingEngineClient`` has it.

    def generate(self, request_id: str, prompt_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Submit one request (``params.n == 1``) and yield its output deltas until finished.

        Implemented as an async generator. Submission happens on the first ``__anext__``, which
        raises :class:`EngineOverloadedError` when no slot frees up within a bounded wait, or
        :class:`EngineDeadError` when the engine is dead; a later ``__anext__`` raises
        :class:`EngineDeadError` if the engine dies mid-request. The last delta has
        ``finished=True``.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel a request (client went away, or the frontend matched a stop string).

        Idempotent; aborting an unknown or finished request is a no-op.
        """
        ...

    def stats(self) -> EngineStats:
        """Scheduler counters for ``/metrics``."""
        ...
