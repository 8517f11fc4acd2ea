"""``convert_gguf_to_hf``: the written directory loads in transformers and gives the same logits
and token ids as transformers loading the GGUF itself; large models are sharded with an index."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from blink.errors import ModelLoadError
from blink.loader import convert_gguf_to_hf, open_model

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import make_tiny_model  # noqa: E402
from test_loader_gguf import export_to_gguf, smollm_path  # noqa: E402

PROMPTS = ["The capital of France is", "def fib(n):\n    return", "日本語 😀 café 12345"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "smollm2"
    return convert_gguf_to_hf(smollm_path(), out, dtype=torch.float32, progress=False)


def test_smollm_round_trip_through_transformers(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm_path()
    assert sorted(p.name for p in converted.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"

    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    dir_tok = AutoTokenizer.from_pretrained(converted)
    for text in PROMPTS + ["<|im_start|>user\nhi<|im_end|>\n"]:
        assert dir_tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
    assert dir_tok.chat_template == ref_tok.chat_template
    assert (dir_tok.bos_token, dir_tok.eos_token) == (ref_tok.bos_token, ref_tok.eos_token)

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.head_dim == 64
    assert model.generation_config.eos_token_id == 2
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([ref_tok(text)["input_ids"]])
            expected = reference(ids).logits
            actual = model(ids).logits
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
            assert actual[0, -1].argmax() == expected[0, -1].argmax()


def test_sharded_output_reads_back(tmp_path):
    gguf = export_to_gguf(make_tiny_model("qwen3_moe", tmp_path), tmp_path / "moe.gguf")
    out = convert_gguf_to_hf(gguf, tmp_path / "out", max_shard_bytes=40_000, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards

    source, written = open_model(gguf), open_model(out)
    assert json.loads((out / "config.json").read_text()) == {**source.hf_config, "torch_dtype": "bfloat16"}
    assert sorted(written.tensor_names()) == sorted(source.tensor_names())
    expected = dict(source.iter_tensors(torch.bfloat16, progress=False))
    for name, tensor in written.iter_tensors(torch.bfloat16, progress=False):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in expected.values())
    assert written.tokenizer_config == source.tokenizer_config


def test_refuses_to_overwrite_or_convert_a_directory(tmp_path):
    gguf = export_to_gguf(make_tiny_model("llama", tmp_path), tmp_path / "llama.gguf")
    out = convert_gguf_to_hf(gguf, tmp_path / "out", progress=False)
    with pytest.raises(ModelLoadError, match="already holds weights"):
        convert_gguf_to_hf(gguf, out, progress=False)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        convert_gguf_to_hf(tmp_path / "llama", tmp_path / "out2", progress=False)
