"""A GGUF file's tensors, dequantized to torch (the torch half of :mod:`.gguf_file`, whose
metadata, config and tokenizer the torch-free frontend reads too)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blink.errors import ModelLoadError
from blink.loader.gguf_file import GGUFFile


#: values per block of ggml's 4-bit formats (Q4_0, Q4_1)
Q4_GROUP = 32


@dataclass
class Q4Codes:
    """A 2-D tensor stored as 4-bit codes with a scale and zero per group of ``Q4_GROUP``
    input channels: ``w[n, k] = (codes[n, k] - 8) * scale[n, g] + zero[n, g]`` with
    ``g = k // Q4_GROUP`` (Q4_1: ``d * q + m``, so scale = d, zero = m + 8d; Q4_0:
    ``d * (q - 8)``, so zero = 0). The exact values ``iter_tensors`` dequantizes."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K // Q4_GROUP]
    zero: torch.Tensor  # float32 [N, K // Q4_GROUP]


#: values per block of ggml's Q8_0
Q8_GROUP = 32


@dataclass
class Q8Codes:
    """A 2-D tensor stored as ggml's Q8_0: ``w[n, k] = codes[n, k] * scale[n, k // Q8_GROUP]``
    (the exact values ``iter_tensors`` dequantizes)."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // Q8_GROUP]: the blocks' fp16 d


def unpack_q8(data: np.ndarray, rows: int, cols: int) -> Q8Codes:
    """Q8_0 blocks (``data``: uint8 [rows, blocks * 34]: fp16 ``d``, then 32 int8 values)
    -> :class:`Q8Codes`."""
    blocks = data.reshape(rows, cols // Q8_GROUP, 2 + Q8_GROUP)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return Q8Codes(torch.from_numpy(codes), torch.from_numpy(d))


def unpack_q4(data: np.ndarray, qtype_name: str, rows: int, cols: int) -> Q4Codes:
    """Q4_0 / Q4_1 blocks (``data``: uint8 [rows, blocks * block_bytes]) -> :class:`Q4Codes`.

    ggml's block layout: fp16 ``d`` (Q4_1: then fp16 ``m``), then 16 bytes whose low nibbles
    are the block's values 0-15 and high nibbles its values 16-31."""
    header = 2 if qtype_name == "Q4_0" else 4
    blocks = data.reshape(rows, cols // Q4_GROUP, header + Q4_GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., header:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, cols)
    if qtype_name == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return Q4Codes(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d), torch.from_numpy(zero))


class GGUFWeights(GGUFFile):
    """:class:`GGUFFile` plus its tensors as HF-named torch tensors, one at a time."""

    def iter_tensors(self, dtype: torch.dtype, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantized HF-named tensors in ``dtype``, one at a time."""
        from tqdm import tqdm

        # The stacked expert tensor of one layer is unpacked once and sliced per expert.
        stacked_index, stacked = -1, None
        bar = tqdm(total=len(self._entries), desc="Loading weights", unit="tensor", disable=not progress)
        try:
            for entry in self._entries:
                if entry.expert >= 0:
                    if stacked_index != entry.tensor_index:
                        stacked = self._dequantize(entry.tensor_index).to(dtype)
                        stacked_index = entry.tensor_index
                    tensor = stacked[entry.expert].clone()
                else:
                    stacked_index, stacked = -1, None
                    tensor = self._dequantize(entry.tensor_index)
                    if entry.permute_heads:
                        tensor = _reverse_rope_permute(tensor, entry.permute_heads)
                    tensor = tensor.to(dtype).contiguous()
                bar.update(1)
                yield entry.hf_name, tensor
        finally:
            bar.close()

    def iter_q4_codes(self) -> Iterator[tuple[str, Q4Codes]]:
        """``(hf_name, codes)`` for every 2-D tensor the file stores as Q4_0 or Q4_1 (experts
        excluded), in the same row order as ``iter_tensors`` gives it, one at a time."""
        for entry, tensor, rows, cols in self._coded_tensors(("Q4_0", "Q4_1")):
            q4 = unpack_q4(np.asarray(tensor.data), tensor.tensor_type.name, rows, cols)
            if entry.permute_heads:
                q4 = Q4Codes(*(_reverse_rope_permute(t, entry.permute_heads).contiguous()
                               for t in (q4.codes, q4.scale, q4.zero)))
            yield entry.hf_name, q4

    def iter_q8_codes(self) -> Iterator[tuple[str, Q8Codes]]:
        """``(hf_name, codes)`` for every 2-D tensor the file stores as Q8_0 (experts
        excluded), in the same row order as ``iter_tensors`` gives it, one at a time."""
        for entry, tensor, rows, cols in self._coded_tensors(("Q8_0",)):
            q8 = unpack_q8(np.asarray(tensor.data), rows, cols)
            if entry.permute_heads:
                q8 = Q8Codes(*(_reverse_rope_permute(t, entry.permute_heads).contiguous() for t in (q8.codes, q8.scale)))
            yield entry.hf_name, q8

    def _coded_tensors(self, qtypes: tuple[str, ...]) -> Iterator[tuple[Any, Any, int, int]]:
        """(entry, gguf tensor, rows, columns) of every 2-D non-expert tensor stored in one of
        ``qtypes``."""
        for entry in self._entries:
            tensor = self.reader.tensors[entry.tensor_index]
            if entry.expert >= 0 or tensor.tensor_type.name not in qtypes or len(tensor.shape) != 2:
                continue
            cols, rows = (int(d) for d in tensor.shape.tolist())  # ggml order: [in, out]
            yield entry, tensor, rows, cols

    def _dequantize(self, index: int) -> torch.Tensor:
        """Tensor ``index`` as float32 in torch dimension order, in memory it owns."""
        import gguf

        tensor = self.reader.tensors[index]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, IndexError) as exc:
            raise ModelLoadError(self.path, f"cannot dequantize tensor {tensor.name}: {exc}") from None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        # F32 data comes back as a view of the read-only file mapping; the caller may write to it.
        if not values.flags.writeable:
            values = values.copy()
        values = values.astype(np.float32, copy=False)
        return torch.from_numpy(values.reshape(shape))


def _reverse_rope_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved rope pairs -> HF's half split)."""
    half = weight.shape[0] // n_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)
