"""Prompt logprobs (vLLM's ``prompt_logprobs``) from the engine: each prompt token's logprob,
rank and top-N equal transformers' log-softmax at the position before it, whether the prompt
runs in one step or in chunks, with a warm prefix cache, for concurrent requests, and when
requests wait for a free lane (blink.engine.prompt_logprobs, blink.ring "Prompt logprobs")."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import GREEDY, Reference, make_llm, random_prompts, tiny_model_dir  # noqa: E402

from blink.shared.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("plp_models"))


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference()


def check(ref: Reference, prompt: list[int], got, top_n: int) -> None:
    """``got`` (RequestOutput.prompt_logprobs) against transformers' fp32 logits."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    lp = torch.log_softmax(ref.logits(prompt).double(), dim=-1)
    for i in range(1, len(prompt)):
        row, entry = lp[i - 1], got[i]
        token = prompt[i]
        ids = list(entry)
        assert ids[0] == token, f"position {i}: the prompt token comes first"
        value, rank = entry[token]
        assert abs(value - float(row[token])) < 1e-4, f"position {i}"
        assert rank == int((row >= row[token] - 1e-6).sum()) or \
            rank == int((row > row[token] + 1e-6).sum()) + 1, f"position {i}: rank {rank}"
        want_top = row.topk(top_n).indices.tolist()
        got_top = [t for t in ids if t != token or entry[t][1] <= top_n][:top_n]
        assert len(entry) == top_n + (token not in want_top), f"position {i}"
        for k, t in enumerate(want_top):
            assert abs(entry[t][0] - float(row[t])) < 1e-4
            assert entry[t][1] == k + 1 or t == token
        assert sorted(got_top) == sorted(want_top)


PROMPTS = random_prompts(3, 20, 60, seed=11)


def test_prompt_logprobs_match_transformers(model_dir, ref):
    with make_llm(model_dir, prompt_logprob_lanes=2) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, prompt_logprobs=5, **GREEDY),
                            timeout_s=120)
        for p, o in zip(PROMPTS, outs):
            check(ref, p, o.prompt_logprobs, 5)
        # N = 0: the prompt token alone
        (o,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))
        assert all(len(e) == 1 for e in o.prompt_logprobs[1:])
        check(ref, PROMPTS[0], o.prompt_logprobs, 0)
        # a request without prompt_logprobs gets none
        (o,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, **GREEDY))
        assert o.prompt_logprobs is None


def test_prompt_logprobs_chunked_prefill_and_warm_prefix_cache(model_dir, ref):
    """A 16-token budget prefills every prompt in chunks; the same prompt again, its prefix
    cached by a plain request first, gives the same values (it never reads the cache)."""
    prompt = random_prompts(1, 90, 90, seed=12)[0]
    with make_llm(model_dir, max_num_batched_tokens=16, prompt_logprob_lanes=1) as llm:
        (cold,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3, **GREEDY),
                               timeout_s=120)
        check(ref, prompt, cold.prompt_logprobs, 3)
        llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY), timeout_s=120)
        (plain,) = llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY), timeout_s=120)
        assert plain.num_cached_tokens > 0  # the cache is warm
        (warm,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3, **GREEDY),
                               timeout_s=120)
        assert warm.num_cached_tokens == 0
        assert warm.prompt_logprobs == cold.prompt_logprobs


def test_prompt_logprobs_more_requests_than_lanes(model_dir, ref):
    """Four concurrent requests on one lane: they wait for it in turn, none fails."""
    prompts = random_prompts(4, 10, 40, seed=13)
    with make_llm(model_dir, prompt_logprob_lanes=1) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY),
                            timeout_s=120)
        assert len(llm._ring._free_lanes) == 1  # every lane came back
    for p, o in zip(prompts, outs):
        check(ref, p, o.prompt_logprobs, 2)


def test_prompt_logprobs_refused_without_lanes(model_dir):
    from blink.dpu.ring_packing import RingRequestError

    with make_llm(model_dir, prompt_logprob_lanes=0) as llm:
        with pytest.raises(RingRequestError, match="prompt logprobs"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=1))
