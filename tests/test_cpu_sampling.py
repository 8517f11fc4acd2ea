"""The CPU sampler's C penalties, filter and draw (kernels/cpu/sampling.c) against the torch
references (:mod:`blink.kernels.reference.sampling`).

Compared exactly: the RNG bits, the penalised logits' bits, the chosen tokens and the surviving
logits. The cases avoid
near-ties within rounding (two Gumbel scores within an ulp of the log; a mass within rounding of
top_p), where the C code and the reference may differ by design; they do include exact ties
(half-integer logits), which both must break the same way (lowest index first).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from blink.engine.sampler import Sampler, SamplerPlan, SamplingTensors
from blink.kernels import ops_for
from blink.kernels.cpu import sampling as cpu_sampling
from blink.kernels.reference import sampling as ref
from blink.shared.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from sampling_cases import tied_filter_case  # noqa: E402

if cpu_sampling.LIBRARY.get() is None:
    pytest.skip(f"sampling.c is not available here: {cpu_sampling.LIBRARY.failure}", allow_module_level=True)

NEG_INF = float("-inf")


def _same_survivors(got: torch.Tensor, want: torch.Tensor) -> None:
    kept, kept_ref = torch.isfinite(got), torch.isfinite(want)
    rows = (kept != kept_ref).any(1).nonzero().flatten().tolist()
    assert not rows, f"rows {rows} keep different entries"
    assert torch.equal(got[kept], want[kept_ref])


def test_uniform_bits_match_reference():
    seeds = torch.tensor([0, 1, -5, 2**62 + 12345, -(2**63), 2**31], dtype=torch.int64)
    counters = torch.tensor([0, 7, 2**40, 3, -1, 2**32 - 1], dtype=torch.int64)
    assert torch.equal(cpu_sampling.uniform(seeds, counters, 1500), ref.uniform(seeds, counters, 1500))


def test_gumbel_noise_within_rounding_of_torch_log():
    """The C log (vector lanes and scalar tail alike) against torch's: a few 1e-7 apart."""
    g = torch.Generator().manual_seed(1)
    seeds = torch.randint(-(2**62), 2**62, (32,), generator=g)
    counters = torch.arange(32, dtype=torch.int64) * 977
    got, want = cpu_sampling.gumbel_noise(seeds, counters, 4099), ref.gumbel_noise(seeds, counters, 4099)
    assert float((got - want).abs().max()) < 4e-6
    assert float(got.max()) < 16.7 and float(got.min()) > -2.9  # the draw's pruning bound (GUMBEL_SPAN)


@pytest.mark.parametrize("vocab", [1, 15, 37, 300, 3001, 49152, 128256])
def test_sample_matches_reference_tokens(vocab):
    """Masked, unmasked, narrow and wide rows (the draw scores only entries that can win:
    a wide row tests that bound), vocabularies below, between and above the 16-lane blocks."""
    g = torch.Generator().manual_seed(vocab)
    n_rows = 12
    logits = torch.randn(n_rows, vocab, generator=g) * 2
    logits[1] *= 20  # most entries far below the top: pruned
    logits[2] /= 20  # all close: every entry a candidate
    logits[::3, vocab // 2:] = NEG_INF
    logits[4] = NEG_INF  # all masked: index 0, as torch.argmax of all -inf
    seeds = torch.randint(-(2**62), 2**62, (n_rows,), generator=g)
    counters = torch.arange(n_rows, dtype=torch.int64) * 1000 + 17
    tokens = cpu_sampling.sample(logits, seeds, counters)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, ref.sample(logits, seeds, counters))
    if vocab >= 300:  # really keyed: another counter moves most draws
        assert (cpu_sampling.sample(logits, seeds, counters + 1) != tokens).sum() >= n_rows // 3


