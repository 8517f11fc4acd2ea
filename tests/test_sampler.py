"""The on-device sampler and its torch reference (RNG, filtering, Gumbel-max)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st_

from blink.engine.sampler import Sampler, SamplerOutput, SamplingTensors
from blink.shared.sampling_params import SamplingParams
from blink.errors import BlinkError
from blink.kernels.reference import sampling as ref
from blink.kernels.reference.sampling import apply_penalties, token_counts

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers


def _py_fmix32(h: int) -> int:
    """Murmur3 fmix32 in plain Python ints: an independent check of the documented formula."""
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def _py_uniform(seed: int, counter: int, v: int) -> float:
    m = 0xFFFFFFFF
    k = _py_fmix32((seed & m) ^ 0x243F6A88)
    k = _py_fmix32(k ^ ((seed >> 32) & m))
    k = _py_fmix32(k ^ (counter & m))
    k = _py_fmix32(k ^ ((counter >> 32) & m))
    bits = _py_fmix32(k ^ ((v * 0x9E3779B9) & m))
    return (((bits >> 9) << 1) + 1) * 2.0**-24


def _run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    token_ids: torch.Tensor | None = None,
    prompt_lens: list[int] | None = None,
    total_lens: list[int] | None = None,
    counters: torch.Tensor | None = None,
    suppress_ids: torch.Tensor | None = None,
    sampler: Sampler | None = None,
) -> SamplerOutput:
    """Sample a batch with no history unless one is given."""
    b = logits.shape[0]
    if token_ids is None:
        token_ids = torch.full((b, 1), -1, dtype=torch.int32)
    pl = torch.tensor(prompt_lens or [0] * b, dtype=torch.int32)
    tl = torch.tensor(total_lens or [0] * b, dtype=torch.int32)
    if counters is None:
        counters = torch.zeros(b, dtype=torch.int64)
    st = SamplingTensors.from_params(params)
    return (sampler or Sampler())(logits, st, token_ids, pl, tl, counters, suppress_ids)


def _flat_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Nearly uniform logits: an ignored filter would almost never land on the argmax."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 0.1


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n draws for one request: the same row repeated with counters 0..n-1."""
    logits = logits_row.expand(n, -1).contiguous()
    return _run(logits, [params] * n, counters=torch.arange(n)).tokens


# ----------------------------------------------------------------------------- the RNG


@settings(max_examples=60, deadline=None)
@given(
    seed=st_.integers(-(2**63), 2**63 - 1),
    counter=st_.integers(0, 2**63 - 1),
    v=st_.integers(0, 2**31 - 1),
)
def test_rng_matches_documented_formula(seed: int, counter: int, v: int) -> None:
    bits = ref.row_key(torch.tensor([seed]), torch.tensor([counter]))
    vv = torch.tensor([v], dtype=torch.int64)
    u_bits = ref.fmix32(bits ^ ref.mul32(vv, 0x9E3779B9))
    u = ((((u_bits >> 9) << 1) + 1).float() * 2.0**-24).item()
    assert u == _py_uniform(seed, counter, v)
    # The vectorised path (v = arange) agrees with the scalar formula too.
    if v < 64:
        row = ref.uniform(torch.tensor([seed]), torch.tensor([counter]), 64)[0, v].item()
        assert row == _py_uniform(seed, counter, v)


def test_rng_is_uniform_and_open_interval() -> None:
    u = ref.uniform(torch.tensor([0, 1, -5, 2**40]), torch.tensor([0, 0, 7, 3]), 8192)
    assert u.min() > 0 and u.max() < 1
    hist = torch.histc(u.flatten(), bins=32, min=0.0, max=1.0)
    expected = u.numel() / 32
    chi2 = (((hist - expected) ** 2) / expected).sum().item()
    assert chi2 < 80, chi2  # df = 31; p(chi2 > 80) ~ 3e-6
    # Neighbouring counters and seeds are not correlated.
    corr = torch.corrcoef(u)
    assert (corr - torch.eye(4)).abs().max() < 0.05
    # A row's draws are all distinct (v -> bits is a bijection).
    bits = ref.random_bits(torch.tensor([3]), torch.tensor([9]), 100_000)
    assert bits.unique().numel() == 100_000


