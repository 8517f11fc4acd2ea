"""Structured outputs (issue 15): constraint -> automaton -> ring grammar region -> device mask.

- compile: regexes/choices/schemas on a byte vocabulary, numeric bounds, refusals, caching;
- the device ops (torch reference, and the Triton kernel under the interpreter) walked over
  hypothesis-generated JSON schemas: every output that ends by EOS parses and validates;
- the grammar region: content-hash reuse, LRU eviction of unused entries, full -> wait;
- end to end through ``LLM.generate`` on the tiny random model, greedy and sampled, n > 1.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import byte_tokenizer_json, make_llm, tiny_model_dir  # noqa: E402
from test_ring_layout import MemoryTransport  # noqa: E402

from blink.dpu.ring_protocol import RingClient  # noqa: E402
from blink.dpu.structured.compiler import GrammarCompiler, GrammarLimitError, GrammarLimits, pack_entry  # noqa: E402
from blink.dpu.structured.regex import int_range_regex, json_object_regex  # noqa: E402
from blink.dpu.tokenizer import Tokenizer  # noqa: E402
from blink.kernels.grammar_reference import advance_grammar, apply_grammar_mask  # noqa: E402
from blink.ring import G_INITIAL_STATE, Ring, RingConfig, RingLayout  # noqa: E402
from blink.shared.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from blink.shared.structured_outputs import StructuredOutputs as SO  # noqa: E402
from blink.shared.structured_outputs import StructuredOutputsError  # noqa: E402

EOS = 0  # the byte tokenizer's EOS (NUL never occurs in JSON text or the test regexes)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(byte_tokenizer_json(), {}, {"eos_token_id": EOS})


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def walk(grammar_words: np.ndarray, seed: int, max_steps: int = 300, mask=apply_grammar_mask,
         eos_bonus: float = 2.0) -> bytes | None:
    """Sample a path through the automaton with the device ops (random logits, EOS favoured);
    the bytes emitted before EOS, or None if EOS did not come within ``max_steps``."""
    words = torch.from_numpy(grammar_words.astype(np.int32))
    entry = torch.zeros(1, dtype=torch.int32)
    state = words[G_INITIAL_STATE].view(1).clone()
    gen = torch.Generator().manual_seed(seed)
    out = bytearray()
    for _ in range(max_steps):
        logits = torch.randn(1, 256, generator=gen)
        logits[0, EOS] += eos_bonus
        masked = mask(logits, words, entry, state)
        assert torch.isfinite(masked).any(), "the mask left no token"
        token = int(torch.argmax(masked + torch.empty_like(masked).exponential_(generator=gen).log().neg()))
        if token == EOS:
            return bytes(out)
        out.append(token)
        state = advance_grammar(words, entry, state, torch.tensor([token])).to(torch.int32)
        assert int(state) >= 0, f"token {token!r} was allowed but has no transition"
    return None


# ------------------------------------------------------------------------ compile

def test_request_type_validates():
    for bad in (dict(), dict(regex="a", choice=("x",)), dict(regex="("), dict(json="{"),
                dict(choice=()), dict(choice=("",)), dict(json_object=1)):
        with pytest.raises(StructuredOutputsError):
            SO(**bad)
    assert SO(json={"b": 1, "a": 2}).content_hash() == SO(json='{"a": 2, "b": 1}').content_hash()
    with pytest.raises(StructuredOutputsError, match="grammar"):
        SO.from_dict({"grammar": "root ::= 'a'"})
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=SO(regex="a+"))


@pytest.mark.parametrize("lo,hi", [(None, None), (0, None), (None, 0), (-37, 205), (5, 5),
                                   (-1000, -3), (1, 14), (None, -12), (99, None)])
def test_int_range_regex_is_exact(lo, hi):
    rx = re.compile(int_range_regex(lo, hi))
    for v in range(-1500, 1500):
        assert bool(rx.fullmatch(str(v))) == ((lo is None or v >= lo) and (hi is None or v <= hi)), v
    assert not rx.fullmatch("-0") and not rx.fullmatch("007")


def test_json_object_regex_depth():
    rx = re.compile(json_object_regex())
    assert rx.fullmatch('{"a": {"b": 1}, "c": [1, "x"]}')
    assert not rx.fullmatch('{"a": {"b": [1]}}')  # depth 3
    assert not rx.fullmatch("[1]")


@pytest.mark.parametrize("so,problem", [
    (SO(json={"type": "integer", "multipleOf": 3}), "multipleOf"),
    (SO(json={"oneOf": [{"type": "integer"}]}), "oneOf"),
    (SO(json={"type": "string", "format": "hostname"}), "format"),
    (SO(json={"type": "number", "minimum": 0.5}), "number bounds"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), "no value"),
    (SO(regex="a(?=b)"), "cannot be compiled"),
    (SO(json={"allOf": [{"type": "integer"}, {"minimum": 1}]}), "allOf"),
])
def test_refusals_name_the_problem(compiler, so, problem):
    with pytest.raises(StructuredOutputsError, match=problem):
        compiler.compile(so)


def test_pydantic_style_schema_walks_valid(compiler):
    """allOf around a $ref (pydantic), type lists, additionalProperties schemas, $defs."""
    schema = {"type": "object", "$defs": {"Level": {"type": "integer", "minimum": 1, "maximum": 3}},
              "properties": {"level": {"allOf": [{"$ref": "#/$defs/Level"}], "description": "d"},
                             "note": {"type": ["string", "null"], "maxLength": 5},
                             "extra": {"type": "object", "additionalProperties": {"type": "boolean"}}},
              "required": ["level", "note", "extra"]}
    g = compiler.compile(SO(json=schema))
    done = [d for d in (walk(g.words, seed) for seed in range(10)) if d is not None]
    assert done
    for d in done:
        jsonschema.validate(json.loads(d.decode()), schema)


def test_limits_and_cache(tokenizer):
    small = GrammarCompiler(tokenizer, GrammarLimits(max_states=10))
    with pytest.raises(GrammarLimitError, match="limit of 10"):
        small.compile(SO(regex="[a-z]{20}"))
    c = GrammarCompiler(tokenizer)
    a = c.compile(SO(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = c.compile(SO(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert a is b  # same content, one compile


@pytest.mark.parametrize("so,check", [
    (SO(regex=r"[a-c]{2,5}x(yz)?"), lambda t: re.fullmatch(r"[a-c]{2,5}x(yz)?", t)),
    (SO(choice=("yes", "no", "maybe so")), lambda t: t in ("yes", "no", "maybe so")),
    (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_walks_satisfy_regex_choice_object(compiler, so, check):
    g = compiler.compile(so)
    done = [walk(g.words, seed) for seed in range(20)]
    assert sum(d is not None for d in done) >= 10
    for d in done:
        if d is not None:
            assert check(d.decode()), d


# ------------------------------------------------------- hypothesis JSON schemas

_leaf = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.integers(0, 5).map(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 3}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,4}$"}, {"type": "boolean"},
                     {"type": "null"}, {"type": "integer"}, {"enum": ["red", "green", 3, None]},
                     {"const": "fixed"}, {"type": "string", "format": "date"}]),
)


def _objects(children):
    props = st.dictionaries(st.sampled_from(["a", "b", "name", "x_1"]), children, min_size=1, max_size=3)
    return st.one_of(
        props.flatmap(lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
            lambda req: {"type": "object", "properties": p, "required": req})),
        st.tuples(children, st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "maxItems": t[1] + 1}),
        st.lists(children, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
    )


SCHEMAS = st.recursive(_leaf, _objects, max_leaves=6).map(
    lambda s: s if s.get("type") == "object" else
    {"type": "object", "properties": {"v": s}, "required": ["v"]})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1))
def test_hypothesis_schemas_walk_to_valid_json(compiler, schema, seed):
    g = compiler.compile(SO(json=schema))
    finished = 0
    for k in range(3):
        out = walk(g.words, seed + k)
        if out is not None:
            finished += 1
            jsonschema.validate(json.loads(out.decode()), schema)
    # Not a guarantee for every schema (long strings), but most walks end.


def test_generic_tool_schema_walks_parse(compiler):
    """The generic tool-call format's grammar (templates without tools): every walk is one of
    its two answers, valid against the schema, and the generic parser reads it."""
    from blink.dpu.tool_parsers import GenericToolParser, generic_schema

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"]}}}
    schema = generic_schema([tool], single_call=True)
    g = compiler.compile(SO(json=schema))
    kinds = set()
    for seed in range(12):
        out = walk(g.words, seed, max_steps=400)
        if out is None:
            continue
        value = json.loads(out)
        jsonschema.validate(value, schema)
        parser = GenericToolParser.parse(out.decode())
        if "tool_calls" in value:
            kinds.add("call")
            assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == \
                [(c["name"], c["arguments"]) for c in value["tool_calls"]]
        else:
            kinds.add("response")
            assert parser.content == value["response"] and not parser.calls
    assert kinds, "no walk ended"


@pytest.mark.parametrize("seed", [0, 1])
def test_advance_is_the_packed_transition_table(seed):
    """A random dense automaton with many exceptions to the default next states: the device
    advance gives every transition's next state, and -1 for forbidden tokens, dead rows and
    unconstrained rows."""
    from blink.ring import G_NUM_TRANSITIONS

    rng = np.random.default_rng(seed)
    states, vocab = 40, 3000
    pairs = rng.choice(states * vocab, size=8000, replace=False)
    src, tok = pairs // vocab, pairs % vocab
    tok = np.where(tok == EOS, 1, tok)  # EOS has no transition
    src, tok = np.unique(np.stack([src, tok]), axis=1)
    dst = rng.integers(0, 3, size=src.size) * (src % 7)  # a few next states per state
    words = pack_entry(states, 0, vocab, [EOS], np.zeros(states, dtype=bool), src, tok, dst)
    assert words[G_NUM_TRANSITIONS] > 1000
    w = torch.from_numpy(words)
    got = advance_grammar(w, torch.zeros(src.size, dtype=torch.int32), torch.from_numpy(src).int(),
                          torch.from_numpy(tok))
    assert torch.equal(got, torch.from_numpy(dst))
    allowed = set(zip(src.tolist(), tok.tolist()))
    probe = [(s, t) for s, t in zip(rng.integers(0, states, 500), rng.integers(0, vocab, 500))
             if (s, t) not in allowed]
    ps, pt = (torch.tensor(x) for x in zip(*probe))
    assert bool((advance_grammar(w, torch.zeros(len(probe), dtype=torch.int32), ps, pt) == -1).all())
    assert advance_grammar(w, torch.tensor([0, -1]), torch.tensor([-1, 3]),
                           torch.tensor([5, 5])).tolist() == [-1, -1]


def _allowed_by_spec(grammar_words: np.ndarray, state: int, vocab: int) -> set[int]:
    """The tokens a state allows, read bit by bit from the entry's mask (the format's spec)."""
    from blink.ring import G_EOS, G_MASK, G_VOCAB_BITS, G_WORDS_PER_STATE

    if state < 0:
        return {int(grammar_words[G_EOS])}
    wps, bits = int(grammar_words[G_WORDS_PER_STATE]), int(grammar_words[G_VOCAB_BITS])
    row = grammar_words[int(grammar_words[G_MASK]) + state * wps:][:wps].view(np.uint32)
    return {t for t in range(min(vocab, bits)) if (int(row[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("vocab", [256, 300, 250])  # the vocabulary, wider (padded), narrower
def test_mask_matches_the_bitmask_spec_and_host_rows(compiler, vocab):
    """The reference mask keeps exactly the allowed logits (bit for bit, NaN and -inf
    included), and masking only the host-found constrained rows gives the same logits."""
    from blink.engine.grammar import GrammarBatch

    g = compiler.compile(SO(json={"type": "object", "properties": {"n": {"type": "integer"}}}))
    words = torch.from_numpy(g.words.astype(np.int32))
    states = [int(g.words[G_INITIAL_STATE]), 1, -1, 2, g.num_states - 1]
    entry = torch.tensor([0, -1, 0, 0, -1, 0], dtype=torch.int32)
    state = torch.tensor(states + [3], dtype=torch.int32)
    logits = torch.randn(6, vocab)
    logits[0, 5], logits[3, 7] = float("nan"), float("-inf")
    got = apply_grammar_mask(logits, words, entry, state)
    for row in range(6):
        if entry[row] < 0:
            assert torch.equal(got[row], logits[row])
            continue
        allowed = _allowed_by_spec(g.words, int(state[row]), vocab)
        keep = torch.tensor([t in allowed for t in range(vocab)])
        assert torch.equal(got[row, keep].view(torch.int32), logits[row, keep].view(torch.int32))
        assert bool((got[row, ~keep] == float("-inf")).all()), row
    rows = (entry >= 0).nonzero().flatten()
    host = GrammarBatch(words, entry, state, rows).apply(apply_grammar_mask, logits)
    assert torch.equal(host.view(torch.int32), got.view(torch.int32))


def test_triton_mask_matches_reference(compiler):
    triton_grammar = pytest.importorskip("blink.kernels.triton_grammar")
    from blink.kernels.triton_common import interpreting

    if not interpreting():
        pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1")
    g1 = compiler.compile(SO(json={"type": "object", "properties": {"n": {"type": "integer"}}}))
    g2 = compiler.compile(SO(choice=("alpha", "beta")))
    region = np.zeros(g1.words.size + g2.words.size + 16, dtype=np.int32)
    region[: g1.words.size] = g1.words
    region[g1.words.size: g1.words.size + g2.words.size] = g2.words
    words = torch.from_numpy(region)
    entry = torch.tensor([0, -1, g1.words.size, 0, g1.words.size], dtype=torch.int32)
    state = torch.tensor([int(g1.words[G_INITIAL_STATE]), 5, int(g2.words[G_INITIAL_STATE]), -1, 3],
                         dtype=torch.int32)
    logits = torch.randn(5, 300)  # wider than the vocabulary: the tail is masked on constrained rows
    want = apply_grammar_mask(logits, words, entry, state)
    got = triton_grammar.apply_grammar_mask(logits, words, entry, state)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[torch.isfinite(want)], want[torch.isfinite(want)])
    assert torch.equal(want[1], logits[1])  # unconstrained row untouched
    assert torch.isfinite(want[3]).sum() == 1 and torch.isfinite(want[3, EOS])  # dead: EOS only
    # And a whole walk through the kernel.
    out = walk(g2.words, 7, mask=triton_grammar.apply_grammar_mask)
    assert out in (b"alpha", b"beta")


# ------------------------------------------------------------------ grammar region

def _client(grammar_words: int) -> RingClient:
    cfg = RingConfig(n_slots=4, arena_tokens=256, stream_capacity=8, max_model_len=128,
                     grammar_words=grammar_words)
    buf = bytearray(RingLayout(cfg).total_bytes)
    Ring.create(buf, cfg)
    return RingClient(MemoryTransport(buf))


def test_region_reuse_eviction_and_full(compiler):
    a = compiler.compile(SO(choice=("one", "two")))
    b = compiler.compile(SO(regex="[0-9]{3}"))
    ring = _client(a.words.size + b.words.size // 2)  # room for a, or b, never both
    fields = dict(max_tokens=4)
    h1 = ring.try_submit(1, [1, 2], grammar=a, **fields)
    h2 = ring.try_submit(2, [1, 2], grammar=a, **fields)
    assert h1 and h2 and ring.grammars.stats.uploads == 1 and ring.grammars.stats.hits == 1
    assert int(ring._read_field("grammar_entry", h1.slot, h1.slot + 1)[0]) == h1.grammar >= 0
    assert ring.try_submit(3, [1, 2], grammar=b, **fields) is None  # a is in use: wait
    assert "grammar region" in ring.full_message(2, 1.0)
    for h in (h1, h2):  # the engine finishes both; the frontend reads them and frees the slots
        ring._write_field("stream_seq", h.slot, h.seq)
        ring._write_field("finish_reason", h.slot, 1)
        ring._write_field("state", h.slot, 3)
    ring.poll_many()
    h3 = ring.try_submit(3, [1, 2], grammar=b, **fields)
    assert h3 is not None and ring.grammars.stats.evictions == 1 and ring.grammars.stats.uploads == 2
    with pytest.raises(GrammarLimitError, match="grammar region"):
        _client(16).try_submit(1, [1], grammar=a, **fields)


# --------------------------------------------------------------- end to end (LLM)

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with make_llm(tiny_model_dir(tmp_path_factory.mktemp("so_models"), eos_token_id=EOS)) as engine:
        yield engine


def _texts(outs):
    # The byte tokenizer's EOS (NUL) is an ordinary token to the detokenizer, which may leave
    # it at the end of the text; a real model's EOS is a special token and never shows.
    return [(c.text.removesuffix("\x00"), c.finish_reason) for o in outs for c in o.outputs]


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_llm_outputs_validate(llm, schema):
    """Greedy and sampled (n=2) choices of one constrained request in one batch."""
    so = SO(json=schema)
    outs = llm.generate([[3, 4, 5], [7]], [
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so),
        SamplingParams(temperature=1.0, max_tokens=80, n=2, seed=5, structured_outputs=so)])
    stopped = 0
    for text, reason in _texts(outs):
        if reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text), schema)
        else:
            assert reason == "length"


def test_llm_regex_choice_and_mixed_batch(llm):
    rx = r"[a-d]{2,6}!"
    outs = llm.generate([[5, 6], [9], [1, 2, 3]], [
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(regex=rx)),
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs=SO(choice=("yes", "no"))),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),  # unconstrained neighbour
    ])
    (t1, r1), (t2, r2), (t3, r3) = _texts(outs)
    assert r1 == "stop" and re.fullmatch(rx, t1)
    assert r2 == "stop" and t2 in ("yes", "no")
    assert r3 == "length" and len(outs[2].outputs[0].token_ids) == 8
    free = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert free[0].outputs[0].token_ids == outs[2].outputs[0].token_ids  # neighbour unaffected
