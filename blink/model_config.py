"""Model configuration: one normalised, validated view of a Hugging Face ``config.json``.

The model code reads only :class:`ModelConfig`, never the raw HF dict, so the differences
between the supported families (fused projections, biases, q/k norm, rope variants, MoE)
are settled here once, as flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blink.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Families whose HF checkpoints store q/k/v and gate/up already fused (Phi-3/Phi-4).
_HF_FUSED = ("phi3",)
# Families whose sliding window only applies when ``use_sliding_window`` is set.
_SLIDING_OPT_IN = ("qwen2", "qwen3", "qwen3_moe")
# Families where ``attention_bias`` puts a bias on q/k/v and o_proj.
_BIAS_FLAG = ("llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a model, in one flat record.

    ``rope_scaling`` is ``None`` or a dict with ``rope_type == "llama3"`` and its factors.
    ``sliding_window`` is ``None`` unless the model restricts attention to a window shorter
    than ``max_position_embeddings``; the executor then caps the context length at it.
    ``moe_layers`` lists the layers whose MLP is a mixture of experts (empty for dense models).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hf_fused_projections: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hf_dtype: str | None = None
    source: str = field(default="", compare=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], source: str | Path) -> ModelConfig:
        """Validate and normalise an HF config dict (``config.json`` contents).

        Raises :class:`UnsupportedModelError` for an unknown ``model_type``, rope scaling or
        activation, and :class:`ModelLoadError` for missing or inconsistent fields.
        """
        src = str(source)
        hf = _text_config(hf_config)
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                src,
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
            )

        def req(key: str) -> Any:
            value = hf.get(key)
            if value is None:
                raise ModelLoadError(src, f"config has no {key!r} (needed for {model_type})")
            return value

        def positive_int(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelLoadError(src, f"config {key!r} must be a positive integer, got {value!r}")
            return value

        hidden = positive_int("hidden_size", req("hidden_size"))
        n_heads = positive_int("num_attention_heads", req("num_attention_heads"))
        n_kv = positive_int("num_key_value_heads", hf.get("num_key_value_heads") or n_heads)
        if n_heads % n_kv:
            raise ModelLoadError(
                src, f"num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv})"
            )
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % n_heads:
                raise ModelLoadError(src, f"hidden_size {hidden} is not divisible by {n_heads} heads")
            head_dim = hidden // n_heads
        head_dim = positive_int("head_dim", head_dim)

        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise UnsupportedModelError(src, f"hidden_act {act!r} is not supported (supported: silu)")

        max_pos = positive_int("max_position_embeddings", req("max_position_embeddings"))
        theta, rotary_dim, scaling = _rope(hf, src, head_dim)

        sliding = hf.get("sliding_window")
        if model_type in _SLIDING_OPT_IN and not hf.get("use_sliding_window", False):
            sliding = None
        if sliding is not None:
            sliding = positive_int("sliding_window", sliding)
            if sliding >= max_pos:
                sliding = None

        attention_bias = bool(hf.get("attention_bias", False))
        moe_fields: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            moe_fields = _moe(hf, src, positive_int)

        return cls(
            model_type=model_type,
            vocab_size=positive_int("vocab_size", req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size", req("intermediate_size")),
            num_hidden_layers=positive_int("num_hidden_layers", req("num_hidden_layers")),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rotary_dim=rotary_dim,
            max_position_embeddings=max_pos,
            rope_scaling=scaling,
            sliding_window=sliding,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias (never on o_proj); in Llama and Qwen3 configs
            # attention_bias covers q/k/v/o; Mistral and Phi-3 have no biases at all.
            qkv_bias=model_type == "qwen2" or (attention_bias and model_type in _BIAS_FLAG),
            o_bias=attention_bias and model_type in _BIAS_FLAG,
            mlp_bias=bool(hf.get("mlp_bias", False)) and model_type == "llama",
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hf_fused_projections=model_type in _HF_FUSED,
            eos_token_ids=_token_ids(hf.get("eos_token_id"), src),
            bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
            hf_dtype=_dtype_name(hf.get("dtype", hf.get("torch_dtype"))),
            source=src,
            **moe_fields,
        )


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (some exports nest it under ``text_config``)."""
    if not isinstance(hf, dict):
        raise ModelLoadError(None, f"config must be a JSON object, got {type(hf).__name__}")
    if "model_type" not in hf and isinstance(hf.get("text_config"), dict):
        return hf["text_config"]
    return hf


def _rope(hf: dict[str, Any], src: str, head_dim: int) -> tuple[float, int, dict | None]:
    """(theta, rotary_dim, scaling) from either the transformers-4 form (``rope_theta`` +
    ``rope_scaling``) or the transformers-5 form (``rope_parameters``)."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ModelLoadError(src, f"config {key!r} must be an object, got {value!r}")
        params.update(value)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            src,
            f"rope scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
        )
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(
            src, f"partial_rotary_factor {partial} gives an invalid rotary dim {rotary_dim} for head_dim {head_dim}"
        )
    scaling = None
    if rope_type == "llama3":
        missing = [k for k in ("factor", "original_max_position_embeddings") if k not in params]
        if missing:
            raise ModelLoadError(src, f"llama3 rope scaling lacks {', '.join(missing)}")
        scaling = {
            "rope_type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        }
    return theta, rotary_dim, scaling


def _moe(hf: dict[str, Any], src: str, positive_int) -> dict[str, Any]:
    """MoE fields of a Qwen3-MoE config, including which layers are sparse."""
    # transformers 5 writes num_local_experts; the published checkpoints say num_experts.
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    n_experts = positive_int("num_experts", n_experts)
    top_k = positive_int("num_experts_per_tok", hf.get("num_experts_per_tok"))
    if top_k > n_experts:
        raise ModelLoadError(src, f"num_experts_per_tok ({top_k}) exceeds num_experts ({n_experts})")
    step = positive_int("decoder_sparse_step", hf.get("decoder_sparse_step", 1))
    mlp_only = set(hf.get("mlp_only_layers") or ())
    n_layers = hf["num_hidden_layers"]
    return {
        "num_experts": n_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": positive_int("moe_intermediate_size", hf.get("moe_intermediate_size")),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_layers": tuple(
            i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0
        ),
    }


def _token_ids(value: Any, src: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ModelLoadError(src, f"eos_token_id must be an integer or a list of integers, got {value!r}")


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")
