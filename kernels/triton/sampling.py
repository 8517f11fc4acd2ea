"""Triton top-k / top-p / min-p filtering and Gumbel-max sampling.

Twins of :func:`blink.kernels.reference.sampling.apply_top_k_top_p_min_p` and
:func:`blink.kernels.reference.sampling.sample`, same signatures, same rule, same RNG bits.

The reference sorts each row; a vocabulary of 150K entries does not sort inside one Triton
program, so the filter finds the reference's cut-offs by *selection* instead, one program
per row streaming the row in chunks:

* every float maps to an int32 key with the same order (``-0.0`` canonicalised to ``+0.0``);
* "the k-th largest value" and "the last value whose strictly-larger mass is below top_p"
  are both "the largest key t with F(t) >= target" for a non-increasing step function
  F(t) = sum of weights of the entries with key >= t (weights 1 for top-k, the entries'
  unnormalised probabilities for top-p). A multi-pivot search evaluates NP pivots per pass
  over the row, so 32-bit keys resolve in about 8 passes, and the answer is always the key
  of a real entry;
* ties at the top-p cut-off keep the lowest vocabulary indices first (the reference's
  stable sort), found by the same search over indices when the cut falls inside a tie.

:class:`blink.engine.sampler.Sampler` calls both through ``blink.kernels.ops_for(device)``,
inside the captured CUDA graphs: launch grids and block sizes depend only on the shapes, the
wrappers never read a tensor value on the host, and the per-row branches (top-k on/off,
top-p on/off) are taken inside the kernel. Over fake tensors (``FakeTensorMode``: the capture
audit's fake-CUDA step, shape propagation) the wrappers return outputs of the right shape,
dtype and device without launching (a fake tensor has no memory).

Agreement with the reference is exact except when a probability mass lies within fp32
rounding of ``top_p`` or ``exp(x - max)`` within rounding of ``min_p`` (sums are added in a
different order), and, for sampling, when two Gumbel scores are within an ulp of ``log``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

_INT32_MIN = tl.constexpr(-(2**31))


# ----------------------------------------------------------------------------- rng


@triton.jit
def _fmix32(h):
    """Murmur3 finaliser on uint32 (multiplication wraps modulo 2**32)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_key(seed, counter):
    """Per-row key from int64 seed and counter (lo/hi 32-bit halves, as the reference)."""
    k = _fmix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x243F6A88)
    k = _fmix32(k ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = _fmix32(k ^ (counter & 0xFFFFFFFF).to(tl.uint32))
    return _fmix32(k ^ ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _uniform(key, v):
    """Uniform draws in [2**-24, 1 - 2**-24] for vocabulary indices ``v`` of a row."""
    bits = _fmix32(key ^ (v.to(tl.uint32) * 0x9E3779B9))
    return (((bits >> 9) << 1) + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _gumbel(key, v):
    """Standard Gumbel noise -log(-log(u)) for vocabulary indices ``v`` of a row."""
    return -tl.log(-tl.log(_uniform(key, v)))


@triton.jit
def _uniform_kernel(seed_ptr, counter_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = _row_key(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    tl.store(out_ptr + row * vocab + v, _uniform(key, v), mask=v < vocab)


def uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, vocab_size]: the sampler's uniform draws, bit-identical to
    :func:`sampling_reference.uniform` (exposed so the RNG can be checked on its own)."""
    seeds, counters = seeds.long().contiguous(), counters.long().contiguous()
    out = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    block = min(1024, triton.next_power_of_2(vocab_size))
    if seeds.shape[0] and not is_fake(out):
        _uniform_kernel[(seeds.shape[0], triton.cdiv(vocab_size, block))](
            seeds, counters, out, vocab_size, BLOCK_V=block
        )
    return out


@triton.jit
def _sample_kernel(
    logits_ptr, seed_ptr, counter_ptr, out_ptr, vocab, stride_row, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    key = _row_key(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + row * stride_row + v, mask=v < vocab, other=float("-inf"))
        score = tl.where(v < vocab, x.to(tl.float32) + _gumbel(key, v), float("-inf"))
        chunk_best = tl.max(score, axis=0)
        # First maximum within the chunk; strict '>' across chunks: ties go to the lowest index.
        chunk_idx = tl.min(tl.where(score == chunk_best, v, vocab), axis=0).to(tl.int32)
        take = chunk_best > best
        best_idx = tl.where(take, chunk_idx, best_idx)
        best = tl.where(take, chunk_best, best)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def sample(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draw of one token per row; see :func:`sampling_reference.sample`.

    logits f32 [B, V] (-inf = excluded), seeds/counters i64 [B]. Returns int64 [B].
    """
    n_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # The kernel reads one int64 per row at unit stride (the hi-32 halves need 64 bits).
    seeds = seeds.long().contiguous()
    counters = counters.long().contiguous()
    out = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    if n_rows and not is_fake(logits):
        _sample_kernel[(n_rows,)](
            logits, seeds, counters, out, vocab, logits.stride(0),
            BLOCK_V=min(2048, triton.next_power_of_2(vocab)), num_warps=8,
        )
    return out


# ----------------------------------------------------------------------------- filtering


@triton.jit
def _float_key(x):
    """int32 key with the order of the float ``x`` (-0.0 and +0.0 map to the same key)."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(key == -1, 0, key)  # -1 is -0.0


@triton.jit
def _search(
    row_ptr, vocab, row_max, min_p, key_floor, tie_key, target, lo, hi,
    MODE: tl.constexpr, NP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Largest t in [lo, hi] with F(t) = sum(w[v] for key[v] >= t) >= target.

    Requires F(lo) >= target. MODE 0: key = value key, w = 1 over the whole row (top-k).
    MODE 1: key = value key, w = exp(x - max) over the survivors of min-p and top-k
    (entries with key >= key_floor) (top-p). MODE 2: key = vocabulary index, w = 1 over the
    survivors whose value key is ``tie_key`` (ties at the top-p cut).
    """
    lanes = tl.arange(0, NP).to(tl.int64)
    while lo < hi:
        # NP pivots spread over (lo, hi]; each pass shrinks the interval ~NP+1 times.
        piv = lo + ((hi - lo) * (lanes + 1) + NP) // (NP + 1)
        acc = tl.zeros([NP], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            v = start + tl.arange(0, BLOCK_V)
            ok = v < vocab
            x = tl.load(row_ptr + v, mask=ok, other=float("-inf"))
            vkey = _float_key(x)
            if MODE == 0:
                key = vkey
                w = ok.to(tl.float32)
            else:
                e = tl.exp(x - row_max)
                alive = ok & (e >= min_p) & (vkey >= key_floor)
                if MODE == 1:
                    key = vkey
                    w = tl.where(alive, e, 0.0)
                else:
                    key = v
                    w = tl.where(alive & (vkey == tie_key), 1.0, 0.0)
            hit = key.to(tl.int64)[:, None] >= piv[None, :]
            acc += tl.sum(tl.where(hit, w[:, None], 0.0), axis=0)
        good = acc >= target
        new_lo = tl.max(tl.where(good, piv, lo), axis=0)
        hi = tl.min(tl.where(good, hi, piv - 1), axis=0)
        lo = new_lo
    return lo


@triton.jit
def _filter_kernel(
    logits_ptr, out_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab, stride_in, stride_out,
    NP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_in
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)

    # Pass 1: the row maximum (the reference's s[0]).
    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        m = tl.maximum(m, tl.max(tl.load(row_ptr + v, mask=v < vocab, other=float("-inf")), axis=0))
    key_max = _float_key(m).to(tl.int64)
    m = tl.where(m == float("-inf"), 0.0, m)  # all -inf row: exp(x - m) = 0, not nan

    # Top-k: key of the k-th largest entry; everything >= it survives (ties included).
    k_eff = tl.where(top_k <= 0, vocab, tl.minimum(top_k, vocab))
    key_k = tl.full([], _INT32_MIN, tl.int64)
    if k_eff < vocab:
        key_k = _search(row_ptr, vocab, m, min_p, 0, 0, k_eff.to(tl.float32), key_k, key_max,
                        0, NP, BLOCK_V)

    # Top-p: key of the last kept value, then how many of its ties (lowest index first) fit.
    key_p = tl.full([], _INT32_MIN, tl.int64)
    first_cut = vocab.to(tl.int64)  # tied entries at key_p with index >= first_cut are cut
    if top_p < 1.0:
        # Z: unnormalised mass of the min-p and top-k survivors (the reference's softmax(s1)).
        z = tl.zeros([], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            v = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + v, mask=v < vocab, other=float("-inf"))
            e = tl.exp(x - m)
            alive = (v < vocab) & (e >= min_p) & (_float_key(x) >= key_k)
            z += tl.sum(tl.where(alive, e, 0.0), axis=0)
        if z > 0.0:
            target = top_p * z
            key_p = _search(row_ptr, vocab, m, min_p, key_k, 0, target, key_k, key_max,
                            1, NP, BLOCK_V)
            above = tl.zeros([], tl.float32)  # mass strictly above key_p
            n_tied = tl.zeros([], tl.float32)
            e_tied = tl.zeros([], tl.float32)
            for start in range(0, vocab, BLOCK_V):
                v = start + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + v, mask=v < vocab, other=float("-inf"))
                vkey = _float_key(x).to(tl.int64)
                e = tl.exp(x - m)
                alive = (v < vocab) & (e >= min_p) & (vkey >= key_k)
                above += tl.sum(tl.where(alive & (vkey > key_p), e, 0.0), axis=0)
                tied = alive & (vkey == key_p)
                n_tied += tl.sum(tied.to(tl.float32), axis=0)
                e_tied = tl.maximum(e_tied, tl.max(tl.where(tied, e, 0.0), axis=0))
            # The j-th tie (0-based) has mass above + j * e_tied before it; kept while < target.
            n_keep = tl.minimum(tl.ceil((target - above) / e_tied), n_tied)
            if n_keep < n_tied:
                first_cut = _search(row_ptr, vocab, m, min_p, key_k, key_p.to(tl.int32),
                                    n_tied - n_keep, tl.full([], 0, tl.int64),
                                    first_cut - 1, 2, NP, BLOCK_V)

    # Final pass: write survivors, -inf elsewhere.
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + v, mask=v < vocab, other=float("-inf"))
        vkey = _float_key(x).to(tl.int64)
        e = tl.exp(x - m)
        keep = (e >= min_p) & (vkey >= key_k) & (vkey >= key_p)
        keep = keep & ((vkey > key_p) | (v < first_cut))
        tl.store(out_ptr + row * stride_out + v, tl.where(keep, x, float("-inf")), mask=v < vocab)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Mask (to -inf) what min-p, top-k and top-p remove; see
    :func:`sampling_reference.apply_top_k_top_p_min_p` for the rule.

    logits f32 [B, V] (temperature already applied), top_k i32 [B] (<= 0 off), top_p f32 [B]
    (>= 1 off), min_p f32 [B] (0 off). Returns a new f32 [B, V] tensor.
    """
    n_rows, vocab = logits.shape
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    top_k, top_p, min_p = top_k.contiguous(), top_p.contiguous(), min_p.contiguous()
    out = torch.empty((n_rows, vocab), dtype=torch.float32, device=logits.device)
    if n_rows and not is_fake(logits):
        _filter_kernel[(n_rows,)](
            logits, out, top_k, top_p, min_p, vocab, logits.stride(0), out.stride(0),
            NP=16, BLOCK_V=min(256, triton.next_power_of_2(vocab)), num_warps=4,
        )
    return out
