"""The two attention ops a compiled CPU step calls as opaque custom ops.

A compiled decoder layer (``blink.engine.compiled``) has static shapes per token bucket: T
padded tokens, nothing else that varies. Attention is the one part whose work depends on the
step's *values* (which rows are active, how long their contexts are), so it stays outside
the graph, as vLLM does: two ``torch.library`` custom ops that inductor calls but does not
trace.

- ``blink::write_kv_cache`` scatters the new K/V into the paged cache in place (declared as
  mutating the caches, so the graph never copies them).
- ``blink::paged_attention`` reads the step's host-side metadata from the *attention step
  context* (:func:`attention_step`), which the CPU loop sets around the forward: the rows
  compacted to those with tokens and the longest context (vLLM's "forward context"). The
  graph only passes q and the caches, so nothing it sees changes shape between steps, and
  per-layer index work is memoised once per step in the context's ``step_cache``.

What the op runs is set with the context too: the compiled paged kernel
(:func:`blink.kernels.cpu.paged_attention.paged_attention`), or the reference when that
kernel did not compile.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from blink.kernels.attention_metadata import AttentionMetadata
from blink.kernels.reference.layers import write_kv_cache as _write_kv_cache_ref

#: ``(q, k_cache, v_cache, md, scale) -> out``: the reference or the compiled paged kernel
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
_context = threading.local()


@contextmanager
def attention_step(md: AttentionMetadata, num_tokens: int, attend: Attend) -> Iterator[None]:
    """Until the block ends, :func:`paged_attention` runs ``attend(q, k_cache, v_cache, md,
    scale)`` over ``md`` (this step's compacted metadata) and its ``num_tokens`` real tokens.
    Per thread (the engine loop's)."""
    previous = getattr(_context, "step", None)
    _context.step = (dataclasses.replace(md, step_cache={}), num_tokens, attend)
    try:
        yield
    finally:
        _context.step = previous


def _current_step() -> tuple[AttentionMetadata, int, Attend]:
    step = getattr(_context, "step", None)
    if step is None:
        raise RuntimeError(
            "blink::paged_attention ran outside attention_step(): the compiled CPU step must "
            "set the step's metadata around the forward"
        )
    return step


@torch.library.custom_op("blink::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def _write_kv_cache_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("blink::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    md, n, attend = _current_step()
    out = q.new_zeros(q.shape)  # padding tokens (past n) get zeros, like unused rows
    out[:n] = attend(q[:n], k_cache, v_cache, md, scale)
    return out


@_paged_attention_op.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The op table's ``write_kv_cache`` for a compiled step (same signature as the reference)."""
    _write_kv_cache_op(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The op table's ``paged_attention`` for a compiled step. ``md`` (the bucket's fixed-shape
    metadata) is not read: the op takes the step's compacted metadata from :func:`attention_step`."""
    return _paged_attention_op(q, k_cache, v_cache, scale)
