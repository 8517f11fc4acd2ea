"""Triton sampling kernels against :mod:`blink.kernels.reference.sampling`.

CPU + Triton interpreter (``TRITON_INTERPRET=1`` before the kernel modules are imported).
Everything here is compared *exactly*: the RNG bits, the set of surviving logits and the
chosen tokens. The logits use few distinct values so that ties at the top-k and top-p
cut-offs are common, which is where a selection-based filter could differ from a sort.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blink.kernels.reference import sampling as ref

triton_sampling = pytest.importorskip("blink.kernels.triton.sampling")
from blink.kernels.triton.common import interpreting  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from sampling_cases import tied_filter_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
if DEVICE == "cpu" and not interpreting():
    pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

NEG_INF = float("-inf")


def test_uniform_bits_match_reference():
    seeds = torch.tensor([0, 1, -5, 2**62 + 12345, -(2**63), 2**31], dtype=torch.int64)
    counters = torch.tensor([0, 7, 2**40, 3, -1, 2**32 - 1], dtype=torch.int64)
    out = triton_sampling.uniform(seeds.to(DEVICE), counters.to(DEVICE), 1500).cpu()
    assert torch.equal(out, ref.uniform(seeds, counters, 1500))


@pytest.mark.parametrize("seed,n_rows,vocab", [(0, 12, 300), (1, 8, 1000), (2, 6, 37)])
def test_filter_matches_reference_exactly(seed, n_rows, vocab):
    logits, top_k, top_p, min_p = tied_filter_case(seed, n_rows, vocab)
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


# ----------------------------------------------------------------------------- the Sampler on them

from types import SimpleNamespace  # noqa: E402

from blink.engine.sampler import Sampler, SamplerPlan, SamplingTensors  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.kernels import ops_for  # noqa: E402

CPU_OPS = ops_for("cpu")
#: the CPU table with the torch references for the penalties, the filter and the draw (the CPU
#: table's own are their C twins, tests/test_cpu_sampling.py)
REF_OPS = SimpleNamespace(**{**vars(CPU_OPS), "apply_top_k_top_p_min_p": ref.apply_top_k_top_p_min_p,
                             "sample": ref.sample, "apply_penalties": ref.apply_penalties,
                             "top_rows": ref.top_rows})


def _triton_ops() -> SimpleNamespace:
    """The Triton table on this test's device (CPU tensors: the interpreter)."""
    return ops_for(DEVICE, triton=True)


def test_cuda_sampler_is_handed_the_triton_kernels():
    """The CUDA path must not silently fall back to the torch reference (no GPU needed)."""
    cuda = ops_for("cuda")
    assert cuda.apply_top_k_top_p_min_p is triton_sampling.apply_top_k_top_p_min_p
    assert cuda.sample is triton_sampling.sample
    assert ops_for(torch.device("cuda", 1)) is cuda
    assert CPU_OPS.apply_top_k_top_p_min_p is not triton_sampling.apply_top_k_top_p_min_p
    assert CPU_OPS.sample is not triton_sampling.sample
    assert _triton_ops().sample is triton_sampling.sample  # forced, whatever the device
    assert Sampler(device="cuda").ops is cuda
    assert Sampler(device=torch.device("cuda", 0)).ops is cuda
    assert Sampler(device="cpu").ops is CPU_OPS
    # The engine builds Sampler(max_logprobs=...) without a device: the table then comes from
    # the logits' device at each call.
    default = Sampler(max_logprobs=4)
    assert default.ops is None
    assert default.ops_for(torch.device("cuda", 0)) is cuda
    assert default.ops_for("cpu") is CPU_OPS


def _spy(ops: SimpleNamespace, calls: list[str]) -> SimpleNamespace:
    def wrap(name):
        fn = getattr(ops, name)

        def spied(*args):
            calls.append(name)
            return fn(*args)

        return spied

    return SimpleNamespace(**{**vars(ops), "apply_top_k_top_p_min_p": wrap("apply_top_k_top_p_min_p"),
                              "sample": wrap("sample")})


#: one row per feature, and combinations; seeds on every row (sampled rows need them).
_MIXED_PARAMS = [
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_k=5, seed=12, logprobs=2),
    SamplingParams(temperature=1.3, top_p=0.6, seed=-13),
    SamplingParams(temperature=1.0, min_p=0.15, seed=2**40 + 14),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=15, logprobs=5),
    SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.6,
                   presence_penalty=0.3, seed=16),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0),
    SamplingParams(temperature=1.2, logit_bias={3: 5.0, 9: -100.0, 40: 2.5}, top_p=0.9, seed=17),
    SamplingParams(temperature=0.8, top_k=1, seed=18),  # top-k 1: the filtered argmax
    SamplingParams(temperature=1.0, top_p=0.3, seed=19),  # suppressed ids below (min_tokens)
    SamplingParams(temperature=2.0, top_k=3, min_p=0.5, seed=-(2**63)),
]


