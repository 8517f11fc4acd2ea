"""A GGUF file's tensors, dequantized to torch (the torch half of :mod:`.gguf_file`, whose
metadata, config and tokenizer the torch-free frontend reads too)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from blink.errors import ModelLoadError
from blink.loader.gguf_file import GGUFFile


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
