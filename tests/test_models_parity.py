"""Logit and greedy-token parity of the executor with transformers on tiny random models of
every supported architecture, plus config normalisation and weight-loading errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from blink.model_config import ModelConfig
from blink.errors import ModelLoadError, UnsupportedModelError
from blink.executor import ModelExecutor
sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from executor_helpers import build_metadata  # noqa: E402
from helpers_models import ARCHS, VOCAB, LocalModelFiles, make_tiny_model, model_files

BLOCK = 4  # small, so every sequence spans several blocks
ATOL = 1e-4


# one torch thread for the whole module (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_root):
    """(arch, transformers model loaded from disk, fp32 executor) for one architecture."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(request.param, tiny_root)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ex = ModelExecutor(model_files(path), dtype=torch.float32, block_size=BLOCK, num_blocks=96)
    return request.param, hf, ex


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def _blocks(n_seqs: int, per_seq: int) -> list[list[int]]:
    """Interleaved, non-contiguous block ids: sequence i owns i, i+n, i+2n, ..."""
    return [[i + n_seqs * j for j in range(per_seq)] for i in range(n_seqs)]


def test_prefill_of_three_sequences_in_one_batch(case):
    arch, hf, ex = case
    seqs = [_tokens(1, 11), _tokens(2, 5), _tokens(3, 17)]
    blocks = _blocks(3, 5)
    ids, md, last = build_metadata(ex, [(s, 0, b) for s, b in zip(seqs, blocks)])
    logits = ex.execute(ids, md, torch.arange(len(ids)))
    want = torch.cat([_hf_logits(hf, s) for s in seqs])
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(ex.execute(ids, md, last), want[last], atol=ATOL, rtol=0)


def test_decode_step_by_step_through_the_paged_cache(case):
    arch, hf, ex = case
    prompts = [_tokens(4, 6), _tokens(5, 3), _tokens(6, 9)]
    full = [p + _tokens(10 + i, 10) for i, p in enumerate(prompts)]  # teacher-forced tokens
    blocks = _blocks(3, 5)
    want = [_hf_logits(hf, s) for s in full]
    ids, md, last = build_metadata(ex, [(p, 0, b) for p, b in zip(prompts, blocks)])
    got = ex.execute(ids, md, last)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[i], want[i][len(p) - 1], atol=ATOL, rtol=0)
    for step in range(10):
        batch = [([s[len(p) + step]], len(p) + step, b) for s, p, b in zip(full, prompts, blocks)]
        ids, md, last = build_metadata(ex, batch)
        assert md.max_query_len == 1
        got = ex.execute(ids, md, last)
        for i, p in enumerate(prompts):
            torch.testing.assert_close(got[i], want[i][len(p) + step], atol=ATOL, rtol=0)


