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
    """Triton replacements for the reference ops (filled in as kernels land)."""
    return {}
