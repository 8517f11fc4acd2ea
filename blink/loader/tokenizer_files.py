"""A model's tokenizer files, from a Hugging Face directory or a GGUF file, without torch
(the frontend loads its tokenizer through this)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from blink.loader.gguf_file import GGUFFile
from blink.loader.gguf_tokenizer import build_tokenizer
from blink.loader.hf_dir import read_tokenizer_files
from blink.loader.resolve import resolve_model


def load_tokenizer_files(name_or_path: str | Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(tokenizer_json, tokenizer_config, generation_config)`` of a model; needs no torch."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        return read_tokenizer_files(path)
    gguf_file = GGUFFile(path)
    tokenizer_json, tokenizer_config = build_tokenizer(gguf_file.get, path, gguf_file.architecture)
    return tokenizer_json, tokenizer_config, gguf_generation_config(gguf_file.hf_config)


def gguf_generation_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """What generation_config.json would hold: the GGUF only knows the special token ids."""
    return {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
