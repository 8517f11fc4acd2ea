"""The frontend's side of the ring's grammar region: where compiled automata live.

The frontend alone allocates in the region (the engine only reads it), so the allocator is
here: entries are placed first-fit in GRAMMAR_ALIGN_WORDS units, keyed by their content hash
(:attr:`CompiledGrammar.key`), so a schema sent again while its entry is still resident is not
uploaded again. Each request holding an entry counts as a reference, from submission until its
slot is FREE again (after that the engine never reads the entry for it). When an entry does
not fit, entries no request references are evicted least recently used first; if it still does
not fit the caller waits (bounded, then 503), never runs unconstrained.

Ordering: an entry is written before the request records that point at it, and the records'
state word is published after a fence (:meth:`RingClient.try_submit`), so the engine sees the
entry whenever it sees the request.
"""
from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from dataclasses import dataclass

from blink.dpu.structured.compiler import CompiledGrammar, GrammarLimitError
from blink.ring import (
    G_MAGIC, G_TOTAL_WORDS, GRAMMAR_ALIGN_WORDS, GRAMMAR_HEADER_WORDS, GRAMMAR_MAGIC, FieldSpec,
)
from blink.transport.base import Transport

logger = logging.getLogger(__name__)


@dataclass
class GrammarEntry:
    key: str | None  # None: an entry of a previous frontend, kept until its requests drain
    offset: int  # first word, in the region
    words: int
    refs: int = 0


@dataclass
class RegionStats:
    uploads: int = 0
    hits: int = 0
    evictions: int = 0
    bytes_uploaded: int = 0


class GrammarRegion:
    """First-fit, content-addressed, reference-counted entries of the grammar region."""

    def __init__(self, transport: Transport, spec: FieldSpec, capacity_words: int) -> None:
        self.transport = transport
        self.spec = spec
        self.capacity = capacity_words
        self._by_key: OrderedDict[str, GrammarEntry] = OrderedDict()  # LRU order, oldest first
        self._by_offset: dict[int, GrammarEntry] = {}
        self._starts: list[int] = []  # sorted offsets of placed entries
        self.stats = RegionStats()

    @property
    def used_words(self) -> int:
        return sum(e.words for e in self._by_offset.values())

    def check_fits(self, grammar: CompiledGrammar) -> None:
        """:class:`GrammarLimitError` (a 400) when the entry can never fit the region."""
        if grammar.words.size > self.capacity:
            region = "has no grammar region" if self.capacity == 0 else \
                f"has a grammar region of {self.capacity * 4 / 2**20:.1f} MiB"
            raise GrammarLimitError(
                f"the compiled constraint needs {grammar.nbytes / 2**20:.1f} MiB of ring memory; "
                f"this engine {region} (blink serve --grammar-region-mb)"
            )

    def acquire(self, grammar: CompiledGrammar) -> int | None:
        """The entry's word offset, uploading it if it is not resident, with one more
        reference; None while the region has no room for it (evicting cannot make enough)."""
        self.check_fits(grammar)
        entry = self._by_key.get(grammar.key)
        if entry is not None:
            self._by_key.move_to_end(grammar.key)
            entry.refs += 1
            self.stats.hits += 1
            return entry.offset
        size = grammar.words.size
        offset = self._find_gap(size)
        while offset is None and self._evict_one():
            offset = self._find_gap(size)
        if offset is None:
            return None
        self.transport.write(self.spec.element_offset(offset), grammar.words)
        entry = GrammarEntry(grammar.key, offset, size, refs=1)
        self._place(entry)
        self._by_key[grammar.key] = entry
        self.stats.uploads += 1
        self.stats.bytes_uploaded += grammar.nbytes
        return offset

    def release(self, offset: int) -> None:
        """Drop one reference to the entry at ``offset`` (it stays resident, evictable)."""
        entry = self._by_offset.get(offset)
        if entry is None or entry.refs <= 0:
            logger.error("grammar region: release of an entry not held (offset %d)", offset)
            return
        entry.refs -= 1
        if entry.key is None and entry.refs == 0:  # a previous frontend's: nobody can reuse it
            self._remove(entry)

    def adopt(self, offset: int) -> bool:
        """Hold the entry a previous frontend's request (still in the ring) points at, so it
        is not overwritten while that request drains; False if no valid entry is there."""
        entry = self._by_offset.get(offset)
        if entry is None:
            if not 0 <= offset <= self.capacity - GRAMMAR_HEADER_WORDS:
                return False
            header = self.transport.read(self.spec.element_offset(offset),
                                         GRAMMAR_HEADER_WORDS * 4).view("<i4")
            words = int(header[G_TOTAL_WORDS])
            if int(header[G_MAGIC]) != GRAMMAR_MAGIC or not 0 < words <= self.capacity - offset:
                return False
            entry = GrammarEntry(None, offset, words)
            self._place(entry)
        entry.refs += 1
        return True

    # -- placement -----------------------------------------------------------------------

    def _find_gap(self, size: int) -> int | None:
        pos = 0
        for start in self._starts:
            if start - pos >= size:
                return pos
            end = start + self._by_offset[start].words
            pos = max(pos, -(-end // GRAMMAR_ALIGN_WORDS) * GRAMMAR_ALIGN_WORDS)
        return pos if self.capacity - pos >= size else None

    def _place(self, entry: GrammarEntry) -> None:
        bisect.insort(self._starts, entry.offset)
        self._by_offset[entry.offset] = entry

    def _remove(self, entry: GrammarEntry) -> None:
        self._starts.remove(entry.offset)
        del self._by_offset[entry.offset]
        if entry.key is not None:
            del self._by_key[entry.key]

    def _evict_one(self) -> bool:
        """Evict the least recently used entry no request holds; False if there is none."""
        for entry in self._by_key.values():
            if entry.refs == 0:
                self._remove(entry)
                self.stats.evictions += 1
                return True
        return False


