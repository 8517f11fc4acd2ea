"""The model executor: loaded weights, the paged KV cache, and one flattened-token forward.

The executor owns no scheduling state. A caller (the scheduler, a test, a benchmark) hands
it the step's tokens plus an :class:`~blink.kernels.attention_metadata.AttentionMetadata` that says
where each token sits in the paged cache, and gets fp32 logits for the rows it asks for.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from blink import huge_pages
from blink.model_config import ModelConfig
from blink.decode_graphs import DecodeGraphs
from blink.errors import ModelLoadError, UnsupportedModelError
from blink.kernels.attention_metadata import AttentionMetadata
from blink.models import DecoderForCausalLM, build_model, int4_linear, packed_linear

# Default KV-cache size when the caller gives no num_blocks: four full-length sequences,
# but at most this many bytes (K and V, all layers).
class ModelFilesLike(Protocol):
    """What the executor needs from :func:`blink.loader.open_model`'s result."""

    hf_config: dict[str, Any]
    source: Any

    def iter_tensors(self, dtype: torch.dtype) -> Any: ...


class ModelExecutor:
    """Runs the model over a flattened batch of new tokens against a paged KV cache.

    ``model`` is a name or path for :func:`blink.loader.open_model`, or an object already
    returned by it. ``dtype`` is the dtype of weights, activations and KV cache (bf16 by
    default: on CPU it prefills ~2x faster than fp32 and decodes at least as fast; fp32
    gives exact parity with transformers' fp32). The cache has ``num_blocks`` usable blocks
    of ``block_size`` tokens per layer plus one scratch block (index ``scratch_block``)
    that padding tokens write to (the engine sizes it: ``--kv-cache-memory`` /
    ``--kv-cache-tokens``, in one place, ``blink.engine.engine.Engine``).
    ``max_model_len`` defaults to the model's ``max_position_embeddings`` (capped at its
    sliding window, since windowed attention is not implemented: within the window it is
    plain causal attention). ``num_threads`` sets torch's intra-op threads only when given.
    ``pack_weights``: on a CPU with native bf16, store the bf16 projection weights packed
    for oneDNN (:mod:`blink.models.packed_linear`; ~2x faster linears at decode sizes);
    False keeps them plain, which a compiled step needs (it traces the weights).
    ``int4_decode``: with bf16 weights on CPU (``pack_weights``, packed or where oneDNN has no
    native bf16 plain) and a checkpoint that stores projections as codes (a GGUF file: Q4_0,
    Q4_1, Q8_0, K-quants), those projections run on the codes
    (:mod:`blink.models.int4_linear`; ~4x less memory traffic): every step with the AMX
    kernel or an int8 build of the kernel without AMX (AVX-512 VNNI, AVX2), and then no bf16
    copy is kept (packed or plain), decode-sized ones with its AVX-512 BF16 or AVX2 build or
    torch's int4 kernel;
    ``int4_projections`` says how many got an int4 copy, ``int4_kernels`` which kernel and up
    to how many rows. The same switch, with the AMX kernel, computes the logits from a head
    the file stores as Q8_0 (SmolLM2's tied embedding; ~2x less traffic than bf16):
    ``q8_head``.
    ``cpu_graphs``: on CPU, replay steps whose every row decodes one token from graphs of
    their C kernel calls (:mod:`blink.decode_graphs`; the same logits, without the Python
    between the calls); False runs every step eagerly.
    """

    def __init__(
        self,
        model: str | Path | ModelFilesLike,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        *,
        num_blocks: int,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        pack_weights: bool = True,
        int4_decode: bool = True,
        cpu_graphs: bool = True,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if isinstance(model, (str, Path)):
            from blink.loader import open_model

            model = open_model(model)
        self.files = model
        self.source = str(model.source)
        self.config = ModelConfig.from_hf(model.hf_config, self.source)
        self.dtype = dtype
        self.device = torch.device(device)
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_model_len = self._check_max_model_len(max_model_len)

        self.model: DecoderForCausalLM = build_model(
            self.config, dtype, self.device, max_positions=self.max_model_len
        )
        #: whether the projections run oneDNN on packed bf16 weights
        self.packed_weights = pack_weights and packed_linear.packing_available(dtype, self.device)
        #: (projections with an int4 copy for small steps, projections in all)
        self.int4_projections = (0, 0)
        #: whether the logits come from the head's own Q8_0 codes (AMX)
        self.q8_head = False
        # every coded format where the model has it (GGUF), else Q4_0/Q4_1 alone
        iter_q4 = getattr(model, "iter_quant_codes", None) or getattr(model, "iter_q4_codes", None)
        iter_q8 = getattr(model, "iter_q8_codes", None)
        # The copies on codes come first: a projection whose copy runs every step is then
        # neither dequantized nor copied into its bf16 weight, which packing drops unread (a
        # 1B Q4_K_M file: ~1 GB of bf16 writes and ~15 s of dequantizing saved). (Not only with
        # packed weights: an AVX2 CPU under --dtype bfloat16 has no oneDNN bf16, and its 4-bit
        # kernel then replaces plain bf16 GEMVs.)
        # On CPU the weights and the KV cache go to 2 MB pages: a decode step streams them
        # (blink.huge_pages: the kernels read them 1.1-1.5x as fast as from 4 KB pages); the
        # codes are packed straight into them.
        no_huge_pages = huge_pages.unavailable_reason() if self.device.type == "cpu" else "not on CPU"
        arena = huge_pages.HugePageArena() if no_huge_pages is None else None
        unread: set[str] = set()
        if pack_weights and int4_decode and int4_linear.available(dtype, self.device):
            if iter_q4 is not None:
                self.int4_projections = self.model.use_int4_weights(
                    iter_q4(), empty=None if arena is None else arena.empty)
                unread = self.model.unread_plain_weights()
            if iter_q8 is not None:  # (the AMX kernel only: use_q8_head checks)
                self.q8_head = self.model.use_q8_head(iter_q8())
        if unread:  # (a model with codes has open_model's iter_tensors, which can skip)
            params = dict(self.model.named_parameters())  # (once, not per tensor)
            tensors = model.iter_tensors(dtype, skip=lambda name: self.model.parameter_of(name, params) in unread)
        else:
            tensors = model.iter_tensors(dtype)
        # (a GGUF file's tensors are dequantized into memory of their own: taken, not copied)
        self.model.load_weights(tensors, self.source, unread=unread, adopt=getattr(model, "kind", None) == "gguf")
        #: {(kernel, max rows) of the int4 copies: how many projections}
        self.int4_kernels = self.model.int4_kernels()
        if self.packed_weights:
            self.model.use_packed_weights()
            _return_freed_memory()  # the plain bf16 weights packing replaced or dropped
        elif self.model.drop_unread_weights():  # no oneDNN bf16 (an AVX2 CPU), codes every step
            _return_freed_memory()
        # Plain bf16 weights, one-token steps: torch's own matrix-vector kernel reads them
        # ~1.7x faster than oneDNN does (reordering the weight every call); from two rows up
        # oneDNN wins. Packed weights beat both.
        self._bf16_cpu = self.device.type == "cpu" and dtype == torch.bfloat16 and not self.packed_weights
        if self.device.type == "cpu" and dtype == torch.float32:
            self.model.use_input_major_weights()

        cfg = self.config
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks  # the extra last block
        shape = (num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        if arena is not None:  # the rest of what a step streams
            self.model.place_weights(arena.place)
            _return_freed_memory()
        zeros = arena.zeros if arena is not None else (
            lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=self.device))
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (zeros(shape, dtype), zeros(shape, dtype)) for _ in range(cfg.num_hidden_layers)
        ]
        #: the weights' and KV cache's pages, for the start log
        self.pages = (f"weights and KV cache in 2 MB pages ({arena.placed_bytes / 2**20:.0f} MiB, "
                      f"transparent huge pages: {huge_pages.thp_mode()})" if arena is not None
                      else f"weights and KV cache in the allocator's pages ({no_huge_pages})")
        #: the decode steps' CPU graphs (None: every step eager)
        self.decode_graphs = (DecodeGraphs(self.model, self.kv_caches, block_size, self.scratch_block,
                                           self.max_model_len)
                              if cpu_graphs and self.device.type == "cpu" else None)
        #: the calling thread's torch intra-op threads for eager forwards, set by the engine's
        #: CPU loop (None: this executor leaves them alone). Where it is set, a step whose
        #: layers replay a CPU graph sets one thread, which the rest of the step keeps (the
        #: logits' copy, the sampler, the next schedule: small host ops). Their OpenMP team
        #: would otherwise spin after each op (libgomp's default active wait) on the cores
        #: the kernels' pool needs for the next replay (one-row decode steps 1.1-1.5x faster on
        #: 2 cores: docs/performance.md#replay-threads).
        self.eager_threads: int | None = None

    def _check_max_model_len(self, requested: int | None) -> int:
        cfg = self.config
        limit = cfg.max_position_embeddings
        if cfg.sliding_window is not None:
            limit = min(limit, cfg.sliding_window)
        if requested is None:
            return limit
        if requested <= 0:
            raise ValueError(f"max_model_len must be positive, got {requested}")
        if requested > cfg.max_position_embeddings:
            raise ModelLoadError(
                self.source,
                f"max_model_len {requested} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}",
            )
        if cfg.sliding_window is not None and requested > cfg.sliding_window:
            raise UnsupportedModelError(
                self.source,
                f"sliding-window attention is not implemented; max_model_len {requested} "
                f"must not exceed the model's window of {cfg.sliding_window} tokens",
            )
        return requested

    def execute(
        self,
        input_ids: torch.Tensor,
        md: AttentionMetadata,
        logits_indices: torch.Tensor,
        hidden_hook: Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], None] | None = None,
        fp32: bool = True,
    ) -> torch.Tensor:
        """Forward the step's tokens (writing their K/V into the cache) and return fp32
        logits ``[len(logits_indices), vocab]`` for the selected token rows.
        ``hidden_hook(hidden, compute_logits)``: called with every token's final hidden state
        and the head before the logits are taken (prompt logprobs,
        :mod:`blink.engine.prompt_logprobs`); such a step runs eagerly. ``fp32`` False: the
        logits in the model's dtype, and a replayed decode step's are the head's own output,
        valid until the next step (a greedy step's sampler reads them so: no fp32 copy). In
        inference mode (entered here unless the caller, the engine's loop, already is)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.execute(input_ids, md, logits_indices, hidden_hook, fp32)
        graphs = self.decode_graphs
        if graphs is not None and hidden_hook is None and graphs.takes(input_ids, md):
            self._torch_threads(1)
            logits = graphs.run(input_ids, md, logits_indices, fp32)
            if logits is not None:
                return logits
        self._torch_threads(self.eager_threads)
        single_row = input_ids.shape[0] == 1 and self._bf16_cpu
        with _onednn_disabled() if single_row else contextlib.nullcontext():
            hidden = self.model(input_ids, md, self.kv_caches)
            if hidden_hook is not None:
                hidden_hook(hidden, self.model.compute_logits)
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
            return logits.float() if fp32 else logits

    @torch.inference_mode()
    def fill_cache(self, input_ids: torch.Tensor, md: AttentionMetadata) -> None:
        """Forward the step's tokens only to write their K/V into the cache (no logits: a
        speculative draft model follows the target's steps this way, blink.engine.draft_model)."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.takes(input_ids, md):  # a graph computes its logits anyway
            self._torch_threads(1)
            if graphs.run(input_ids, md, torch.zeros(1, dtype=torch.int64)) is not None:
                return
        self._torch_threads(self.eager_threads)
        single_row = input_ids.shape[0] == 1 and self._bf16_cpu
        with _onednn_disabled() if single_row else contextlib.nullcontext():
            self.model(input_ids, md, self.kv_caches)

    def _torch_threads(self, threads: int | None) -> None:
        """This thread's torch intra-op threads for what follows, where :attr:`eager_threads`
        is set (else nothing changes)."""
        if self.eager_threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def _onednn_disabled() -> Iterator[None]:
    """Route CPU matmuls to torch's native kernels for the duration (a global flag)."""
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing).
    Loading makes a plain bf16 copy of every projection; packing frees them (and drops those
    that run on 4-bit codes), but glibc keeps freed multi-MB chunks of its heap mapped:
    measured 857 -> 688 MB RSS for SmolLM2-135M with the 4-bit copies."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass
