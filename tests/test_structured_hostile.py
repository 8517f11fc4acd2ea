"""Hostile constraints against a real ``blink serve`` (issue 30, "What must work" item 4): no
request can take the server down or stall others.

One ``blink serve --model null`` for the module (the real engine, ring and frontend with
SmolLM2's tokenizer and chat template, no model work: it starts in a few seconds), with a
small grammar compile limit (:data:`COMPILE_LIMIT_S`). While a background watcher sends a
probe every ~100 ms (a cached ``json_object`` request and a plain one, in turn) and reads
``/health`` and the frontend process's RSS, each hostile request is sent on its own:

- the MCP-fetch tool (``url`` with ``format: uri``, an integer with ``exclusiveMinimum`` /
  ``exclusiveMaximum``, ``start_index`` ``minimum: 0``, ``raw`` boolean) with
  ``tool_choice: "required"`` and ``"auto"`` (hermes parser);
- 40 tools (``required`` and ``auto``) and 200 tools (a 400 naming OpenAI's 128-tool limit);
- ``{"type": "string", "maxLength": 20}`` alone, ``".{0,100}"`` as a regex;
- schemas built to explode (an ``allOf`` of 10 ``anyOf`` triples with patterns: 3^10
  branches; 600 pattern-string branches), a Lark grammar of 400 overlapping regex
  terminals, 10 distinct 5,000-character alternation regexes;
- an ambiguous Lark grammar, cheap to compile but costly per token (the mask is computed in
  the frontend's poller, which serves every stream);
- a schema served by the lenient grammar whose final check (``jsonschema``) meets
  catastrophic backtracking in Python's ``re``.

Each must be answered (200, or a 400 naming the limit or the problem) within
:data:`ANSWER_LIMIT_S` (the compile limit + a margin: issue 30 asks for 2 s); meanwhile every
probe answers within :data:`PROBE_LIMIT_S`, ``/health`` stays 200 and the frontend's RSS
(sampled, and its ``VmHWM`` peak) stays within :data:`RSS_CAP_MB` of what it was before the
first hostile request. The cap is the documented bound (docs/architecture.md, "Structured
outputs": the compile cache's byte budget, 64 MiB by default, plus each matcher's lexer
states; compiles run in worker processes, which are not the frontend) with room for
allocator noise on a shared machine.

The grammar workers themselves (compiles and final checks: the hostile work) must run at a
housekeeping nice, below the request path's (:func:`test_grammar_workers_yield_to_the_serving_path`).

A 200 is checked too: tool calls name an offered tool, a ``maxLength`` string and the regex's
text match their constraint when they finish with ``stop``. Tool-call arguments cut by
``max_tokens`` are checked by :func:`test_cut_tool_call_arguments_parse_as_json`.
"""
from __future__ import annotations

import json
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from e2e_helpers import ServeProcess, pid_alive  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "null"
COMPILE_LIMIT_S = 0.5
#: A hostile request's answer: the compile limit plus the request's own work (tokenizing a
#: 4,600-token tools prompt, 32 null-model tokens) on two busy cores. Issue 30: "within 2 s".
ANSWER_LIMIT_S = COMPILE_LIMIT_S + 1.5
PROBE_LIMIT_S = 1.0
PROBE_EVERY_S = 0.1
#: The frontend's RSS may grow at most this much above its size before the first hostile
#: request (issue 30 measured 11.7 GB and 21.6 GB before the redesign).
RSS_CAP_MB = 1536
MAX_TOKENS = 32
#: A refusal's message names the problem in a few lines (a 400 once carried 21 KB: the
#: parser's state and the whole grammar).
MAX_MESSAGE_CHARS = 1000
FLAGS = ("--model", MODEL, "--max-model-len", "8192", "--max-num-seqs", "16",
         "--kv-cache-tokens", "16384", "--grammar-compile-timeout", str(COMPILE_LIMIT_S),
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
MESSAGES = [{"role": "user", "content": "Fetch https://example.com and summarise it."}]

FETCH = {"type": "function", "function": {
    "name": "fetch",
    "description": "Fetches a URL from the internet and extracts its contents as markdown.",
    "parameters": {"type": "object", "title": "Fetch", "required": ["url"], "properties": {
        "url": {"type": "string", "format": "uri", "minLength": 1, "title": "Url",
                "description": "URL to fetch"},
        "max_length": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000000,
                       "default": 5000, "description": "Maximum number of characters."},
        "start_index": {"type": "integer", "minimum": 0, "default": 0,
                        "description": "Start output at this character index."},
        "raw": {"type": "boolean", "default": False,
                "description": "Get the actual HTML content, without simplification."}}}}}


