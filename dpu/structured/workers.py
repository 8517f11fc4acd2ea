"""Grammar compilation that no request can turn against the server.

A new constraint's llguidance grammar is first built and exercised (its first mask computed)
in a worker process (:class:`GrammarWorkers`), under a wall-clock limit enforced from outside
(the process is killed at the limit) and an address-space limit set inside it
(``RLIMIT_AS``): a schema that explodes costs a worker, never the frontend. Workers run
requests side by side (no global lock): a request whose constraint is cached, or that has
none, never waits for a compile. A compile whose client has gone is cancelled (its worker
killed and replaced). Only then does this process build the request's matcher, with the same
parser limits (:data:`PARSER_LIMITS`: per-token work and lexer states bounded, so every mask
computation and the matcher's memory are bounded too).

Accepted grammars are kept in an LRU cache with a byte budget (:class:`GrammarService`;
refusals are not cached). Memory the frontend can spend on structured outputs: the cache
budget, plus per constrained request in flight at most ``max_lexer_states`` lexer states
(~1-2 KB each, llguidance's figure) of its matcher. docs/architecture.md, "Structured
outputs".
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from blink.dpu.structured.grammar import GrammarSpec, grammar_spec
from blink.dpu.structured.masker import TokenMasker
from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 1.0
DEFAULT_COMPILE_MEMORY_MB = 1024.0
DEFAULT_GRAMMAR_CACHE_MB = 64.0
DEFAULT_WORKERS = 2
#: A worker process's start (Python, llguidance, the vocabulary): not counted in the limit.
WORKER_START_TIMEOUT_S = 60.0
#: llguidance's parser limits, for the workers' checks and every request's matcher.
PARSER_LIMITS: dict[str, int] = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 1_000_000,  # ~20 ms of lexer construction
    "step_lexer_fuel": 200_000,  # ~15 ms per token, at most
    "step_max_items": 50_000,
    "max_lexer_states": 20_000,  # ~20-40 MB of lexer per matcher, at most
    "max_grammar_size": 500_000,
}
#: Cache accounting per entry: its grammar text, times this, plus a fixed part (an estimate:
#: llguidance does not report a compiled grammar's size).
CACHE_BYTES_PER_TEXT_BYTE = 4
CACHE_BYTES_PER_ENTRY = 256 << 10


class GrammarLimitError(StructuredOutputsError):
    """A constraint went past a compile limit (a 400 that names the limit)."""


class TokenSource(Protocol):
    """What this needs of a tokenizer (:class:`blink.dpu.tokenizer.Tokenizer`)."""

    vocab_size: int
    special_ids: frozenset[int]
    eos_token_ids: list[int]
    bos_token_id: int | None

    def token_bytes(self, token_id: int) -> bytes: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Vocabulary:
    """What llguidance needs of a tokenizer, picklable (it goes to the worker processes)."""

    tokens: tuple[bytes, ...]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    special_ids: tuple[int, ...]

    @classmethod
    def of(cls, tok: TokenSource) -> "Vocabulary":
        return cls(tuple(tok.token_bytes(i) for i in range(tok.vocab_size)),
                   tuple(tok.eos_token_ids), tok.bos_token_id, tuple(sorted(tok.special_ids)))

    def lltokenizer(self, encode=None):
        """An ``llguidance.LLTokenizer`` of this vocabulary. ``encode``: the model's own
        text -> ids (for llguidance's forced tokens); else a greedy longest-match."""
        import llguidance

        vocab = self

        class _Wrapped:
            eos_token_id = vocab.eos_token_ids[0] if vocab.eos_token_ids else 0
            bos_token_id = vocab.bos_token_id
            tokens = list(vocab.tokens)
            special_token_ids = list(vocab.special_ids)

            def __call__(self, text):
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return encode(text) if encode is not None else tok.greedy_tokenize(text)

        tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()),
                                     eos_token=list(self.eos_token_ids) or None)
        return tok


def parser_limits():
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


