"""Constraint -> token automaton for one model's vocabulary, packed as a grammar entry.

outlines-core builds the automaton (``Index``: a DFA over tokens, from the constraint's regex
and the vocabulary's token bytes); this module renumbers its states densely and packs it in
the ring's entry format (:mod:`blink.ring`, ``G_*``): a per-state allowed-token bitmask (what
the device sampler masks with: one word gather per 32 tokens) and CSR transitions (what
``update()`` advances with: a binary search of the sampled token in its state's row). EOS ids
are allowed exactly in accepting states; a state with no way on (none, with outlines-core)
would allow only EOS.

Compiled entries are cached by content hash (the constraint's canonical text + the
vocabulary's identity), so the same schema sent again costs a dict lookup. Limits: states,
transitions and compile time (:class:`GrammarLimits`); beyond them the request is refused
with a 400 naming the limit (refusals are cached too, so a repeated bad schema costs nothing).
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from blink.ring import (
    G_DEFAULT_NEXT, G_EOS, G_INITIAL_STATE, G_MAGIC, G_MASK, G_NUM_STATES, G_NUM_TRANSITIONS, G_ROW_START,
    G_TOTAL_WORDS, G_TRANS_NEXT, G_TRANS_TOKEN, G_VERSION, G_VOCAB_BITS, G_WORDS_PER_STATE,
    GRAMMAR_ALIGN_WORDS, GRAMMAR_FORMAT_VERSION, GRAMMAR_HEADER_WORDS, GRAMMAR_MAGIC,
)
from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError
from blink.dpu.structured.regex import constraint_regex


class GrammarLimitError(StructuredOutputsError):
    """The constraint compiles to an automaton beyond a limit (a 400 naming the limit)."""


class TokenSource(Protocol):
    """What the compiler needs of a tokenizer (:class:`blink.dpu.tokenizer.Tokenizer`)."""

    vocab_size: int
    special_ids: frozenset[int]
    eos_token_ids: list[int]

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one compiled constraint (defaults sized for tool schemas, with room)."""

    max_states: int = 8192
    max_transitions: int = 4_000_000
    max_compile_s: float = 10.0
    cache_entries: int = 256


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint's automaton in the ring's entry format.

    key:   content hash (constraint + vocabulary): equal keys, equal words
    words: int32 entry, header first (``blink.ring.G_*``), a multiple of GRAMMAR_ALIGN_WORDS
    """

    key: str
    words: np.ndarray
    num_states: int
    num_transitions: int
    compile_s: float
    regex: str
    stored_transitions: int = 0  # the exceptions to the default next states actually stored

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes)


def _align(n: int) -> int:
    return -(-n // GRAMMAR_ALIGN_WORDS) * GRAMMAR_ALIGN_WORDS


def pack_entry(num_states: int, initial: int, vocab_bits: int, eos_ids: Sequence[int],
               accepting: np.ndarray, src: np.ndarray, token: np.ndarray,
               dst: np.ndarray) -> np.ndarray:
    """The entry words of a dense automaton: states 0..num_states-1, transitions
    (src -> dst on token), ``accepting`` a bool [num_states]."""
    order = np.lexsort((token, src))
    src, token, dst = src[order], token[order], dst[order]
    # Each state's most common next state is its default; only the other transitions are
    # stored (the mask says which tokens are allowed at all).
    default_next = np.zeros(num_states, dtype=np.int64)
    if src.size:
        pairs, counts = np.unique(src * num_states + dst, return_counts=True)
        pair_src = pairs // num_states
        best = np.lexsort((-counts, pair_src))  # per src, the highest count first
        first = np.ones(best.size, dtype=bool)
        first[1:] = pair_src[best][1:] != pair_src[best][:-1]
        default_next[pair_src[best][first]] = (pairs % num_states)[best][first]
    exception = dst != default_next[src]
    ex_src, ex_token, ex_dst = src[exception], token[exception], dst[exception]
    wps = -(-vocab_bits // 32)
    mask_off = GRAMMAR_HEADER_WORDS
    def_off = _align(mask_off + num_states * wps)
    row_off = _align(def_off + num_states)
    tok_off = _align(row_off + num_states + 1)
    nxt_off = _align(tok_off + ex_token.size)
    total = _align(nxt_off + ex_dst.size)
    words = np.zeros(total, dtype="<i4")
    header = words[:GRAMMAR_HEADER_WORDS]
    header[G_MAGIC] = GRAMMAR_MAGIC
    header[G_VERSION] = GRAMMAR_FORMAT_VERSION
    header[G_NUM_STATES] = num_states
    header[G_INITIAL_STATE] = initial
    header[G_VOCAB_BITS] = vocab_bits
    header[G_WORDS_PER_STATE] = wps
    header[G_NUM_TRANSITIONS] = ex_token.size
    header[G_DEFAULT_NEXT] = def_off
    header[G_EOS] = eos_ids[0]
    header[G_MASK], header[G_ROW_START] = mask_off, row_off
    header[G_TRANS_TOKEN], header[G_TRANS_NEXT] = tok_off, nxt_off
    header[G_TOTAL_WORDS] = total
    # The mask, as uint32 bits (viewed as int32 in the ring): bit t % 32 of word t // 32.
    mask = np.zeros((num_states, wps), dtype=np.uint32)
    np.bitwise_or.at(mask, (src, token // 32), np.left_shift(np.uint32(1), (token % 32).astype(np.uint32)))
    stuck = np.bincount(src, minlength=num_states) == 0
    for eos in eos_ids:  # EOS where the output may end, and wherever nothing else is left
        mask[accepting | stuck, eos // 32] |= np.uint32(1 << (eos % 32))
    words[mask_off: mask_off + mask.size] = mask.reshape(-1).view("<i4")
    words[def_off: def_off + num_states] = default_next
    words[row_off: row_off + num_states + 1] = np.concatenate(
        [[0], np.cumsum(np.bincount(ex_src, minlength=num_states))])
    words[tok_off: tok_off + ex_token.size] = ex_token
    words[nxt_off: nxt_off + ex_dst.size] = ex_dst
    return words


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe; caches by content hash."""

    def __init__(self, tokenizer: TokenSource, limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self._lock = threading.Lock()
        self._vocab = None
        self._vocab_id: str | None = None
        self.eos_ids: list[int] = []  # read with the vocabulary, on the first compile
        self._cache: OrderedDict[str, CompiledGrammar | StructuredOutputsError] = OrderedDict()

    def _vocabulary(self):
        """outlines-core's Vocabulary of the tokenizer (built once, ~1-2 s for 50k tokens)."""
        if self._vocab is None:
            from outlines_core import Vocabulary

            self.eos_ids = [int(e) for e in getattr(self.tokenizer, "eos_token_ids", None) or []]

            if not self.eos_ids:
                raise StructuredOutputsError(
                    "structured outputs need a model with an EOS token; this tokenizer has none."
                )
            tok = self.tokenizer
            by_bytes: dict[bytes, list[int]] = {}
            digest = hashlib.sha256(repr(self.eos_ids).encode())
            skip = set(tok.special_ids) | set(self.eos_ids)
            for token_id in range(tok.vocab_size):
                if token_id in skip:
                    continue
                try:
                    piece = tok.token_bytes(token_id)
                except ValueError:  # a hole in the vocabulary
                    continue
                if piece:
                    by_bytes.setdefault(piece, []).append(token_id)
                    digest.update(token_id.to_bytes(4, "little") + len(piece).to_bytes(2, "little") + piece)
            self._vocab = Vocabulary(self.eos_ids[0], by_bytes)
            self._vocab_id = digest.hexdigest()
        return self._vocab

    @property
    def vocab_id(self) -> str:
        self._vocabulary()
        assert self._vocab_id is not None
        return self._vocab_id

    def compile(self, so: StructuredOutputs) -> CompiledGrammar:
        """The entry of ``so`` (cached); :class:`StructuredOutputsError` if it cannot be."""
        with self._lock:  # one compile at a time: they are CPU-bound anyway
            key = hashlib.sha256((so.canonical_text() + "\0" + self.vocab_id).encode()).hexdigest()
            hit = self._cache.get(key)
            if hit is None:
                try:
                    hit = self._compile(so, key)
                except StructuredOutputsError as exc:
                    hit = exc
                self._cache[key] = hit
                while len(self._cache) > self.limits.cache_entries:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        if isinstance(hit, StructuredOutputsError):
            raise hit
        return hit

    def _compile(self, so: StructuredOutputs, key: str) -> CompiledGrammar:
        from outlines_core import Index

        start = time.perf_counter()
        regex = constraint_regex(so)
        try:
            index = Index(regex, self._vocabulary())
        except ValueError as exc:
            what = "regex" if so.regex is not None else so.kind
            raise StructuredOutputsError(f"{what} cannot be compiled for this model: {exc}") from None
        limits = self.limits
        transitions = index.get_transitions()
        finals = set(index.get_final_states())
        ids = sorted(set(transitions) | finals | {index.get_initial_state()}
                     | {n for row in transitions.values() for n in row.values()})
        if len(ids) > limits.max_states:
            raise GrammarLimitError(
                f"{so.kind} compiles to {len(ids)} automaton states, more than the limit of "
                f"{limits.max_states}; simplify the constraint."
            )
        dense = {s: i for i, s in enumerate(ids)}
        eos = set(self.eos_ids)
        src, tok, dst = [], [], []
        for s, row in transitions.items():
            ds = dense[s]
            for t, n in row.items():
                if t not in eos:
                    src.append(ds)
                    tok.append(t)
                    dst.append(dense[n])
        if len(tok) > limits.max_transitions:
            raise GrammarLimitError(
                f"{so.kind} compiles to {len(tok)} token transitions, more than the limit of "
                f"{limits.max_transitions}; simplify the constraint."
            )
        accepting = np.zeros(len(ids), dtype=bool)
        accepting[[dense[s] for s in finals]] = True
        vocab_bits = max(self.tokenizer.vocab_size, max(self.eos_ids) + 1)
        words = pack_entry(len(ids), dense[index.get_initial_state()], vocab_bits, self.eos_ids,
                           accepting, np.asarray(src, dtype=np.int64),
                           np.asarray(tok, dtype=np.int64), np.asarray(dst, dtype=np.int64))
        elapsed = time.perf_counter() - start
        if elapsed > limits.max_compile_s:
            raise GrammarLimitError(
                f"{so.kind} took {elapsed:.1f} s to compile, more than the limit of "
                f"{limits.max_compile_s:g} s; simplify the constraint."
            )
        return CompiledGrammar(key, words, len(ids), len(tok), elapsed, regex,
                               int(words[G_NUM_TRANSITIONS]))
