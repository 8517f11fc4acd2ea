"""One choice's tokens turned into text: the serving rules, in one place.

Both the HTTP frontend (:class:`blink.dpu.generation.ChoiceRun`) and the offline
:class:`blink.llm.LLM` feed every token of a choice through a :class:`ChoiceText`:

- incremental detokenization (constant work per token; never a split UTF-8 character);
- stop strings matched across token boundaries, only once ``min_tokens`` outputs exist
  (vLLM's rule); a match ends the choice with finish reason ``stop``, and the tokens after it
  are dropped;
- the stop token that ends a choice (EOS or a ``stop_token_ids`` id) is counted but its text
  is not shown, unless ``include_stop_str_in_output``;
- at the end, the detokenizer's and the matcher's held-back text is released;
- a choice whose structured-output grammar does not enforce every keyword of its JSON schema
  (``final_check``: :meth:`blink.dpu.structured.workers.CompiledGrammar.check_output`) keeps
  its text, and when it finishes ``stop`` the caller runs the check on :attr:`ChoiceText.text`
  (:attr:`ChoiceText.needs_final_check`) and reports the outcome with
  :meth:`ChoiceText.final_check_done`: an output that fails ends with finish reason
  ``error`` and :attr:`ChoiceText.error`, never ``stop``.
"""
from __future__ import annotations

from dataclasses import dataclass

from blink.dpu.detokenizer import IncrementalDetokenizer
from blink.dpu.stop_strings import StopStringMatcher
from blink.dpu.tokenizer import Tokenizer
from blink.shared.sampling_params import SamplingParams


@dataclass
class TextDelta:
    """What one batch of engine tokens adds: the text, and how many of the tokens count
    (tokens past a matched stop string are dropped)."""

    text: str
    kept: int


class ChoiceText:
    """The text of one choice, fed token batch by token batch (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                 include_stop_str_in_output: bool = False, final_check: bool = False) -> None:
        self.params = params
        self.include_stop_str_in_output = include_stop_str_in_output
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._matcher = StopStringMatcher(params.stop, include_stop_str_in_output)
        # The caller's params carry EOS among the stop ids unless ignore_eos (what the engine
        # stops on, so what can end the choice).
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self.completion_tokens = 0
        #: "stop" once a stop string matched (the engine request must then be aborted), or the
        #: engine's reason once it finished; None while the choice runs
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        #: the output must pass a final check when it finishes stop (its text is kept)
        self.final_check = final_check
        self._pieces: list[str] | None = [] if final_check else None
        self._checked = False
        #: why the choice failed (finish reason "error"), for the client
        self.error: str | None = None

    @property
    def text(self) -> str:
        """The whole text so far (kept only for a choice with a final check)."""
        if self._pieces is None:
            raise RuntimeError("ChoiceText keeps its text only with final_check")
        return "".join(self._pieces)

    @property
    def needs_final_check(self) -> bool:
        """The choice finished ``stop`` and its output must still pass the final check."""
        return self.final_check and not self._checked and self.finish_reason == "stop"

    def final_check_done(self, problem: str | None) -> None:
        """The final check's outcome: None (valid: the finish stays ``stop``) or the message;
        then the finish reason becomes ``error``."""
        self._checked = True
        if problem is not None:
            self.finish_reason = "error"
            self.error = problem

    def feed(self, token_ids: list[int], finished: bool, finish_reason: str | None) -> TextDelta:
        """Add the engine's next tokens; ``finished``/``finish_reason`` as the engine reports
        them with these tokens."""
        if self.finish_reason is not None:
            return TextDelta("", 0)
        pieces: list[str] = []
        kept = 0
        for token_id in token_ids:
            kept += 1
            self.completion_tokens += 1
            if (token_id in self._stop_token_ids and not self.include_stop_str_in_output
                    and self.completion_tokens > self.params.min_tokens):
                # The stop token (eos) ends the text; it is counted, not shown. The engine
                # stops on it, so it is the last token even when the finish is read only in
                # the next delta (the ring's poller can see the token before the state).
                continue
            active = self.completion_tokens > self.params.min_tokens  # vLLM's rule
            pieces.append(self._matcher.feed(self._detok.step(token_id), active))
            if self._matcher.matched is not None:
                self.finish_reason = "stop"
                self.stopped_by_string = True
                break
        if self.finish_reason is None and finished:
            pieces.append(self._matcher.feed(self._detok.flush()))
            if self._matcher.matched is None:
                pieces.append(self._matcher.flush())
            self.finish_reason = "stop" if self._matcher.matched else (finish_reason or "stop")
            self.stopped_by_string = self._matcher.matched is not None
        text = "".join(pieces)
        if self._pieces is not None and text:
            self._pieces.append(text)
        return TextDelta(text, kept)
