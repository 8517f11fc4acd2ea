"""Issue 33's engine-side request fields: ``allowed_token_ids`` and ``bad_words`` as device
masks in the sampler (the same path as ``logit_bias``: SamplingParams -> ring record ->
per-row tensors -> sampler), and ``cache_salt`` (prefix-cache isolation between tenants).

Unit tests of the mask functions, then the tiny random model through the offline API and
through the HTTP app over the ring (byte tokenizer: token id == byte), greedy runs where the
banned token is the argmax.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import ring_frontend  # noqa: E402
from test_engine import GREEDY, make_llm, random_prompts, tiny_model_dir  # noqa: E402

from blink.dpu.ring_packing import RingRequestError, ring_fields  # noqa: E402
from blink.engine.sampler import (  # noqa: E402
    Sampler,
    SamplerPlan,
    SamplingTensors,
    apply_allowed_token_ids,
    bad_words_banned,
)
from blink.ring import RingConfig  # noqa: E402
from blink.shared.sampling_fields import BAD_WORD_TOKENS, bad_words_entries, cache_salt_hash  # noqa: E402
from blink.shared.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402

A = ord("a")
PROMPTS = random_prompts(3, 8, 30, seed=33)


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{**GREEDY, **kw})


def _bytes(text: str) -> list[int]:
    return list(text.encode())


# ------------------------------------------------------------------------- unit: the masks


def test_allowed_token_ids_mask_rows_that_ask_only():
    logits = torch.randn(3, 10)
    allowed = torch.full((3, 4), -1, dtype=torch.int32)
    allowed[0, :2] = torch.tensor([3, 7])
    out = apply_allowed_token_ids(logits, allowed)
    assert torch.isfinite(out[0]).tolist() == [i in (3, 7) for i in range(10)]
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[0, [3, 7]], logits[0, [3, 7]])


def test_bad_words_banned_matches_vllm_rule():
    n = BAD_WORD_TOKENS
    words = torch.from_numpy(bad_words_entries([[5], [1, 2, 3]], 4 * n)).view(1, -1)
    words = words.expand(4, -1).contiguous()
    # rows: prompt [1, 2] + output [] / output [1, 2] / prompt [9, 1] + output [2] / output [2, 2]
    history = torch.tensor([[1, 2, 0, 0], [9, 1, 2, 0], [9, 1, 2, 0], [9, 2, 2, 0]])
    prompt_lens = torch.tensor([2, 1, 2, 1])
    total_lens = torch.tensor([2, 3, 3, 3])
    banned = bad_words_banned(words, history, prompt_lens, total_lens)
    assert banned.shape == (4, 4)
    # the one-token word always; "1 2 3"'s 3 only where 1, 2 are the last two outputs
    assert banned[:, 0].tolist() == [5] * 4
    assert banned[:, 1].tolist() == [-1, 3, -1, -1]  # row 0: 1, 2 are prompt tokens
    assert (banned[:, 2:] == -1).all()


def test_sampler_greedy_avoids_banned_and_disallowed_argmax():
    V = 16
    logits = torch.zeros(2, V)
    logits[:, 4] = 10.0  # the argmax
    logits[:, 6] = 5.0
    st = SamplingTensors.from_params([
        _greedy(allowed_token_ids=[6, 9]),
        _greedy(bad_words=["x"], bad_words_token_ids=[[4]]),
    ])
    hist = torch.zeros(2, 8, dtype=torch.int32)
    lens = torch.tensor([3, 3])
    for plan in (None, SamplerPlan.of(st)):
        out = Sampler()(logits, st, hist, lens, lens, lens, plan=plan)
        assert out.tokens.tolist() == [6, 6]
        # raw logprobs: before the masks (vLLM's raw_logprobs)
        assert out.logprob[0] == pytest.approx(torch.log_softmax(logits[0], -1)[6].item())
    plan = SamplerPlan.of(st)
    assert plan.any_allowed and plan.any_bad_words
    plain = SamplerPlan.of(SamplingTensors.from_params([_greedy()]))
    assert not plain.any_allowed and not plain.any_bad_words


def test_sampled_rows_stay_in_allowed_set():
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=s,
                                                     allowed_token_ids=[1, 2, 3])
                                      for s in range(32)])
    logits = torch.randn(32, 50)
    lens = torch.full((32,), 4)
    hist = torch.zeros(32, 8, dtype=torch.int32)
    out = Sampler()(logits, st, hist, lens, lens, lens)
    assert set(out.tokens.tolist()) <= {1, 2, 3}


# -------------------------------------------------------------------- params and packing


def test_bad_words_tokenized_like_vllm():
    enc = {"foo": [7], " foo": [8], "ab": [1, 2], " ab": [3, 4], "xy": [5, 6], " xy": [9, 5, 6]}
    p = SamplingParams(bad_words=["foo", "  ab", "xy"])
    p.update_from_tokenizer(lambda t: enc[t])
    # both forms when the spaced one is a different first token in as many tokens
    assert p.bad_words_token_ids == [[7], [8], [1, 2], [3, 4], [5, 6]]
    long = SamplingParams(bad_words=["w" * 20])
    with pytest.raises(SamplingParamsError, match="bad_words"):
        long.update_from_tokenizer(lambda t: list(t.encode()))


def test_params_validation_names_the_field():
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-3])
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[300]).check_vocab(256)
    with pytest.raises(SamplingParamsError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_ring_record_carries_the_fields():
    cfg = RingConfig(n_slots=2, arena_tokens=512, max_model_len=64)
    p = _greedy(max_tokens=4, allowed_token_ids=[5, 6], bad_words=["ab"], cache_salt="t1")
    with pytest.raises(RingRequestError, match="bad_words"):  # not resolved to tokens yet
        ring_fields(p, 3, 64, cfg)
    p.update_from_tokenizer(_bytes)
    rec = ring_fields(p, 3, 64, cfg)
    assert rec["allowed_token_ids"][:3].tolist() == [5, 6, -1]
    assert rec["bad_words_ids"][:BAD_WORD_TOKENS].tolist()[-2:] == [A, A + 1]
    assert int(rec["cache_salt"]) == cache_salt_hash("t1") != 0
    assert cache_salt_hash(None) == 0 and cache_salt_hash("t1") != cache_salt_hash("t2")
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        _greedy(max_tokens=4, allowed_token_ids=list(range(200)))
    small = RingConfig(n_slots=2, arena_tokens=512, max_model_len=64, max_allowed_token_ids=4)
    with pytest.raises(RingRequestError, match="allowed_token_ids"):
        ring_fields(_greedy(max_tokens=4, allowed_token_ids=list(range(5))), 3, 64, small)


# ------------------------------------------------------------------ through the engine


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with make_llm(tiny_model_dir(tmp_path_factory.mktemp("mask_models"))) as engine:
        yield engine


def test_engine_allowed_token_ids(llm):
    free = llm.generate([PROMPTS[0]], _greedy(max_tokens=12), timeout_s=60)[0].token_ids
    allowed = sorted({(t + 1) % 256 for t in free[:3]} | {40, 41})
    allowed = [t for t in allowed if t not in free[:1]] or [40, 41]
    [o] = llm.generate([PROMPTS[0]], _greedy(max_tokens=12, allowed_token_ids=allowed),
                       timeout_s=60)
    assert set(o.token_ids) <= set(allowed), (o.token_ids, allowed)
    [o] = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=5, max_tokens=16,
                                                    ignore_eos=True, allowed_token_ids=[50, 60, 70]),
                       timeout_s=60)
    assert set(o.token_ids) <= {50, 60, 70} and len(o.token_ids) == 16


def test_engine_bad_words(llm):
    # "a" is the argmax everywhere (bias +100); banning "a" never produces it
    forced = dict(max_tokens=10, logit_bias={A: 100.0})
    [o] = llm.generate([PROMPTS[0]], _greedy(**forced), timeout_s=60)
    assert o.token_ids == [A] * 10
    [o] = llm.generate([PROMPTS[0]], _greedy(**forced, bad_words=["a"]), timeout_s=60)
    assert A not in o.token_ids and len(o.token_ids) == 10
    # "aa": the second "a" is banned right after a generated "a", so they alternate
    [o] = llm.generate([PROMPTS[0]], _greedy(**forced, bad_words=["aa"]), timeout_s=60)
    assert o.token_ids[0::2] == [A] * 5 and A not in o.token_ids[1::2]
    # a prompt ending in "a" does not count: vLLM matches generated tokens only
    [o] = llm.generate([PROMPTS[0] + [A]], _greedy(**forced, bad_words=["aa"]), timeout_s=60)
    assert o.token_ids[0] == A
    # the model's own greedy continuation, its second token banned after its first
    free = llm.generate([PROMPTS[2]], _greedy(max_tokens=6), timeout_s=60)[0].token_ids
    word = bytes(free[:2])
    if all(32 < b < 127 for b in word):  # printable: the byte tokenizer encodes it back
        [o] = llm.generate([PROMPTS[2]], _greedy(max_tokens=6, bad_words=[word.decode()]),
                           timeout_s=60)
        assert o.token_ids[0] == free[0] and o.token_ids[1] != free[1]


def test_engine_cache_salt_isolates_prefix_blocks(llm):
    prompt = random_prompts(1, 80, 81, seed=77)[0]  # 5 full blocks of 16

    def cached(salt: str | None) -> int:
        [o] = llm.generate([prompt], _greedy(max_tokens=2, cache_salt=salt), timeout_s=60)
        return o.num_cached_tokens

    assert cached("tenant-a") == 0  # first sight: nothing to share
    assert cached("tenant-a") >= 64  # same salt: shares the blocks
    assert cached("tenant-b") == 0  # another salt: none of them
    assert cached(None) == 0  # unsalted never hits salted blocks
    assert cached(None) >= 64
    assert cached("tenant-c") == 0  # nor salted the unsalted ones
    assert cached("tenant-b") >= 64


# -------------------------------------------------------------------- through the HTTP app


def _post(llm: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        async with ring_frontend(llm) as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=120) as http:
                return [await http.post(path, json=body) for path, body in requests]

    return asyncio.run(main())


def test_http_fields_honoured(llm):
    base = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logit_bias": {str(A): 100}, "return_token_ids": True}
    r_free, r_allowed, r_salt1, r_salt2, r_salt3, r_prompt_lp, r_echo_lp = _post(llm, [
        ("/v1/completions", base),
        ("/v1/completions", {**base, "allowed_token_ids": [98, 99]}),
        ("/v1/completions", {**base, "prompt": PROMPTS[1] * 4, "cache_salt": "s1"}),
        ("/v1/completions", {**base, "prompt": PROMPTS[1] * 4, "cache_salt": "s1"}),
        ("/v1/completions", {**base, "prompt": PROMPTS[1] * 4, "cache_salt": "s2"}),
        ("/v1/completions", {**base, "prompt_logprobs": 1}),
        ("/v1/completions", {**base, "echo": True, "logprobs": 1}),
    ])
    for r in (r_free, r_allowed, r_salt1, r_salt2, r_salt3, r_prompt_lp, r_echo_lp):
        assert r.status_code == 200, r.text
    ids = [r.json()["choices"][0]["token_ids"] for r in (r_free, r_allowed)]
    assert ids[0] == [A] * 8
    assert set(ids[1]) <= {98, 99}
    # the engine's prompt logprobs (tests/test_prompt_logprobs.py checks them against
    # transformers), in vLLM's JSON; echo with logprobs puts them before the answer's
    [want] = llm.generate([PROMPTS[0]], _greedy(max_tokens=1, prompt_logprobs=1), timeout_s=60)
    got = r_prompt_lp.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPTS[0])
    for entry, ref in zip(got[1:], want.prompt_logprobs[1:]):
        assert [int(k) for k in entry] == list(ref)
        for k, (lp, rank) in ref.items():
            assert abs(entry[str(k)]["logprob"] - lp) < 1e-6 and entry[str(k)]["rank"] == rank
    echo_lp = r_echo_lp.json()["choices"][0]["logprobs"]
    n = len(PROMPTS[0])
    assert echo_lp["token_logprobs"][0] is None and len(echo_lp["tokens"]) == n + 8
    assert [round(v, 5) for v in echo_lp["token_logprobs"][1:n]] == [
        round(max(ref[t][0], -9999.0), 5) for ref, t in zip(want.prompt_logprobs[1:], PROMPTS[0][1:])]
    usage = [r.json()["usage"] for r in (r_salt1, r_salt2, r_salt3)]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage]
    assert cached[1] > 0 and cached[2] == 0, usage


def test_http_chat_bad_words_and_refusals(llm):
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {str(A): 100}}
    ok, long_word, empty_allowed, bad_id = _post(llm, [
        ("/v1/chat/completions", {**chat, "bad_words": ["a"]}),
        ("/v1/chat/completions", {**chat, "bad_words": ["x" * 30]}),
        ("/v1/chat/completions", {**chat, "allowed_token_ids": []}),
        ("/v1/chat/completions", {**chat, "allowed_token_ids": [100000]}),
    ])
    assert ok.status_code == 200, ok.text
    assert "a" not in ok.json()["choices"][0]["message"]["content"]
    for r in (long_word, empty_allowed, bad_id):
        assert r.status_code == 400, r.text
    assert long_word.json()["error"]["param"] == "bad_words"
    assert empty_allowed.json()["error"]["param"] == "allowed_token_ids"
    assert bad_id.json()["error"]["param"] == "allowed_token_ids"
