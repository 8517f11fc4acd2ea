"""Reading a GGUF file as if it were a Hugging Face model directory.

A GGUF carries no config.json: its metadata is the config, under llama.cpp's key names. Its tensors
use llama.cpp's names (``blk.N.attn_q.weight``), are often quantized, and for llama the Q and K
projections are permuted for llama.cpp's rope layout. This module maps all of that back to what the
original Hugging Face checkpoint held, following transformers' GGUF integration
(``transformers/modeling_gguf_pytorch_utils.py`` and ``transformers/integrations/ggml.py``).

Nothing here imports torch: the frontend reads tokenizer files through this module on a machine
without torch. The tensors, dequantized to torch, are :class:`blink.loader.gguf_weights.GGUFWeights`.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from blink.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    import gguf

# general.architecture -> (HF model_type, HF architectures entry)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_ATTENTION = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_DENSE_MLP = {
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

# Per architecture: GGUF block tensor stem -> HF name inside ``model.layers.N.``.
_BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "llama": _ATTENTION | _DENSE_MLP,
    "qwen2": _ATTENTION | _DENSE_MLP,
    "qwen3": _ATTENTION | _DENSE_MLP | _QK_NORM,
    # Phi-3 keeps its fused projections; llama.cpp stores the fused gate_up as ffn_up.
    "phi3": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    # Dense FFN tensors only appear in layers listed in the config's mlp_only_layers.
    "qwen3moe": _ATTENTION | _QK_NORM | _DENSE_MLP | {"ffn_gate_inp": "mlp.gate"},
}

# llama.cpp stores the experts of a layer as one 3D tensor; HF checkpoints hold one per expert.
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}

# Tensors that describe rope scaling; they become config entries, not weights.
_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")

_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class _Entry:
    """One HF tensor and how to make it from a GGUF tensor."""

    hf_name: str
    tensor_index: int  # into reader.tensors
    permute_heads: int = 0  # >0: undo llama.cpp's Q/K rope permutation with this many heads
    expert: int = -1  # >=0: this expert's slice of a stacked expert tensor


class GGUFFile:
    """An opened GGUF file: metadata access, HF config, HF tensor names and tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _open_reader(path)
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(path, "GGUF metadata has no general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                path,
                f"GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
            )
        split_count = self.get("split.count", 1)
        if split_count and int(split_count) > 1:
            raise UnsupportedModelError(
                path,
                f"this is part of a GGUF split into {split_count} files; merge the parts into one "
                "file first (llama-gguf-split --merge FIRST_PART OUT.gguf)",
            )
        self.architecture = arch
        self._check_tensor_types()
        self.hf_config = self._build_config()
        self._entries = self._plan_tensors()

    # ---- metadata ------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` as a Python value, or ``default`` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch_key(self, name: str, default: Any = None) -> Any:
        """The value of ``{architecture}.{name}``."""
        return self.get(f"{self.architecture}.{name}", default)

    def _require(self, name: str) -> Any:
        value = self.arch_key(name)
        if value is None:
            raise ModelLoadError(self.path, f"GGUF metadata lacks {self.architecture}.{name}")
        return value

    def _positive(self, name: str) -> int:
        value = self._require(name)
        if not isinstance(value, int) or value <= 0:
            raise ModelLoadError(
                self.path, f"GGUF metadata {self.architecture}.{name} is {value!r}, not a positive integer"
            )
        return value

    # ---- config --------------------------------------------------------------------------------

    def _build_config(self) -> dict[str, Any]:
        arch = self.architecture
        model_type, hf_class = SUPPORTED_ARCHITECTURES[arch]
        tensor_names = {t.name for t in self.reader.tensors}
        hidden = self._positive("embedding_length")
        heads = self._positive("attention.head_count")
        kv_heads = self.arch_key("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            # Some files store one count per layer; the supported models use the same everywhere.
            if len(set(kv_heads)) != 1:
                raise UnsupportedModelError(self.path, "per-layer key/value head counts differ")
            kv_heads = kv_heads[0]
        # Transformers reads llama's head_dim from rope.dimension_count; key_length is the explicit
        # head size llama.cpp writes when the config has head_dim (Qwen3: 128 != hidden / heads).
        head_dim = self.arch_key("attention.key_length")
        if head_dim is None and arch == "llama":
            head_dim = self.arch_key("rope.dimension_count")
        if head_dim is None:
            head_dim = hidden // heads

        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = self.arch_key("vocab_size")
        if vocab_size is None and tokens is not None:
            vocab_size = len(tokens.data)
        if vocab_size is None:
            embed = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
            if embed is None:
                raise ModelLoadError(self.path, "cannot tell the vocabulary size: no tokens, no token_embd")
            vocab_size = int(embed.shape[1])

        config: dict[str, Any] = {
            "architectures": [hf_class],
            "model_type": model_type,
            "hidden_size": hidden,
            "num_hidden_layers": self._positive("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": int(head_dim),
            "rms_norm_eps": _f32(self._require("attention.layer_norm_rms_epsilon")),
            "rope_theta": _f32(self.arch_key("rope.freq_base", 10000.0)),
            "vocab_size": int(vocab_size),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in tensor_names,
        }
        for key, name in (("intermediate_size", "feed_forward_length"),
                          ("max_position_embeddings", "context_length")):
            value = self.arch_key(name)
            if value is not None:
                config[key] = int(value)
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
            value = self.get(f"tokenizer.ggml.{name}")
            if value is not None:
                config[key] = int(value)

        has_qkv_bias = "blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names
        if arch in ("llama", "qwen3", "qwen3moe"):
            config["attention_bias"] = has_qkv_bias
        if arch == "llama":
            config["mlp_bias"] = "blk.0.ffn_down.bias" in tensor_names
        if arch == "qwen3moe":
            config.update(self._moe_config())
        if arch == "phi3":
            window = self.arch_key("attention.sliding_window")
            config["sliding_window"] = int(window) if window else None
            rotary = self.arch_key("rope.dimension_count")
            if rotary is not None and int(rotary) != config["head_dim"]:
                config["partial_rotary_factor"] = int(rotary) / config["head_dim"]
            original = self.arch_key("rope.scaling.original_context_length")
            if original is not None:
                config["original_max_position_embeddings"] = int(original)

        rope_scaling = self._rope_scaling(config)
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        return config

    def _moe_config(self) -> dict[str, Any]:
        experts = self._positive("expert_count")
        gate = next((t for t in self.reader.tensors if t.name.endswith("ffn_gate_exps.weight")), None)
        if gate is not None and int(gate.shape[-1]) != experts:
            raise ModelLoadError(
                self.path, f"expert_count is {experts} but {gate.name} holds {int(gate.shape[-1])} experts"
            )
        moe_config: dict[str, Any] = {
            "num_experts": experts,
            "num_experts_per_tok": self._positive("expert_used_count"),
            # llama.cpp always renormalises the top-k routing weights for Qwen3-MoE.
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            # layers stored with a dense FFN instead of experts
            "mlp_only_layers": sorted(
                int(match.group(1))
                for t in self.reader.tensors
                if (match := _BLOCK_NAME.fullmatch(t.name)) and match.group(2) == "ffn_gate"
            ),
        }
        moe_width = self.arch_key("expert_feed_forward_length")
        if moe_width is None and gate is not None:
            moe_width = int(gate.shape[1])
        if moe_width is not None:
            moe_config["moe_intermediate_size"] = int(moe_width)
        return moe_config

    def _rope_scaling(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """HF ``rope_scaling`` from the rope metadata keys and rope factor tensors."""
        by_name = {t.name: t for t in self.reader.tensors}
        if "rope_factors_long.weight" in by_name and "rope_factors_short.weight" in by_name:
            return {
                "rope_type": "longrope",
                "long_factor": _float_list(by_name["rope_factors_long.weight"]),
                "short_factor": _float_list(by_name["rope_factors_short.weight"]),
            }
        if "rope_freqs.weight" in by_name:
            return _llama3_rope_scaling(
                self.path,
                np.asarray(_float_list(by_name["rope_freqs.weight"]), dtype=np.float64),
                config,
                self.arch_key("rope.scaling.original_context_length"),
            )
        kind = self.arch_key("rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = self.arch_key("rope.scaling.factor")
        scaling: dict[str, Any] = {"rope_type": kind}
        if factor is not None:
            scaling["factor"] = _f32(factor)
        original = self.arch_key("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            value = self.arch_key(f"rope.scaling.yarn_{key}")
            if value is not None:
                scaling[key] = _f32(value)
        return scaling

    # ---- tensors -------------------------------------------------------------------------------

    def _check_tensor_types(self) -> None:
        import gguf

        # (A file cut short fails in GGUFReader already: it maps every tensor's bytes on open.)
        checked: set[int] = set()
        for tensor in self.reader.tensors:
            qtype = tensor.tensor_type
            if qtype in checked:
                continue
            # dequantize() is the authority on what the installed gguf package can unpack.
            _, type_size = gguf.GGML_QUANT_SIZES[qtype]
            try:
                gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
            except NotImplementedError:
                raise UnsupportedModelError(
                    self.path,
                    f"tensor {tensor.name} is stored as {qtype.name}, which the installed gguf "
                    "package cannot dequantize",
                ) from None
            checked.add(qtype)

    def _plan_tensors(self) -> list[_Entry]:
        arch = self.architecture
        block_map = _BLOCK_TENSORS[arch]
        entries: list[_Entry] = []
        for index, tensor in enumerate(self.reader.tensors):
            name = tensor.name
            if name in _ROPE_TENSORS:
                continue  # folded into hf_config["rope_scaling"]
            stem, _, suffix = name.rpartition(".")
            if stem in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
                entries.append(_Entry(f"{_GLOBAL_TENSORS[stem]}.{suffix}", index))
                continue
            match = _BLOCK_NAME.fullmatch(name)
            if match is None:
                raise self._unknown_tensor(name)
            layer, part, suffix = match.groups()
            prefix = f"model.layers.{layer}."
            if arch == "qwen3moe" and part in _EXPERT_TENSORS and suffix == "weight":
                count = int(tensor.shape[-1])  # ggml order: the expert axis is last
                for expert in range(count):
                    hf_name = f"{prefix}mlp.experts.{expert}.{_EXPERT_TENSORS[part]}.weight"
                    entries.append(_Entry(hf_name, index, expert=expert))
                continue
            if part not in block_map:
                raise self._unknown_tensor(name)
            permute = 0
            if arch == "llama" and part in ("attn_q", "attn_k"):
                config = self.hf_config
                permute = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
            entries.append(_Entry(f"{prefix}{block_map[part]}.{suffix}", index, permute_heads=permute))
        return entries

    def _unknown_tensor(self, name: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            self.path, f"tensor {name!r} has no Hugging Face counterpart for architecture {self.architecture!r}"
        )

    def tensor_names(self) -> list[str]:
        """HF parameter names, in file order."""
        return [entry.hf_name for entry in self._entries]


@functools.cache  # one class; built on first use, as this module imports gguf lazily
def _plain_array_reader_class() -> type:
    """``gguf.GGUFReader`` whose ``data`` is a plain ndarray over the same read-only mapping
    instead of an ``np.memmap``. The reader slices ``data`` once or twice per metadata value
    (~250k times for a 49k-token vocabulary), and every memmap slice pays its subclass hooks
    (``__array_finalize__``, ``__getitem__``): SmolLM2's file opened in 1.9 s, now 0.7 s."""
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:  # the reader's __init__ sets its memmap here
            self._plain_data = value.view(np.ndarray)  # the view keeps the mapping alive

    return PlainArrayReader


def _open_reader(path: Path) -> "gguf.GGUFReader":
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(path, f"cannot read file: {exc.strerror or exc}") from None
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return _plain_array_reader_class()(path, "r")
    except Exception as exc:  # the reader raises assorted errors on a cut-off or damaged file
        raise ModelLoadError(path, f"GGUF file is truncated or corrupt ({type(exc).__name__}: {exc})") from None


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _float_list(tensor: Any) -> list[float]:
    """A small F32/F16 tensor's values as Python floats."""
    return [_f32(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def _llama3_rope_factors(
    head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs`` for Llama-3.1 rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    low_wavelen = original / low_freq_factor
    high_wavelen = original / high_freq_factor
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    factors = np.where(wavelen < high_wavelen, 1.0, 1.0 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen > low_wavelen, factor, factors)


def _llama3_rope_scaling(
    path: Path, stored: np.ndarray, config: dict[str, Any], original: int | None
) -> dict[str, Any] | None:
    """Recover HF's ``llama3`` rope_scaling from the ``rope_freqs`` tensor.

    In HF's formula each frequency's blend weight is s = clip(A / wavelen + B, 0, 1) with
    A = original / (high - low) and B = -low / (high - low): the factors pin down only a line
    (A, B), and any line giving the same clipped weights gives the same frequencies. So
    ``original`` is taken from the metadata (else Llama-3.1's 8192) and low/high follow from a
    line through the stored weights. Factors that do not follow the formula are refused.
    """
    if np.allclose(stored, 1.0):
        return None
    head_dim, theta = config["head_dim"], config["rope_theta"]
    if stored.shape[0] != head_dim // 2:
        raise ModelLoadError(path, f"rope_freqs has {stored.shape[0]} entries, expected {head_dim // 2}")
    original = int(original or 8192)
    factor = float(stored.max())
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = freqs / (2 * math.pi)  # 1 / wavelen
    # stored = 1 / ((1 - s) / factor + s)  =>  s = (1/stored - 1/factor) / (1 - 1/factor)
    weight = (1.0 / stored - 1.0 / factor) / (1.0 - 1.0 / factor)
    ones, zeros = weight > 1 - 1e-6, weight < 1e-6
    inner = ~(ones | zeros)
    line = _blend_line(x, weight, ones, zeros, inner)
    if line is None:
        raise UnsupportedModelError(path, "rope_freqs does not follow Llama-3 rope scaling; cannot map it")
    slope, intercept = line
    span = original / slope
    low = -intercept * span
    for low_f, high_f in ((round(low, 6), round(low + span, 6)), (low, low + span)):
        if low_f <= 0 or high_f <= low_f:
            continue
        rebuilt = _llama3_rope_factors(head_dim, theta, factor, low_f, high_f, original)
        if np.allclose(rebuilt, stored, rtol=1e-4, atol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": _f32(factor),
                "low_freq_factor": float(low_f),
                "high_freq_factor": float(high_f),
                "original_max_position_embeddings": original,
            }
    raise UnsupportedModelError(path, "rope_freqs does not follow Llama-3 rope scaling; cannot map it")


def _blend_line(
    x: np.ndarray, weight: np.ndarray, ones: np.ndarray, zeros: np.ndarray, inner: np.ndarray
) -> tuple[float, float] | None:
    """A line s = slope * x + intercept (slope > 0) through the blended weights, >= 1 where the
    weight is 1 and <= 0 where it is 0; ``None`` when there is none."""
    if inner.sum() >= 2:
        slope, intercept = np.polyfit(x[inner], weight[inner], 1)
        return (float(slope), float(intercept)) if slope > 0 else None
    lowest_one = x[ones].min() if ones.any() else None
    highest_zero = x[zeros].max() if zeros.any() else None
    if inner.sum() == 1:
        x0, s0 = float(x[inner][0]), float(weight[inner][0])
        bounds = []
        if lowest_one is not None and lowest_one > x0:
            bounds.append((1 - s0) / (lowest_one - x0))
        if highest_zero is not None and highest_zero < x0:
            bounds.append(s0 / (x0 - highest_zero))
        slope = max(bounds) if bounds else s0 / x0
        return slope, s0 - slope * x0
    if highest_zero is None:
        return None
    if lowest_one is None:
        lowest_one = 2 * highest_zero
    if lowest_one <= highest_zero:
        return None
    slope = 1.0 / (lowest_one - highest_zero)
    return slope, -slope * highest_zero
