"""Triton MoE routing and expert-grouped MLP against the torch reference.

CPU + Triton interpreter (``TRITON_INTERPRET=1`` before the kernel modules are imported).
Tolerances: routing weights 1e-6 with identical ids (no near-ties in random logits);
experts fp32 1e-4, bf16 atol/rtol 3e-2 (the interpreter truncates to bf16 at the
reference's three rounding points where a GPU rounds to nearest).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest
import torch

from blink.kernels.reference import layers as ref

triton_moe = pytest.importorskip("blink.kernels.triton.moe")
from blink.kernels.triton.common import interpreting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
if DEVICE == "cpu" and not interpreting():
    pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)


@pytest.mark.parametrize("n_experts,top_k", [(8, 2), (12, 3), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_route(n_experts, top_k, renormalize):
    logits = torch.randn(5, n_experts, generator=torch.Generator().manual_seed(n_experts)) * 2
    logits = logits.to(torch.bfloat16)  # the router output dtype in a bf16 model
    w, ids = triton_moe.moe_topk_route(logits.to(DEVICE), top_k, renormalize)
    w_ref, ids_ref = ref.moe_topk_route(logits, top_k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, atol=1e-6, rtol=1e-6)


def test_align_by_expert_groups_pairs_into_single_expert_tiles():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])
    pairs, tile_expert, max_rows = triton_moe._align_by_expert(ids, n_experts=5, block_m=4)
    n_pairs = ids.numel()
    assert max_rows == pairs.numel() and max_rows % 4 == 0 and max_rows >= n_pairs + 5 * 3
    flat = ids.reshape(-1)
    seen = []
    for t, e in enumerate(tile_expert.tolist()):
        rows = pairs[t * 4 : (t + 1) * 4].tolist()
        real = [p for p in rows if p < n_pairs]
        if e == 5:  # past the end: padding only
            assert not real
            continue
        assert real and all(int(flat[p]) == e for p in real)
        seen += real
    assert sorted(seen) == list(range(n_pairs))  # every pair exactly once
    assert set(tile_expert.tolist()) == {0, 1, 2, 3, 5}  # expert 4 has no tokens, no tile


@pytest.mark.parametrize(
    "n_tokens,n_experts,top_k,hidden,inter,dtype,tiles",
    [
        (1, 8, 2, 32, 48, torch.float32, (16, 16, 16)),    # decode: gathered experts
        (9, 6, 2, 40, 24, torch.float32, (16, 32, 16)),    # non-pow2 dims: masked tiles
        (24, 4, 2, 32, 32, torch.bfloat16, (16, 16, 32)),  # several tiles per expert
        (6, 8, 3, 32, 32, torch.bfloat16, None),           # the public entry (its own tiles)
    ],
)
def test_moe_experts(n_tokens, n_experts, top_k, hidden, inter, dtype, tiles):
    g = torch.Generator().manual_seed(n_tokens)
    x = torch.randn(n_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(n_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(n_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(n_tokens, n_experts, generator=g)
    logits[:, -1] = -30.0  # one expert nobody picks: it must not get a tile
    weights, ids = ref.moe_topk_route(logits, top_k, True)
    expected = ref.moe_experts(x, w13, w2, weights, ids)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    if tiles is None:
        out = triton_moe.moe_experts(*args)
    else:
        bm, bn, bk = tiles
        out = triton_moe.moe_experts_impl(*args, block_m=bm, block_n=bn, block_k=bk)
    assert out.dtype == dtype and out.shape == x.shape
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.cpu().float(), expected.float(), **tol)