def tools(n: int) -> list[dict]:
    """``n`` plain tools of four parameters each (the issue's 20 x 4 / 40-tool shape)."""
    return [{"type": "function", "function": {
        "name": f"tool_{i:03d}", "description": f"Tool number {i}.",
        "parameters": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string"}, "b": {"type": "integer", "minimum": -i},
            "c": {"type": "boolean"}, "d": {"type": "number"}}}}} for i in range(n)]


def allof_product(k: int = 10, n: int = 3) -> dict:
    """An ``allOf`` of ``k`` ``anyOf`` s of ``n`` pattern objects: n^k branches if expanded."""
    return {"allOf": [{"anyOf": [
        {"type": "object", "required": [f"a{i}_{j}"], "properties": {
            f"a{i}_{j}": {"type": "string", "pattern": f"^x{j}[a-z]{{{j},{j + 5}}}$"}}}
        for j in range(n)]} for i in range(k)]}


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


def pattern_branches(n: int = 600) -> dict:
    rng = random.Random(3)
    return {"anyOf": [{"type": "string",
                       "pattern": f"^{_word(rng, 2)}[a-z0-9]{{{i % 7 + 3},{i % 30 + 40}}}"
                                  f"({_word(rng, 2)}|[0-9]{{2,9}}){{1,9}}$"} for i in range(n)]}


def alternation_regex(seed: int, chars: int = 5000) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(_word(rng, rng.randint(4, 12)))
    return "(" + "|".join(words) + ")"


def lexer_bomb_lark(n: int = 400) -> str:
    """A Lark grammar of ``n`` overlapping regex terminals: past llguidance's lexer limits
    ("too many expressions constructed") at the first mask."""
    rng = random.Random(2)
    rules = "\n".join(f"R{i}: /[a-z]{{3,{30 + i % 50}}}([0-9]{{1,5}}[{_word(rng, 3)}]){{1,20}}x{i}/"
                      for i in range(n))
    return "start: " + " | ".join(f"R{i}" for i in range(n)) + "\n" + rules


AMBIGUOUS_LARK = 'start: x\nx: x x | x x x | "a" | "aa" | "b" x'
AMBIGUOUS_TOKENS = 120
AMBIGUOUS_STREAMS = 4


# -- the server and the watcher -------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = ServeProcess(*FLAGS, name="hostile-serve")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(signal.SIGTERM)


def chat(client: httpx.Client, timeout: float = 30.0, **body) -> tuple[httpx.Response, float]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            **body}
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json=body, timeout=timeout)
    return r, time.monotonic() - t0


def rss_kb(pid: int, field_name: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field_name} in /proc/{pid}/status")


