"""Incremental detokenization with constant work per token (vLLM's offset scheme).

Decoding the whole output after every token costs O(n) per token; decoding each token alone is
wrong (sentencepiece's leading-space rules, and a multi-byte character split over several
byte-level or ``<0xNN>`` byte-fallback tokens). Instead we keep two offsets into the token list:

- ``prefix_offset``: start of a short window of already-emitted tokens, decoded for context;
- ``read_offset``: end of the tokens whose text has been emitted.

Per token we decode ``ids[prefix:read]`` and ``ids[prefix:]``; the new text is the difference.
While the latter ends in U+FFFD the last character is incomplete, so nothing is emitted and the
window grows by at most a few tokens (a character is at most 4 bytes). The windows are a handful
of tokens long, so the work per token does not grow with the output.

With ``skip_special_tokens`` special tokens are dropped before they enter the window (exactly
what a full ``decode(..., skip_special_tokens=True)`` does), so they cost nothing and cannot
break the windowed decode.
"""
from __future__ import annotations

from typing import Sequence

from blink.dpu.tokenizer import Tokenizer

#: Prompt tokens kept as decoding context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# Drop emitted tokens from the front of the list once this many are no longer needed.
_TRIM_AT = 256


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    ``prompt_ids`` supply the decoding context, so the first output token decodes as it would
    after the prompt (e.g. with its leading space), like vLLM; the prompt's own text is never
    emitted.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        context: list[int] = []
        for token_id in reversed(prompt_ids):
            if len(context) == CONTEXT_TOKENS:
                break
            if token_id not in self._skip:
                context.append(token_id)
        context.reverse()
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=False)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing new yet, or the last character is still incomplete: hold it back.
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= _TRIM_AT:  # keep memory bounded on long outputs
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def flush(self) -> str:
        """At the end of the stream, emit what is held back (a truncated character decodes to
        U+FFFD, as in a full decode)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
