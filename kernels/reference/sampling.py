"""Torch reference for the sampling kernels: counter-based RNG, top-k/top-p/min-p, Gumbel-max.

This file is the specification the Triton sampling kernel must reproduce. Everything is
branch-free tensor code of fixed shape (no host sync, no Python branching on tensor values), so
it runs inside a captured CUDA graph and under ``torch.compile(fullgraph=True)``.

Counter-based RNG (exact formula)
---------------------------------
All arithmetic is on unsigned 32-bit values. The reference holds them in int64 tensors and masks
explicitly, so no product ever exceeds 2**63 (no reliance on overflow behaviour); a Triton kernel
computes the very same bits with ``tl.uint32`` arithmetic, which wraps modulo 2**32 natively.

    M32            = 0xFFFFFFFF
    lo32(x)        = x & M32                 (x int64, two's complement)
    hi32(x)        = (x >> 32) & M32         (arithmetic shift, then mask)
    mul32(a, c)    = (a * c) mod 2**32       for a, c < 2**32
                   = (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & M32
    fmix32(h)      = murmur3 finaliser:
                       h ^= h >> 16;  h = mul32(h, 0x85EBCA6B)
                       h ^= h >> 13;  h = mul32(h, 0xC2B2AE35)
                       h ^= h >> 16
    row_key(seed, counter) =                 (seed, counter: int64, one per row)
        k = fmix32(lo32(seed) ^ 0x243F6A88)
        k = fmix32(k ^ hi32(seed))
        k = fmix32(k ^ lo32(counter))
        k = fmix32(k ^ hi32(counter))
    bits(seed, counter, v) = fmix32(row_key(seed, counter) ^ mul32(v, 0x9E3779B9))
                                             (v: vocabulary index, 0 <= v < 2**31)
    uniform(seed, counter, v) = float32(((bits >> 9) << 1) + 1) * 2**-24

``uniform`` is exactly representable in float32 and lies in [2**-24, 1 - 2**-24], strictly
inside (0, 1), so ``-log(-log(u))`` is always finite. ``v -> bits`` is a bijection for a
fixed row key (odd multiplier, xor, and fmix32 are all bijections), so no two vocabulary entries
of a row share a draw. The draws of a row depend only on (seed, counter, v): never on the batch
size, on the row's position in the batch or on the other rows.

Sampling (Gumbel-max)
---------------------
    token = argmax_v ( logits[v] + g[v] ),   g[v] = -log(-log(uniform(seed, counter, v)))

computed in float32; ties go to the lowest vocabulary index (``torch.argmax`` returns the first
maximum; the kernel must do the same). ``argmax(logits + g)`` draws from ``softmax(logits)``
exactly (Gumbel-max), and is the log-domain form of vLLM's exponential race
``argmax(probs / E)`` with ``E = -log(u)``. Masked logits (-inf) are never chosen unless the
whole row is -inf. ``log`` may differ by an ulp between torch and a GPU kernel, so the two agree
on the token unless two candidates' scores are within rounding of each other.

Filtering: see :func:`apply_top_k_top_p_min_p` for the exact per-row rule; penalties:
:func:`apply_penalties` (vLLM's repetition, frequency and presence penalties).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35
_SEED_SALT = 0x243F6A88  # first digits of pi: keeps seed 0 away from fmix32's fixed point 0
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio, odd: v -> v * _GOLDEN mod 2**32 is a bijection
_TWO_POW_M24 = 2.0**-24


def mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``(a * c) mod 2**32`` for int64 ``a`` in [0, 2**32) and a constant ``c`` < 2**32.

    Split ``c`` in 16-bit halves so that every intermediate stays below 2**49.
    """
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (a * c_lo + (((a * c_hi) & 0xFFFF) << 16)) & M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """Murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def row_key(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit key (held in int64) from int64 ``seeds`` and ``counters`` (any shape)."""
    seeds, counters = seeds.long(), counters.long()
    k = fmix32((seeds & M32) ^ _SEED_SALT)
    k = fmix32(k ^ ((seeds >> 32) & M32))
    k = fmix32(k ^ (counters & M32))
    return fmix32(k ^ ((counters >> 32) & M32))


