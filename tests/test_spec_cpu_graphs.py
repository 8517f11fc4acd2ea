"""Speculative verify steps on the CPU-graphs runner (issue 36): steps whose rows carry
their last token and a draft replay the recorded decode graphs (blink.decode_graphs,
``DecodeGraphs.allow_rows_of``), and what the engine produces is what it produces without
graphs: greedy tokens, seeded samples and their logprobs, stops and ``max_tokens`` inside an
accepted run, the KV pool whole at quiescence; the draft model's target verify steps replay
too. The real model (SmolLM2 GGUF): the tiny random models of tests/test_spec_decode.py have
no C kernels to record."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_loader_gguf import smollm_path  # noqa: E402
from test_spec_decode import _pool_whole  # noqa: E402
from llm_helpers import admit_each_call_at_once  # noqa: E402

from blink.engine.speculative import SPEC_NUM_ACCEPTED_TOKENS, SPEC_NUM_DRAFTS  # noqa: E402
from blink.llm import LLM  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
SPEC = ('{"method": "ngram", "num_speculative_tokens": %d, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3}' % K)
# text the model copies (drafts hit) and text it does not (drafts miss)
PROMPTS = [
    "Copy the list exactly: red, green, blue, red, green, blue, red, green, blue, red, green,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3",
    "The capital of France is",
]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _llm(graphs: bool) -> LLM:
    """The engine under test; each generate() call's requests are admitted together (the
    two engines batch alike, so they take the same kernel paths)."""
    return admit_each_call_at_once(LLM(str(smollm_path()), max_num_seqs=4, max_model_len=256,
                                       cpu_graphs=graphs, speculative_config=SPEC))


@pytest.fixture(scope="module")
def eager():
    with _llm(False) as llm:
        yield llm


@pytest.fixture(scope="module")
def graphs():
    """The engine with graphs, its verify steps counted: the max_query_len of each step
    the graphs replayed."""
    with _llm(True) as llm:
        recorded = llm.engine.executor.decode_graphs
        if recorded is None or not recorded.graphs:
            pytest.skip("decode steps run eagerly here")
        assert type(llm.engine.runner).__name__ == "SpecCpuGraphsRunner"
        assert recorded.max_query_len == K + 1
        # the buckets a step of 4 rows of K + 1 tokens can use (without speculation: 1, 2, 4)
        assert sorted(b for b, _ in recorded.graphs) == [1, 2, 4, 8, 12, 16, 24]
        llm.replayed = _count_replays(recorded)
        yield llm


def _count_replays(recorded) -> list[int]:
    """Wrap ``recorded.run`` so that each replayed step appends its ``max_query_len`` to the
    returned list (> 1: a verify step)."""
    replayed: list[int] = []
    run = recorded.run

    def counted(input_ids, md, logits_indices, *rest):
        out = run(input_ids, md, logits_indices, *rest)
        if out is not None:
            replayed.append(md.max_query_len)
        return out

    recorded.run = counted
    return replayed


def _verify_replays(llm, before: int) -> int:
    return sum(1 for q in llm.replayed[before:] if q > 1)


def test_greedy_identical_and_verify_steps_replayed(eager, graphs):
    params = SamplingParams(max_tokens=32, **GREEDY)
    want = eager.generate(PROMPTS, params, timeout_s=300)
    before, counters = len(graphs.replayed), graphs.engine.scheduler.spec_counters.clone()
    got = graphs.generate(PROMPTS, params, timeout_s=300)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    c = graphs.engine.scheduler.spec_counters - counters
    assert int(c[SPEC_NUM_DRAFTS]) > 0 and int(c[SPEC_NUM_ACCEPTED_TOKENS]) > 0
    assert _verify_replays(graphs, before) > 0, "no verify step replayed a graph"
    # one stream (where speculation pays): every verify step replays
    before = len(graphs.replayed)
    [g] = graphs.generate([PROMPTS[0]], params, timeout_s=120)
    assert g.token_ids == want[0].token_ids
    assert _verify_replays(graphs, before) > 0
    _pool_whole(graphs)


def test_stops_and_max_tokens_inside_accepted_runs(eager, graphs):
    base = eager.generate(PROMPTS[:3], SamplingParams(max_tokens=32, **GREEDY), timeout_s=300)
    params = [SamplingParams(max_tokens=32, stop_token_ids=[b.token_ids[9]], **GREEDY) for b in base]
    params += [SamplingParams(max_tokens=mt, **GREEDY) for mt in (2, 5, 11)]
    prompts = PROMPTS[:3] * 2
    want = eager.generate(prompts, params, timeout_s=300)
    got = graphs.generate(prompts, params, timeout_s=300)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
    _pool_whole(graphs)


def test_seeded_sampling_and_logprobs_identical(eager, graphs):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=24, ignore_eos=True, logprobs=2)
              for s in range(len(PROMPTS))]
    want = eager.generate(PROMPTS, params, timeout_s=300)
    before = len(graphs.replayed)
    got = graphs.generate(PROMPTS, params, timeout_s=300)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        # the accepted tokens' logprobs: the same bits in, the same values out
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert _verify_replays(graphs, before) > 0
    _pool_whole(graphs)


def test_draft_model_verify_steps_replay_the_target_graphs():
    """``"method": "draft_model"`` (the SmolLM2 GGUF drafting for itself): the target's verify
    steps replay its graphs too, and the output is that of the same engine without graphs
    (two fresh engines: the same requests meet the same prefix cache, so the same steps)."""
    path = str(smollm_path())
    spec = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": %d}' % (path, K)
    params = SamplingParams(max_tokens=12, **GREEDY)
    outputs = {}
    for graphs in (False, True):
        with LLM(path, max_num_seqs=4, max_model_len=256, cpu_graphs=graphs, speculative_config=spec) as llm:
            admit_each_call_at_once(llm)
            target = llm.engine.executor.decode_graphs
            replayed: list[int] = []
            if graphs:
                if target is None or not target.graphs:
                    pytest.skip("decode steps run eagerly here")
                assert target.max_query_len == K + 1
                replayed = _count_replays(target)
            outputs[graphs] = [o.token_ids for o in llm.generate(PROMPTS, params, timeout_s=300)]
            assert int(llm.engine.scheduler.spec_counters[SPEC_NUM_ACCEPTED_TOKENS]) > 0
            _pool_whole(llm)
            if graphs:
                assert sum(1 for q in replayed if q > 1) > 0, "no verify step replayed a graph"
    assert outputs[True] == outputs[False]
