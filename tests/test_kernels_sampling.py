"""Triton sampling kernels against :mod:`blink.kernels.sampling_reference`.

CPU + Triton interpreter (``TRITON_INTERPRET=1`` before the kernel modules are imported).
Everything here is compared *exactly*: the RNG bits, the set of surviving logits and the
chosen tokens. The logits use few distinct values so that ties at the top-k and top-p
cut-offs are common, which is where a selection-based filter could differ from a sort.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest
import torch

from blink.kernels import sampling_reference as ref

triton_sampling = pytest.importorskip("blink.kernels.triton_sampling")
from blink.kernels.triton_common import interpreting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
if DEVICE == "cpu" and not interpreting():
    pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

NEG_INF = float("-inf")


def test_uniform_bits_match_reference():
    seeds = torch.tensor([0, 1, -5, 2**62 + 12345, -(2**63), 2**31], dtype=torch.int64)
    counters = torch.tensor([0, 7, 2**40, 3, -1, 2**32 - 1], dtype=torch.int64)
    out = triton_sampling.uniform(seeds.to(DEVICE), counters.to(DEVICE), 1500).cpu()
    assert torch.equal(out, ref.uniform(seeds, counters, 1500))


def _filter_case(seed: int, n_rows: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    # Half-integer logits in [-6, 6]: many exact ties, like bf16 logits upcast to fp32.
    logits = torch.randint(-12, 13, (n_rows, vocab), generator=g).float() / 2
    logits[0] = torch.randn(vocab, generator=g) * 3  # one row without ties
    logits[1, : vocab // 3] = NEG_INF  # suppressed tokens
    logits[2] = -0.0  # all equal (signed zero): every filter cuts inside one tie
    logits[2, ::5] = 0.0
    top_k = torch.randint(-1, 12, (n_rows,), generator=g, dtype=torch.int32)
    top_k[3] = vocab + 10  # larger than the vocabulary: off
    top_p = torch.rand(n_rows, generator=g) * 0.98 + 0.02
    top_p[4] = 1.0
    min_p = torch.where(torch.rand(n_rows, generator=g) < 0.5, torch.rand(n_rows, generator=g) * 0.5, 0.0)
    return logits, top_k, top_p, min_p


@pytest.mark.parametrize("seed,n_rows,vocab", [(0, 12, 300), (1, 8, 1000), (2, 6, 37)])
def test_filter_matches_reference_exactly(seed, n_rows, vocab):
    logits, top_k, top_p, min_p = _filter_case(seed, n_rows, vocab)
    out = triton_sampling.apply_top_k_top_p_min_p(
        logits.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), min_p.to(DEVICE)
    ).cpu()
    expected = ref.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    kept = torch.isfinite(out)
    kept_ref = torch.isfinite(expected)
    assert torch.equal(kept, kept_ref), f"rows differ: {(kept != kept_ref).any(1).nonzero().flatten().tolist()}"
    assert torch.equal(out[kept], expected[kept_ref])
    # The cases must exercise real cuts, not only pass-through rows.
    assert (kept.sum(1) < vocab).sum() >= n_rows // 2


def test_filter_cut_inside_a_tie_keeps_lowest_indices():
    """Eight equal logits, top_p = 0.3: the reference's stable sort keeps the first three
    indices (mass before them 0, 1/8, 2/8 < 0.3), not any three."""
    logits = torch.full((1, 8), 1.5)
    out = triton_sampling.apply_top_k_top_p_min_p(
        logits.to(DEVICE), torch.tensor([0], dtype=torch.int32, device=DEVICE),
        torch.tensor([0.3], device=DEVICE), torch.tensor([0.0], device=DEVICE),
    ).cpu()
    assert torch.isfinite(out[0]).tolist() == [True] * 3 + [False] * 5


def test_all_masked_row_stays_masked_and_samples_index_zero():
    logits = torch.full((2, 50), NEG_INF)
    logits[1, 7] = 0.0
    filt = triton_sampling.apply_top_k_top_p_min_p(
        logits.to(DEVICE), torch.tensor([5, 5], dtype=torch.int32, device=DEVICE),
        torch.tensor([0.5, 0.5], device=DEVICE), torch.tensor([0.1, 0.1], device=DEVICE),
    )
    assert torch.equal(filt.cpu(), ref.apply_top_k_top_p_min_p(
        logits, torch.tensor([5, 5], dtype=torch.int32), torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1])))
    seeds = torch.tensor([3, 4])
    tokens = triton_sampling.sample(filt, seeds.to(DEVICE), seeds.to(DEVICE)).cpu()
    assert tokens.tolist() == ref.sample(filt.cpu(), seeds, seeds).tolist() == [0, 7]


def test_sample_matches_reference_tokens():
    """Filtered and unfiltered rows, several seeds and counters, vocabulary spanning chunks."""
    g = torch.Generator().manual_seed(5)
    n_rows, vocab = 16, 3000
    logits = torch.randn(n_rows, vocab, generator=g) * 2
    logits[::3, 100:] = NEG_INF  # few candidates
    logits[1] = NEG_INF  # all masked over several chunks: the reference's argmax gives 0
    seeds = torch.randint(-(2**62), 2**62, (n_rows,), generator=g)
    counters = torch.arange(n_rows, dtype=torch.int64) * 1000 + 17
    tokens = triton_sampling.sample(logits.to(DEVICE), seeds.to(DEVICE), counters.to(DEVICE)).cpu()
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, ref.sample(logits, seeds, counters))
    # A different counter must change the draw for most rows (the RNG is really keyed).
    other = triton_sampling.sample(logits.to(DEVICE), seeds.to(DEVICE), (counters + 1).to(DEVICE)).cpu()
    assert (other != tokens).sum() >= n_rows // 2
