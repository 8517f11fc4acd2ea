"""Tiny random models of every supported architecture, saved as HF directories.

``make_tiny_model(arch, root)`` builds a model with transformers' own config and model
classes (hidden 64, 2 layers, vocab 256, GQA), fills every parameter with seeded random
values (norm weights included, so a swapped or skipped norm cannot go unnoticed) and saves
it with ``save_pretrained`` (safetensors) into ``root / arch``. Nothing is downloaded.

``model_files(path)`` opens such a directory with ``blink.loader.open_model``;
:class:`LocalModelFiles` is a plain reader with the same interface whose config or tensor
stream a test can edit (to check the executor's errors).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 256
ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=None,  # greedy parity runs never stop early
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _hf_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**_COMMON, rope_theta=10000.0)
    if arch == "llama3":
        # original_max_position_embeddings small so the scaling changes frequencies that
        # a short test sequence can see.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return tf.LlamaConfig(**_COMMON, rope_parameters=rope)
    if arch == "mistral":
        return tf.MistralConfig(**_COMMON, sliding_window=None, head_dim=16)
    if arch == "qwen2":
        # tied embeddings here: exercises the lm_head = embed_tokens path
        return tf.Qwen2Config(**{**_COMMON, "tie_word_embeddings": True})
    if arch == "qwen3":
        # explicit head_dim different from hidden/heads, as in the real Qwen3 models
        return tf.Qwen3Config(**_COMMON, head_dim=32)
    if arch == "phi3":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return tf.Phi3Config(**_COMMON, rope_parameters=rope, sliding_window=None)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **_COMMON,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],  # layer 0 dense, layer 1 sparse
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {ARCHS}")


def build_hf_model(arch: str, seed: int = 0):
    """The transformers model (fp32, eval mode) with seeded random weights."""
    import transformers as tf

    config = _hf_config(arch)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.eval()


def make_tiny_model(arch: str, root: str | Path, seed: int = 0) -> Path:
    """Save the tiny ``arch`` model under ``root/arch`` (once) and return that directory."""
    path = Path(root) / arch
    if not (path / "config.json").exists():
        build_hf_model(arch, seed).save_pretrained(path, safe_serialization=True)
    return path


@dataclass
class LocalModelFiles:
    """The part of ``blink.loader.ModelFiles`` the executor uses, for an HF directory."""

    source: Path
    hf_config: dict[str, Any]

    def iter_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in sorted(self.source.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)


def model_files(path: str | Path):
    """Open a tiny model directory with the real loader (it reads the tokenizer lazily, so
    these weight-only directories need none)."""
    from blink.loader import open_model

    return open_model(path)
