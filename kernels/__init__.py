"""Kernels for the model executor and sampler, chosen by device in one place.

``ops_for(device)`` returns the op table the model and sampler call. On CPU every entry is
the torch reference from :mod:`blink.kernels.reference`; on CUDA the Triton kernels replace
the entries they implement. Model code never branches on which kernel it got.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from blink.kernels import reference

_OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rope",
    "silu_and_mul",
    "write_kv_cache",
    "paged_attention",
    "moe_topk_route",
    "moe_experts",
)

_cache: dict[str, SimpleNamespace] = {}


def ops_for(device: torch.device | str) -> SimpleNamespace:
    """The op table for ``device`` (cached per device type)."""
    device_type = torch.device(device).type
    if device_type not in _cache:
        table = {name: getattr(reference, name) for name in _OP_NAMES}
        if device_type == "cuda":
            table.update(_triton_ops())
        _cache[device_type] = SimpleNamespace(**table)
    return _cache[device_type]


def _triton_ops() -> dict:
    """Triton replacements for the reference ops, under the reference names.

    The sampling pair replaces :mod:`blink.kernels.sampling_reference`'s functions of the
    same names. Without an importable Triton the reference ops stay (slower, still correct).
    """
    try:
        from blink.kernels import (
            triton_activation,
            triton_attention,
            triton_moe,
            triton_norm_rope,
            triton_sampling,
        )
    except ImportError as exc:  # e.g. a CUDA torch without the triton package
        import warnings

        warnings.warn(f"Triton kernels unavailable ({exc}); using the torch reference ops")
        return {}
    return {
        "rms_norm": triton_norm_rope.rms_norm,
        "fused_add_rms_norm": triton_norm_rope.fused_add_rms_norm,
        "apply_rope": triton_norm_rope.apply_rope,
        "silu_and_mul": triton_activation.silu_and_mul,
        "write_kv_cache": triton_attention.write_kv_cache,
        "paged_attention": triton_attention.paged_attention,
        "moe_topk_route": triton_moe.moe_topk_route,
        "moe_experts": triton_moe.moe_experts,
        "apply_top_k_top_p_min_p": triton_sampling.apply_top_k_top_p_min_p,
        "sample": triton_sampling.sample,
    }
