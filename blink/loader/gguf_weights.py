"""A GGUF file's tensors, dequantized to torch (the torch half of :mod:`.gguf_file`, whose
metadata, config and tokenizer the torch-free frontend reads too)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blink.errors import ModelLoadError
from blink.loader.gguf_file import GGUFFile
from blink.shared.load_chunks import run_chunks


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


#: the formats :func:`unpack_codes` takes (what a GGUF file's projections and head are stored as
#: by llama.cpp's usual quantizations: Q4_0, Q4_1, Q8_0, and the K-quants of Q4_K_M / Q5_K_M /
#: Q6_K files)
CODED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
#: values per K-quant super-block
QK_K = 256


@dataclass
class KScales:
    """A K-quant's scales as its file holds them, for kernels that read those bytes rather than
    one fp32 d (and m) per group: per super-block of 256 channels fp16 ``d`` (and ``dmin``), per
    group a small integer scale ``sc`` (and min ``mn``); ``QuantCodes.d = d * sc`` and ``m =
    -dmin * mn`` per group, each exact in fp32.

    - Q4_K / Q5_K: 6-bit ``sc`` and ``mn`` (0..63) per group of 32, ``d`` and ``dmin``.
    - Q6_K: int8 ``sc`` per group of 16, ``d``; no min."""

    d: torch.Tensor  # float16 [N, K // 256]
    sc: torch.Tensor  # int8 [N, K // group]
    dmin: torch.Tensor | None = None  # float16 [N, K // 256]
    mn: torch.Tensor | None = None  # int8 [N, K // group]

    def rows(self, index: slice | torch.Tensor) -> "KScales":
        """The same for some output rows."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return KScales(self.d[index], self.sc[index], pick(self.dmin), pick(self.mn))