def test_chunked_prefill_attends_to_the_cached_prefix(case):
    arch, hf, ex = case
    seq = _tokens(7, 21)
    other = _tokens(8, 6)  # a second sequence decoding in the same step as chunk 2
    b_seq, b_other = [3, 9, 1, 12, 7, 20], [5, 2]
    want_seq, want_other = _hf_logits(hf, seq), _hf_logits(hf, other)
    ids, md, _ = build_metadata(ex, [(seq[:9], 0, b_seq), (other[:5], 0, b_other)])
    ex.execute(ids, md, torch.arange(len(ids)))
    ids, md, _ = build_metadata(ex, [(seq[9:], 9, b_seq), (other[5:], 5, b_other)])
    got = ex.execute(ids, md, torch.arange(len(ids)))
    torch.testing.assert_close(got[:12], want_seq[9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[12], want_other[5], atol=ATOL, rtol=0)


def _greedy(ex: ModelExecutor, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Greedy continuation of all prompts together: one prefill step, then batched decode."""
    per_seq = -(-(max(map(len, prompts)) + n_new) // ex.block_size)
    blocks = _blocks(len(prompts), per_seq)
    seqs = [list(p) for p in prompts]
    step = [(list(p), 0, b) for p, b in zip(prompts, blocks)]
    for _ in range(n_new):
        ids, md, last = build_metadata(ex, step)
        nxt = ex.execute(ids, md, last).argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        step = [([s[-1]], len(s) - 1, b) for s, b in zip(seqs, blocks)]
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def test_greedy_32_tokens_match_generate(case):
    arch, hf, ex = case
    prompts = [_tokens(20, 7), _tokens(21, 12)]
    got = _greedy(ex, prompts, 32)
    for prompt, tokens in zip(prompts, got):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )
        want = out[0, len(prompt) :].tolist()
        assert len(want) == 32
        assert tokens == want, f"{arch}: greedy continuation differs from transformers"


def test_bf16_runs_and_stays_close(case, tiny_root):
    arch, hf, _ = case
    ex = ModelExecutor(model_files(tiny_root / arch), dtype=torch.bfloat16, block_size=BLOCK, num_blocks=32)
    assert ex.kv_caches[0][0].dtype == torch.bfloat16
    seqs = [_tokens(30, 13), _tokens(31, 4)]
    ids, md, _ = build_metadata(ex, [(s, 0, b) for s, b in zip(seqs, _blocks(2, 4))])
    got = ex.execute(ids, md, torch.arange(len(ids)))
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    want = torch.cat([_hf_logits(hf, s) for s in seqs])
    err = (got - want).abs().max() / want.abs().max()
    assert err < 0.05, f"{arch}: bf16 logits off by {err:.3f} of the logit range"
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.8, f"{arch}: bf16 top-1 agrees on only {agree:.0%} of tokens"
    # a one-token step takes the matrix-vector path (torch's kernel instead of oneDNN's)
    seq = seqs[1] + _tokens(32, 1)
    ids, md, last = build_metadata(ex, [(seq[-1:], len(seq) - 1, _blocks(2, 4)[1])])
    step = ex.execute(ids, md, last)[0]
    want_step = _hf_logits(hf, seq)[-1]
    assert (step - want_step).abs().max() / want_step.abs().max() < 0.05


# ----------------------------------------------------------------------------- config


def _cfg(tiny_root, arch: str) -> dict:
    return json.loads((make_tiny_model(arch, tiny_root) / "config.json").read_text())


def test_config_rejects_unknown_model_type():
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported: llama, mistral"):
        ModelConfig.from_hf({"model_type": "gpt2"}, "m")


@pytest.mark.parametrize("rope", [{"rope_type": "longrope", "short_factor": [1.0]}, {"type": "yarn", "factor": 4.0}])
def test_config_rejects_unsupported_rope_scaling(tiny_root, rope):
    hf = {**_cfg(tiny_root, "phi3"), "rope_parameters": None, "rope_scaling": rope}
    with pytest.raises(UnsupportedModelError, match=r"rope scaling type .*\(supported: default, llama3\)"):
        ModelConfig.from_hf(hf, "m")


def test_config_legacy_and_nested_rope_forms_agree(tiny_root):
    nested = _cfg(tiny_root, "llama3")
    legacy = {k: v for k, v in nested.items() if k != "rope_parameters"}
    params = dict(nested["rope_parameters"])
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    a, b = ModelConfig.from_hf(nested, "m"), ModelConfig.from_hf(legacy, "m")
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_scaling["original_max_position_embeddings"] == 32


def test_config_normalises_family_flags(tiny_root):
    phi = ModelConfig.from_hf(_cfg(tiny_root, "phi3"), "m")
    assert phi.rotary_dim == 8 and phi.hf_fused_projections
    qwen2 = ModelConfig.from_hf({**_cfg(tiny_root, "qwen2"), "eos_token_id": [5, 7]}, "m")
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
    assert qwen2.eos_token_ids == (5, 7)
    qwen3 = ModelConfig.from_hf({**_cfg(tiny_root, "qwen3"), "eos_token_id": 3}, "m")
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.eos_token_ids == (3,)
    moe_hf = _cfg(tiny_root, "qwen3_moe")
    moe = ModelConfig.from_hf(moe_hf, "m")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_layers) == (8, 2, (1,))
    # the published checkpoints spell it num_experts; mlp_only_layers and sparse step apply
    legacy = {k: v for k, v in moe_hf.items() if k != "num_local_experts"}
    legacy.update(num_experts=8, num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)
    assert ModelConfig.from_hf(legacy, "m").moe_layers == (1, 3)


def test_config_errors_name_the_problem(tiny_root):
    hf = _cfg(tiny_root, "llama")
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "hidden_size"}, "m")
    with pytest.raises(ModelLoadError, match="not a multiple"):
        ModelConfig.from_hf({**hf, "num_key_value_heads": 3}, "m")
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_hf({**hf, "hidden_act": "gelu"}, "m")


def test_sliding_window_caps_the_context(tiny_root):
    path = make_tiny_model("mistral", tiny_root)
    hf = {**json.loads((path / "config.json").read_text()), "sliding_window": 64}
    assert ModelConfig.from_hf(hf, "m").sliding_window == 64
    assert ModelConfig.from_hf({**hf, "sliding_window": 4096}, "m").sliding_window is None
    files = LocalModelFiles(path, hf)
    assert ModelExecutor(files, dtype=torch.float32, num_blocks=4).max_model_len == 64
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        ModelExecutor(files, dtype=torch.float32, num_blocks=4, max_model_len=128)
    # Qwen2-style configs carry a window that only counts with use_sliding_window
    qwen = {**_cfg(tiny_root, "qwen2"), "sliding_window": 64, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen, "m").sliding_window is None


# ----------------------------------------------------------------------------- loading


class _EditedFiles(LocalModelFiles):
    """A tiny model whose tensor stream is edited on the way to the executor."""

    def __init__(self, path, edit):
        super().__init__(path, json.loads((path / "config.json").read_text()))
        self.edit = edit

    def iter_tensors(self, dtype):
        return self.edit(list(super().iter_tensors(dtype)))


def _load(tiny_root, arch, edit):
    return ModelExecutor(_EditedFiles(make_tiny_model(arch, tiny_root), edit), dtype=torch.float32, num_blocks=4)


def test_missing_weight_is_named(tiny_root):
    drop = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ModelLoadError, match=r"missing weight.*layers\.1\.self_attn\.k_proj\.weight"):
        _load(tiny_root, "llama", lambda ws: [(n, t) for n, t in ws if n != drop])
    drop = "model.layers.1.mlp.experts.5.up_proj.weight"
    with pytest.raises(ModelLoadError, match=r"missing weight.*experts\.5\.up_proj\.weight"):
        _load(tiny_root, "qwen3_moe", lambda ws: [(n, t) for n, t in ws if n != drop])
    with pytest.raises(ModelLoadError, match=r"missing weight.*lm_head\.weight"):
        _load(tiny_root, "llama", lambda ws: [(n, t) for n, t in ws if n != "lm_head.weight"])


def test_shape_mismatch_is_named(tiny_root):
    bad = "model.layers.0.mlp.up_proj.weight"
    edit = lambda ws: [(n, t[:-1] if n == bad else t) for n, t in ws]  # noqa: E731
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight.* shape \(127, 64\), expected \(128, 64\)"):
        _load(tiny_root, "llama", edit)


def test_unexpected_and_duplicate_weights_are_rejected(tiny_root):
    with pytest.raises(ModelLoadError, match=r"unexpected weight 'model\.layers\.0\.mlp\.fc1\.weight'"):
        _load(tiny_root, "llama", lambda ws: ws + [("model.layers.0.mlp.fc1.weight", torch.zeros(1))])
    with pytest.raises(ModelLoadError, match=r"unexpected weight 'model\.layers\.5\.input_layernorm"):
        _load(tiny_root, "llama", lambda ws: ws + [("model.layers.5.input_layernorm.weight", torch.zeros(64))])
    with pytest.raises(ModelLoadError, match="given twice"):
        _load(tiny_root, "llama", lambda ws: ws + [ws[3]])


def _fuse(ws):
    """Rewrite a split checkpoint into the fused (Phi-3 style / stacked expert) layout."""
    d = dict(ws)
    out = {}
    for name, t in d.items():
        if ".self_attn.q_proj." in name:
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [t, d[name.replace("q_proj", "k_proj")], d[name.replace("q_proj", "v_proj")]]
            )
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, d[name.replace("gate_proj", "up_proj")]])
        elif not any(s in name for s in ("k_proj", "v_proj", "up_proj", "experts.")):
            out[name] = t
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts."
        if prefix + "0.gate_proj.weight" in d:
            experts = range(8)
            out[prefix + "gate_up_proj"] = torch.stack(
                [torch.cat([d[f"{prefix}{e}.gate_proj.weight"], d[f"{prefix}{e}.up_proj.weight"]]) for e in experts]
            )
            out[prefix + "down_proj"] = torch.stack([d[f"{prefix}{e}.down_proj.weight"] for e in experts])
    return list(out.items())


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fused_checkpoint_layout_loads_the_same_model(tiny_root, arch):
    split = _load(tiny_root, arch, lambda ws: ws)
    fused = _load(tiny_root, arch, _fuse)
    a, b = dict(split.model.named_parameters()), dict(fused.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and a partially fused layout (q/k/v split but also fused) is an overlap, not a model
    with pytest.raises(ModelLoadError, match="given twice|overlaps"):
        _load(tiny_root, "llama", lambda ws: ws + [n for n in _fuse(ws) if "qkv_proj" in n[0]][:1])


def test_tied_checkpoint_may_carry_lm_head(tiny_root):
    base = _load(tiny_root, "qwen2", lambda ws: ws)
    extra = _load(tiny_root, "qwen2", lambda ws: ws + [("lm_head.weight", torch.zeros(VOCAB, 64))])
    assert torch.equal(base.model.compute_logits(torch.ones(1, 64)), extra.model.compute_logits(torch.ones(1, 64)))
