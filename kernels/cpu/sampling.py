"""The sampler's penalties, seeded draw, top-k / top-p / min-p filter and top logprobs'
selection, and the prompt logprobs' per-position numbers, for fp32 CPU logits (``sampling.c``),
under the reference names and signatures (:func:`blink.kernels.reference.sampling.apply_penalties`,
:func:`blink.kernels.reference.sampling.sample`,
:func:`blink.kernels.reference.sampling.apply_top_k_top_p_min_p`,
:func:`blink.kernels.reference.sampling.top_rows`,
:func:`blink.kernels.reference.sampling.prompt_logprobs`).

Why: the references are torch code over the whole vocabulary: at one row of SmolLM2's 49152
entries the draw took ~0.8 ms and the filter ~3.9 ms (a full sort), more than the forward they
follow (docs/performance.md#cpu-sampler). ``sampling.c`` draws with the reference's RNG bits
and scores only the entries that can win, and finds the filter's cut-offs from per-bucket counts
and masses, sorting only the bucket that holds each cut. The penalties touch only the tokens of
a row's history (the reference counts them over the vocabulary): the same bits. The prompt
logprobs never materialise a block's log-softmax (two passes a position, not five).

Same tokens and survivors as the reference except within rounding: two Gumbel scores within an
ulp of the log, a mass within rounding of ``top_p``, ``exp(x - max)`` within rounding of
``min_p`` (``tests/test_cpu_sampling.py`` holds them to the reference on cases without such
near-ties, as ``tests/test_kernels_sampling.py`` holds the Triton twins). A filtered row holding
a NaN or +inf logit is passed through unfiltered (the reference masks all of it). Anything else
(other dtypes, a missing compiler, said once in the log, ``$BLINK_CPU_SAMPLER=torch``) runs the
reference, so callers never need to know. No wrapper reads a tensor's value on the host: the
GPU tiers' capture audit runs them on CPU tensors.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor

from blink.kernels.cpu import abi, pool as cpu_pool
from blink.kernels.cpu.threads import kernel_threads
from blink.kernels.reference import sampling as sampling_reference
from blink.shared.native_build import NativeLibrary

log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("sampling.c")
#: "torch": the references (tests, diagnosis); "c" or unset: the C ops
IMPL_ENV = "BLINK_CPU_SAMPLER"
# -ffp-contract=off: the vector and scalar logs give the same bits (sampling.c)
_FLAGS = ("-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")


def _declare(library) -> None:
    abi.declare(library, abi.SAMPLING)
    cpu_pool.attach(library)  # rows split over the process's one pool


LIBRARY = NativeLibrary(
    _SOURCE, what="the CPU sampler's penalties, filter and draw and the prompt logprobs: the C library",
    logger=log, fallback="the torch references run instead (~1-4 ms a sampled row at a 49K vocabulary)",
    flags=("-O3", "-march=native", *_FLAGS), fallback_flags=("-O3", *_FLAGS),
    headers=(_SOURCE.with_name("kernels.h"),), env=IMPL_ENV, setup=_declare,
    queries=("blink_has_avx512",))


#: per loaded build of sampling.c (its handle): the (entries, slots) its scratch holds, grown,
#: never shrunk
_reserved: dict[int, tuple[int, int]] = {}
_reserve_lock = threading.Lock()


def _reserve(lib, cols: int) -> int:
    """The kernel threads a call may use, once the library's scratch holds a vocabulary of
    ``cols`` for each of them (grown here, on the host, so that the calls never allocate; no
    tensor is read, so this is safe inside a graph's capture audit)."""
    threads = kernel_threads()
    held_cols, held_count = _reserved.get(lib._handle, (0, 0))
    if cols > held_cols or threads > held_count:
        with _reserve_lock:
            held_cols, held_count = _reserved.get(lib._handle, (0, 0))
            cols, count = max(cols, held_cols), max(threads, held_count)
            if lib.blink_sampling_reserve(cols, count) != 0:
                raise MemoryError(f"the CPU sampler's scratch for a vocabulary of {cols} on {count} threads "
                                  f"(~{26 * cols * count >> 20} MB) could not be allocated")
            _reserved[lib._handle] = (cols, count)
    return threads


def _usable(logits: torch.Tensor) -> bool:
    """fp32 CPU [rows, vocab] with a contiguous vocabulary, outside tracing and fake tensors."""
    return (logits.dtype is torch.float32 and logits.is_cpu and logits.ndim == 2 and logits.stride(1) == 1
            and 0 < logits.shape[1] < 2**31 and not torch.compiler.is_compiling()
            and not isinstance(logits, FakeTensor))


def sample(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """:func:`blink.kernels.reference.sampling.sample`: int64 [B], one draw per row of
    ``softmax(logits)`` keyed by ``(seeds[b], counters[b])``."""
    logits = logits.float()
    lib = LIBRARY.get()
    if lib is None or not _usable(logits):
        return sampling_reference.sample(logits, seeds, counters)
    rows = logits.shape[0]
    seeds = seeds.to(torch.int64).contiguous()
    counters = counters.to(torch.int64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    lib.blink_sample_rows(logits.data_ptr(), logits.stride(0), seeds.data_ptr(), counters.data_ptr(),
                          out.data_ptr(), rows, logits.shape[1], kernel_threads())
    return out


def apply_penalties(logits: torch.Tensor, token_ids: torch.Tensor, prompt_lens: torch.Tensor,
                    total_lens: torch.Tensor, repetition_penalty: torch.Tensor, presence_penalty: torch.Tensor,
                    frequency_penalty: torch.Tensor) -> torch.Tensor:
    """:func:`blink.kernels.reference.sampling.apply_penalties`: a new fp32 [B, V], the same
    bits, reading each row's history instead of counting it over the vocabulary."""
    lib = LIBRARY.get()
    if (lib is None or not _usable(logits) or token_ids.ndim != 2 or token_ids.shape[0] != logits.shape[0]
            or token_ids.dtype not in (torch.int32, torch.int64)):
        return sampling_reference.apply_penalties(logits, token_ids, prompt_lens, total_lens, repetition_penalty,
                                                  presence_penalty, frequency_penalty)
    rows, cols = logits.shape
    ids = token_ids.to(torch.int32)
    if ids.stride(1) != 1:
        ids = ids.contiguous()
    prompt_lens, total_lens = (t.to(torch.int64).contiguous() for t in (prompt_lens, total_lens))
    rep, pres, freq = (t.to(torch.float32).contiguous()
                       for t in (repetition_penalty, presence_penalty, frequency_penalty))
    out = torch.empty((rows, cols), dtype=torch.float32)
    threads = _reserve(lib, cols)
    lib.blink_penalties_rows(logits.data_ptr(), logits.stride(0), ids.data_ptr(), ids.stride(0), ids.shape[1],
                             prompt_lens.data_ptr(), total_lens.data_ptr(), rep.data_ptr(), pres.data_ptr(),
                             freq.data_ptr(), out.data_ptr(), rows, cols, threads)
    return out


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """:func:`blink.kernels.reference.sampling.apply_top_k_top_p_min_p`: a new fp32 [B, V]
    with what min-p, top-k and top-p remove set to -inf."""
    lib = LIBRARY.get()
    if lib is None or not _usable(logits):
        return sampling_reference.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    rows, cols = logits.shape
    top_k = top_k.to(torch.int64).clamp(-1, cols).to(torch.int32).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    min_p = min_p.to(torch.float32).contiguous()
    out = torch.empty((rows, cols), dtype=torch.float32)
    threads = _reserve(lib, cols)
    lib.blink_filter_rows(logits.data_ptr(), logits.stride(0), top_k.data_ptr(), top_p.data_ptr(),
                          min_p.data_ptr(), out.data_ptr(), rows, cols, threads)
    return out


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`blink.kernels.reference.sampling.prompt_logprobs`: one pass for the log-normaliser
    and one for the target's rank and the top ``top_n`` a position, where the reference
    materialises the [k, V] log-softmax and reads it three more times. The logprobs within a
    few fp32 ulps of torch's (the sum's order and exp differ), the rank and top ids counted on
    them."""
    lib = LIBRARY.get()
    rows = logits.shape[0]
    if lib is None or not _usable(logits) or targets.shape != (rows,) or top_n < 0 or top_n > logits.shape[1]:
        return sampling_reference.prompt_logprobs(logits, targets, top_n)
    targets = targets.to(torch.int64).contiguous()
    chosen = torch.empty(rows, dtype=torch.float32)
    rank = torch.empty(rows, dtype=torch.int64)
    top_lp = torch.empty((rows, top_n), dtype=torch.float32)
    top_ids = torch.empty((rows, top_n), dtype=torch.int64)
    lib.blink_prompt_logprobs_rows(logits.data_ptr(), logits.stride(0), targets.data_ptr(), top_n, chosen.data_ptr(),
                                   rank.data_ptr(), top_lp.data_ptr(), top_ids.data_ptr(), rows, logits.shape[1],
                                   kernel_threads())
    return chosen, rank, top_lp, top_ids


def top_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blink.kernels.reference.sampling.top_rows` (``torch.topk``): the same values and
    ids (ties in index order), one pass a row with a threshold in registers."""
    lib = LIBRARY.get()
    if lib is None or not _usable(x) or not 0 <= k <= x.shape[1]:
        return sampling_reference.top_rows(x, k)
    rows = x.shape[0]
    values = torch.empty((rows, k), dtype=torch.float32)
    ids = torch.empty((rows, k), dtype=torch.int64)
    lib.blink_top_rows(x.data_ptr(), x.stride(0), k, values.data_ptr(), ids.data_ptr(), rows, x.shape[1],
                       kernel_threads())
    return values, ids


def uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """:func:`blink.kernels.reference.sampling.uniform` from the C code's RNG (tests)."""
    return _per_entry("blink_uniform_rows", seeds, counters, vocab_size)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """:func:`blink.kernels.reference.sampling.gumbel_noise` as the C draw computes it (tests)."""
    return _per_entry("blink_gumbel_rows", seeds, counters, vocab_size)


def _per_entry(function: str, seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 [B, vocab_size] of one of the library's per-entry functions of (seed, counter, v)."""
    lib = LIBRARY.get()
    if lib is None:
        raise RuntimeError(f"{_SOURCE.name} is not available here: {LIBRARY.failure}")
    seeds, counters = seeds.to(torch.int64).contiguous(), counters.to(torch.int64).contiguous()
    out = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32)
    getattr(lib, function)(seeds.data_ptr(), counters.data_ptr(), out.data_ptr(), seeds.shape[0], vocab_size)
    return out