def random_bits(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [B, vocab_size] of 32-bit hashes ``bits(seed[b], counter[b], v)``."""
    key = row_key(seeds, counters).unsqueeze(-1)
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return fmix32(key ^ mul32(v, _GOLDEN))


def uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, vocab_size] uniform draws in [2**-24, 1 - 2**-24] (see module docstring)."""
    bits = random_bits(seeds, counters, vocab_size)
    return (((bits >> 9) << 1) + 1).to(torch.float32) * _TWO_POW_M24


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, vocab_size] standard Gumbel noise ``-log(-log(u))``."""
    return -torch.log(-torch.log(uniform(seeds, counters, vocab_size)))


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) the logits that min-p, top-k or top-p filtering removes.

    logits f32 [B, V] (already temperature-scaled), top_k i32 [B] (<= 0: off; > V: V),
    top_p f32 [B] (>= 1: off), min_p f32 [B] (0: off). Returns a new f32 [B, V] tensor.

    Exact rule per row (vLLM v1's order: min-p, then top-k, then top-p on what survives):

        s, idx   = sort(x, descending, stable)     ties keep the lower vocab index first
        keep_mp  = exp(s - s[0]) >= min_p          p_j / p_max >= min_p   (min_p 0: all)
        k_eff    = V if top_k <= 0 else min(top_k, V)
        keep_k   = s >= s[k_eff - 1]               ties with the k-th value are kept (vLLM)
        s1       = where(keep_mp & keep_k, s, -inf)
        q        = softmax(s1)                     renormalised over the survivors
        before   = cumsum(q) - q                   mass ranked strictly above each entry
        keep_p   = (top_p >= 1) | (before < top_p) the top entry always survives
        out[idx] = where(keep_p, s1, -inf)

    The top entry survives every filter, so no row is left empty.
    """
    vocab_size = logits.shape[-1]
    s, idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    s_max = s[:, :1]

    keep = torch.exp(s - s_max) >= min_p.to(s.dtype).unsqueeze(-1)

    top_k = top_k.long()
    k_eff = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
    kth_value = s.gather(-1, (k_eff - 1).clamp(min=0).unsqueeze(-1))
    keep = keep & (s >= kth_value)

    s1 = s.masked_fill(~keep, float("-inf"))
    q = torch.softmax(s1, dim=-1)
    before = torch.cumsum(q, dim=-1) - q
    top_p = top_p.to(s.dtype).unsqueeze(-1)
    keep_p = (top_p >= 1.0) | (before < top_p)
    s2 = s1.masked_fill(~keep_p, float("-inf"))
    return torch.empty_like(logits).scatter(-1, idx, s2)