@dataclass
class Watch:
    """Probes, ``/health`` and the frontend's RSS, in a background thread."""

    base_url: str
    frontend_pid: int
    probes: list[tuple[str, float, int]] = field(default_factory=list)  # (kind, s, status)
    health: list[int] = field(default_factory=list)
    rss_kb: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start_rss_kb = rss_kb(self.frontend_pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-watch", daemon=True)

    def _run(self) -> None:
        probes = [("json_object", {"response_format": {"type": "json_object"}, "max_tokens": 4}),
                  ("plain", {"max_tokens": 4})]
        with httpx.Client(base_url=self.base_url, timeout=10) as c:
            i = 0
            while not self._stop.is_set():
                tick = time.monotonic()
                kind, body = probes[i % 2]
                i += 1
                try:
                    r, dt = chat(c, timeout=10, **body)
                    self.probes.append((kind, dt, r.status_code))
                    self.health.append(c.get("/health", timeout=10).status_code)
                    self.rss_kb.append(rss_kb(self.frontend_pid))
                except (httpx.HTTPError, OSError, AssertionError) as e:
                    self.errors.append(f"{kind}: {type(e).__name__}: {e}")
                self._stop.wait(max(0.0, PROBE_EVERY_S - (time.monotonic() - tick)))

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def check(self) -> str:
        """Assert the probes, /health and the RSS cap; a one-line summary of them."""
        assert not self.errors, self.errors[:5]
        assert self.probes, "no probe was answered"
        slow = [(k, round(dt, 3), s) for k, dt, s in self.probes if dt > PROBE_LIMIT_S]
        assert not slow, f"probes over {PROBE_LIMIT_S} s: {slow}"
        bad = [(k, s) for k, _, s in self.probes if s != 200]
        assert not bad, f"probes not answered 200: {bad}"
        assert set(self.health) == {200}, f"/health answers: {sorted(set(self.health))}"
        peak_kb = max(rss_kb(self.frontend_pid, "VmHWM"), *self.rss_kb)
        grown_mb = (peak_kb - self.start_rss_kb) / 1024
        assert grown_mb < RSS_CAP_MB, (
            f"the frontend grew {grown_mb:.0f} MB (cap {RSS_CAP_MB} MB) from "
            f"{self.start_rss_kb / 1024:.0f} MB")
        lat = sorted(dt for _, dt, _ in self.probes)
        return (f"{len(lat)} probes, max {lat[-1] * 1e3:.0f} ms, p50 {lat[len(lat) // 2] * 1e3:.0f} ms;"
                f" frontend RSS {self.start_rss_kb / 1024:.0f} MB -> peak {peak_kb / 1024:.0f} MB")


@pytest.fixture(scope="module")
def warm(server):
    """Both grammar workers started (their start is not part of the limit) and the probe's
    ``json_object`` grammar cached, before anything is timed."""
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        results: list[int] = []

        def one(body):
            results.append(chat(c, timeout=120, **body)[0].status_code)

        threads = [threading.Thread(target=one, args=(b,)) for b in (
            {"response_format": {"type": "json_object"}, "max_tokens": 2},
            {"structured_outputs": {"regex": "warm-[0-9]"}, "max_tokens": 2})]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert results == [200, 200], results
        chat(c, max_tokens=2)
    return server


# -- the hostile requests -------------------------------------------------------------------


def _tool_names(r: httpx.Response) -> list[str]:
    message = r.json()["choices"][0]["message"]
    return [c["function"]["name"] for c in message.get("tool_calls") or []]


def _refusal_names_problem(r: httpx.Response, *words: str) -> str:
    err = r.json()["error"]
    assert any(w.lower() in err["message"].lower() for w in words), err
    # the problem, not llguidance's parser-state dump with the whole grammar echoed back
    assert len(err["message"]) <= MAX_MESSAGE_CHARS, (len(err["message"]), err["message"][:2000])
    return err["message"].splitlines()[0][:120]


def _forced_call(r, names: set[str]):
    """A forced call: tool calls naming offered tools, or (the null model's URL and strings
    never close, so MAX_TOKENS cuts the call) the cut call as plain content (item 3)."""
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    called = _tool_names(r)
    if called:
        assert set(called) <= names, r.text
    else:
        assert choice["finish_reason"] == "length", r.text
        assert choice["message"]["content"].startswith('[{"name": "'), r.text


def _fetch_required(r):
    _forced_call(r, {"fetch"})


def _auto(r):
    assert r.status_code == 200, r.text  # hermes: the model decides; nothing to enforce


def _tools40_required(r):
    _forced_call(r, {f"tool_{i:03d}" for i in range(40)})


def _tools200(r):
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools", r.text
    _refusal_names_problem(r, "At most 128 tools")


def _max_length(r):
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        assert isinstance(value, str) and len(value) <= 20, choice


def _regex100(r):
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert re.fullmatch(".{0,100}", choice["message"]["content"]), choice


def _exploding(r):
    # A 400 names what was too much (llguidance's own limits or --grammar-compile-*); a
    # 200 is an answer too (llguidance is lazy: what it can hold, it serves).
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        _refusal_names_problem(r, "too large", "too many", "limit", "--grammar-compile")


HOSTILE = {
    "fetch-required": ({"tools": [FETCH], "tool_choice": "required"}, _fetch_required),
    "fetch-auto": ({"tools": [FETCH], "tool_choice": "auto"}, _auto),
    "40-tools-required": ({"tools": tools(40), "tool_choice": "required"}, _tools40_required),
    "40-tools-auto": ({"tools": tools(40), "tool_choice": "auto"}, _auto),
    "200-tools-required": ({"tools": tools(200), "tool_choice": "required"}, _tools200),
    "maxLength-20": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "maxLength": 20}}}}, _max_length),
    "allOf-anyOf-product": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": allof_product()}}}, _exploding),
    "600-pattern-branches": ({"structured_outputs": {"json": pattern_branches()}}, _exploding),
    "regex-.{0,100}": ({"structured_outputs": {"regex": ".{0,100}"}}, _regex100),
    "lexer-bomb-grammar": ({"structured_outputs": {"grammar": lexer_bomb_lark()}}, _exploding),
}


