"""One constrained request's matcher: the mask of each next token, from the tokens so far.

The ring client (:mod:`blink.dpu.ring_protocol`) writes :meth:`TokenMasker.mask` into the
slot's row of the ring's mask area before the request is published (the first token's mask),
and after reading each batch of the request's tokens it calls :meth:`TokenMasker.advance`
and writes the next mask with the new epoch (docs/architecture.md, "Structured outputs").
Bit ``t % 32`` of word ``t // 32`` set: token t allowed (llguidance's layout, the sampler's).

The masks are computed in the ring poller, beside every other stream's tokens, so one
request's grammar must not cost the others their latency: a request whose mask takes longer
than :data:`MASK_TIME_LIMIT_S` for one token is ended with an error naming the limit
(measured on the real-world corpus: p99 0.4 ms, max 43 ms on a loaded 2-core machine; only
ambiguous grammars go past it, docs/performance.md#structured-outputs).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from blink.shared.structured_outputs import StructuredOutputsError


#: Longest one token's advance + mask may take before the request is ended (seconds).
MASK_TIME_LIMIT_S = 0.25


class MaskError(StructuredOutputsError):
    """The matcher cannot go on (a token the grammar refuses, a per-token limit reached)."""


class TokenMasker:
    """Wraps one llguidance ``LLMatcher`` (a request's own copy)."""

    def __init__(self, matcher, mask_bytes: int, eos_token_ids: Sequence[int] = (),
                 time_limit_s: float = MASK_TIME_LIMIT_S) -> None:
        self._matcher = matcher
        self._buf = np.zeros(mask_bytes // 4, dtype="<i4")
        self._eos = frozenset(eos_token_ids)
        self.time_limit_s = time_limit_s

    def mask(self) -> np.ndarray:
        """int32 words: the tokens allowed next (the buffer is reused: copy to keep it)."""
        m = self._matcher
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(self._buf.ctypes.data, self._buf.nbytes)
        if m.is_error():
            raise MaskError(f"structured outputs: {m.get_error()}")
        took = time.perf_counter() - t0
        if took > self.time_limit_s:
            raise MaskError(
                f"structured outputs: the grammar took {took * 1e3:.0f} ms to compute one "
                f"token's mask, over the limit of {self.time_limit_s * 1e3:.0f} ms per token "
                "(an ambiguous grammar; other requests would wait behind it)")
        return self._buf

    def advance(self, tokens: Sequence[int]) -> None:
        """Follow the engine's ``tokens`` (each one was allowed by the mask before it)."""
        m = self._matcher
        for token in tokens:
            if m.is_stopped() and token in self._eos:
                continue  # the grammar is complete and the engine ends the request on EOS
            if not m.consume_token(token) or m.is_error():
                raise MaskError(f"structured outputs: the grammar refused an engine token: "
                                f"{m.get_error() or 'unknown'}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete: only EOS is allowed from here."""
        return bool(self._matcher.is_stopped())