@dataclass
class QuantCodes:
    """A 2-D tensor as its file's codes: ``w[n, k] = codes[n, k] * d[n, g] + m[n, g]`` (m None:
    0) with ``g = k // group``, in fp32 exactly the values gguf dequantizes (``d q`` is exact in
    fp32 for every format: at most 17 + 8 significant bits).

    - Q4_0: codes 0..15, d, m = -8d; Q4_1: codes 0..15, d, m (fp16, the block's own).
    - Q8_0: int8 codes, d.
    - Q4_K: codes 0..15, d = the super-block's d times the sub-block's 6-bit scale, m = -dmin
      times its 6-bit min (groups of 32); Q5_K: the same with 5-bit codes 0..31 (held in int8).
    - Q6_K: codes q - 32 in -32..31 (int8), d = the super-block's d times the sub-block's int8
      scale, groups of 16.
    ``bits``: 4 (codes uint8 0..15) or 8 (int8 codes). ``k_scales``: a K-quant's scales as the
    file holds them (:class:`KScales`; None for Q4_0, Q4_1, Q8_0)."""

    qtype: str
    codes: torch.Tensor  # uint8 [N, K] (bits 4) or int8 [N, K] (bits 8)
    d: torch.Tensor  # float32 [N, K // group]
    m: torch.Tensor | None  # float32 [N, K // group] or None
    group: int
    bits: int
    k_scales: KScales | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight (gguf's own values, bit for bit)."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // self.group, self.group) * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.view(n, k)

    def rows(self, index: slice | torch.Tensor) -> "QuantCodes":
        """The same for some output rows."""
        return QuantCodes(self.qtype, self.codes[index], self.d[index], None if self.m is None else self.m[index],
                          self.group, self.bits, None if self.k_scales is None else self.k_scales.rows(index))


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K/Q5_K super-block's 12 bytes -> its 8 sub-blocks' 6-bit scales and mins
    (gguf.quants.Q4_K.get_scale_min, on [..., 12])."""
    lead = scales.shape[:-1]
    d, m, m_d = (scales.reshape(*lead, 3, 4)[..., i, :] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


#: weights unpacked at a time by :func:`unpack_codes`: its numpy temporaries (several a code)
#: stay a few MB instead of several times a large head's size in fresh pages
UNPACK_ROW_WEIGHTS = 1 << 20


def unpack_codes(data: np.ndarray, qtype_name: str, rows: int, cols: int) -> QuantCodes:
    """A 2-D tensor's blocks (``data``: uint8 [rows, bytes per row]) in one of
    :data:`CODED_TYPES` -> :class:`QuantCodes`, ggml's block layouts (as gguf.quants reads
    them), :data:`UNPACK_ROW_WEIGHTS` weights of rows at a time into the result, the chunks
    side by side on the process's cores (:mod:`blink.shared.load_chunks`)."""
    step = max(1, UNPACK_ROW_WEIGHTS // max(cols, 1))
    if rows <= step:
        return _unpack_rows(data, qtype_name, rows, cols)
    data = data.reshape(rows, -1)
    first = _unpack_rows(data[:step], qtype_name, step, cols)

    def whole(part: torch.Tensor | None) -> torch.Tensor | None:  # the rows' tensor, first rows filled
        if part is None:
            return None
        out = torch.empty((rows, *part.shape[1:]), dtype=part.dtype)
        out[:step] = part
        return out

    k = first.k_scales
    result = QuantCodes(first.qtype, whole(first.codes), whole(first.d), whole(first.m), first.group, first.bits,
                        None if k is None else KScales(whole(k.d), whole(k.sc), whole(k.dmin), whole(k.mn)))

    def unpack_chunk(row: int) -> None:  # its own rows of the result
        part = _unpack_rows(data[row: row + step], qtype_name, min(step, rows - row), cols)
        end = row + part.codes.shape[0]
        pairs = [(result.codes, part.codes), (result.d, part.d), (result.m, part.m)]
        if k is not None:
            pairs += [(getattr(result.k_scales, f), getattr(part.k_scales, f)) for f in ("d", "sc", "dmin", "mn")]
        for out, piece in pairs:
            if out is not None:
                out[row:end] = piece

    run_chunks(unpack_chunk, range(step, rows, step))
    return result


def _unpack_rows(data: np.ndarray, qtype_name: str, rows: int, cols: int) -> QuantCodes:
    """:func:`unpack_codes` on all the rows at once."""
    t = torch.from_numpy
    if qtype_name in ("Q4_0", "Q4_1"):
        q4 = unpack_q4(data, qtype_name, rows, cols)
        if qtype_name == "Q4_1":  # the file's own m (zero = m + 8d is rounded)
            m = t(_f16(data.reshape(rows, cols // Q4_GROUP, 4 + Q4_GROUP // 2)[..., 2:4]))
        else:
            m = -8 * q4.scale  # d (q - 8) = d q - 8d, each exact
        return QuantCodes(qtype_name, q4.codes, q4.scale, m, Q4_GROUP, 4)
    if qtype_name == "Q8_0":
        q8 = unpack_q8(data, rows, cols)
        return QuantCodes(qtype_name, q8.codes, q8.scale, None, Q8_GROUP, 8)
    nb = cols // QK_K
    if qtype_name in ("Q4_K", "Q5_K"):
        size = 144 if qtype_name == "Q4_K" else 176
        blocks = data.reshape(rows, nb, size)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _k_scale_min(blocks[..., 4:16])
        d_g = (d[..., None] * sc.astype(np.float32)).reshape(rows, nb * 8)
        m_g = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, nb * 8)
        qs = blocks[..., size - 128:].reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        q = (qs & 0x0F).reshape(rows, nb, 8, 32)
        if qtype_name == "Q5_K":
            qh = blocks[..., 16:48].reshape(rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = (q | ((qh & 0x01) << 4)).astype(np.int8)
        codes = np.ascontiguousarray(q.reshape(rows, cols))
        k_scales = KScales(t(blocks[..., 0:2].copy().view(np.float16)[..., 0]), t(sc.astype(np.int8).reshape(rows, nb * 8)),
                           t(blocks[..., 2:4].copy().view(np.float16)[..., 0]), t(mn.astype(np.int8).reshape(rows, nb * 8)))
        return QuantCodes(qtype_name, t(codes), t(d_g), t(m_g), 32, 4 if qtype_name == "Q4_K" else 8, k_scales)
    if qtype_name == "Q6_K":
        blocks = data.reshape(rows, nb, 210)
        ql = blocks[..., 0:128].reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        ql = (ql & 0x0F).reshape(rows, nb, 8, 32)
        qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        qh = (qh & 0x03).reshape(rows, nb, 8, 32)
        q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
        sc = blocks[..., 192:208].copy().view(np.int8)
        d_g = (_f16(blocks[..., 208:210])[..., None] * sc.astype(np.float32)).reshape(rows, nb * 16)
        k_scales = KScales(t(blocks[..., 208:210].copy().view(np.float16)[..., 0]), t(sc.reshape(rows, nb * 16)))
        return QuantCodes(qtype_name, t(np.ascontiguousarray(q.reshape(rows, cols))), t(d_g), None, 16, 8, k_scales)
    raise ValueError(f"no codes for {qtype_name} tensors (only {', '.join(CODED_TYPES)})")


class GGUFWeights(GGUFFile):
    """:class:`GGUFFile` plus its tensors as HF-named torch tensors, one at a time."""

    def iter_tensors(self, dtype: torch.dtype, progress: bool = True,
                     skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantized HF-named tensors in ``dtype``, one at a time; those whose HF name
        ``skip`` is true for are not read (the caller takes them on their codes)."""
        from tqdm import tqdm

        # The stacked expert tensor of one layer is unpacked once and sliced per expert.
        stacked_index, stacked = -1, None
        bar = tqdm(total=len(self._entries), desc="Loading weights", unit="tensor", disable=not progress)
        try:
            for entry in self._entries:
                if skip is not None and skip(entry.hf_name):
                    bar.update(1)
                    continue
                if entry.expert >= 0:
                    if stacked_index != entry.tensor_index:
                        stacked = self._dequantize(entry.tensor_index).to(dtype)
                        stacked_index = entry.tensor_index
                    tensor = stacked[entry.expert].clone()
                else:
                    stacked_index, stacked = -1, None
                    tensor = self._dequantize(entry.tensor_index, dtype)
                    if entry.permute_heads:
                        tensor = _reverse_rope_permute(tensor, entry.permute_heads)
                    tensor = tensor.to(dtype).contiguous()
                bar.update(1)
                yield entry.hf_name, tensor
        finally:
            bar.close()

    def uncoded_matrices(self, qtypes: tuple[str, ...] = CODED_TYPES) -> list[str]:
        """HF names of the matrices a step multiplies that the file does not store in one of
        ``qtypes`` (the CPU kernels' codes): experts, and 2-D tensors of other types (F16, Q5_0,
        IQ*...); the token embedding counts where it is also the head (no ``lm_head``), else it
        is a lookup. Empty: every product can run on the file's codes."""
        names = {entry.hf_name for entry in self._entries}
        tied = "lm_head.weight" not in names
        uncoded = []
        for entry in self._entries:
            tensor = self.reader.tensors[entry.tensor_index]
            if entry.hf_name == "model.embed_tokens.weight" and not tied:
                continue
            if entry.expert >= 0 or (len(tensor.shape) == 2 and tensor.tensor_type.name not in qtypes):
                uncoded.append(entry.hf_name)
        return uncoded

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

    def iter_quant_codes(self, qtypes: tuple[str, ...] = CODED_TYPES,
                         progress: bool = True) -> Iterator[tuple[str, QuantCodes]]:
        """``(hf_name, codes)`` for every 2-D tensor the file stores in one of ``qtypes``
        (experts excluded; :class:`QuantCodes`), in the same row order as ``iter_tensors``
        gives it, one at a time. Shows a "Reading quantized codes" progress bar on stderr
        unless ``progress`` is False (a 1B file's codes take seconds to unpack)."""
        from tqdm import tqdm

        coded = list(self._coded_tensors(qtypes))
        with tqdm(total=len(coded), desc="Reading quantized codes", unit="tensor", disable=not progress) as bar:
            for entry, tensor, rows, cols in coded:
                codes = unpack_codes(np.asarray(tensor.data), tensor.tensor_type.name, rows, cols)
                if entry.permute_heads:  # a permutation of whole rows: codes and every scale alike
                    codes = codes.rows(_reverse_rope_permute(torch.arange(rows), entry.permute_heads))
                bar.update(1)
                yield entry.hf_name, codes

    def _coded_tensors(self, qtypes: tuple[str, ...]) -> Iterator[tuple[Any, Any, int, int]]:
        """(entry, gguf tensor, rows, columns) of every 2-D non-expert tensor stored in one of
        ``qtypes``."""
        for entry in self._entries:
            tensor = self.reader.tensors[entry.tensor_index]
            if entry.expert >= 0 or tensor.tensor_type.name not in qtypes or len(tensor.shape) != 2:
                continue
            cols, rows = (int(d) for d in tensor.shape.tolist())  # ggml order: [in, out]
            yield entry, tensor, rows, cols

    def _dequantize(self, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor ``index`` in torch dimension order, in memory it owns: float32, or ``dtype``
        for a 2-D tensor in one of :data:`CODED_TYPES` (its codes' values, gguf's bit for bit,
        rounded once to ``dtype``)."""
        import gguf

        tensor = self.reader.tensors[index]
        qtype = tensor.tensor_type.name
        try:
            if qtype in CODED_TYPES and len(tensor.shape) == 2:
                cols, rows = (int(d) for d in tensor.shape.tolist())  # ggml order: [in, out]
                return _dequantize_rows(np.asarray(tensor.data), qtype, rows, cols, dtype)
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, IndexError) as exc:
            raise ModelLoadError(self.path, f"cannot dequantize tensor {tensor.name}: {exc}") from None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        # F32 data comes back as a view of the read-only file mapping; the caller may write to it.
        if not values.flags.writeable:
            values = values.copy()
        values = values.astype(np.float32, copy=False)
        return torch.from_numpy(values.reshape(shape))


#: weights dequantized at a time by :func:`_dequantize_rows`: its fp32 temporaries stay a few MB
#: (reused by the allocator) rather than several times a large embedding's size in fresh pages
#: (gguf's numpy dequantization of a 1B model's Q6_K embedding took ~10 s, most of it that)
DEQUANTIZE_ROW_WEIGHTS = 1 << 20


def _dequantize_rows(data: np.ndarray, qtype_name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A 2-D tensor's blocks in one of :data:`CODED_TYPES` -> ``[rows, cols]`` in ``dtype``,
    some rows at a time through :func:`unpack_codes` (gguf's values, bit for bit), the chunks
    side by side on the process's cores as :func:`unpack_codes`' own."""
    data = data.reshape(rows, -1)
    out = torch.empty(rows, cols, dtype=dtype)
    step = max(1, DEQUANTIZE_ROW_WEIGHTS // cols)

    def dequantize_chunk(row: int) -> None:  # its own rows of ``out``
        part = data[row: row + step]
        out[row: row + part.shape[0]] = unpack_codes(part, qtype_name, part.shape[0], cols).dequantize()

    run_chunks(dequantize_chunk, range(0, rows, step))
    return out


def _reverse_rope_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved rope pairs -> HF's half split)."""
    half = weight.shape[0] // n_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)