# -- the worker process -----------------------------------------------------------------


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _worker_main(conn_in: Connection, conn: Connection) -> None:
    """A worker: read the vocabulary and the memory cap, build the tokenizer, cap the address
    space, then check grammars until the parent closes the pipe."""
    import llguidance

    try:
        vocab, memory_bytes = conn_in.recv()
    except EOFError:
        return
    tok = vocab.lltokenizer()
    limits = parser_limits()
    if memory_bytes > 0:
        cap = _vm_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            text = conn_in.recv()
        except EOFError:
            return
        try:
            m = llguidance.LLMatcher(tok, text, limits=limits)
            if not m.is_error():
                m.compute_bitmask()  # builds the lexer's first states: the real cost
            conn.send(("error", m.get_error()) if m.is_error() else ("ok", None))
        except MemoryError:
            conn.send(("memory", None))
        except Exception as exc:  # an llguidance API error: report, keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Worker:
    """One worker process (``python -m blink.dpu.structured.workers``: a fresh interpreter,
    so nothing of the caller's ``__main__`` is re-run), over two pipes."""

    def __init__(self, vocab: Vocabulary, memory_bytes: int) -> None:
        to_child, child_in = os.pipe()
        child_out, from_child = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "blink.dpu.structured.workers", str(to_child), str(from_child)],
            pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, close_fds=True)
        os.close(to_child)
        os.close(from_child)
        self._send = Connection(child_in, readable=False)
        self._parent = Connection(child_out, writable=False)
        self.ready = False
        try:
            self._send.send((vocab, memory_bytes))
        except OSError:
            pass  # it died at once: wait_ready says so

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self._parent.poll(timeout_s):
            self.kill()
            raise GrammarLimitError("the grammar worker did not start within "
                                    f"{timeout_s:g} s")
        try:
            self._parent.recv()
        except EOFError:
            self.kill()
            raise GrammarLimitError("the grammar worker failed to start") from None
        self.ready = True

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill that did not land
            logger.error("grammar worker %d did not exit after SIGKILL", self.process.pid)
        self._send.close()
        self._parent.close()


class GrammarWorkers:
    """A pool of worker processes, started on first use; a killed one is replaced."""

    def __init__(self, vocab_source, *, workers: int = DEFAULT_WORKERS,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 memory_mb: float = DEFAULT_COMPILE_MEMORY_MB) -> None:
        if workers < 1 or not timeout_s > 0 or not memory_mb > 0:
            raise ValueError("grammar workers: workers >= 1, timeout > 0 and memory > 0")
        self._vocab_source = vocab_source  # () -> Vocabulary, called once
        self._vocab: Vocabulary | None = None
        self.size = workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self.killed = 0  # workers killed at a limit or for a cancelled compile

    def _spawn(self) -> _Worker:
        with self._lock:
            if self._vocab is None:
                self._vocab = self._vocab_source()
            return _Worker(self._vocab, int(self.memory_mb * (1 << 20)))

    def _take(self) -> _Worker:
        with self._lock:
            grow = self._started < self.size and self._idle.empty()
            if grow:
                self._started += 1
        if grow:
            worker = self._spawn()
        else:
            worker = self._idle.get(timeout=WORKER_START_TIMEOUT_S + self.timeout_s * 4)
        worker.wait_ready(WORKER_START_TIMEOUT_S)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.killed += 1
        self._idle.put(self._spawn())

    def check(self, spec: GrammarSpec, cancelled: threading.Event | None = None) -> None:
        """Build and exercise ``spec`` in a worker; raise a 400-class error naming the limit
        or the grammar's problem. ``cancelled``: set by the caller to give up (the worker
        is killed)."""
        try:
            worker = self._take()
        except queue.Empty:
            raise GrammarLimitError("every grammar worker stayed busy; retry") from None
        status, detail = "timeout", None
        deadline = time.monotonic() + self.timeout_s
        try:
            worker._send.send(spec.text)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or (cancelled is not None and cancelled.is_set()):
                    break
                if worker._parent.poll(min(left, 0.05)):
                    status, detail = worker._parent.recv()
                    break
        except (EOFError, OSError):
            status, detail = "died", worker.process.poll()
        if status in ("ok", "error"):
            self._idle.put(worker)
        else:
            self._replace(worker)
        if cancelled is not None and cancelled.is_set() and status not in ("ok", "error"):
            raise GrammarLimitError("the request was cancelled while its grammar compiled")
        if status == "ok":
            return
        what = f"the {spec.kind} constraint"
        if status == "error":
            raise StructuredOutputsError(f"{what} cannot be enforced: {detail}")
        if status == "timeout":
            raise GrammarLimitError(
                f"{what} did not compile within the limit of {self.timeout_s:g} s "
                "(--grammar-compile-timeout)")
        raise GrammarLimitError(
            f"{what} needs more than the grammar compile memory limit of "
            f"{self.memory_mb:g} MiB (--grammar-compile-memory-mb)")

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


