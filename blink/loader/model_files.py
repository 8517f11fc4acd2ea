"""One view of a model, whether it comes as a Hugging Face directory or as a GGUF file."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

from blink.loader.gguf_weights import GGUFWeights, Q4Codes, Q8Codes, QuantCodes
from blink.loader.gguf_tokenizer import build_tokenizer
from blink.loader.hf_dir import SafetensorsWeights, read_config, read_generation_config, read_tokenizer_files
from blink.loader.resolve import resolve_model
from blink.loader.tokenizer_files import gguf_generation_config

if TYPE_CHECKING:
    import torch

class _Weights(Protocol):
    def tensor_names(self) -> list[str]: ...

    def iter_tensors(self, dtype: "torch.dtype", progress: bool = True,
                     skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, "torch.Tensor"]]: ...


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

    def iter_tensors(self, dtype: "torch.dtype", progress: bool = True,
                     skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, "torch.Tensor"]]:
        """``(hf_name, tensor)`` one at a time: dequantized, floating-point tensors in ``dtype``.
        Tensors whose HF name ``skip`` is true for are neither read nor yielded (the executor
        skips the projections it runs on their codes alone).

        Shows a "Loading weights" progress bar on stderr unless ``progress`` is False. Only the
        tensor being produced is held, never a second copy of the model.
        """
        return self._weights.iter_tensors(dtype, progress=progress, skip=skip)

    def iter_q4_codes(self) -> Iterator[tuple[str, "Q4Codes"]]:
        """``(hf_name, codes)`` of the tensors stored as 4-bit Q4_0/Q4_1 codes (a GGUF file's;
        a Hugging Face directory has none): the same values ``iter_tensors`` dequantizes."""
        if isinstance(self._weights, GGUFWeights):
            yield from self._weights.iter_q4_codes()

    def iter_quant_codes(self, progress: bool = True) -> Iterator[tuple[str, "QuantCodes"]]:
        """``(hf_name, codes)`` of the tensors a GGUF file stores as codes the CPU kernels take
        (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; a Hugging Face directory has none): the same values
        ``iter_tensors`` dequantizes ("Reading quantized codes" progress bar unless ``progress``
        is False)."""
        if isinstance(self._weights, GGUFWeights):
            yield from self._weights.iter_quant_codes(progress=progress)

    def uncoded_matrices(self) -> list[str] | None:
        """A GGUF file's matrices that no CPU kernel takes on their codes
        (:meth:`GGUFWeights.uncoded_matrices`; empty: every product can); None for a Hugging
        Face directory (no codes)."""
        return self._weights.uncoded_matrices() if isinstance(self._weights, GGUFWeights) else None

    def iter_q8_codes(self) -> Iterator[tuple[str, "Q8Codes"]]:
        """``(hf_name, codes)`` of the tensors stored as 8-bit Q8_0 codes (a GGUF file's; a
        Hugging Face directory has none): the same values ``iter_tensors`` dequantizes."""
        if isinstance(self._weights, GGUFWeights):
            yield from self._weights.iter_q8_codes()


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
    gguf_file = GGUFWeights(path)
    return ModelFiles(
        path, "gguf", gguf_file.hf_config, gguf_generation_config(gguf_file.hf_config), gguf_file,
        lambda: build_tokenizer(gguf_file.get, path, gguf_file.architecture),
    )
