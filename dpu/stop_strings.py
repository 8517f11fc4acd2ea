"""Stop strings over a stream of text deltas.

A stop string may span several tokens, so text that could be the start of one is held back
until it either completes the stop string (the request ends there and the stop string is never
sent, unless ``include_stop_str_in_output``) or stops matching (then it is released). The work
per delta is bounded by the longest stop string, not by the output length.
"""
from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to send.

    After a match, :attr:`matched` is the stop string and :meth:`feed` must not be called
    again. The output is the text up to (or, with ``include_stop_str_in_output``, through) the
    earliest occurrence of any stop string.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop: tuple[str, ...] = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._pending = ""  # held back: may be the beginning of a stop string
        self._tail = ""  # recently sent text (include mode): a stop string may start in it
        self.matched: str | None = None

    def feed(self, delta: str, active: bool = True) -> str:
        """Add ``delta``; return the text to send now.

        ``active=False`` (before ``min_tokens`` are generated, as in vLLM) sends everything
        and matches nothing, and a later match cannot reach back into that text.
        """
        if self.matched is not None:
            raise RuntimeError("feed() after a stop string matched")
        if not self.stop:
            return delta
        if not active:
            out, self._pending, self._tail = self._pending + delta, "", ""
            return out
        if self.include_stop_str_in_output:
            return self._feed_including(delta)
        text = self._pending + delta
        hit = self._earliest_match(text)
        if hit is not None:
            pos, stop = hit
            self.matched, self._pending = stop, ""
            return text[:pos]
        hold = self._partial_suffix_len(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def _feed_including(self, delta: str) -> str:
        # Nothing needs holding back (the stop string is sent anyway), but a stop string may
        # have started in text already sent, so search from the remembered tail.
        text = self._tail + delta
        hit = self._earliest_match(text)
        if hit is not None:
            pos, stop = hit
            self.matched = stop
            return text[len(self._tail): pos + len(stop)]
        keep = self._max_len - 1
        self._tail = text[-keep:] if keep else ""
        return delta

    def flush(self) -> str:
        """The stream ended without a match: release the held-back text."""
        out, self._pending = self._pending, ""
        return out

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first (earliest end; on a tie the longer one), so the
        result does not depend on how the text was split into deltas."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            pos = text.find(stop)
            if pos != -1:
                key = (pos + len(stop), pos, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0
