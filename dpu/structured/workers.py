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

A JSON schema served by its lenient grammar (:mod:`.grammar`: keywords llguidance cannot
enforce) carries a :class:`~.grammar.FinalCheck`: its finished outputs are validated against
the original schema (:func:`output_validator`) in separate final-check workers (no
vocabulary; killed past ``DEFAULT_FINAL_CHECK_TIMEOUT_S``), through
:meth:`CompiledGrammar.check_output`.

Accepted grammars are kept in an LRU cache with a byte budget (:class:`GrammarService`;
refusals are not cached; a constraint seen before is found by its content hash). Memory the
frontend can spend on structured outputs: the cache
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
from typing import Any, Callable, Protocol, Sequence

from blink.dpu.structured.grammar import (FinalCheck, GrammarSpec, grammar_spec, keyword_refusal,
                                          unenforced_keywords)
from blink.dpu.structured.masker import TokenMasker
from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 1.0
DEFAULT_COMPILE_MEMORY_MB = 1024.0
DEFAULT_GRAMMAR_CACHE_MB = 64.0
DEFAULT_WORKERS = 2
#: Constraint hashes remembered with their grammar's key (64 bytes each, twice).
_KEYS_KEPT = 4096
#: A final check (``jsonschema`` on a finished output, in a worker) past this is killed and
#: the output fails (nothing says it is valid); the outputs are bounded by max_tokens.
DEFAULT_FINAL_CHECK_TIMEOUT_S = 2.0
DEFAULT_FINAL_CHECK_WORKERS = 2
#: A worker process's start (Python, llguidance, the vocabulary): not counted in the limit.
WORKER_START_TIMEOUT_S = 60.0
#: A worker's nice: the hostile work (a compile or a check up to its limit) yields to the
#: serving path. Without it a worker inherits the nice of the thread that started it: -10,
#: the frontend's request path (configs/threads/default.yaml), the engine loop's equal.
WORKER_NICE = 10
#: llguidance's parser limits, for the workers' checks and every request's matcher.
PARSER_LIMITS: dict[str, int | bool] = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 1_000_000,  # ~20 ms of lexer construction
    "step_lexer_fuel": 200_000,  # llguidance: ~14k per ms
    "step_max_items": 50_000,
    "max_lexer_states": 20_000,  # ~20-40 MB of lexer per matcher, at most
    "max_grammar_size": 500_000,
    # errors name the problem only: verbose ones append the parser's state, the tokens so
    # far and the whole grammar (a 400 of 21 KB for a 400-rule Lark grammar)
    "verbose_errors": False,
}
#: what llguidance appends to an error when ``verbose_errors`` is off
_NON_VERBOSE = "\n<non-verbose/>"
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


def _try_grammar(llguidance, tok, limits, text: str) -> str | None:
    """Build and exercise one grammar: None if it is fine, else llguidance's error."""
    m = llguidance.LLMatcher(tok, text, limits=limits)
    if not m.is_error():
        m.compute_bitmask()  # builds the lexer's first states: the real cost
    return m.get_error().replace(_NON_VERBOSE, "") if m.is_error() else None


def _worker_main(conn_in: Connection, conn: Connection) -> None:
    """A worker: read the vocabulary (None for a final-check worker) and the memory cap,
    build the tokenizer, cap the address space, then answer until the parent closes the
    pipe: ``("grammar", text, fallback, lenient_first)`` -> ``("ok", (0 or 1, strict
    error))`` (1: the fallback serves it: tried first, or the strict grammar was refused for
    keywords only) or ``("error", message)``; ``("validate", schema_json, output)`` ->
    ``("ok", None or the problem)``."""
    try:
        vocab, memory_bytes = conn_in.recv()
    except EOFError:
        return
    if vocab is not None:
        import llguidance

        tok = vocab.lltokenizer()
        limits = parser_limits()
    else:  # a final-check worker: its imports are part of its start, not of a check
        import jsonschema  # noqa: F401
        from jsonschema.exceptions import best_match  # noqa: F401
    if memory_bytes > 0:
        cap = _vm_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    validators: OrderedDict[str, Any] = OrderedDict()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn_in.recv()
        except EOFError:
            return
        try:
            if msg[0] == "validate":
                conn.send(("ok", _validate_output(validators, msg[1], msg[2])))
                continue
            _, text, fallback, lenient_first = msg
            if lenient_first:  # see GrammarSpec.lenient_first
                error = _try_grammar(llguidance, tok, limits, fallback)
                conn.send(("ok", (1, "")) if error is None else ("error", error))
                continue
            error = _try_grammar(llguidance, tok, limits, text)
            if error is None:
                conn.send(("ok", (0, None)))
            elif fallback is None or not keyword_refusal(error):
                conn.send(("error", error))
            else:
                lenient_error = _try_grammar(llguidance, tok, limits, fallback)
                conn.send(("ok", (1, error)) if lenient_error is None else ("error", lenient_error))
        except MemoryError:
            conn.send(("memory", None))
        except Exception as exc:  # an llguidance API error: report, keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


