"""Offline inference: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

The offline API is a ring client like the HTTP frontend: it writes requests into the
engine's ring through the loopback transport and reads tokens back from the output streams,
so it exercises exactly the serving path (never a side door into the model).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from blink.dpu.ring_packing import ring_fields
from blink.dpu.ring_protocol import RingClient, RingHandle
from blink.dpu.engine_client import EngineOutput
from blink.dpu.output_processor import ChoiceText
from blink.dpu.structured.workers import CompiledGrammar, GrammarService
from blink.dpu.tokenizer import Tokenizer
from blink.engine.engine import EngineConfig
from blink.engine.factory import create_engine
from blink.shared.sampling_params import SamplingParams, SamplingParamsError
from blink.errors import BlinkError
from blink.loader import load_tokenizer_files
from blink.transport import InProcessTransport, LoopbackTransport
from blink.transport import doorbell as doorbells


#: the longest generate() waits for the engine's doorbell before it reads the ring anyway (a
#: bell is never lost while the engine steps, but an idle loop rings none)
BELL_SAFETY_S = 0.02


@dataclass
class CompletionOutput:
    """One generated sequence (one of a request's ``n`` choices)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    #: per generated token: {token_id: logprob} of the chosen token and the top-N, when asked
    logprobs: list[dict[int, float]] | None = None
    #: with finish_reason "error": why, when known (a structured output that failed its JSON
    #: schema's final check names the keyword and the validation error; ``text`` is kept)
    error: str | None = None


@dataclass
class RequestOutput:
    """The result for one prompt; ``text``/``token_ids``/... are shortcuts to choice 0."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    #: with ``SamplingParams.prompt_logprobs``: None for the first prompt token, then per
    #: prompt position {token id: (logprob, rank)}, the prompt token first, then the top N
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


@dataclass
class _Choice:
    """Bookkeeping of one in-flight sequence."""

    request: int
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    fields: Any  # the packed request record (ring_packing.ring_fields)
    output: ChoiceText
    handle: RingHandle | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_cached: int = 0
    grammar: CompiledGrammar | None = None  # the structured-output automaton, if any
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason


class LLM:
    """An engine plus a ring client in one process, for batch generation from Python.

    Keyword arguments are :class:`~blink.engine.engine.EngineConfig` fields (``dtype``,
    ``max_model_len``, ``max_num_seqs``, ``kv_cache_tokens``, ``enable_prefix_caching``...).
    ``loop`` picks the device loop like ``blink serve --loop``: ``auto`` (the CPU loop on a
    CPU; tier B, else tier A, on a GPU), ``cpu``, ``host`` (tier A) or ``device`` (tier B).
    """

    def __init__(self, model: str = "smollm2-135m", *, loop: str = "auto", **engine_kwargs: Any) -> None:
        tokenizer_json, tokenizer_config, generation_config = load_tokenizer_files(model)
        self.tokenizer = Tokenizer(tokenizer_json, tokenizer_config, generation_config)
        self.generation_config = generation_config
        # The same factory as `blink serve`/`blink engine`: the CPU loop on a CPU, a GPU
        # tier (--loop host|device|auto) on a CUDA machine.
        self.engine = create_engine(EngineConfig(model=model, **engine_kwargs), loop,
                                    in_process_frontend=True)
        self.engine.start()
        region = self.engine.region
        transport = (InProcessTransport(region) if region.kind == "inprocess"
                     else LoopbackTransport(region.name, region.total_bytes))
        self._ring = RingClient(transport)
        self.max_model_len = self.engine.max_model_len
        #: structured-output grammars for this tokenizer (checked in a worker, cached)
        self.grammars = GrammarService(self.tokenizer)
        #: rung by the engine's loop after each step (None: generate() polls on a backoff)
        self._bell = self._attach_doorbell()

    # ------------------------------------------------------------------------------ public

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids). Outputs keep prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_ids = [self._encode(p) for p in prompts]
        params_list = self._params_for(len(prompt_ids), sampling_params)
        choices: list[_Choice] = []
        for r, (ids, params) in enumerate(zip(prompt_ids, params_list)):
            for index in range(params.n):
                choices.append(self._new_choice(r, index, ids, params))
        self._run(choices, timeout_s)
        results = []
        for r, prompt in enumerate(prompts):
            mine = [c for c in choices if c.request == r]
            results.append(RequestOutput(
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt_ids[r],
                outputs=[CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs,
                                          c.output.error) for c in mine],
                num_cached_tokens=mine[0].num_cached if mine else 0,
                prompt_logprobs=mine[0].prompt_logprobs if mine else None,
            ))
        return results

    def chat(
        self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None, **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.encode_chat(conv, **template_kwargs) for conv in conversations]
        return self.generate(ids, sampling_params)

    def close(self) -> None:
        self.grammars.close()
        self._ring.close()
        if self._bell is not None:
            self.engine.doorbell = None
        self.engine.close()
        if self._bell is not None:
            self._bell.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- helpers

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise BlinkError("empty prompt: give at least one token")
        return ids

    def _params_for(self, n: int, sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams.from_generation_config(self.generation_config)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise SamplingParamsError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

    def _new_choice(self, r: int, index: int, ids: list[int], params: SamplingParams) -> _Choice:
        # Checked for every prompt before anything is submitted, so that a bad prompt never
        # leaves the batch's earlier requests orphaned in the ring.
        if len(ids) >= self.max_model_len:
            raise SamplingParamsError(
                f"prompt {r} has {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:  # the engine stops on stop ids; eos is one unless ignored
            stop_ids += [t for t in self.tokenizer.eos_token_ids if t not in stop_ids]
        seed = None if params.seed is None else params.seed + index
        # A copy, not SamplingParams(...): params is validated already; what changes here (the
        # seed, the stop ids with EOS) is checked against the ring's limits by the packing.
        one = copy.copy(params)
        one.n, one.seed, one.stop_token_ids = 1, seed, stop_ids
        if one.bad_words and one.bad_words_token_ids is None:  # vLLM's update_from_tokenizer
            one.update_from_tokenizer(
                lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        fields = ring_fields(one, len(ids), self.max_model_len, self._ring.config)
        grammar = None
        if params.structured_outputs is not None:  # compiled once per constraint (cached)
            grammar = self.grammars.compile(params.structured_outputs)
        if len(ids) + fields["max_tokens"] > self.max_model_len and params.max_tokens is not None:
            fields["max_tokens"] = max(1, self.max_model_len - len(ids))
        return _Choice(
            request=r, index=index, prompt_ids=ids, params=params, fields=fields,
            output=ChoiceText(self.tokenizer, ids, one,
                              final_check=grammar is not None and grammar.needs_final_check),
            logprobs=[] if params.logprobs is not None else None, grammar=grammar,
        )

    def _run(self, choices: list[_Choice], timeout_s: float | None) -> None:
        pending = list(reversed(choices))  # pop() from the end keeps submission order
        active: dict[RingHandle, _Choice] = {}
        try:
            self._loop(pending, active, timeout_s)
        except BaseException:
            self._abandon(active)
            raise

    def _loop(self, pending: list[_Choice], active: dict[RingHandle, _Choice],
              timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request_id = 0
        idle_sleep = 0.0
        while pending or active:
            if self.engine.error is not None or not self.engine.alive:
                raise BlinkError(f"the engine loop stopped: {self.engine.error!r}")
            while pending:
                choice = pending[-1]
                request_id += 1
                handle = self._ring.try_submit(request_id, choice.prompt_ids, choice.fields,
                                               grammar=choice.grammar)
                if handle is None:
                    break  # slots or arena full: poll and retry
                pending.pop()
                choice.handle = handle
                active[handle] = choice
            deltas = self._ring.poll_many(list(active))
            for handle, delta in deltas.items():
                choice = active[handle]
                self._consume(choice, delta)
                if delta.finished:
                    del active[handle]
            for handle in active:
                if handle.error is not None:  # poll_many drops such a handle for good
                    raise BlinkError(f"request failed in the ring: {handle.error}")
            if deltas:
                idle_sleep = 0.0
            else:
                if deadline is not None and time.monotonic() > deadline:
                    raise BlinkError(f"generate() timed out after {timeout_s} s")
                if self._bell is not None:  # until the next step ends (or a safety net's time)
                    self._bell.wait(BELL_SAFETY_S)
                else:
                    # Back off while the engine computes a step, so polling does not take the
                    # CPU the engine thread needs (a step is milliseconds to seconds on CPU).
                    idle_sleep = min(max(idle_sleep * 2, 1e-4), 2e-3)
                    time.sleep(idle_sleep)

    def _attach_doorbell(self) -> doorbells.DoorbellListener | None:
        """The engine's doorbell (blink.transport.doorbell), as a frontend on its host has it:
        generate() then reads the ring once after each step. On a backoff of its own it woke
        mid-step, and the threads running the kernels were preempted ~4.5 times a step of
        SmolLM2 (~1.1 on the bell; docs/performance.md#llm-doorbell). None where the engine
        rings no bell (a GPU loop with no host step) or the platform has none."""
        if not (getattr(self.engine, "rings_doorbell", False) and doorbells.supported()):
            return None
        listener = doorbells.DoorbellListener()
        self.engine.doorbell = doorbells.Doorbell(listener.name)
        return listener

    def _abandon(self, active: dict[RingHandle, _Choice], wait_s: float = 5.0) -> None:
        """Cancel what is still in flight and read it to the end (bounded), so that the slots
        come back FREE and the engine goes idle instead of holding FINISHED slots forever."""
        todo = [h for h in active if not h.done and h.error is None]
        for handle in todo:
            self._ring.cancel(handle)
        deadline = time.monotonic() + wait_s
        while todo and self.engine.alive and time.monotonic() < deadline:
            self._ring.poll_many(todo)
            todo = [h for h in todo if not h.done and h.error is None]
            time.sleep(1e-3)

    def _consume(self, choice: _Choice, delta: EngineOutput) -> None:
        """The frontend's rules (:class:`~blink.dpu.output_processor.ChoiceText`) on a delta."""
        choice.num_cached = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if choice.output.finish_reason is not None:
            return
        out = choice.output.feed(list(delta.token_ids), delta.finished, delta.finish_reason)
        choice.text += out.text
        for i, token in enumerate(delta.token_ids[: out.kept]):
            choice.token_ids.append(token)
            if choice.logprobs is not None:
                entry = {token: float(delta.logprobs[i])}
                for tid, lp in delta.top_logprobs[i]:
                    if tid >= 0:
                        entry.setdefault(int(tid), float(lp))
                choice.logprobs.append(entry)
        if choice.output.stopped_by_string and not delta.finished:
            self._ring.cancel(choice.handle)  # the engine would go on generating for nobody
        if choice.output.needs_final_check:  # a lenient grammar: validate what finished stop
            assert choice.grammar is not None
            choice.output.final_check_done(choice.grammar.check_output(choice.output.text))
