"""Fused bf16 elementwise ops for the eager CPU forward (``fused.c``), under the reference
names and signatures: each is one C call where the torch reference
(:mod:`blink.kernels.reference.layers`) is 6-18 aten ops.

Why: at a decode step's sizes an aten op costs a few microseconds of dispatch whatever it
computes, and a SmolLM2 layer spends ~45 of them on norms, the rotary embedding, the KV-cache
write and the gated activation: one C call each made the one-row step 1.22x faster (25.3 ->
20.7 ms) and the 16-row one 1.25x (docs/performance.md#cpu-fused). The C functions do
the reference's fp32 arithmetic in its order and round
to bf16 where it rounds; ``tests/test_cpu_fused.py`` holds them to the reference's bits (the
norm and SiLU to one bf16 step where an fp32 sum or exp lands on a rounding edge).

Each op takes the C path only for bf16 CPU tensors in the layouts the model passes (rows
strided, channels contiguous); anything else (fp32, the exact mode against transformers;
per-head q/k norms; a missing compiler, said once in the log; ``$BLINK_CPU_FUSED=torch``)
runs the reference, so callers never need to know.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor

from blink.kernels.cpu import abi, pool as cpu_pool
from blink.kernels.reference import (
    mask as mask_reference,
    layers as reference,
    sampling as sampling_reference,
)
from blink.kernels.cpu.threads import kernel_threads
from blink.shared.native_build import NativeLibrary

log = logging.getLogger("blink.kernels")

_SOURCE = Path(__file__).with_name("fused.c")
#: "torch": the references (tests, diagnosis); "c" or unset: the C ops. (A build without
#: AVX-512 once kept the SiLU and the sampler's logsumexp on torch, whose exp was vectorised
#: and theirs not; with kernels.h's 8-lane exp they run here too, and a decode step's graph,
#: which records only C calls, then records on such a CPU: SmolLM2's one-row step 11.1-11.3 ->
#: 4.8-4.9 ms on AVX2 code, docs/performance.md#avx2-cpus.)
IMPL_ENV = "BLINK_CPU_FUSED"
_BF16 = torch.bfloat16
#: the library's compute calls (their signatures: abi.FUSED)
_KERNELS = ("blink_add_rms_norm", "blink_rope", "blink_write_kv", "blink_silu_and_mul",
            "blink_logsumexp_rows", "blink_argmax_logsumexp_rows", "blink_token_mask_rows")

# No fused multiply-adds the reference does not do (the rotary embedding stays bit-exact);
# no floating-point traps to keep, so the compiler may vectorise branches (exp's clamps).
_FLAGS = ("-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")


def _declare(library: ctypes.CDLL) -> None:
    abi.declare(library, abi.FUSED)
    cpu_pool.attach(library)  # calls that split run on the process's one pool


LIBRARY = NativeLibrary(
    _SOURCE, what="fused CPU ops: the C library", logger=log,
    fallback="the torch references run instead, slower for small steps",
    flags=("-O3", "-march=native", *_FLAGS), fallback_flags=("-O3", *_FLAGS),
    headers=(_SOURCE.with_name("kernels.h"),), env=IMPL_ENV, setup=_declare,
    kernels=_KERNELS, queries=("blink_has_avx512",))


def library() -> ctypes.CDLL | None:
    """The built library, once per process; None where it cannot be built (said once in the
    log) or ``$BLINK_CPU_FUSED=torch``."""
    return LIBRARY.get()


# The checks below run per op call; they use the cheapest tensor attributes (``is_cpu``
# rather than ``device.type``), because at these sizes they cost as much as the op.


def _rows(x: torch.Tensor) -> bool:
    """bf16 CPU [rows, channels] with contiguous channels."""
    return x.dtype is _BF16 and x.is_cpu and x.ndim == 2 and x.stride(1) == 1


def _heads(x: torch.Tensor) -> bool:
    """bf16 CPU [tokens, heads, head_dim] with contiguous heads (rows may be strided)."""
    if x.dtype is not _BF16 or not x.is_cpu or x.ndim != 3:
        return False
    stride = x.stride()
    return stride[2] == 1 and stride[1] == x.shape[2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`blink.kernels.reference.layers.rms_norm`."""
    lib = LIBRARY.get()
    if lib is None or not _rows(x) or weight.dtype is not _BF16 or not weight.is_contiguous():
        return reference.rms_norm(x, weight, eps)
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=_BF16)
    lib.blink_add_rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(),
                           None, rows, dim, eps, kernel_threads())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blink.kernels.reference.layers.fused_add_rms_norm`."""
    lib = LIBRARY.get()
    if (lib is None or not _rows(x) or not _rows(residual) or x.shape != residual.shape
            or weight.dtype is not _BF16 or not weight.is_contiguous()):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=_BF16)
    residual_out = torch.empty((rows, dim), dtype=_BF16)
    lib.blink_add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                           weight.data_ptr(), out.data_ptr(), residual_out.data_ptr(), rows, dim, eps,
                           kernel_threads())
    return out, residual_out


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blink.kernels.reference.layers.apply_rope` (q and k: views into one new buffer)."""
    lib = LIBRARY.get()
    if (lib is None or not _heads(q) or not _heads(k) or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
            or positions.dtype != torch.int64 or not positions.is_contiguous()
            or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()):
        return reference.apply_rope(q, k, positions, cos_sin_cache)
    T, H, D = q.shape
    KVH = k.shape[1]
    out = torch.empty((T, H + KVH, D), dtype=_BF16)
    status = lib.blink_rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
                            cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], out.data_ptr(),
                            T, H, KVH, D, cos_sin_cache.shape[1], kernel_threads())
    if status != 0:
        raise IndexError(f"rotary embedding: a position lies outside the {cos_sin_cache.shape[0]}-position table")
    return out[:, :H], out[:, H:]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """:func:`blink.kernels.reference.layers.write_kv_cache`."""
    lib = LIBRARY.get()
    if (lib is None or not _heads(k) or not _heads(v) or k.shape != v.shape
            or k_cache.dtype is not _BF16 or v_cache.dtype is not _BF16 or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.shape != v_cache.shape
            or tuple(k_cache.shape[2:]) != tuple(k.shape[1:])
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        return reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    row = k.shape[1] * k.shape[2]
    status = lib.blink_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], row,
                                k_cache.shape[0] * k_cache.shape[1], kernel_threads())
    if status != 0:
        raise IndexError("KV cache write: a slot lies outside the cache")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`blink.kernels.reference.layers.silu_and_mul`."""
    lib = LIBRARY.get()
    if lib is None or not _rows(x) or x.shape[1] % 2:
        return reference.silu_and_mul(x)
    rows, dim = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, dim), dtype=_BF16)
    lib.blink_silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, dim, kernel_threads())
    return out


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """:func:`blink.kernels.reference.sampling.logsumexp_rows` (fp32 [B, V] -> [B, 1]): one
    call with two passes over each row instead of torch's four ops and a [B, V] temporary
    (0.61 -> 0.31 ms for a 16-row step's SmolLM2 logits); the last bit may differ from torch's."""
    lib = LIBRARY.get()
    if (lib is None or x.dtype is not torch.float32 or not x.is_cpu or x.ndim != 2
            or x.stride(1) != 1 or x.shape[1] == 0
            # the sampler is also traced (a compiled step) and run over fake tensors (the
            # capture checks): the reference then, a C call needs real memory
            or torch.compiler.is_compiling() or isinstance(x, FakeTensor)):
        return sampling_reference.logsumexp_rows(x)
    out = torch.empty((x.shape[0], 1), dtype=torch.float32)
    lib.blink_logsumexp_rows(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1], kernel_threads())
    return out


