"""``convert_gguf_to_hf``: sharded output with an index that reads back to the GGUF's tensors,
and refusal to overwrite. The SmolLM2 round trip (transformers loads the converted directory and
its logits equal transformers loading the GGUF itself) is in test_loader_gguf.py, where the
transformers reference model is already loaded."""
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
from test_loader_gguf import export_to_gguf  # noqa: E402

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
