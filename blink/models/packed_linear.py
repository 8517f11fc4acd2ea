"""bf16 projections on CPU through oneDNN with the weights reordered once, at load.

``F.linear`` on a plain bf16 weight makes oneDNN reorder the weight into its blocked layout
(the one its AMX / AVX512-BF16 kernels read) on every call: for a decode step's few rows that
reorder costs as much as the product itself. Reordering each weight once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU weight prepacking does when
it freezes a graph) and calling oneDNN's linear on the packed tensor
(``torch.ops.mkldnn._linear_pointwise``) measured about 2x faster per decoder layer at 1 and
16 rows on SmolLM2-135M (docs/performance.md#bf16). The results are the same bits as
``F.linear``'s oneDNN path (tests/test_packed_linear.py).

Only bf16 is packed: float32 gained nothing stable here, and float32 stays bit-exact with
transformers through torch's own GEMM. Used only where :func:`packing_available` says the
installed torch has oneDNN with native bf16 support on this CPU (detected, never assumed:
the CPU model varies between machines).
"""
from __future__ import annotations

import torch

#: Row count oneDNN is told to expect when choosing the packed layout (a decode batch).
#: The layout it picks measured the same for hints of 1 and 16 rows on this CPU.
_BATCH_HINT = 16


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 weights on ``device`` can be packed for oneDNN: a CPU, bf16, a torch
    built with oneDNN, and a CPU that oneDNN runs bf16 on natively."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private API: absent in some builds
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A plain ``[out, in]`` bf16 weight -> the same weight in oneDNN's blocked layout (an
    opaque mkldnn tensor that still reports shape ``[out, in]``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a weight made by :func:`pack`; x is ``[..., in]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
