"""Reading a Hugging Face model directory: config, tokenizer files and safetensors weights.

Safetensors headers are checked here, without torch, before any tensor is read, so that a
truncated file or a header whose offsets, shapes and dtypes disagree with the data is reported
as a :class:`ModelLoadError` naming the file and the tensor, not as a crash mid-load.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blink.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


def read_optional_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or ``None`` when the file does not exist."""
    return read_json(path) if path.is_file() else None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``."""
    if not path.is_file():
        raise ModelLoadError(path, "file is missing")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(path, f"expected a JSON object, found {type(value).__name__}")
    return value


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of a model directory."""
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            directory,
            "no config.json: a Hugging Face model directory needs config.json, tokenizer.json and "
            "safetensors weights (or pass a .gguf file)",
        )
    return read_json(path)


def read_generation_config(directory: Path) -> dict[str, Any]:
    """generation_config.json of a model directory, ``{}`` when it has none."""
    return read_optional_json(directory / "generation_config.json") or {}


def read_tokenizer_files(directory: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(tokenizer_json, tokenizer_config, generation_config)`` of a model directory.

    The chat template may also live in ``chat_template.jinja`` or ``chat_template.json``; as in
    transformers, such a file takes precedence over the template in tokenizer_config.json.
    """
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        hint = ""
        if (directory / "tokenizer.model").is_file():
            hint = " (only a SentencePiece tokenizer.model; re-save the tokenizer with transformers to get one)"
        raise ModelLoadError(directory, f"no tokenizer.json{hint}")
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    try:
        json.loads(tokenizer_json)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(tokenizer_path, f"invalid JSON: {exc}") from None
    tokenizer_config = read_optional_json(directory / "tokenizer_config.json") or {}
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        tokenizer_config["chat_template"] = jinja.read_text(encoding="utf-8")
    else:
        template_file = read_optional_json(directory / "chat_template.json")
        if template_file is not None:
            if "chat_template" not in template_file:
                raise ModelLoadError(directory / "chat_template.json", "no 'chat_template' key")
            tokenizer_config["chat_template"] = template_file["chat_template"]
    return tokenizer_json, tokenizer_config, read_generation_config(directory)


class SafetensorsWeights:
    """The safetensors weights of a directory: validated headers, then tensors one at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # tensor name -> file, in file order (tensors of one file are read together)
        self._files: dict[Path, list[str]] = {}
        index_path = directory / SAFETENSORS_INDEX
        if index_path.is_file():
            self._load_index(index_path)
        elif (directory / SAFETENSORS_SINGLE).is_file():
            path = directory / SAFETENSORS_SINGLE
            self._files[path] = list(read_safetensors_header(path))
        else:
            shards = sorted(directory.glob("*.safetensors"))
            if not shards:
                raise ModelLoadError(directory, _no_weights_message(directory))
            seen: dict[str, Path] = {}
            for path in shards:
                names = list(read_safetensors_header(path))
                for name in names:
                    if name in seen:
                        raise ModelLoadError(path, f"tensor {name} is also in {seen[name].name}")
                    seen[name] = path
                self._files[path] = names

    def _load_index(self, index_path: Path) -> None:
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index_path, "no 'weight_map' object naming the shard of each tensor")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise ModelLoadError(index_path, f"tensor {name} names an invalid shard {shard!r}")
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            path = self.directory / shard
            if not path.is_file():
                raise ModelLoadError(index_path, f"names shard {shard} (for {names[0]}), which does not exist")
            present = read_safetensors_header(path)
            missing = [name for name in names if name not in present]
            if missing:
                raise ModelLoadError(path, f"tensor {missing[0]} listed in {index_path.name} is not in this shard")
            # keep file order so reads walk each shard front to back
            wanted = set(names)
            self._files[path] = [name for name in present if name in wanted]

    def tensor_names(self) -> list[str]:
        """Every tensor name, shard by shard."""
        return [name for names in self._files.values() for name in names]

    def iter_tensors(self, dtype: "torch.dtype", progress: bool = True,
                     skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Tensors one at a time; floating-point ones cast to ``dtype``; those whose name
        ``skip`` is true for are not read."""
        from safetensors import SafetensorError, safe_open
        from tqdm import tqdm

        bar = tqdm(total=len(self.tensor_names()), desc="Loading weights", unit="tensor", disable=not progress)
        try:
            for path, names in self._files.items():
                try:
                    with safe_open(str(path), framework="pt") as handle:
                        for name in names:
                            if skip is not None and skip(name):
                                bar.update(1)
                                continue
                            tensor = handle.get_tensor(name)
                            if tensor.is_floating_point() and tensor.dtype != dtype:
                                tensor = tensor.to(dtype)
                            bar.update(1)
                            yield name, tensor
                except SafetensorError as exc:
                    raise ModelLoadError(path, f"cannot read safetensors file: {exc}") from None
        finally:
            bar.close()


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file, checked against the file's size.

    Raises ModelLoadError for a truncated file or a header whose dtype, shape and offsets do not
    describe the data that follows it.
    """
    size = path.stat().st_size
    if size < 8:
        raise ModelLoadError(path, f"truncated safetensors file ({size} bytes, shorter than its 8-byte header length)")
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > _MAX_HEADER:
            raise ModelLoadError(path, f"not a safetensors file (header length {header_len} is implausible)")
        if 8 + header_len > size:
            raise ModelLoadError(
                path, f"truncated safetensors file: header needs {8 + header_len} bytes, file has {size}"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(path, "safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    end_of_data = 0
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(path, f"tensor {name}: malformed header entry {info!r}") from None
        if dtype not in _DTYPE_BYTES:
            raise ModelLoadError(path, f"tensor {name}: unsupported dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ModelLoadError(path, f"tensor {name}: invalid shape {shape!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise ModelLoadError(path, f"tensor {name}: invalid data_offsets {[begin, end]!r}")
        expected = math.prod(shape) * _DTYPE_BYTES[dtype]
        if end - begin != expected:
            raise ModelLoadError(
                path,
                f"tensor {name}: header is inconsistent: {dtype} {shape} needs {expected} bytes "
                f"but data_offsets [{begin}, {end}] span {end - begin}",
            )
        end_of_data = max(end_of_data, end)
    if end_of_data > data_size:
        raise ModelLoadError(
            path, f"truncated safetensors file: header describes {end_of_data} data bytes, file holds {data_size}"
        )
    # The safetensors library's own checks (no gaps or overlaps between tensors, ...); numpy mode
    # reads only the header and needs no torch.
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as exc:
        raise ModelLoadError(path, f"invalid safetensors file: {exc}") from None
    # file order, which is the order of the data offsets
    return dict(sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]))


def _no_weights_message(directory: Path) -> str:
    legacy = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pth")]
    if legacy:
        return (
            f"no safetensors weights (found {legacy[0]}: PyTorch pickle checkpoints are not supported; "
            "re-save the model with safetensors)"
        )
    return f"no weights: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}"