def row_mask(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map -1 padding and out-of-vocabulary ids to the spare column ``vocab_size``.

    Returns (int64 ids safe for a [B, V+1] scatter, bool validity mask).
    """
    ids = ids.long()
    valid = (ids >= 0) & (ids < vocab_size)
    return torch.where(valid, ids, vocab_size), valid


def token_counts(
    token_ids: torch.Tensor, start: torch.Tensor, end: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """f32 [B, V]: how often each token occurs in ``token_ids[b, start[b]:end[b]]``.

    Positions outside the range, and ids outside [0, V), are counted in a spare column that is
    dropped, so the shape is fixed whatever the lengths are.
    """
    batch, length = token_ids.shape
    pos = torch.arange(length, device=token_ids.device)
    ids, valid = row_mask(token_ids, vocab_size)
    in_range = (pos >= start.long().unsqueeze(-1)) & (pos < end.long().unsqueeze(-1)) & valid
    ids = torch.where(in_range, ids, vocab_size)
    counts = torch.zeros(batch, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts = counts.scatter_add(1, ids, in_range.to(torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_lens: torch.Tensor,
    total_lens: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties, computed from ``token_ids`` [B, L] (prompt then output, padded).

    Tokens seen anywhere in ``[0, total_len)`` get the repetition penalty: logit / r when the
    logit is positive, logit * r otherwise. Then, with c = the token's count in the output
    ``[prompt_len, total_len)``: ``logit -= frequency * c + presence * (c > 0)``.
    """
    vocab_size = logits.shape[-1]
    zeros = torch.zeros_like(prompt_lens)
    seen = token_counts(token_ids, zeros, total_lens, vocab_size) > 0
    out_counts = token_counts(token_ids, prompt_lens, total_lens, vocab_size).to(logits.dtype)

    r = repetition_penalty.to(logits.dtype).unsqueeze(-1)
    penalised = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalty.to(logits.dtype).unsqueeze(-1) * out_counts
    logits = logits - presence_penalty.to(logits.dtype).unsqueeze(-1) * (out_counts > 0).to(
        logits.dtype
    )
    return logits


def top_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of a [B, V] float tensor: the k largest values of each row,
    largest first, and their ids (int64): the sampler's top logprobs from its raw logits."""
    return torch.topk(x, k, dim=-1)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt logprobs at k positions (vLLM's ``prompt_logprobs``): from fp32 logits [k, V] and
    each position's next prompt token ``targets`` (int64 [k]), the fp32 log-softmax's value at
    the target (``chosen`` [k]), its rank (int64 [k]: how many logprobs are at least as large,
    itself included, as vLLM counts), and the ``top_n`` largest logprobs (fp32 [k, top_n]) with
    their ids (int64 [k, top_n]), largest first."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    rank = (logprobs >= chosen).sum(1)
    values, ids = logprobs.topk(top_n, dim=1)
    return chosen.squeeze(1), rank, values, ids


#: Chunk width of :func:`argmax_rows`' two-level search.
ARGMAX_CHUNK = 64


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [B]: ``torch.argmax(x, dim=-1)`` of a [B, V] float tensor, the same index
    (the first maximum; a NaN counts as the maximum, as in torch).

    Why not torch.argmax: on CPU its reduction is scalar code (~90 us per 49152-entry row
    here, ~1.5 ms at 16 rows), while ``amax`` is vectorised (~6 us). So: the max of each
    ``ARGMAX_CHUNK``-wide chunk (vectorised), the first chunk holding the row's max (a short
    argmax), and the first max inside that chunk. A vocabulary that is not a multiple of the
    chunk is padded with -inf (the pad never wins: a real entry is >= -inf and comes first).
    """
    B, V = x.shape
    C = ARGMAX_CHUNK
    if V < 2 * C:
        return torch.argmax(x, dim=-1)
    if V % C:
        x = torch.nn.functional.pad(x, (0, C - V % C), value=float("-inf"))
    chunks = x.reshape(B, -1, C)  # a view for row-contiguous logits (a copy otherwise)
    best_chunk = chunks.amax(-1).argmax(-1)  # amax propagates NaN, argmax picks it first
    inside = chunks.gather(1, best_chunk.view(B, 1, 1).expand(B, 1, C)).squeeze(1).argmax(-1)
    return best_chunk * C + inside


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, 1]: ``log(sum(exp(x), -1))`` of a [B, V] float tensor, the sampler's log-normaliser
    (raw logprobs are ``x - logsumexp_rows(x)``)."""
    return torch.logsumexp(x, dim=-1, keepdim=True)


def argmax_logsumexp_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(argmax_rows(x), logsumexp_rows(x), the argmax's logprob)``: a greedy step's tokens,
    log-normaliser and the tokens' logprobs ([B]: their logits minus the log-normaliser) when no
    stage changes the logits in between (the sampler asks for all at once, so that a kernel can
    take them in one pass). bf16 and fp16 are widened to fp32 first (the C kernel reads a CPU
    step's bf16 logits so)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    tokens, log_norm = argmax_rows(x), logsumexp_rows(x)
    return tokens, log_norm, (x.gather(-1, tokens.unsqueeze(-1)) - log_norm).squeeze(-1)


def sample(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``softmax(logits)`` with the counter-based RNG.

    logits f32 [B, V] (log-probabilities or any unnormalised log-weights; -inf = excluded),
    seeds i64 [B], counters i64 [B] (the caller's per-row draw index, e.g. the position of the
    token being generated). Returns int64 [B]. Gumbel-max: ``argmax(logits + gumbel_noise)``.
    """
    noise = gumbel_noise(seeds, counters, logits.shape[-1])
    return argmax_rows(logits.float() + noise)
