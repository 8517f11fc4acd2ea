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

:class:`StepInputs` also lives here: a replayed decode graph's inputs written by one C call
(``blink_step_inputs``) instead of ten torch calls (blink.decode_graphs).
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
            "blink_logsumexp_rows", "blink_argmax_logsumexp_rows", "blink_argmax_logsumexp_rows_bf16",
            "blink_token_mask_rows", "blink_step_inputs")

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
    blink.engine.sampler). bf16 rows are read as they are, each value widened to fp32: the
    results of the fp32 rows ``x.float()``, without making them."""
    lib = LIBRARY.get()
    if (lib is None or x.dtype not in (torch.float32, _BF16) or not x.is_cpu or x.ndim != 2
            or x.stride(1) != 1 or x.shape[1] == 0 or x.shape[1] >= 2**31
            or torch.compiler.is_compiling() or isinstance(x, FakeTensor)):  # (as logsumexp_rows)
        return sampling_reference.argmax_logsumexp_rows(x)
    argmax = torch.empty(x.shape[0], dtype=torch.int64)
    out = torch.empty((x.shape[0], 1), dtype=torch.float32)
    logprob = torch.empty(x.shape[0], dtype=torch.float32)
    kernel = lib.blink_argmax_logsumexp_rows if x.dtype is torch.float32 else lib.blink_argmax_logsumexp_rows_bf16
    kernel(x.data_ptr(), x.stride(0), argmax.data_ptr(), out.data_ptr(), logprob.data_ptr(), x.shape[0], x.shape[1],
           kernel_threads())
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


class _StepInputsStruct(ctypes.Structure):
    """fused.c's blink_step_inputs_t (its size checked against the C at first use)."""

    _fields_ = [("table", ctypes.c_void_p), ("table_rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("table_stride", ctypes.c_int64), ("ids", ctypes.c_void_p), ("embedded", ctypes.c_void_p),
                ("positions_src", ctypes.c_void_p), ("slots_src", ctypes.c_void_p), ("seq_idx_src", ctypes.c_void_p),
                ("pad_slots", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("seq_idx", ctypes.c_void_p), ("query_start_src", ctypes.c_void_p), ("seq_lens_src", ctypes.c_void_p),
                ("tables_src", ctypes.c_void_p), ("query_start", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("n", ctypes.c_int64), ("tokens", ctypes.c_int64), ("r", ctypes.c_int64),
                ("width", ctypes.c_int64), ("tables_src_stride", ctypes.c_int64), ("tables_stride", ctypes.c_int64),
                ("logits_indices", ctypes.c_void_p), ("k", ctypes.c_int64)]


def _int64_run(t: torch.Tensor) -> bool:
    return t.dtype is torch.int64 and t.is_cpu and t.ndim == 1 and t.stride(0) == 1


def _int32_run(t: torch.Tensor) -> bool:
    return t.dtype is torch.int32 and t.is_cpu and t.ndim == 1 and t.stride(0) == 1


class StepInputs:
    """A decode graph's inputs for one step shape written by one C call (``blink_step_inputs``)
    instead of an index select, six copies and four fills (each a torch call on the step's
    host path): built over the step's source tensors and the graph's buffers, whose addresses
    it keeps, so it serves the steps whose sources are these same tensors (:meth:`serves`; the
    CPU loop's batch and compacted metadata are views made once per shape). :meth:`make`
    returns None where the C library or a layout is missing: the caller copies with torch."""

    def __init__(self, lib: ctypes.CDLL, sources: tuple[torch.Tensor, ...], struct: _StepInputsStruct,
                 keep: tuple[torch.Tensor, ...]) -> None:
        self._lib, self.sources, self._struct, self._keep = lib, sources, struct, keep
        self._ref = ctypes.byref(struct)

    @classmethod
    def make(cls, embedding: torch.Tensor, input_ids: torch.Tensor, md, logits_indices: torch.Tensor,
             buffers: dict[str, torch.Tensor]) -> "StepInputs | None":
        """``buffers``: the graph's ``embedded`` [tokens, dim], ``positions``, ``slot_mapping``,
        ``pad_slots``, ``token_seq_idx`` [tokens] int64, ``query_start_loc`` [tokens + 1],
        ``seq_lens`` [tokens] and ``block_tables`` [tokens, width] int32."""
        lib = LIBRARY.get()
        if lib is None:
            return None
        if not hasattr(lib, "step_inputs_checked"):
            lib.step_inputs_checked = lib.blink_step_inputs_size() == ctypes.sizeof(_StepInputsStruct)
        embedded, tables, src_tables = buffers["embedded"], buffers["block_tables"], md.block_tables
        n, r, tokens = input_ids.shape[0], md.seq_lens.shape[0], buffers["positions"].shape[0]
        if not (lib.step_inputs_checked and embedding.ndim == 2 and embedding.stride(1) == 1 and embedding.is_cpu
                and embedded.dtype is embedding.dtype and embedded.is_contiguous()
                and all(map(_int64_run, (input_ids, md.positions, md.slot_mapping, md.token_seq_idx, logits_indices,
                                         buffers["positions"], buffers["slot_mapping"], buffers["pad_slots"],
                                         buffers["token_seq_idx"])))
                and all(map(_int32_run, (md.query_start_loc, md.seq_lens, buffers["query_start_loc"],
                                         buffers["seq_lens"])))
                and src_tables.dtype is torch.int32 and tables.dtype is torch.int32 and src_tables.ndim == 2
                and src_tables.stride(1) == 1 and tables.stride(1) == 1 and src_tables.shape[1] <= tables.shape[1]
                and md.positions.shape[0] == n and md.slot_mapping.shape[0] == n and md.token_seq_idx.shape[0] == n
                and md.query_start_loc.shape[0] == r + 1 and src_tables.shape[0] == r and n <= tokens and r <= tokens):
            return None
        sources = (input_ids, md.positions, md.slot_mapping, md.token_seq_idx, md.query_start_loc, md.seq_lens,
                   src_tables, logits_indices)
        struct = _StepInputsStruct(
            embedding.data_ptr(), embedding.shape[0], embedding.shape[1] * embedding.element_size(),
            embedding.stride(0) * embedding.element_size(), input_ids.data_ptr(), embedded.data_ptr(),
            md.positions.data_ptr(), md.slot_mapping.data_ptr(), md.token_seq_idx.data_ptr(),
            buffers["pad_slots"].data_ptr(), buffers["positions"].data_ptr(), buffers["slot_mapping"].data_ptr(),
            buffers["token_seq_idx"].data_ptr(), md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(),
            src_tables.data_ptr(), buffers["query_start_loc"].data_ptr(), buffers["seq_lens"].data_ptr(),
            tables.data_ptr(), n, tokens, r, src_tables.shape[1], src_tables.stride(0), tables.stride(0),
            logits_indices.data_ptr(), logits_indices.shape[0])
        return cls(lib, sources, struct, (embedding, *sources, *buffers.values()))

    def serves(self, input_ids: torch.Tensor, md, logits_indices: torch.Tensor) -> bool:
        """Whether this step's sources are the tensors this call was built over: the
        metadata's the same tensors, the token ids and logits indices (sliced anew each step)
        the same memory and length."""
        s, c = self.sources, self._struct
        return (md.positions is s[1] and md.slot_mapping is s[2] and md.token_seq_idx is s[3]
                and md.query_start_loc is s[4] and md.seq_lens is s[5] and md.block_tables is s[6]
                and input_ids.shape[0] == c.n and logits_indices.shape[0] == c.k
                and input_ids.data_ptr() == c.ids and logits_indices.data_ptr() == c.logits_indices
                and input_ids.dtype is torch.int64 and logits_indices.dtype is torch.int64
                and input_ids.stride(0) == 1 and logits_indices.stride(0) == 1)

    def write(self) -> bool:
        """Write the step's inputs; returns whether the logits indices are 0 .. k - 1.
        Raises IndexError for a token id outside the embedding (as the index select does)."""
        status = self._lib.blink_step_inputs(self._ref)
        if status < 0:
            raise IndexError("a step's token id lies outside the embedding")
        return status == 1