def test_sample_follows_torch_on_nan_and_inf():
    """A NaN logit is taken (the first), as torch.argmax takes NaN for the maximum; +inf
    scores +inf, so the first +inf wins."""
    logits = torch.randn(3, 100)
    logits[0, 50] = logits[0, 70] = float("nan")
    logits[1, 7] = logits[1, 9] = float("inf")
    logits[2, :] = NEG_INF
    logits[2, 99] = 1.0
    seeds = torch.tensor([1, 2, 3])
    assert cpu_sampling.sample(logits, seeds, seeds).tolist() == ref.sample(logits, seeds, seeds).tolist() == [50, 7, 99]


def test_sample_draws_from_the_softmax():
    """Many draws of one row: the token frequencies follow softmax(logits) (a sampler that
    kept the argmax, or a biased RNG, would fail)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, NEG_INF, 0.5]]).repeat(4000, 1)
    seeds = torch.full((4000,), 1234)
    counters = torch.arange(4000)
    counts = torch.bincount(cpu_sampling.sample(logits, seeds, counters), minlength=6).float() / 4000
    expected = torch.softmax(logits[0], -1)
    assert counts[4] == 0
    assert float((counts - expected).abs().max()) < 0.03, (counts, expected)


@pytest.mark.parametrize("seed,n_rows,vocab", [(0, 12, 300), (1, 8, 1000), (2, 6, 37), (3, 8, 4099), (4, 6, 49152)])
def test_filter_matches_reference_on_ties(seed, n_rows, vocab):
    logits, top_k, top_p, min_p = tied_filter_case(seed, n_rows, vocab)
    out = cpu_sampling.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    _same_survivors(out, ref.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p))
    assert (torch.isfinite(out).sum(1) < vocab).sum() >= n_rows // 2  # real cuts, not pass-through


def test_filter_matches_reference_on_model_like_rows():
    """Continuous logits at several spreads (a temperature's scale) with the usual settings:
    the cut inside the first 8 nats (the entries listed on the way), beyond them (every
    bucket counted), and a top-k whose k-th value is in the farthest bucket."""
    g = torch.Generator().manual_seed(7)
    vocab = 8192
    spreads = [0.3, 1.0, 3.0, 10.0, 30.0]
    settings = [(0, 0.9, 0.0), (50, 1.0, 0.0), (40, 0.95, 0.05), (0, 0.5, 0.1), (1000, 0.99, 0.0),
                (0, 0.999, 0.0), (5000, 1.0, 0.0), (1, 0.9, 0.0)]
    rows = [(s, k, p, m) for s in spreads for k, p, m in settings]
    logits = torch.stack([torch.randn(vocab, generator=g) * s for s, *_ in rows])
    top_k = torch.tensor([k for _, k, _, _ in rows], dtype=torch.int32)
    top_p = torch.tensor([p for _, _, p, _ in rows])
    min_p = torch.tensor([m for *_, m in rows])
    out = cpu_sampling.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    _same_survivors(out, ref.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p))
    kept = torch.isfinite(out).sum(1)
    assert kept.min() >= 1 and kept.max() > 1000  # narrow and wide cuts both exercised


def test_filter_cuts_beyond_the_near_buckets_and_in_the_far_one():
    """A top entry and a plateau 10 nats below holding ~18% of the mass (the top-p cut falls
    inside the plateau's tie, past the 8 nats listed on the way; with a top-k whose k-th value
    is the plateau's, all of it tied); a top-k whose k-th value lies 40 nats down (the
    farthest bucket)."""
    vocab = 5000
    logits = torch.full((3, vocab), -10.0)
    logits[:, 123] = 0.0
    logits[2, 200:] = -40.0
    top_k = torch.tensor([0, 3000, 300], dtype=torch.int32)
    top_p = torch.tensor([0.99, 0.97, 1.0])
    min_p = torch.zeros(3)
    out = cpu_sampling.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    want = ref.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    _same_survivors(out, want)
    kept = torch.isfinite(out).sum(1).tolist()
    assert 1 < kept[0] < vocab and 1 < kept[1] < vocab and kept[2] == vocab  # k-th = -40: ties all kept


def test_filter_cut_inside_a_tie_keeps_lowest_indices():
    """Eight equal logits, top_p = 0.3: the reference's stable sort keeps the first three."""
    out = cpu_sampling.apply_top_k_top_p_min_p(torch.full((1, 8), 1.5), torch.tensor([0], dtype=torch.int32),
                                               torch.tensor([0.3]), torch.tensor([0.0]))
    assert torch.isfinite(out[0]).tolist() == [True] * 3 + [False] * 5


def test_filter_passes_nan_and_inf_rows_through_and_masks_all_masked_rows():
    """A row holding NaN or +inf is copied unfiltered (the reference masks all of it; the draw
    then takes its first NaN or +inf, as torch.argmax would); a row of -inf stays -inf, as in the
    reference; the other rows are filtered as the reference filters them."""
    logits = torch.randn(4, 64)
    logits[0, 5] = float("nan")
    logits[1] = NEG_INF
    logits[2, 9] = float("inf")
    args = (torch.tensor([4] * 4, dtype=torch.int32), torch.tensor([0.5] * 4), torch.tensor([0.1] * 4))
    got, want = cpu_sampling.apply_top_k_top_p_min_p(logits, *args), ref.apply_top_k_top_p_min_p(logits, *args)
    assert torch.equal(got[0].isnan(), logits[0].isnan()) and torch.equal(got[0, 6:], logits[0, 6:])
    assert torch.equal(got[2], logits[2])
    assert not torch.isfinite(got[1]).any() and not torch.isfinite(want[1]).any()
    _same_survivors(got[3:], want[3:])
    seeds = torch.tensor([1, 2, 3, 4])
    assert cpu_sampling.sample(got, seeds, seeds)[:3].tolist() == [5, 0, 9]


def test_no_wrapper_reads_a_tensor_on_the_host():
    """The GPU tiers' capture audit runs the sampler's ops on CPU tensors: the C wrappers must
    issue no op a graph cannot hold (a host read of a status, say)."""
    from blink.engine.capture_audit import CaptureAudit

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4099, generator=g)
    ids = torch.randint(0, 4099, (3, 20), generator=g, dtype=torch.int32)
    lens = torch.tensor([5, 20, 12])
    rep, zeros, freq = torch.full((3,), 1.2), torch.zeros(3), torch.full((3,), 0.5)
    top_k, top_p, keys = torch.tensor([5, 0, 40], dtype=torch.int32), torch.tensor([1.0, 0.9, 0.5]), torch.arange(3)
    audit = CaptureAudit()
    with audit:
        cpu_sampling.apply_penalties(logits, ids, lens // 2, lens, rep, zeros, freq)
        cpu_sampling.sample(cpu_sampling.apply_top_k_top_p_min_p(logits, top_k, top_p, zeros), keys, keys)
    audit.check("the CPU sampler's C ops")


def test_penalties_match_reference_bits():
    """Repetition, frequency and presence penalties, positive, negative and off, over histories
    with padding, out-of-vocabulary ids, repeats and prompt-only rows: the reference's bits,
    -0.0 logits included (a negative penalty turns them +0.0 in the reference's arithmetic)."""
    g = torch.Generator().manual_seed(0)
    b, vocab, length = 7, 4099, 300
    logits = torch.randn(b, vocab, generator=g) * 3
    logits[0, :100] = -0.0
    logits[2, 7] = NEG_INF
    ids = torch.randint(-1, vocab + 5, (b, length), generator=g, dtype=torch.int32)
    ids[:, 50:60] = 7
    ids[1] = torch.randint(0, 20, (length,), generator=g)  # few distinct tokens, many repeats
    prompt = torch.tensor([10, 0, 50, 100, 299, 5, 300])
    total = torch.tensor([200, 300, 60, 250, 300, 3, 300])
    rep = torch.tensor([1.2, 1.0, 0.8, 2.0, 1.1, 1.0, 1.3])
    pres = torch.tensor([0.5, -0.3, 0.0, 1.0, 2.0, -2.0, 0.7])
    freq = torch.tensor([-0.5, 0.3, 0.0, 1.5, -2.0, 0.1, 0.4])
    for token_ids in (ids, ids.long(), ids[:, ::2]):  # int32, int64, strided
        args = (logits, token_ids, prompt, total, rep, pres, freq)
        got, want = cpu_sampling.apply_penalties(*args), ref.apply_penalties(*args)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(got, logits)


def test_the_cpu_sampler_uses_the_c_ops_and_keeps_the_references_tokens():
    """The engine's Sampler on CPU logits: the table's C filter and draw, the same tokens as the
    references over a batch mixing greedy, plain, filtered and penalised rows."""
    cpu = ops_for("cpu")
    assert cpu.sample is cpu_sampling.sample and cpu.apply_top_k_top_p_min_p is cpu_sampling.apply_top_k_top_p_min_p
    assert cpu.apply_penalties is cpu_sampling.apply_penalties
    from types import SimpleNamespace

    reference = SimpleNamespace(**{**vars(cpu), "sample": ref.sample, "apply_top_k_top_p_min_p": ref.apply_top_k_top_p_min_p,
                                   "apply_penalties": ref.apply_penalties, "top_rows": ref.top_rows})
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, top_p=0.9, seed=2), SamplingParams(temperature=0.8, top_k=40, seed=3),
              SamplingParams(temperature=1.0, min_p=0.05, seed=4),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.02, seed=5, repetition_penalty=1.2)]
    st = SamplingTensors.from_params(params)
    g = torch.Generator().manual_seed(3)
    b, vocab = len(params), 49152
    token_ids = torch.randint(0, vocab, (b, 12), generator=g, dtype=torch.int32)
    prompt, total = torch.full((b,), 4), torch.full((b,), 12)
    drawn = 0
    for step in range(4):
        logits = torch.randn(b, vocab, generator=g) * 4
        counters = total + 100 * step
        got = Sampler(ops=cpu)(logits, st, token_ids, prompt, total, counters, plan=SamplerPlan.of(st))
        want = Sampler(ops=reference)(logits, st, token_ids, prompt, total, counters, plan=SamplerPlan.of(st))
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.top_ids, want.top_ids) and torch.equal(got.top_logprobs, want.top_logprobs)
        drawn += int((got.tokens[1:] != logits[1:].argmax(-1)).sum())
    assert drawn >= 4  # the rows really sample


