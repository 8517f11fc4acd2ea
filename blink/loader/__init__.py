"""Model loaders: Hugging Face directories and GGUF files, presented the same way.

``open_model`` gives a :class:`ModelFiles` with an HF-style config, tokenizer files and
HF-named tensors (dequantized, one at a time). ``load_tokenizer_files`` needs no torch, so the
frontend can use it. ``convert_gguf_to_hf`` writes a GGUF out as a Hugging Face directory.
"""
from blink.loader.convert import convert_gguf_to_hf
from blink.loader.gguf_file import SUPPORTED_ARCHITECTURES as SUPPORTED_GGUF_ARCHITECTURES
from blink.loader.model_files import DEFAULT_MODEL, ModelFiles, load_tokenizer_files, open_model, resolve_model

__all__ = [
    "DEFAULT_MODEL",
    "ModelFiles",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "convert_gguf_to_hf",
    "load_tokenizer_files",
    "open_model",
    "resolve_model",
]