@settings(max_examples=60, deadline=None)
@given(
    rows=st_.integers(1, 4),
    vocab=st_.sampled_from([1, 5, 127, 128, 129, 1000, 4096, 4099]),
    seed=st_.integers(0, 2**31 - 1),
    ties=st_.booleans(),
    special=st_.sampled_from(["none", "nan", "all_neg_inf", "some_neg_inf"]),
)
def test_argmax_rows_is_torch_argmax(rows: int, vocab: int, seed: int, ties: bool, special: str) -> None:
    """The chunked argmax returns torch.argmax's index: the first maximum, NaN first."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if ties:  # coarse values: many equal maxima, in different chunks
        x = (x * 2).round()
    if special == "nan":
        x[0, torch.randint(vocab, (1,), generator=g)] = float("nan")
    elif special == "all_neg_inf":
        x[-1] = NEG_INF
    elif special == "some_neg_inf":
        x[:, ::3] = NEG_INF
    assert torch.equal(ref.argmax_rows(x), torch.argmax(x, dim=-1))


def test_mul32_never_overflows() -> None:
    a = torch.tensor([0xFFFFFFFF, 0x12345678, 1, 0])
    got = ref.mul32(a, 0xC2B2AE35)
    want = [(int(x) * 0xC2B2AE35) & 0xFFFFFFFF for x in a]
    assert got.tolist() == want


# ----------------------------------------------------------------------------- filtering


def test_top_k_keeps_ties_and_is_off_for_nonpositive() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]] * 3)
    out = ref.apply_top_k_top_p_min_p(
        logits, torch.tensor([2, 0, 9], dtype=torch.int32), torch.ones(3), torch.zeros(3)
    )
    assert out[0].tolist() == [3.0, 2.0, 2.0, NEG_INF]
    assert out[1].tolist() == logits[1].tolist()
    assert out[2].tolist() == logits[2].tolist()  # k > V clamps to V


def test_top_p_and_min_p_follow_the_documented_order() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4, -1).contiguous()
    k = torch.zeros(4, dtype=torch.int32)
    out = ref.apply_top_k_top_p_min_p(
        logits, k, torch.tensor([0.75, 0.85, 0.83, 0.83]), torch.tensor([0.0, 0.0, 0.0, 0.2])
    )
    kept = (out > NEG_INF).tolist()
    assert kept[0] == [True, True, False, False]
    assert kept[1] == [True, True, True, False]
    assert kept[2] == [True, True, True, False]
    # min-p (0.05 / 0.5 < 0.2) first, then top-p on the renormalised survivors:
    # mass above token 2 becomes 0.8 / 0.95 = 0.842 >= 0.83, so token 2 goes too.
    assert kept[3] == [True, True, False, False]
    # Surviving logits are unchanged (filtering masks, it does not rescale).
    assert torch.equal(out[0, :2], logits[0, :2])


def test_filter_is_fixed_shape_and_keeps_the_top_token() -> None:
    logits = torch.randn(5, 33, generator=torch.Generator().manual_seed(1))
    out = ref.apply_top_k_top_p_min_p(
        logits, torch.full((5,), 1, dtype=torch.int32), torch.full((5,), 1e-6), torch.ones(5)
    )
    assert out.shape == logits.shape
    assert ((out > NEG_INF).sum(-1) == 1).all()
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


# ----------------------------------------------------------------------------- each parameter


def test_temperature_zero_is_argmax() -> None:
    logits = _flat_logits(16, 200)
    params = [SamplingParams(temperature=0.0, seed=i) for i in range(16)]
    out = _run(logits, params, counters=torch.arange(16))
    assert torch.equal(out.tokens, logits.argmax(-1))
    # Control: sampling at temperature 1 from the same logits does not always hit the argmax.
    sampled = _run(logits, [SamplingParams(seed=i) for i in range(16)], counters=torch.arange(16))
    assert not torch.equal(sampled.tokens, logits.argmax(-1))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)],
    ids=["top_k=1", "top_p=tiny", "min_p=1"],
)
def test_narrow_filters_give_argmax(params: SamplingParams) -> None:
    logits = _flat_logits(16, 200, seed=2)
    rows = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(16)]
    out = _run(logits, rows, counters=torch.arange(16))
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_min_p_removes_unlikely_tokens() -> None:
    probs = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
    tokens = _draws(probs.log(), SamplingParams(min_p=0.5, seed=11), 3000)
    counts = torch.bincount(tokens, minlength=6)
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() / 3000 - 4 / 7) < 0.04
    # Control: without min_p the tail is drawn.
    assert (_draws(probs.log(), SamplingParams(seed=11), 3000) >= 2).any()


def _expected_distribution(
    logits: list[float], t: float, k: int, p: float, m: float
) -> list[float]:
    """The filtered distribution, computed independently in plain Python."""
    z = [x / t for x in logits]
    mx = max(z)
    w = [math.exp(x - mx) for x in z]
    total = sum(w)
    probs = [x / total for x in w]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = [probs[i] / probs[order[0]] >= m for i in range(len(z))]
    if k > 0:
        kth = z[order[k - 1]]
        keep = [keep[i] and z[i] >= kth for i in range(len(z))]
    mass = sum(probs[i] for i in range(len(z)) if keep[i])
    before = 0.0
    final = [False] * len(z)
    for i in order:
        if keep[i]:
            final[i] = p >= 1 or before < p
            before += probs[i] / mass
    mass = sum(probs[i] for i in range(len(z)) if final[i])
    return [probs[i] / mass if final[i] else 0.0 for i in range(len(z))]


@pytest.mark.parametrize(
    ("t", "k", "p", "m"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (1.5, 4, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (0.8, 5, 0.9, 0.05),
    ],
)
def test_sampled_frequencies_follow_filtered_distribution(
    t: float, k: int, p: float, m: float
) -> None:
    logits = [1.2, 0.9, 0.5, 0.0, -0.3, -1.0]
    expected = torch.tensor(_expected_distribution(logits, t, k, p, m))
    n = 4000
    tokens = _draws(
        torch.tensor(logits), SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=5), n
    )
    counts = torch.bincount(tokens, minlength=6).float()
    assert (counts[expected == 0] == 0).all()
    nz = expected > 0
    chi2 = (((counts[nz] - n * expected[nz]) ** 2) / (n * expected[nz])).sum().item()
    assert chi2 < 25, (chi2, counts.tolist(), expected.tolist())  # df <= 5; p ~ 1e-4


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    # prompt [0, 1], output [2, 2, 3], then padding holding token 5 that must not count.
    token_ids = torch.tensor([[0, 1, 2, 2, 3, 5, 5]], dtype=torch.int32)
    out = apply_penalties(
        logits,
        token_ids,
        torch.tensor([2]),
        torch.tensor([5]),
        torch.tensor([2.0]),
        torch.tensor([0.5]),
        torch.tensor([0.25]),
    )
    # 0: 2/2; 1: -1*2; 2: 0.5/2 - 0.25*2 - 0.5; 3: -0.5*2 - 0.25 - 0.5; 4, 5: unseen.
    assert out[0].tolist() == pytest.approx([1.0, -2.0, -0.75, -1.75, 1.0, 3.0])
    counts = token_counts(token_ids, torch.tensor([2]), torch.tensor([5]), 6)
    assert counts[0].tolist() == [0, 0, 2, 1, 0, 0]


@pytest.mark.parametrize(
    ("kwargs", "prompt", "output", "expected"),
    [
        ({"repetition_penalty": 2.0}, [0], [], 1),  # prompt tokens count for repetition
        ({"presence_penalty": 0.2}, [3], [0], 1),
        ({"presence_penalty": 0.2}, [0], [3], 0),  # presence looks at output tokens only
        ({"frequency_penalty": 0.06}, [3], [0, 0], 1),  # 1.0 - 2 * 0.06 < 0.9
        ({"frequency_penalty": 0.06}, [3], [0], 0),  # 1.0 - 0.06 > 0.9: scales with count
    ],
)
def test_each_penalty_changes_the_greedy_choice(
    kwargs: dict, prompt: list[int], output: list[int], expected: int
) -> None:
    logits = torch.tensor([[1.0, 0.9, -2.0, -3.0]])
    history = prompt + output
    token_ids = torch.tensor([history + [-1, 0]], dtype=torch.int32)
    out = _run(
        logits,
        [SamplingParams(temperature=0.0, **kwargs)],
        token_ids,
        prompt_lens=[len(prompt)],
        total_lens=[len(history)],
    )
    assert out.tokens.item() == expected


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = _flat_logits(4, 100, seed=3)
    best = logits.argmax(-1)
    params = [
        SamplingParams(logit_bias={7: 100.0}, seed=1),
        SamplingParams(temperature=0.0, logit_bias={9: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(best[2]): -100.0}),
        SamplingParams(temperature=0.0),
    ]
    out = _run(logits, params)
    assert out.tokens[:2].tolist() == [7, 9]
    assert out.tokens[2] != best[2]
    assert out.tokens[2] == logits[2].topk(2).indices[1]
    assert out.tokens[3] == best[3]


def test_suppress_ids_are_never_chosen() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]] * 3)
    suppress = torch.tensor([[0, -1], [0, 1], [-1, -1]], dtype=torch.int32)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, seed=2),
        SamplingParams(temperature=0.0),
    ]
    out = _run(logits, params, suppress_ids=suppress)
    assert out.tokens.tolist() == [1, 2, 0]


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(
            temperature=0.3, logprobs=3, logit_bias={1: 50.0}, repetition_penalty=1.5, seed=1
        ),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(logprobs=20, seed=2),
    ]
    token_ids = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    out = _run(logits, params, token_ids, prompt_lens=[2, 2, 2], total_lens=[2, 2, 2])
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprob, raw.gather(-1, out.tokens[:, None]).squeeze(-1))
    assert out.tokens[0] == 1  # the bias moved the token, not the reported logprob
    top = raw.topk(20, dim=-1)
    assert out.top_ids.shape == (3, 20) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids[0, :3], top.indices[0, :3])
    assert torch.allclose(out.top_logprobs[0, :3], top.values[0, :3])
    assert (out.top_ids[0, 3:] == -1).all() and (out.top_logprobs[0, 3:] == NEG_INF).all()
    assert (out.top_ids[1] == -1).all()
    assert torch.equal(out.top_ids[2], top.indices[2])
    # A narrower configured N and a vocabulary smaller than N both keep a fixed width.
    small = _run(
        logits[:, :5], params, token_ids, [2, 2, 2], [2, 2, 2], sampler=Sampler(max_logprobs=8)
    )
    assert small.top_ids.shape == (3, 8)
    assert (small.top_ids[2, 5:] == -1).all() and (small.top_ids[2, :5] >= 0).all()


def test_sampler_rejects_bad_max_logprobs() -> None:
    with pytest.raises(BlinkError, match="max_logprobs"):
        Sampler(max_logprobs=21)


# ----------------------------------------------------------------------------- seeds


_ROW_PARAMS = st_.builds(
    SamplingParams,
    temperature=st_.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_k=st_.sampled_from([0, 1, 3, 40]),
    top_p=st_.sampled_from([1.0, 0.9, 0.5]),
    min_p=st_.sampled_from([0.0, 0.1]),
    repetition_penalty=st_.sampled_from([1.0, 1.3]),
    frequency_penalty=st_.sampled_from([0.0, 0.5]),
    seed=st_.integers(-(2**63), 2**63 - 1),
)


@settings(max_examples=40, deadline=None)
@given(
    rows=st_.lists(_ROW_PARAMS, min_size=1, max_size=6),
    data_seed=st_.integers(0, 2**16),
    perm_seed=st_.integers(0, 2**16),
)
def test_same_seed_same_token_whatever_the_batch(
    rows: list[SamplingParams], data_seed: int, perm_seed: int
) -> None:
    b, vocab = len(rows), 64
    g = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(b, vocab, generator=g)
    token_ids = torch.randint(0, vocab, (b, 8), generator=g, dtype=torch.int32)
    prompt = torch.randint(0, 5, (b,), generator=g)
    total = prompt + torch.randint(0, 4, (b,), generator=g)
    counters = torch.randint(0, 2**40, (b,), generator=g)
    st = SamplingTensors.from_params(rows)
    sampler = Sampler()
    full = sampler(logits, st, token_ids, prompt, total, counters).tokens

    perm = torch.randperm(b, generator=torch.Generator().manual_seed(perm_seed))
    permuted = sampler(
        logits[perm], st.gather(perm), token_ids[perm], prompt[perm], total[perm], counters[perm]
    )
    assert torch.equal(permuted.tokens, full[perm])
    for i in range(b):
        alone = sampler(
            logits[i : i + 1],
            st.gather(torch.tensor([i])),
            token_ids[i : i + 1],
            prompt[i : i + 1],
            total[i : i + 1],
            counters[i : i + 1],
        )
        assert alone.tokens.item() == full[i].item()


def test_different_seeds_and_counters_differ() -> None:
    logits = _flat_logits(1, 1000)[0]
    a = _draws(logits, SamplingParams(seed=1), 20)
    assert torch.equal(a, _draws(logits, SamplingParams(seed=1), 20))
    assert not torch.equal(a, _draws(logits, SamplingParams(seed=2), 20))
    assert a.unique().numel() > 10  # each counter gives a fresh draw


def test_unseeded_requests_get_a_seed_once() -> None:
    st = SamplingTensors.from_params([SamplingParams(), SamplingParams(), SamplingParams(seed=-7)])
    assert st.seed[0] != st.seed[1] and st.seed[2] == -7
    forced = SamplingTensors.from_params([SamplingParams(seed=3)], seeds=[99])
    assert forced.seed.tolist() == [99]
    with pytest.raises(BlinkError, match="logit_bias has 2 entries"):
        SamplingTensors.from_params([SamplingParams(logit_bias={1: 1.0, 2: 1.0})], max_logit_bias=1)


def test_sampling_tensors_layout() -> None:
    st = SamplingTensors.from_params(
        [SamplingParams(temperature=0.5, top_k=4, logit_bias={3: 2.0}, logprobs=2, seed=1)]
    )
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.int32
    assert st.seed.dtype == torch.int64 and st.logit_bias_ids.shape == (1, 32)
    assert st.logit_bias_ids[0, :2].tolist() == [3, -1] and st.logit_bias_values[0, 0].item() == 2.0
    assert st.logprobs.tolist() == [2]
    empty = SamplingTensors.empty(3)
    assert (empty.temperature == 0).all() and (empty.logit_bias_ids == -1).all()


# ----------------------------------------------------------------------------- compile


def test_compiles_fullgraph_without_host_sync() -> None:
    torch._dynamo.reset()
    sampler = Sampler()

    def step(logits, st, token_ids, prompt_lens, total_lens, counters, suppress):
        return sampler(logits, st, token_ids, prompt_lens, total_lens, counters, suppress)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, top_p=0.9, seed=1, logprobs=2),
        SamplingParams(min_p=0.1, presence_penalty=1.0, logit_bias={2: 3.0}, seed=2),
    ]
    st = SamplingTensors.from_params(params)
    args = (
        logits,
        st,
        torch.randint(0, 40, (3, 6), dtype=torch.int32),
        torch.tensor([2, 3, 1]),
        torch.tensor([4, 6, 5]),
        torch.tensor([4, 6, 5]),
        torch.tensor([[1, -1]] * 3, dtype=torch.int32),
    )
    got, want = compiled(*args), step(*args)
    # the traced sampler takes torch's logsumexp, the eager CPU table's is a C pass (last bits)
    for name, g, w in zip(("tokens", "logprob", "top_ids", "top_logprobs"), got, want):
        if name.endswith("logprob") or name.endswith("logprobs"):
            torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6)
        else:
            assert torch.equal(g, w), name


_PLAN_PARAMS = st_.sampled_from([
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=1.0, top_k=5, seed=4),
    SamplingParams(temperature=1.0, top_p=0.5, seed=5),
    SamplingParams(temperature=0.7, min_p=0.2, seed=6),
    SamplingParams(temperature=0, repetition_penalty=1.5),
    SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5, seed=7),
    SamplingParams(temperature=0, logprobs=3),
])


@settings(max_examples=40, deadline=None)
@given(st_.lists(_PLAN_PARAMS, min_size=1, max_size=5), st_.integers(0, 1000))
def test_sampler_plan_skips_only_identity_stages(params: list[SamplingParams], seed: int) -> None:
    """The CPU loop's host-side plan must never change a token: with the plan the sampler
    skips stages no row uses; the result equals running every stage."""
    from blink.engine.sampler import SamplerPlan

    b, vocab = len(params), 64
    logits = _flat_logits(b, vocab, seed) * 4
    token_ids = torch.randint(0, vocab, (b, 12), generator=torch.Generator().manual_seed(seed)).int()
    pl = torch.full((b,), 6, dtype=torch.int32)
    tl = torch.full((b,), 12, dtype=torch.int32)
    counters = torch.arange(b, dtype=torch.int64) + seed
    st = SamplingTensors.from_params(params)
    full = Sampler()(logits, st, token_ids, pl, tl, counters)
    planned = Sampler()(logits, st, token_ids, pl, tl, counters, plan=SamplerPlan.of(st))
    assert torch.equal(full.tokens, planned.tokens)
    assert torch.equal(full.logprob, planned.logprob)
    plan = SamplerPlan.of(st)
    if plan.any_top_logprobs:
        assert torch.equal(full.top_ids, planned.top_ids)
        assert torch.equal(full.top_logprobs, planned.top_logprobs)
    else:  # no row asked: the full run's entries are all padding, the planned run has none
        assert (full.top_ids == -1).all() and planned.top_ids.shape == (b, 0)
        assert planned.top_logprobs.shape == (b, 0)
    assert plan.any_random == any(p.temperature > 0 for p in params)
    # Each flag is exactly "some row uses the stage" (a flag set too often only costs time,
    # so the identity check above cannot see it; this one can).
    rand = [p.temperature > 0 for p in params]
    assert plan.any_filter == any(r and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)
                                  for r, p in zip(rand, params))
    assert plan.any_penalty == any(p.repetition_penalty != 1 or p.presence_penalty != 0
                                   or p.frequency_penalty != 0 for p in params)
    assert plan.any_top_logprobs == any((p.logprobs or 0) > 0 for p in params)
    assert plan.any_logit_bias == any(bool(p.logit_bias) for p in params)
    constrained = torch.tensor([0] * (b - 1) + [seed % 2], dtype=torch.int32)  # last row maybe
    assert SamplerPlan.of(st, constrained=constrained).any_constrained == (seed % 2 == 1)


def test_sampler_takes_its_filter_and_draw_from_the_op_table() -> None:
    """On CPU the op table holds the C penalties, filter and draw (their references' twins,
    tests/test_cpu_sampling.py); an explicit ``ops`` is what a call uses (the Triton table on
    CUDA: tests/test_kernels_sampling.py)."""
    from types import SimpleNamespace

    from blink.kernels import ops_for
    from blink.kernels.cpu import sampling as cpu_sampling

    cpu = ops_for("cpu")
    assert cpu.apply_top_k_top_p_min_p is cpu_sampling.apply_top_k_top_p_min_p
    assert cpu.sample is cpu_sampling.sample
    assert Sampler(device="cpu").ops is cpu and Sampler().ops_for("cpu") is cpu
    calls: list[str] = []

    def spy(name):
        def fn(*args):
            calls.append(name)
            return getattr(ref, name)(*args)
        return fn

    ops = SimpleNamespace(apply_top_k_top_p_min_p=spy("apply_top_k_top_p_min_p"), sample=spy("sample"),
                          logsumexp_rows=spy("logsumexp_rows"), argmax_logsumexp_rows=spy("argmax_logsumexp_rows"),
                          apply_penalties=spy("apply_penalties"), top_rows=spy("top_rows"))
    logits = _flat_logits(2, 50)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=4, seed=3)]
    out = _run(logits, params, sampler=Sampler(ops=ops))
    assert calls == ["logsumexp_rows", "apply_penalties", "apply_top_k_top_p_min_p", "sample", "top_rows"]
    assert torch.equal(out.tokens, _run(logits, params).tokens)


@pytest.mark.parametrize("params,path", [
    ([SamplingParams(temperature=0)] * 3, ["argmax_logsumexp_rows"]),
    ([SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5, seed=2)],
     ["argmax_logsumexp_rows", "apply_top_k_top_p_min_p", "sample"]),
    ([SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.3)],
     ["logsumexp_rows", "apply_penalties"]),
    ([SamplingParams(temperature=0, logit_bias={7: 5.0})], ["logsumexp_rows"]),
])
def test_a_plan_whose_logits_stay_raw_takes_the_greedy_tokens_from_the_log_normalisers_pass(params, path):
    """The CPU loop's plan: no stage changes the logits (no penalty, bias, bad words, allowed
    ids or suppressed ids), so the greedy tokens come from ``argmax_logsumexp_rows``, one pass
    over the logits; otherwise ``logsumexp_rows`` and the argmax of the changed logits. The
    tokens and logprobs are those of every stage run (SmolLM2's vocabulary size: the chunked
    argmax's path)."""
    from types import SimpleNamespace

    from blink.engine.sampler import SamplerPlan
    from blink.kernels import ops_for

    calls: list[str] = []
    cpu = ops_for("cpu")

    def spy(name):
        def fn(*args):
            calls.append(name)
            return getattr(cpu, name)(*args)
        return fn

    ops = SimpleNamespace(**{name: spy(name) for name in (
        "apply_penalties", "apply_top_k_top_p_min_p", "sample", "logsumexp_rows", "argmax_logsumexp_rows")})
    b, vocab = len(params), 49152
    logits = _flat_logits(b, vocab, 5) * 4
    token_ids = torch.randint(0, vocab, (b, 12), generator=torch.Generator().manual_seed(5)).int()
    pl, tl = torch.full((b,), 6, dtype=torch.int32), torch.full((b,), 12, dtype=torch.int32)
    counters = torch.arange(b, dtype=torch.int64)
    st = SamplingTensors.from_params(params)
    planned = Sampler(ops=ops)(logits, st, token_ids, pl, tl, counters, plan=SamplerPlan.of(st))
    assert calls == path
    full = Sampler()(logits, st, token_ids, pl, tl, counters)
    assert torch.equal(planned.tokens, full.tokens) and torch.equal(planned.logprob, full.logprob)
