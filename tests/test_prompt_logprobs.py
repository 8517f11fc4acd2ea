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
    """``got`` (RequestOutput.prompt_logprobs) against transformers' fp32 logits: None first,
    then at position i the prompt token first with its logprob and rank, then the top N in
    order with ranks 1..N (the token keeps its own entry when it is one of them)."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    lp = torch.log_softmax(ref.logits(prompt).double(), dim=-1)
    for i in range(1, len(prompt)):
        row, entry, token = lp[i - 1], got[i], prompt[i]
        assert list(entry)[0] == token, f"position {i}: the prompt token comes first"
        value, rank = entry[token]
        assert abs(value - float(row[token])) < 1e-4, f"position {i}"
        # vLLM's rank: the ids at least as likely, itself included (within fp32 noise)
        assert int((row > row[token] + 1e-5).sum()) + 1 <= rank <= int((row >= row[token] - 1e-5).sum())
        want = row.topk(top_n).indices.tolist()
        assert len(entry) == top_n + (token not in want), f"position {i}"
        ranked = sorted(entry, key=lambda t: -entry[t][0])[:top_n]
        assert ranked == want, f"position {i}: top {top_n}"
        for k, t in enumerate(ranked):
            assert abs(entry[t][0] - float(row[t])) < 1e-4
            assert entry[t][1] == k + 1


PROMPTS = random_prompts(3, 20, 60, seed=11)


@pytest.mark.parametrize("cpu_graphs", [True, False], ids=["cpu-graphs", "eager"])
def test_prompt_logprobs_match_transformers(model_dir, ref, cpu_graphs):
    with make_llm(model_dir, prompt_logprob_lanes=2, cpu_graphs=cpu_graphs) as llm:
        assert llm.engine.runner.name == ("cpu-graphs" if cpu_graphs else "eager")
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


def test_frontend_waits_for_a_lane_in_order(model_dir, ref):
    """The serving path's ring client: with one lane and a 50 ms submit timeout, six requests
    asking for prompt logprobs all succeed (a lane wait is not bounded by the timeout, which is
    for ring room), and they take the lane in the order they came."""
    import asyncio

    from blink.dpu.ring_engine_client import RingEngineClient
    from blink.dpu.ring_protocol import RingClient
    from blink.transport import InProcessTransport, LoopbackTransport

    prompts = random_prompts(6, 30, 60, seed=14)
    with make_llm(model_dir, prompt_logprob_lanes=1, max_num_batched_tokens=16) as llm:
        region = llm.engine.region
        transport = (InProcessTransport(region) if region.kind == "inprocess"
                     else LoopbackTransport(region.name, region.total_bytes))
        client = RingEngineClient(RingClient(transport), model_name="tiny", submit_timeout_s=0.05,
                                  poll_min_interval_s=1e-4, poll_max_interval_s=1e-3)
        order: list[int] = []
        submit = client.ring.try_submit

        def recording(request_id, prompt_ids, *args, **kwargs):
            handle = submit(request_id, prompt_ids, *args, **kwargs)
            if handle is not None:
                order.append(len(prompt_ids))
            return handle

        client.ring.try_submit = recording  # type: ignore[method-assign]

        async def one(i: int):
            params = SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY)
            got = None
            async for out in client.generate(f"r{i}", prompts[i], params):
                got = out.prompt_logprobs if out.prompt_logprobs is not None else got
            return got

        async def main():
            client.start()
            try:
                tasks = []
                for i in range(len(prompts)):
                    tasks.append(asyncio.create_task(one(i)))
                    await asyncio.sleep(0)  # each enters the queue before the next
                return await asyncio.gather(*tasks)
            finally:
                await client.close()

        results = asyncio.run(main())
    assert order == [len(p) for p in prompts]
    for p, got in zip(prompts, results):
        check(ref, p, got, 1)