def _mixed_batch(step: int, vocab: int = 96):
    b = len(_MIXED_PARAMS)
    g = torch.Generator().manual_seed(100 + step)
    logits = torch.randn(b, vocab, generator=g) * 2
    logits[3] = torch.randint(-4, 5, (vocab,), generator=g).float() / 2  # ties at the cuts
    token_ids = torch.randint(0, vocab, (b, 10), generator=g, dtype=torch.int32)
    prompt = torch.randint(1, 5, (b,), generator=g)
    total = prompt + torch.randint(0, 6, (b,), generator=g)
    counters = total + 1000 * step
    suppress = torch.full((b, 3), -1, dtype=torch.int32)
    suppress[10] = logits[10].topk(3).indices.int()  # EOS-like ids forbidden before min_tokens
    suppress[0, 0] = int(logits[0].argmax())  # a greedy row with its argmax suppressed
    st = SamplingTensors.from_params(_MIXED_PARAMS)
    return logits, st, token_ids, prompt, total, counters, suppress


@pytest.mark.parametrize("use_plan", [False, True])
def test_sampler_on_triton_ops_matches_the_reference_sampler(use_plan):
    """The whole sampler, Triton filter + draw vs the torch reference, on a batch mixing every
    feature, over a few steps: same tokens and top ids (bits), same logprobs."""
    calls: list[str] = []
    triton_sampler = Sampler(max_logprobs=5, ops=_spy(_triton_ops(), calls))
    ref_sampler = Sampler(max_logprobs=5, ops=REF_OPS)
    differs_from_greedy = 0
    for step in range(3):
        logits, st, token_ids, prompt, total, counters, suppress = _mixed_batch(step)
        plan = SamplerPlan.of(st) if use_plan else None
        want = ref_sampler(logits, st, token_ids, prompt, total, counters, suppress, plan=plan)
        dev = lambda t: t.to(DEVICE)  # noqa: E731
        got = triton_sampler(dev(logits), st.to(DEVICE), dev(token_ids), dev(prompt), dev(total),
                             dev(counters), dev(suppress), plan=plan)
        got = [t.cpu() for t in got]
        assert torch.equal(got[0], want.tokens), (got[0], want.tokens)
        torch.testing.assert_close(got[1], want.logprob, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[2], want.top_ids)
        torch.testing.assert_close(got[3], want.top_logprobs, rtol=1e-5, atol=1e-5)
        assert not torch.isin(want.tokens[10], suppress[10]) and want.tokens[0] != suppress[0, 0]
        differs_from_greedy += int((want.tokens[1:7] != logits[1:7].argmax(-1)).sum())
    assert calls.count("apply_top_k_top_p_min_p") == 3 and calls.count("sample") == 3
    assert differs_from_greedy >= 3  # the draws are really random, not argmax in disguise


def test_triton_sampler_seeded_rows_are_batch_independent():
    """A seeded row alone gives the token it gives inside the mixed batch (the Triton path)."""
    sampler = Sampler(max_logprobs=5, ops=_triton_ops())
    logits, st, token_ids, prompt, total, counters, suppress = _mixed_batch(0)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    full = sampler(dev(logits), st.to(DEVICE), dev(token_ids), dev(prompt), dev(total),
                   dev(counters), dev(suppress)).tokens.cpu()
    for i in (2, 5, 8):
        rows = torch.tensor([i])
        alone = sampler(dev(logits[i : i + 1]), st.gather(rows).to(DEVICE), dev(token_ids[i : i + 1]),
                        dev(prompt[i : i + 1]), dev(total[i : i + 1]), dev(counters[i : i + 1]),
                        dev(suppress[i : i + 1])).tokens.cpu()
        assert alone.tolist() == [full[i].item()]


# What a CUDA graph cannot hold (the subset that sampler-shaped code could reach).
_UNSAFE = {"lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "item", "is_nonzero", "equal",
           "nonzero", "argwhere", "masked_select", "masked_scatter", "unique", "_unique",
           "_unique2", "unique_dim", "unique_consecutive", "bincount", "repeat_interleave"}


class _Audit(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bad: list[str] = []
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen += 1
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if func.overloadpacket.__name__ in _UNSAFE:
            self.bad.append(str(func))
        if func.overloadpacket.__name__ in ("index", "index_put", "index_put_") and any(
                t.dtype == torch.bool for t in tensors[1:]):
            self.bad.append(f"{func} (boolean mask)")
        if len({t.device for t in tensors}) > 1:
            self.bad.append(f"{func} (several devices)")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("table", ["triton", "reference"])
def test_graph_path_sampler_is_capture_safe_over_fake_tensors(table):
    """plan=None (what the graphs capture), every stage, over fake tensors: the Triton wrappers
    return right-shaped outputs without launching, and no op a graph cannot hold is issued."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = _triton_ops() if table == "triton" else REF_OPS
    calls: list[str] = []
    sampler = Sampler(max_logprobs=5, ops=_spy(ops, calls))
    logits, st, token_ids, prompt, total, counters, suppress = _mixed_batch(0)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor
        st_fake = SamplingTensors(**{k: fake(v) for k, v in vars(st).items()})
        args = [fake(t) for t in (logits, token_ids, prompt, total, counters, suppress)]
        audit = _Audit()
        with audit:
            out = sampler(args[0], st_fake, *args[1:])
    assert audit.seen > 20 and not audit.bad, audit.bad
    assert calls == ["apply_top_k_top_p_min_p", "sample"]
    b = logits.shape[0]
    assert out.tokens.shape == (b,) and out.tokens.dtype == torch.int64
    assert out.top_ids.shape == (b, 5) and out.logprob.dtype == torch.float32
