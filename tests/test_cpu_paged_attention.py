"""The CPU paged attention kernel (blink.kernels.cpu.paged_attention), compiled as the engine
compiles it, against the reference: decode, prefill, extend over a cached prefix, an unused
row and padding in one step; GQA/MQA/MHA; fp32 and bf16; chunked tiles; and one compiled
graph for every shape (no recompiles). Compiled code is cached under pytest's cache dir."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from attention_cases import CPU_CASES, make_batch  # noqa: E402

from blink.engine.compiled import compile_fn, configure_compile_cache, warming  # noqa: E402
from blink.kernels.cpu import paged_attention as cpa  # noqa: E402
from blink.kernels.reference import layers as ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture(scope="module")
def kernel(request):
    """Compiled and warmed as the engine does (fp32 and bf16), then used under its
    steady-state policy: a call that would compile again is refused and counted."""
    configure_compile_cache(Path(request.config.cache.mkdir("blink-inductor")))
    fn = compile_fn(cpa.tile_attention, "the paged attention kernel", **cpa.compile_options())
    for dtype in (torch.float32, torch.bfloat16):
        kc, vc, _, _, md, _ = make_batch([(3, 2), (0, 1)], n_kv_heads=1, head_dim=8,
                                         block_size=4, dtype=dtype)
        q = torch.zeros(md.slot_mapping.shape[0], 2, 8, dtype=dtype)
        with torch.inference_mode(), warming():
            for _ in range(2):
                cpa.paged_attention(q, kc, vc, md, 1.0, fn)
    return fn


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("rows,n_heads,n_kv_heads,head_dim,block_size,dtype", CPU_CASES)
def test_matches_reference(kernel, rows, n_heads, n_kv_heads, head_dim, block_size, dtype):
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        rows, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
        pad_tokens=3,
    )
    T = md.slot_mapping.shape[0]
    q = torch.randn(T, n_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    scale = head_dim ** -0.5
    expected = ref.paged_attention(q, k_cache, v_cache, md, scale)
    with torch.inference_mode():
        out = cpa.paged_attention(q, k_cache, v_cache, md, scale, kernel)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out[:n_live].float(), expected[:n_live].float(), **TOL[dtype])
    assert torch.count_nonzero(out[n_live:]) == 0  # padding tokens: exact zeros
    assert kernel.refused == 0  # the compiled kernel ran, not the eager fallback


def test_chunks_of_tiles_and_one_graph_for_all_shapes(kernel, monkeypatch):
    """Many tiles in chunks (a small score budget) give the same result, and after the first
    compile no shape (tile count, query width, context length, head layout) compiles again."""
    k_cache, v_cache, k_new, v_new, md, n_live = make_batch(
        [(50, 1), (0, 12), (7, 3), (90, 1), (0, 0), (33, 5)], n_kv_heads=2, head_dim=16,
        block_size=4, dtype=torch.float32, pad_tokens=2,
    )
    ref.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    T = md.slot_mapping.shape[0]
    q = torch.randn(T, 4, 16, generator=torch.Generator().manual_seed(2))
    expected = ref.paged_attention(q, k_cache, v_cache, md, 0.25)
    graphs = _graphs()
    monkeypatch.setattr(cpa, "_SCORE_BUDGET_BYTES", 4 * 16 * 4 * 4 * 10)
    with torch.inference_mode():
        chunked = cpa.paged_attention(q, k_cache, v_cache, md, 0.25, kernel)
    monkeypatch.undo()
    for rows in ([(5, 1)], [(0, 7), (3, 2)], [(120, 1)] * 9):
        # caches made outside inference mode, like the engine's
        kc, vc, kn, vn, md2, _ = make_batch(rows, n_kv_heads=2, head_dim=16, block_size=4,
                                           dtype=torch.float32)
        ref.write_kv_cache(kn, vn, kc, vc, md2.slot_mapping)
        q2 = torch.randn(md2.slot_mapping.shape[0], 4, 16)
        with torch.inference_mode():
            got = cpa.paged_attention(q2, kc, vc, md2, 0.25, kernel)
        torch.testing.assert_close(got, ref.paged_attention(q2, kc, vc, md2, 0.25), **TOL[torch.float32])
    torch.testing.assert_close(chunked[:n_live], expected[:n_live], **TOL[torch.float32])
    assert kernel.refused == 0 and _graphs() == graphs