def argmax_logsumexp_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`blink.kernels.reference.sampling.argmax_logsumexp_rows` (fp32 [B, V] -> int64
    [B], fp32 [B, 1], fp32 [B]): :func:`logsumexp_rows`' call and bits, the argmax taken in its
    first pass over each row (torch's index: the first NaN, else the first maximum), and the
    argmax's logprob (its logit minus the log-normaliser), where the reference reads the logits
    twice more and takes the logprob in four more ops (a greedy step's sampler,
    blink.engine.sampler)."""
    lib = LIBRARY.get()
    if (lib is None or x.dtype is not torch.float32 or not x.is_cpu or x.ndim != 2
            or x.stride(1) != 1 or x.shape[1] == 0 or x.shape[1] >= 2**31
            or torch.compiler.is_compiling() or isinstance(x, FakeTensor)):  # (as logsumexp_rows)
        return sampling_reference.argmax_logsumexp_rows(x)
    argmax = torch.empty(x.shape[0], dtype=torch.int64)
    out = torch.empty((x.shape[0], 1), dtype=torch.float32)
    logprob = torch.empty(x.shape[0], dtype=torch.float32)
    lib.blink_argmax_logsumexp_rows(x.data_ptr(), x.stride(0), argmax.data_ptr(), out.data_ptr(),
                                    logprob.data_ptr(), x.shape[0], x.shape[1], kernel_threads())
    return argmax, out, logprob


def apply_token_mask(logits: torch.Tensor, words: torch.Tensor, epoch: torch.Tensor,
                     slots: torch.Tensor, constrained: torch.Tensor,
                     expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blink.kernels.reference.mask.apply_token_mask` for fp32 CPU logits: one C pass
    per row (the bit test per token) instead of the reference's unpack and [B, V] select
    (~1/10 of the time at 16 x 49152). Same results, bit for bit (a select, no arithmetic)."""
    lib = LIBRARY.get()
    if (lib is None or logits.dtype is not torch.float32 or not logits.is_cpu or logits.ndim != 2
            or logits.stride(1) != 1 or words.dtype is not torch.int32 or words.stride(1) != 1
            or torch.compiler.is_compiling() or isinstance(logits, FakeTensor)):
        return mask_reference.apply_token_mask(logits, words, epoch, slots, constrained, expected)
    s, on, ready, missing = mask_reference.mask_rows(epoch, slots, constrained, expected)
    mode = torch.where(on, torch.where(ready, 1, 2), 0).to(torch.uint8).contiguous()
    rows, cols = logits.shape
    out = torch.empty((rows, cols), dtype=torch.float32)
    s = s.contiguous()
    lib.blink_token_mask_rows(logits.data_ptr(), logits.stride(0), words.data_ptr(),
                              words.stride(0), words.shape[1], s.data_ptr(), mode.data_ptr(),
                              out.data_ptr(), rows, cols, kernel_threads())
    return out, missing
