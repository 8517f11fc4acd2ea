"""The torch reference ops against naive, obviously-correct versions (and transformers)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from blink.kernels import ops_for
from blink.kernels.reference import layers as reference
from blink.kernels.attention_metadata import AttentionMetadata


def _random_batch(seed: int, block_size: int, decode_only: bool, padding: int):
    """Random sequences in a random paged layout, their new tokens flattened, plus
    ``padding`` tokens that write to the scratch block and belong to an unused row."""
    g = torch.Generator().manual_seed(seed)
    n_seqs = int(torch.randint(1, 5, (1,), generator=g))
    num_blocks, KVH, H, D = 96, 2, 4, 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs = []
    for _ in range(n_seqs):
        cached = int(torch.randint(0, 12, (1,), generator=g))
        new = 1 if decode_only else int(torch.randint(1, 9, (1,), generator=g))
        n_blk = -(-(cached + new) // block_size)
        seqs.append((cached, new, [perm.pop() for _ in range(n_blk)]))
    scratch = num_blocks
    width = max(len(b) for _, _, b in seqs) + 1  # one spare column, as a scheduler may have
    positions, slots, rows, starts, seq_lens, tables = [], [], [], [0], [], []
    for row, (cached, new, blocks) in enumerate(seqs):
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            rows.append(row)
        starts.append(starts[-1] + new)
        seq_lens.append(cached + new)
        tables.append(blocks + [scratch] * (width - len(blocks)))
    # an unused row (seq_len 0) owning the padding tokens
    unused = len(seqs)
    tables.append([scratch] * width)
    seq_lens.append(0)
    for i in range(padding):
        positions.append(0)
        slots.append(scratch * block_size + i % block_size)
        rows.append(unused)
    starts.append(starts[-1] + padding)
    T = len(positions)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        positions=torch.tensor(positions),
        token_seq_idx=torch.tensor(rows),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
    )
    k_cache = torch.randn(num_blocks + 1, block_size, KVH, D, generator=g)
    v_cache = torch.randn(num_blocks + 1, block_size, KVH, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    k_new = torch.randn(T, KVH, D, generator=g)
    v_new = torch.randn(T, KVH, D, generator=g)
    return seqs, md, q, k_new, v_new, k_cache, v_cache


def _naive_attention(seqs, md, q, k_cache, v_cache, scale):
    """Per token, in float64: read the context slot by slot through the block table."""
    block_size = k_cache.shape[1]
    H, KVH = q.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q, dtype=torch.float64)
    t = 0
    for cached, new, blocks in seqs:
        for pos in range(cached, cached + new):
            ctx = range(pos + 1)
            k = torch.stack([k_cache[blocks[j // block_size], j % block_size] for j in ctx]).double()
            v = torch.stack([v_cache[blocks[j // block_size], j % block_size] for j in ctx]).double()
            k = k.repeat_interleave(H // KVH, dim=1)  # [L, H, D]
            v = v.repeat_interleave(H // KVH, dim=1)
            s = torch.einsum("hd,lhd->hl", q[t].double(), k) * scale
            out[t] = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
            t += 1
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("decode_only", [False, True])
def test_paged_attention_matches_naive(seed, block_size, decode_only):
    seqs, md, q, k_new, v_new, k_cache, v_cache = _random_batch(seed, block_size, decode_only, padding=3)
    reference.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    scale = 0.3
    want = _naive_attention(seqs, md, q, k_cache, v_cache, scale)
    n_real = sum(new for _, new, _ in seqs)
    max_q = max(new for _, new, _ in seqs)
    max_ctx = max(c + n for c, n, _ in seqs)
    variants = [
        AttentionMetadata(**{**md.__dict__}),  # no hints
        AttentionMetadata(**{**md.__dict__, "max_context": max_ctx, "max_query_len": max_q}),
    ]
    for variant in variants:
        got = reference.paged_attention(q, k_cache, v_cache, variant, scale)
        assert got.shape == q.shape
        torch.testing.assert_close(got[:n_real].double(), want[:n_real], atol=1e-5, rtol=1e-5)
        # padding tokens (unused row) see nothing and come out as zeros, never NaN
        assert torch.equal(got[n_real:], torch.zeros_like(got[n_real:]))


def test_paged_attention_chunks_tiles_under_a_small_budget(monkeypatch):
    seqs, md, q, k_new, v_new, k_cache, v_cache = _random_batch(3, 4, False, padding=0)
    reference.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    whole = reference.paged_attention(q, k_cache, v_cache, md, 0.5)
    monkeypatch.setattr(reference, "_GATHER_BUDGET_BYTES", 1)  # one tile per chunk
    monkeypatch.setattr(reference, "_WHOLE_MASK_ELEMENTS", 0)  # masks built per chunk
    torch.testing.assert_close(reference.paged_attention(q, k_cache, v_cache, md, 0.5), whole)


def test_paged_attention_prefill_chunk_beside_many_decodes():
    """The continuous-batching mix: one long chunk (over a cached prefix) and many
    single-token rows, in small tiles, with a step cache shared by two 'layers'."""
    block_size, H, KVH, D = 4, 4, 2, 8
    g = torch.Generator().manual_seed(7)
    seqs = [(6, 23, list(range(0, 8)))] + [(3 + i, 1, [8 + 3 * i, 9 + 3 * i, 10 + 3 * i]) for i in range(9)]
    positions, slots, rows, starts = [], [], [], [0]
    for row, (cached, new, blocks) in enumerate(seqs):
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            rows.append(row)
        starts.append(starts[-1] + new)
    width = max(len(b) for _, _, b in seqs)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        positions=torch.tensor(positions),
        token_seq_idx=torch.tensor(rows),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n, _ in seqs], dtype=torch.int32),
        block_tables=torch.tensor([b + [40] * (width - len(b)) for _, _, b in seqs], dtype=torch.int32),
        max_context=29,
        max_query_len=23,
        step_cache={},
    )
    T = len(positions)
    k_cache = torch.randn(41, block_size, KVH, D, generator=g)
    v_cache = torch.randn(41, block_size, KVH, D, generator=g)
    reference.write_kv_cache(
        torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g), k_cache, v_cache, md.slot_mapping
    )
    q = torch.randn(T, H, D, generator=g)
    want = _naive_attention(seqs, md, q, k_cache, v_cache, 0.4)
    for _ in range(2):  # the second call reuses the memoised plan
        got = reference.paged_attention(q, k_cache, v_cache, md, 0.4)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    plan = md.step_cache["paged_attention"]
    n_tiles, tile = plan.limit.shape
    assert tile == 4 and n_tiles <= len(seqs) + -(-T // tile)  # small tiles, not a T x B grid


def test_paged_attention_bf16_close_to_fp32():
    seqs, md, q, k_new, v_new, k_cache, v_cache = _random_batch(1, 4, False, padding=0)
    reference.write_kv_cache(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    want = reference.paged_attention(q, k_cache, v_cache, md, 0.35)
    got = reference.paged_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), md, 0.35)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_write_kv_cache_scatters_to_slots():
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    k = torch.arange(8.0).view(2, 1, 4)
    reference.write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, 0]))
    assert torch.equal(k_cache[2, 1, 0], k[0, 0]) and torch.equal(k_cache[0, 0, 0], k[1, 0])
    assert torch.equal(v_cache[2, 1, 0], -k[0, 0])
    assert k_cache[1].abs().sum() == 0


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = reference.rope_inv_freq(128, 500000.0, rope)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)


def test_apply_rope_partial_rotary_leaves_the_rest():
    cache = reference.rope_cos_sin_cache(4, 16, 10000.0)
    q = torch.randn(3, 2, 8)
    k = torch.randn(3, 1, 8)
    pos = torch.tensor([0, 5, 9])
    q2, k2 = reference.apply_rope(q, k, pos, cache)
    assert torch.equal(q2[..., 4:], q[..., 4:]) and torch.equal(k2[..., 4:], k[..., 4:])
    assert torch.equal(q2[0], q[0])  # position 0 rotates by zero
    # rotation preserves the norm of each rotated pair
    torch.testing.assert_close(q2[..., :4].norm(dim=-1), q[..., :4].norm(dim=-1))
    assert not torch.allclose(q2[1:, :, :4], q[1:, :, :4])


@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_topk_route(renormalize):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    weights, ids = reference.moe_topk_route(logits, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    probs = logits.float().softmax(-1)
    for t in range(5):
        order = probs[t].argsort(descending=True)[:3]
        assert ids[t].tolist() == order.tolist()
        want = probs[t, order]
        if renormalize:
            want = want / want.sum()
        torch.testing.assert_close(weights[t], want)


def _naive_moe(x, w13, w2, weights, ids):
    out = torch.zeros_like(x, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = w13[e, :inter].double() @ x[t].double()
            up = w13[e, inter:].double() @ x[t].double()
            out[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 3, 9])  # 1: gather path (2*T*k < E); 3, 9: dense path
def test_moe_experts_matches_naive(tokens):
    g = torch.Generator().manual_seed(tokens)
    E, H, inter, k = 8, 16, 6, 2
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g)
    w2 = torch.randn(E, H, inter, generator=g)
    weights, ids = reference.moe_topk_route(torch.randn(tokens, E, generator=g), k, True)
    got = reference.moe_experts(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _naive_moe(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_op_table_has_the_moe_ops():
    ops = ops_for("cpu")
    assert ops.moe_experts is reference.moe_experts
    assert ops.moe_topk_route is reference.moe_topk_route


def test_rms_norm_matches_formula():
    x = torch.randn(4, 32)
    w = torch.randn(32)
    want = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-5), want)
    res = torch.randn(4, 32)
    normed, new_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, reference.rms_norm(x + res, w, 1e-5))
    assert math.isfinite(float(normed.abs().max()))