def test_hostile_constraints_answered_in_time_without_stalling_others(warm):
    """Each hostile request answered within ANSWER_LIMIT_S, one at a time, while the probes
    stay under PROBE_LIMIT_S, /health 200 and the frontend under its RSS cap."""
    server = warm
    times: dict[str, str] = {}
    with httpx.Client(base_url=server.base_url) as c, \
            Watch(server.base_url, server.frontend_pid) as watch:
        time.sleep(0.3)  # a few probes before the first hostile request
        for name, (body, check) in HOSTILE.items():
            r, dt = chat(c, **body)
            times[name] = f"{r.status_code} in {dt:.2f} s"
            check(r)
            assert dt < ANSWER_LIMIT_S, (name, times[name], r.text[:300])
        for seed in range(10):  # issue 30: 10 refused 5,000-character regexes left +300 MB
            r, dt = chat(c, structured_outputs={"regex": alternation_regex(seed)})
            times[f"regex-5000-{seed}"] = f"{r.status_code} in {dt:.2f} s"
            assert r.status_code in (200, 400), r.text
            assert dt < ANSWER_LIMIT_S, (seed, times[f"regex-5000-{seed}"])
        time.sleep(0.3)
    summary = watch.check()
    print(f"\nhostile answers: {times}\n{summary}")
    assert pid_alive(server.frontend_pid) and pid_alive(server.engine_pid)