#: Validators a final-check worker keeps (by schema text), most recently used.
_VALIDATORS_KEPT = 32


def output_validator(schema: Any):
    """The ``jsonschema`` validator a final check uses: the draft the schema's ``$schema``
    names, else 2020-12 that also asserts the draft-4..7 forms llguidance reads (property
    and schema ``dependencies``, ``items`` as a list with ``additionalItems``). ``format`` is
    not asserted here: the grammar enforces the formats it knows, the others are
    annotations (docs/architecture.md, "Structured outputs")."""
    import jsonschema
    from jsonschema import _keywords, _legacy_keywords

    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        cls = jsonschema.validators.validator_for(schema)
    else:
        def items(validator, value, instance, sch):
            if isinstance(value, list):
                yield from _legacy_keywords.items_draft6_draft7_draft201909(
                    validator, value, instance, sch)
            else:
                yield from _keywords.items(validator, value, instance, sch)

        def additional_items(validator, value, instance, sch):
            if isinstance(sch.get("items"), list):
                yield from _legacy_keywords.additionalItems(validator, value, instance, sch)

        cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, {
            "dependencies": _legacy_keywords.dependencies_draft4_draft6_draft7,
            "items": items, "additionalItems": additional_items})
    return cls(schema)


def _validate_output(validators: OrderedDict, schema_json: str, output: str) -> str | None:
    """None if ``output`` is JSON valid against the schema, else what is wrong."""
    import json

    from jsonschema.exceptions import best_match

    validator = validators.get(schema_json)
    if validator is None:
        validator = validators[schema_json] = output_validator(json.loads(schema_json))
        while len(validators) > _VALIDATORS_KEPT:
            validators.popitem(last=False)
    validators.move_to_end(schema_json)
    try:
        value = json.loads(output)
    except ValueError as exc:
        return f"the output is not JSON: {exc}"
    error = best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "$" + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]"
                          for p in error.absolute_path)
    return f"{error.message[:300]} (keyword {error.validator!r} at {where})"


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

    def _ask(self, msg: Any, cancelled: threading.Event | None) -> tuple[str, Any]:
        """Send ``msg`` to an idle worker and wait for its answer within the limit:
        ``(status, detail)``, status ``ok`` / ``error`` (the worker stays) or ``timeout`` /
        ``memory`` / ``died`` (the worker was killed and replaced)."""
        try:
            worker = self._take()
        except queue.Empty:
            raise GrammarLimitError("every grammar worker stayed busy; retry") from None
        status, detail = "timeout", None
        deadline = time.monotonic() + self.timeout_s
        try:
            worker._send.send(msg)
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
        return status, detail

    def check(self, spec: GrammarSpec, cancelled: threading.Event | None = None
              ) -> tuple[int, str | None]:
        """Build and exercise ``spec`` in a worker; raise a 400-class error naming the limit
        or the grammar's problem. ``cancelled``: set by the caller to give up (the worker
        is killed). Returns ``(0, None)`` when ``spec.text`` is fine, ``(1, its error)`` when
        llguidance refused it for keywords only and ``spec.fallback`` is fine."""
        status, detail = self._ask(("grammar", spec.text, spec.fallback,
                                    spec.lenient_first and spec.fallback is not None), cancelled)
        if cancelled is not None and cancelled.is_set() and status not in ("ok", "error"):
            raise GrammarLimitError("the request was cancelled while its grammar compiled")
        if status == "ok":
            return detail
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

    def validate(self, schema_json: str, output: str) -> str | None:
        """Validate ``output`` against the JSON schema in a worker (a final check): None if
        valid, else what is wrong (also when the check passed a limit: then nothing says
        the output is valid)."""
        try:
            status, detail = self._ask(("validate", schema_json, output), None)
        except StructuredOutputsError as exc:  # no worker could start / all stayed busy
            return f"the check could not run: {exc}"
        if status == "ok":
            return detail
        if status == "error":
            return f"the check failed: {detail}"
        if status == "timeout":
            return f"the check did not finish within its limit of {self.timeout_s:g} s"
        return f"the check needed more than its memory limit of {self.memory_mb:g} MiB"

    def warm(self) -> None:
        """Start one worker now (not waiting for it), so the first use does not wait for a
        whole start."""
        with self._lock:
            if self._started:
                return
            self._started += 1
        self._idle.put(self._spawn())

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
    #: set when the grammar is the schema's lenient one: a finished output must pass it
    final_check: FinalCheck | None = None
    #: (schema_json, output) -> None or the problem: the service's final-check workers
    checker: Callable[[str, str], str | None] | None = field(default=None, repr=False)

    def new_masker(self) -> TokenMasker:
        """A fresh matcher for one request (a copy of the template)."""
        return TokenMasker(self.template.deep_copy(), self.mask_bytes, self.eos_token_ids)

    @property
    def needs_final_check(self) -> bool:
        return self.final_check is not None

    def check_output(self, text: str) -> str | None:
        """The final check of an output that finished ``stop`` (blocking, bounded: run it
        off the event loop): None if it satisfies the original schema, else the message the
        choice fails with, naming the keywords the grammar does not enforce and the
        validation error."""
        check = self.final_check
        if check is None:
            return None
        assert self.checker is not None, "a final check needs the service's checker"
        problem = self.checker(check.schema_json, text)
        if problem is None:
            return None
        keywords = ", ".join(check.keywords) or "some keywords"
        return (f"structured outputs: the output does not satisfy its JSON schema: {problem}. "
                f"The grammar cannot enforce {keywords}; those are checked once the output "
                "is complete, and this output failed the check (retry, e.g. with another "
                "seed, or simplify the schema).")