def test_a_scratch_that_cannot_grow_is_a_clear_error_and_leaves_the_old_one():
    """Growing the scratch past what memory holds raises MemoryError naming it; the scratch
    already reserved keeps serving calls."""
    logits, top_k, top_p, min_p = tied_filter_case(5, 6, 300)
    cpu_sampling.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)  # reserves what these need
    with pytest.raises(MemoryError, match="CPU sampler's scratch"):
        cpu_sampling._reserve(cpu_sampling.LIBRARY.get(), 2**45)  # past any address space
    _same_survivors(cpu_sampling.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p),
                    ref.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p))


@pytest.mark.parametrize("vocab,rows,top_n", [(49152, 40, 5), (4099, 17, 20), (37, 5, 37), (100, 3, 0)])
def test_prompt_logprobs_match_reference(vocab, rows, top_n):
    """The target's logprob within fp32 rounding of torch's log-softmax; its rank exact on
    logits in 1/64 steps (ties: each side ranks equal logits equally; a continuous logit within
    an ulp of the target's could rank either way); the top N's ids and values on continuous
    logits (no ties among the top)."""
    g = torch.Generator().manual_seed(vocab + top_n)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    stepped = (torch.randn(rows, vocab, generator=g) * 3 * 64).round() / 64
    got, want = cpu_sampling.prompt_logprobs(stepped, targets, top_n), ref.prompt_logprobs(stepped, targets, top_n)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1].dtype == torch.int64 and torch.equal(got[1], want[1])
    smooth = torch.randn(rows, vocab, generator=g) * 3
    got, want = cpu_sampling.prompt_logprobs(smooth, targets, top_n), ref.prompt_logprobs(smooth, targets, top_n)
    assert got[2].shape == want[2].shape == (rows, top_n) and torch.equal(got[3], want[3])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
    assert (got[1] - want[1]).abs().max() <= 1