def test_hostile_constraints_all_at_once(warm):
    """The same requests all at once (two grammar workers for nine new grammars): every one
    answered, none waits on a global lock past the workers' share, probes unaffected."""
    server = warm
    results: dict[str, tuple[int, float]] = {}
    # The accepted grammars are cached by now (alone, this test compiles them); the
    # refused ones are compiled again (refusals are not cached).
    bodies = {name: body for name, (body, _) in HOSTILE.items()}

    def one(name: str, body: dict) -> None:
        with httpx.Client(base_url=server.base_url) as c:
            r, dt = chat(c, **body)
            results[name] = (r.status_code, dt)
            HOSTILE[name][1](r)

    with Watch(server.base_url, server.frontend_pid) as watch:
        time.sleep(0.3)
        threads = [threading.Thread(target=one, args=item) for item in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.3)
    assert len(results) == len(HOSTILE), (sorted(results), sorted(HOSTILE))
    # With 2 workers, the k-th of the compiles waits for ceil(k / 2) limits at most.
    bound = ANSWER_LIMIT_S + COMPILE_LIMIT_S * ((len(HOSTILE) + 1) // 2)
    late = {n: round(dt, 2) for n, (_, dt) in results.items() if dt > bound}
    assert not late, (late, bound)
    summary = watch.check()
    print(f"\nall at once: { {n: f'{s} in {dt:.2f} s' for n, (s, dt) in results.items()} }"
          f"\n{summary}")


def test_costly_per_token_grammar_does_not_stall_other_streams(warm):
    """An ambiguous Lark grammar compiles at once but each of its masks can cost the Earley
    parser up to its per-token item limit; the masks are computed in the frontend's poller,
    which also reads every other request's tokens. AMBIGUOUS_STREAMS such requests must not
    push a probe past PROBE_LIMIT_S.

    Sized to pass with a margin today: measured on 2 busy cores, the masks of this grammar
    cost ~6 ms per token at 20 tokens and ~35 ms at 200 (the items grow with the length,
    up to llguidance's per-token item limit); 4 streams x 120 tokens kept the probes under
    ~0.3 s, while 4 x 300 took them to 0.95 s and 8 x 200 to 0.74 s (p50 0.16-0.26 s against
    0.04 s idle). The poller computing every request's mask inline is the limit here."""
    server = warm
    results: list[tuple[int, float, str | None]] = []

    def one(seed: int) -> None:
        with httpx.Client(base_url=server.base_url) as c:
            # EOS (SmolLM2's id 2) biased away: greedy then writes "a" until max_tokens,
            # and each "a" adds parses (the Earley items per token grow with the length).
            r, dt = chat(c, max_tokens=AMBIGUOUS_TOKENS, logit_bias={"2": -100},
                         structured_outputs={"grammar": AMBIGUOUS_LARK})
            finish = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
            results.append((r.status_code, dt, finish))

    with Watch(server.base_url, server.frontend_pid) as watch:
        time.sleep(0.3)
        threads = [threading.Thread(target=one, args=(s,)) for s in range(AMBIGUOUS_STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        time.sleep(0.3)
    assert len(results) == AMBIGUOUS_STREAMS and all(s in (200, 400) for s, _, _ in results), results
    summary = watch.check()
    print(f"\nambiguous grammar: {[(s, round(dt, 2), f) for s, dt, f in results]}\n{summary}")


#: Served by llguidance's lenient grammar (it cannot enforce ``not``) plus the final check,
#: ``jsonschema`` in a worker killed at 2 s (dpu/structured/workers.py): with EOS (id 2) and
#: the closing quote (id 18) biased away the grammar makes the null model write 32 "a" (id
#: 81, its lowest allowed token), on which Python's ``re`` tries 2^32 ways to match
#: ``^(a+)+b$``.
BACKTRACKING_SCHEMA = {"type": "string", "maxLength": 32, "pattern": "^a+$",
                       "not": {"pattern": "^(a+)+b$"}}
FINAL_CHECK_LIMIT_S = 2.0


def test_final_check_with_catastrophic_backtracking_is_bounded(warm):
    """The final check of a lenient schema's output runs the schema's own ``pattern`` through
    Python's backtracking ``re``: two such requests at once (one per final-check worker) are
    answered, as failures that name the limit and never as ``stop``, within the check's
    limit + a margin, while the probes keep their latency."""
    server = warm
    results: list[tuple[int, float, str]] = []

    def one(_: int) -> None:
        with httpx.Client(base_url=server.base_url) as c:
            fmt = {"type": "json_schema",
                   "json_schema": {"name": "b", "schema": BACKTRACKING_SCHEMA}}
            r, dt = chat(c, max_tokens=64, logit_bias={"2": -100, "18": -100},
                         response_format=fmt)
            results.append((r.status_code, dt, r.text))

    with Watch(server.base_url, server.frontend_pid) as watch:
        time.sleep(0.3)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.3)
    assert len(results) == 2, results
    for status, dt, text in results:
        assert status != 200 or '"finish_reason":"stop"' not in text, text
        assert status in (200, 500), text
        assert "limit" in text, text
        # + the start of the final-check workers (on first need; not counted in the limit)
        assert dt < FINAL_CHECK_LIMIT_S + 3.0, (round(dt, 2), text[:300])
    summary = watch.check()
    print(f"\nbacktracking final check: {[(s, round(dt, 2)) for s, dt, _ in results]}\n{summary}")


def _nice_of_threads(pid: int) -> dict[int, int]:
    """{tid: nice} of a process's threads (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        out[int(task.name)] = int(stat[stat.rfind(")") + 2:].split()[16])
    return out


def _grammar_workers(frontend_pid: int) -> list[int]:
    from e2e_helpers import child_pids, cmdline

    return [p for p in child_pids(frontend_pid) if "blink.dpu.structured.workers" in cmdline(p)]


def test_grammar_workers_yield_to_the_serving_path(warm):
    """The compile and final-check workers do the hostile work (up to their limits, on the
    same cores): they run at a housekeeping nice (10, configs/threads/default.yaml), not at
    the -10 the frontend's request threads that start them have (a child inherits its
    parent thread's nice). Measured before: two final checks spinning in ``re`` at -10 took
    the probes of the test above to 0.55-0.76 s on 2 busy cores."""
    workers = _grammar_workers(warm.frontend_pid)
    assert len(workers) >= 2, workers  # the warm-up started both compile workers
    for pid in workers:
        nices = _nice_of_threads(pid)
        assert nices and min(nices.values()) >= 10, (pid, nices)


def test_cut_tool_call_arguments_parse_as_json(warm):
    """Issue 30, item 3: tool arguments returned to the client always parse as JSON; a call
    cut by ``max_tokens`` becomes plain content (vLLM). The null model's forced fetch call
    never closes its URL (its favourite token is refused; the lowest allowed id is ``+``),
    so ``max_tokens`` always cuts it."""
    with httpx.Client(base_url=warm.base_url) as c:
        r, _ = chat(c, tools=[FETCH], tool_choice="required", max_tokens=12)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    for call in choice["message"].get("tool_calls") or []:
        json.loads(call["function"]["arguments"])  # raises on a cut call
