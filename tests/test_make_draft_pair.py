"""benchmarks/make_draft_pair.py's widening at tiny widths: the widened model computes the small
model's function (before noise), the noise changes it through the unused heads/channels only, and
shapes the head mapping cannot hold are refused."""
from __future__ import annotations

import pytest
import torch

from benchmarks.make_draft_pair import hf_model, set_noise, widen_into, widened_config

SRC = {"hidden_size": 48, "intermediate_size": 64, "num_attention_heads": 3, "num_key_value_heads": 1,
       "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 101, "rms_norm_eps": 1e-5,
       "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 64,
       "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
WIDE = {"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 8, "num_key_value_heads": 2}


def _pair(noise: float = 0.0):
    small = hf_model(SRC, seed=1, init_std=0.2)  # a larger std than the default: not a near-constant function
    with torch.no_grad():  # the norms' weights away from 1, so their scaling is exercised
        for name, p in small.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    src = {k: v.detach().clone() for k, v in small.state_dict().items() if k != "lm_head.weight"}
    cfg = widened_config(SRC, **WIDE)
    wide = hf_model(cfg, seed=2, init_std=0.2)
    widen_into(wide, src, SRC)
    if noise:
        set_noise(wide, src, SRC, noise, seed=3)
    return small, wide, src


IDS = torch.tensor([[5, 17, 99, 3, 42, 42, 8, 60, 1, 77]])


def test_widened_model_computes_the_small_models_function() -> None:
    small, wide, _ = _pair()
    assert sum(p.numel() for p in wide.parameters()) > 3 * sum(p.numel() for p in small.parameters())
    with torch.inference_mode():
        a, out = small(IDS).logits, wide(IDS, output_hidden_states=True)
    assert a.abs().max() > 1.0
    torch.testing.assert_close(out.logits, a, rtol=0, atol=1e-5 * float(a.abs().max()))
    for hidden in out.hidden_states[:-1]:  # the padded residual dims stay zero
        assert hidden[..., SRC["hidden_size"]:].abs().max() == 0


def test_noise_changes_the_function_through_unused_heads_only_and_zero_restores_it() -> None:
    small, wide, src = _pair(noise=0.5)
    with torch.inference_mode():
        a, out = small(IDS).logits, wide(IDS, output_hidden_states=True)
        assert (out.logits - a).abs().max() > 1e-2 * a.abs().max()
        for hidden in out.hidden_states[:-1]:
            assert hidden[..., SRC["hidden_size"]:].abs().max() == 0
        set_noise(wide, src, SRC, 0.0)
        torch.testing.assert_close(wide(IDS).logits, a, rtol=0, atol=1e-5 * float(a.abs().max()))


def test_shapes_the_mapping_cannot_hold_are_refused() -> None:
    with pytest.raises(SystemExit, match="query group"):
        widened_config(SRC, **dict(WIDE, num_attention_heads=4, num_key_value_heads=2))  # groups of 2 < 3
    with pytest.raises(SystemExit, match="every size must grow"):
        widened_config(SRC, **dict(WIDE, hidden_size=32))
