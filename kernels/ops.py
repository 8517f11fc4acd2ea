"""Kernels for the model executor and sampler, chosen by device in one place.

``ops_for(device)`` returns the op table the model and sampler call. The base is the torch
reference (:mod:`blink.kernels.reference.layers`, and :mod:`blink.kernels.reference.sampling` for the
sampler's filter and seeded draw). On CPU the eager forward's norms, rotary embedding,
KV-cache write and gated activation are one C call each for bf16
(:mod:`blink.kernels.cpu.fused`, the reference for anything else), so is the sampler's
log-normaliser (``logsumexp_rows``, fp32; ``argmax_logsumexp_rows`` with a greedy step's
tokens from the same pass), so are its penalties, filter, seeded draw and top logprobs' selection
and the prompt logprobs' per-position numbers (:mod:`blink.kernels.cpu.sampling`),
and the paged attention is
:mod:`blink.kernels.cpu.attention`; on CUDA the Triton kernels replace the entries they
implement. Model and sampler code never branch on which kernel of this table they got.

The projections (matmuls) are not in the table: their back-end depends on how each weight was
loaded (packed for oneDNN, a copy on the checkpoint's 4-bit codes for a C kernel, plain), so
the model chooses it once, at load (:meth:`blink.models.decoder.DecoderForCausalLM.matmul_backend`
names the choice in one start-log line).

``compiled_cpu_ops()`` is the CPU table a compiled step uses: the references, which inductor
traces and fuses, with attention as opaque custom ops.

``ops_for(device, triton=True)`` forces the Triton table whatever the device: the tests use it
on CPU tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from blink.kernels.reference import (
    mask as mask_reference,
    layers as reference,
    sampling as sampling_reference,
)

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
# The entries blink.kernels.cpu.fused replaces on CPU (eager only).
_CPU_FUSED_NAMES = ("rms_norm", "fused_add_rms_norm", "apply_rope", "silu_and_mul", "write_kv_cache")
# The sampler's ops (blink.engine.sampler calls them through ``ops_for``).
_SAMPLING_OP_NAMES = (
    "apply_penalties",
    "apply_top_k_top_p_min_p",
    "sample",
    "logsumexp_rows",
    "argmax_logsumexp_rows",
    "prompt_logprobs",
    "top_rows",
)
# Structured outputs: the sampling gate and the token mask (the sampler calls them through
# ``ops_for``; blink.engine.token_mask).
_MASK_OP_NAMES = ("wait_token_masks", "apply_token_mask")

_cache: dict[tuple[str, bool], SimpleNamespace] = {}


def ops_for(device: torch.device | str, *, triton: bool | None = None) -> SimpleNamespace:
    """The op table for ``device`` (cached per device type).

    ``triton``: None (the default) = Triton kernels on CUDA, torch references elsewhere;
    True = the Triton kernels whatever the device (an ImportError if Triton is missing;
    on CPU tensors this needs ``TRITON_INTERPRET=1`` before the kernels are imported);
    False = the references.
    """
    device_type = torch.device(device).type
    use_triton = device_type == "cuda" if triton is None else bool(triton)
    key = (device_type, use_triton)
    if key not in _cache:
        table = {name: getattr(reference, name) for name in _OP_NAMES}
        table.update({name: getattr(sampling_reference, name) for name in _SAMPLING_OP_NAMES})
        table.update({name: getattr(mask_reference, name) for name in _MASK_OP_NAMES})
        if use_triton:
            table.update(_triton_ops(required=triton is True))
        elif device_type == "cpu":
            from blink.kernels.cpu import attention as cpu_attention, fused as cpu_fused, sampling as cpu_sampling

            table.update({name: getattr(cpu_fused, name) for name in _CPU_FUSED_NAMES})
            table["apply_penalties"] = cpu_sampling.apply_penalties
            table["apply_top_k_top_p_min_p"] = cpu_sampling.apply_top_k_top_p_min_p
            table["sample"] = cpu_sampling.sample
            table["prompt_logprobs"] = cpu_sampling.prompt_logprobs
            table["top_rows"] = cpu_sampling.top_rows
            table["paged_attention"] = cpu_attention.paged_attention
            table["logsumexp_rows"] = cpu_fused.logsumexp_rows
            table["argmax_logsumexp_rows"] = cpu_fused.argmax_logsumexp_rows
            table["apply_token_mask"] = cpu_fused.apply_token_mask
        _cache[key] = SimpleNamespace(**table)
    return _cache[key]


def compiled_cpu_ops() -> SimpleNamespace:
    """The CPU table for a compiled step (``blink.engine.compiled``): the references (not the C
    calls of the eager table, which inductor cannot trace), except that the KV-cache write and
    the paged attention are opaque custom ops
    (:mod:`blink.kernels.cpu.step_ops`), which keep the graph free of value-dependent shapes."""
    key = ("cpu-compiled", False)
    if key not in _cache:
        from blink.kernels.cpu import step_ops as cpu_step_ops

        table = vars(ops_for("cpu")).copy()
        table.update({name: getattr(reference, name) for name in _CPU_FUSED_NAMES})  # traceable
        table["logsumexp_rows"] = sampling_reference.logsumexp_rows
        table["argmax_logsumexp_rows"] = sampling_reference.argmax_logsumexp_rows
        table["apply_penalties"] = sampling_reference.apply_penalties
        table["apply_top_k_top_p_min_p"] = sampling_reference.apply_top_k_top_p_min_p
        table["sample"] = sampling_reference.sample
        table["prompt_logprobs"] = sampling_reference.prompt_logprobs
        table["top_rows"] = sampling_reference.top_rows
        table["apply_token_mask"] = mask_reference.apply_token_mask
        table["write_kv_cache"] = cpu_step_ops.write_kv_cache
        table["paged_attention"] = cpu_step_ops.paged_attention
        _cache[key] = SimpleNamespace(**table)
    return _cache[key]


def _triton_ops(required: bool = False) -> dict:
    """Triton replacements for the reference ops, under the reference names.

    The sampling pair replaces :mod:`blink.kernels.reference.sampling`'s functions of the
    same names. Without an importable Triton the reference ops stay (slower, still correct)
    with a warning, unless ``required`` (then the ImportError propagates).
    """
    try:
        from blink.kernels.triton import (
            activation as triton_activation,
            attention as triton_attention,
            mask as triton_mask,
            moe as triton_moe,
            norm_rope as triton_norm_rope,
            sampling as triton_sampling,
        )
    except ImportError as exc:  # e.g. a CUDA torch without the triton package
        if required:
            raise
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
        "wait_token_masks": triton_mask.wait_token_masks,
        "apply_token_mask": triton_mask.apply_token_mask,
    }