@pytest.fixture(scope="module")
def avx2_build():
    """sampling.c built for an AVX2 CPU (x86-64-v3: Zen 2/3, Haswell to Skylake client), whose
    loops are the scalar ones, where this CPU runs AVX-512."""
    from blink.shared.cpu_features import read_cpu_flags
    from blink.shared.native_build import build_library

    if not {"avx2", "fma"} <= (read_cpu_flags() or frozenset()):
        pytest.skip("this CPU runs no AVX2 code")
    native = cpu_sampling.LIBRARY
    library = build_library(native.source, tuple("-march=x86-64-v3" if f == "-march=native" else f
                                                  for f in native.flags), None, native.headers)
    native.setup(library)
    assert library.blink_has_avx512() == 0
    return library


def test_the_avx2_build_matches_the_references(avx2_build):
    """The scalar loops against the same references: RNG bits, tokens, survivors, penalised
    bits, prompt logprobs."""
    g = torch.Generator().manual_seed(11)
    seeds, counters = torch.randint(-(2**62), 2**62, (6,), generator=g), torch.arange(6) * 7
    logits = torch.randn(6, 3001, generator=g) * 3
    logits[::2, 1500:] = NEG_INF
    ids = torch.randint(-1, 3001, (6, 40), generator=g, dtype=torch.int32)
    lens, rep, pres = torch.full((6,), 40), torch.full((6,), 1.3), torch.full((6,), -0.4)
    tied = tied_filter_case(12, 8, 4099)
    with cpu_sampling.LIBRARY.using(avx2_build):
        assert torch.equal(cpu_sampling.uniform(seeds, counters, 700), ref.uniform(seeds, counters, 700))
        assert torch.equal(cpu_sampling.sample(logits, seeds, counters), ref.sample(logits, seeds, counters))
        _same_survivors(cpu_sampling.apply_top_k_top_p_min_p(*tied), ref.apply_top_k_top_p_min_p(*tied))
        got = cpu_sampling.apply_penalties(logits, ids, lens // 2, lens, rep, pres, pres)
        assert torch.equal(got.view(torch.int32),
                           ref.apply_penalties(logits, ids, lens // 2, lens, rep, pres, pres).view(torch.int32))
        stepped = (torch.randn(5, 49152, generator=g) * 3 * 64).round() / 64
        targets = torch.randint(0, 49152, (5,), generator=g)
        got, want = cpu_sampling.prompt_logprobs(stepped, targets, 4), ref.prompt_logprobs(stepped, targets, 4)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows,vocab,k", [(1, 49152, 20), (16, 4099, 5), (3, 37, 37), (2, 100, 0)])
def test_top_rows_match_torch_topk(rows, vocab, k):
    """The sampler's top logprobs' selection: torch.topk's values, and its ids wherever the
    values differ (masked entries included); among equal values (the -inf of masked entries, a
    row of ties) the ids in index order, where torch's order is its own."""
    g = torch.Generator().manual_seed(rows * vocab + k)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[0, : vocab // 2] = NEG_INF
    got, want = cpu_sampling.top_rows(x, k), ref.top_rows(x, k)
    finite = torch.isfinite(want[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][finite], want[1][finite])
    for r in range(rows):  # the masked entries taken: the same ones, in index order
        masked = got[1][r][~finite[r]]
        assert sorted(masked.tolist()) == sorted(want[1][r][~finite[r]].tolist()) == masked.tolist()
    tied = torch.zeros(1, vocab)
    values, ids = cpu_sampling.top_rows(tied, k)
    assert torch.equal(values, ref.top_rows(tied, k)[0]) and ids.tolist() == [list(range(k))]