@dataclass
class CacheStats:
    hits: int = 0
    compiles: int = 0
    refusals: int = 0
    evictions: int = 0
    bytes: int = 0
    lenient: int = 0  # compiles served by the lenient grammar + the final check
    final_checks: int = 0
    final_check_failures: int = 0


class GrammarService:
    """Constraints -> :class:`CompiledGrammar` for one tokenizer: the spec, the worker's
    check, this process's template, an LRU cache of accepted ones under ``cache_mb``."""

    def __init__(self, tokenizer: TokenSource, *, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 memory_mb: float = DEFAULT_COMPILE_MEMORY_MB,
                 cache_mb: float = DEFAULT_GRAMMAR_CACHE_MB,
                 workers: int = DEFAULT_WORKERS,
                 check_timeout_s: float = DEFAULT_FINAL_CHECK_TIMEOUT_S) -> None:
        if not cache_mb >= 0:
            raise ValueError("grammar cache: cache_mb must be >= 0")
        self.tokenizer = tokenizer
        self._vocab: Vocabulary | None = None
        self._lltok = None
        self._lock = threading.Lock()
        self.workers = GrammarWorkers(self.vocabulary, workers=workers, timeout_s=timeout_s,
                                      memory_mb=memory_mb)
        #: final checks of lenient grammars' outputs (jsonschema, no vocabulary): their own
        #: workers, so a check never waits behind a compile; started on first need
        self.checkers = GrammarWorkers(lambda: None, workers=DEFAULT_FINAL_CHECK_WORKERS,
                                       timeout_s=check_timeout_s, memory_mb=memory_mb)
        self.cache_budget = int(cache_mb * (1 << 20))
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        #: a constraint's content hash -> its grammar's key (so a cache hit skips grammar_spec)
        self._keys: OrderedDict[str, str] = OrderedDict()
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

    def _known(self, so: StructuredOutputs) -> tuple[str, CompiledGrammar | None]:
        """The constraint's content hash and, if a grammar of it is cached, that grammar:
        a hit costs no :func:`grammar_spec` (tens of ms of Python for a big schema)."""
        digest = so.content_hash()
        with self._lock:
            key = self._keys.get(digest)
            entry = self._cache.get(key) if key is not None else None
            if entry is not None:
                self._cache.move_to_end(key)
                self._keys.move_to_end(digest)
            return digest, entry

    def _remember(self, digest: str, key: str) -> None:
        with self._lock:
            self._keys[digest] = key
            self._keys.move_to_end(digest)
            while len(self._keys) > _KEYS_KEPT:
                self._keys.popitem(last=False)

    def _lookup(self, so: StructuredOutputs) -> tuple[CompiledGrammar | None, GrammarSpec | None]:
        """``(the cached entry or None, the constraint's spec when it had to be built)``."""
        digest, entry = self._known(so)
        if entry is not None:
            return entry, None
        spec = grammar_spec(so)
        self._remember(digest, spec.key)
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None:
                self._cache.move_to_end(spec.key)
        return entry, spec

    def cached(self, so: StructuredOutputs) -> CompiledGrammar | None:
        return self._lookup(so)[0]

    def compile(self, so: StructuredOutputs, cancelled: threading.Event | None = None) -> CompiledGrammar:
        """The constraint's :class:`CompiledGrammar` (blocking; run it off the event loop).
        Raises :class:`StructuredOutputsError` (400) naming what is wrong or which limit."""
        import llguidance

        t0 = time.perf_counter()
        entry, spec = self._lookup(so)
        if entry is not None:
            with self._lock:
                self.stats.hits += 1
            return entry
        assert spec is not None
        try:
            used, strict_error = self.workers.check(spec, cancelled)
        except StructuredOutputsError:
            self.stats.refusals += 1
            raise
        text, final = spec.text, None
        if used == 1:  # refused for keywords only: the lenient grammar + the final check
            assert spec.fallback is not None and spec.final_check is not None
            text = spec.fallback
            keywords = set(spec.final_check.keywords)
            if strict_error:
                keywords |= set(unenforced_keywords(so.schema_dict(), strict_error))
            final = FinalCheck(spec.final_check.schema_json, tuple(sorted(keywords)))
            self.checkers.warm()
        tok = self._tokenizer()
        template = llguidance.LLMatcher(tok, text, limits=parser_limits())
        if template.is_error():  # the worker accepted it: only an llguidance bug gets here
            self.stats.refusals += 1
            raise StructuredOutputsError(f"the {spec.kind} constraint cannot be enforced: "
                                         f"{template.get_error()}")
        mask_bytes = (tok.vocab_size + 31) // 32 * 4  # what unsafe_compute_mask_ptr takes
        size = (len(text) + (len(final.schema_json) if final else 0)) \
            * CACHE_BYTES_PER_TEXT_BYTE + CACHE_BYTES_PER_ENTRY
        entry = CompiledGrammar(spec.key, spec.kind, template, mask_bytes, size,
                                time.perf_counter() - t0, self.vocabulary().eos_token_ids,
                                final, self.final_check if final else None)
        with self._lock:
            self.stats.compiles += 1
            self.stats.lenient += final is not None
            if size <= self.cache_budget and spec.key not in self._cache:
                self._cache[spec.key] = entry
                self.stats.bytes += size
                while self.stats.bytes > self.cache_budget:
                    _, old = self._cache.popitem(last=False)
                    self.stats.bytes -= old.nbytes
                    self.stats.evictions += 1
        return entry

    def final_check(self, schema_json: str, output: str) -> str | None:
        """Validate a finished output against its original schema in a final-check worker
        (killed past ``check_timeout_s``): None if valid, else the problem."""
        problem = self.checkers.validate(schema_json, output)
        with self._lock:
            self.stats.final_checks += 1
            self.stats.final_check_failures += problem is not None
        return problem

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
        self.checkers.close()


if __name__ == "__main__":  # a worker process (see _Worker)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, WORKER_NICE)  # raising one's nice needs no privilege
    except OSError:  # pragma: no cover
        pass
    _worker_main(Connection(int(sys.argv[1]), writable=False),
                 Connection(int(sys.argv[2]), readable=False))
