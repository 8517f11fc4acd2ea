"""Model loaders: Hugging Face directories and GGUF files, presented the same way.

- :func:`~blink.loader.model_files.open_model` gives a :class:`ModelFiles`: an HF-style
  config, tokenizer files and HF-named tensors (dequantized, one at a time).
- :func:`~blink.loader.tokenizer_files.load_tokenizer_files` and
  :func:`~blink.loader.resolve.resolve_model` need no torch (the frontend uses them).
- :func:`~blink.loader.convert.convert_gguf_to_hf` writes a GGUF out as an HF directory.

The names below load their module on first use, so importing this package (as the torch-free
frontend does, for the tokenizer files) runs none of the torch side.
"""
from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "DEFAULT_MODEL": "blink.loader.resolve",
    "resolve_model": "blink.loader.resolve",
    "load_tokenizer_files": "blink.loader.tokenizer_files",
    "ModelFiles": "blink.loader.model_files",
    "open_model": "blink.loader.model_files",
    "convert_gguf_to_hf": "blink.loader.convert",
    "SUPPORTED_GGUF_ARCHITECTURES": "blink.loader.gguf_file",
}
_ATTRIBUTE = {"SUPPORTED_GGUF_ARCHITECTURES": "SUPPORTED_ARCHITECTURES"}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), _ATTRIBUTE.get(name, name))
    raise AttributeError(f"module 'blink.loader' has no attribute {name!r}")
