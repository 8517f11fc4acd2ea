"""Kernels for the model executor and sampler: torch references, the Triton kernels that
replace them on CUDA, and the device loop's CUDA C. ``ops_for(device)`` (:mod:`.ops`) picks
in one place.

This folder installs as ``blink.kernels``. From a checkout's root it would also be importable
as a top-level ``kernels``, the name of Hugging Face's package (which transformers imports
when it is installed): under that name the import is handed on (:mod:`blink._shadowing`).
"""
if __name__ == "blink.kernels":
    from blink.kernels.ops import _OP_NAMES, _SAMPLING_OP_NAMES, _triton_ops, ops_for

    __all__ = ["ops_for"]
else:
    from blink._shadowing import hand_on as _hand_on

    _hand_on(__name__, globals())
    del _hand_on