@dataclass
class CompiledGrammar:
    """An accepted constraint: a matcher template every request of it copies."""

    key: str
    kind: str
    template: Any  # llguidance.LLMatcher in its initial state
    mask_bytes: int
    nbytes: int  # what it counts against the cache budget
    compile_s: float = 0.0
    eos_token_ids: tuple[int, ...] = ()

    def new_masker(self) -> TokenMasker:
        """A fresh matcher for one request (a copy of the template)."""
        return TokenMasker(self.template.deep_copy(), self.mask_bytes, self.eos_token_ids)


@dataclass
class CacheStats:
    hits: int = 0
    compiles: int = 0
    refusals: int = 0
    evictions: int = 0
    bytes: int = 0


class GrammarService:
    """Constraints -> :class:`CompiledGrammar` for one tokenizer: the spec, the worker's
    check, this process's template, an LRU cache of accepted ones under ``cache_mb``."""

    def __init__(self, tokenizer: TokenSource, *, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 memory_mb: float = DEFAULT_COMPILE_MEMORY_MB,
                 cache_mb: float = DEFAULT_GRAMMAR_CACHE_MB,
                 workers: int = DEFAULT_WORKERS) -> None:
        if not cache_mb >= 0:
            raise ValueError("grammar cache: cache_mb must be >= 0")
        self.tokenizer = tokenizer
        self._vocab: Vocabulary | None = None
        self._lltok = None
        self._lock = threading.Lock()
        self.workers = GrammarWorkers(self.vocabulary, workers=workers, timeout_s=timeout_s,
                                      memory_mb=memory_mb)
        self.cache_budget = int(cache_mb * (1 << 20))
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self.stats = CacheStats()

    def vocabulary(self) -> Vocabulary:
        with self._lock:
            if self._vocab is None:
                self._vocab = Vocabulary.of(self.tokenizer)
            return self._vocab

    def _tokenizer(self):
        vocab = self.vocabulary()
        with self._lock:
            if self._lltok is None:
                encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
                self._lltok = vocab.lltokenizer(encode)
            return self._lltok

    def cached(self, so: StructuredOutputs) -> CompiledGrammar | None:
        spec = grammar_spec(so)
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None:
                self._cache.move_to_end(spec.key)
            return entry

    def compile(self, so: StructuredOutputs, cancelled: threading.Event | None = None) -> CompiledGrammar:
        """The constraint's :class:`CompiledGrammar` (blocking; run it off the event loop).
        Raises :class:`StructuredOutputsError` (400) naming what is wrong or which limit."""
        import llguidance

        t0 = time.perf_counter()
        spec = grammar_spec(so)
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None:
                self._cache.move_to_end(spec.key)
                self.stats.hits += 1
                return entry
        try:
            self.workers.check(spec, cancelled)
        except StructuredOutputsError:
            self.stats.refusals += 1
            raise
        tok = self._tokenizer()
        template = llguidance.LLMatcher(tok, spec.text, limits=parser_limits())
        if template.is_error():  # the worker accepted it: only an llguidance bug gets here
            self.stats.refusals += 1
            raise StructuredOutputsError(f"the {spec.kind} constraint cannot be enforced: "
                                         f"{template.get_error()}")
        mask_bytes = (tok.vocab_size + 31) // 32 * 4  # what unsafe_compute_mask_ptr takes
        size = len(spec.text) * CACHE_BYTES_PER_TEXT_BYTE + CACHE_BYTES_PER_ENTRY
        entry = CompiledGrammar(spec.key, spec.kind, template, mask_bytes, size,
                                time.perf_counter() - t0, self.vocabulary().eos_token_ids)
        with self._lock:
            self.stats.compiles += 1
            if size <= self.cache_budget and spec.key not in self._cache:
                self._cache[spec.key] = entry
                self.stats.bytes += size
                while self.stats.bytes > self.cache_budget:
                    _, old = self._cache.popitem(last=False)
                    self.stats.bytes -= old.nbytes
                    self.stats.evictions += 1
        return entry

    async def compile_async(self, so: StructuredOutputs) -> CompiledGrammar:
        """:meth:`compile` in a thread; if the awaiting task is cancelled (the client left),
        the compile is cancelled too (its worker killed)."""
        cancelled = threading.Event()
        try:
            return await asyncio.shield(asyncio.to_thread(self.compile, so, cancelled))
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def close(self) -> None:
        self.workers.close()


if __name__ == "__main__":  # a worker process (see _Worker)
    _worker_main(Connection(int(sys.argv[1]), writable=False),
                 Connection(int(sys.argv[2]), readable=False))
