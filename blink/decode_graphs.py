"""Decode steps replayed from CPU graphs (:mod:`blink.kernels.cpu.graph`): the CPU loop's
counterpart of the GPU tiers' per-bucket CUDA graphs.

A step whose every row decodes one token (most steps of a serving load) runs the same C
calls each time, only on other tokens, positions and KV blocks. Per bucket of token counts,
:class:`DecodeGraphs` records the forward and the head once, on inputs it keeps in buffers of
its own; each later step writes its inputs into those buffers (a few small copies) and
replays the calls. The Python between the calls (module calls, checks, allocations, ctypes
argument conversion) is gone: measured on SmolLM2-135M, 16 rows, one core, 36.4 ms eager
against 26.5 ms for the same calls replayed (docs/performance.md#decode-graphs).

A step of n rows runs the graph of the smallest bucket holding n; its extra rows are padding
(no context, their K/V written to the scratch block, their logits not returned). Every
kernel computes each row on its own, so the real rows get the eager step's bits, provided
the padded step takes the kernel paths the eager one would: each row count at which a kernel
changes path is a bucket edge (:data:`DECODE_BUCKETS`).

Where the forward is not replayable (a torch op between the C calls: no AMX or no AVX-512
here, another dtype, a model whose ops have no C kernel), the first recording says why in the
log and every step stays eager.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from blink.kernels.cpu import graph as cpu_graph
from blink.kernels.cpu.threads import kernel_threads
from blink.kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from blink.models.decoder import DecoderForCausalLM

log = logging.getLogger("blink.executor")

#: Token counts a decode graph is recorded for. The kernels change path at 16 rows (the 8-bit
#: head's few-rows limit) and 32 (the 4-bit projections' and the Q8 head's), so both are edges:
#: a padded step never crosses one. Larger decode steps stay eager.
DECODE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)


def progress_only(on_layer: Callable[[], None] | None) -> bool:
    """Whether a model's per-layer callback may be called once per replayed step instead of
    after each layer: it is unset or only reports progress (the engine's heartbeat, marked
    ``progress_only``). A callback that does per-layer work (the KV sender's) keeps steps eager."""
    return on_layer is None or getattr(on_layer, "progress_only", False)


class DecodeGraphs:
    """The decode graphs of one model and KV cache: recorded by :meth:`record` (the engine's
    start), or else at a bucket's first step."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 scratch_block: int, max_model_len: int) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.scratch_block = block_size, scratch_block
        self.table_width = -(-max_model_len // block_size)
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}  # (bucket, kernel threads) -> graph
        #: why steps stay eager (the recording that failed), None while graphs are in use
        self.off_reason: str | None = None
        #: the largest step a graph runs: below DECODE_BUCKETS[-1] where a larger bucket's
        #: recording failed after smaller ones worked (a kernel that takes few rows only, e.g.
        #: the AVX2 4-bit one's 8: larger steps run bf16 through torch, and stay eager)
        self.max_tokens = DECODE_BUCKETS[-1]

    def takes(self, input_ids: torch.Tensor, md: AttentionMetadata) -> bool:
        """Whether a graph runs this step: every row decodes one token (``max_query_len`` 1
        and as many rows as tokens: the CPU loop's compacted metadata), at most the largest
        bucket, and no per-layer callback needs calling."""
        tokens = input_ids.shape[0]
        return (self.off_reason is None and md.max_query_len == 1 and 0 < tokens <= self.max_tokens
                and md.seq_lens.shape[0] == tokens and md.block_tables.shape[1] <= self.table_width
                and progress_only(self.model.on_layer))

    def run(self, input_ids: torch.Tensor, md: AttentionMetadata,
            logits_indices: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits ``[len(logits_indices), vocab]`` of a step :meth:`takes`, its K/V written
        to the cache, as the eager forward returns them; None when the graph cannot be recorded
        (the caller runs the step eagerly, and so do all later steps)."""
        tokens = input_ids.shape[0]
        graph = self._graph(next(b for b in DECODE_BUCKETS if b >= tokens))
        if graph is None:
            return None
        logits = graph.replay(input_ids, md)
        if self.model.on_layer is not None:
            self.model.on_layer()  # progress (progress_only): once for the step's layers
        return logits.index_select(0, logits_indices).float()

    def record(self, max_rows: int) -> int:
        """Record now every bucket a step of at most ``max_rows`` rows can use (the engine's
        start, as the GPU loops capture theirs before serving), so no step pays for a
        recording. Returns how many graphs exist (0: steps stay eager, see ``off_reason``)."""
        for bucket in DECODE_BUCKETS:
            if self._graph(bucket) is None:
                return 0 if self.off_reason is not None else len(self.graphs)
            if bucket >= max_rows:
                break
        return len(self.graphs)

    @property
    def kept_bytes(self) -> int:
        """Bytes the recorded graphs keep (their buffers, activations and logits)."""
        return sum(g.graph.kept_bytes for g in self.graphs.values())

    def _graph(self, bucket: int) -> _DecodeGraph | None:
        """The bucket's graph for the current kernel thread count (one of the recorded
        arguments), recorded on first use; None once a recording has failed."""
        if self.off_reason is not None:
            return None
        key = (bucket, kernel_threads())
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = _DecodeGraph(self, bucket)
            except cpu_graph.GraphRecordingError as exc:
                smaller = [b for b, _ in self.graphs if b < bucket]
                if smaller:  # the smaller buckets replay; larger steps stay eager
                    self.max_tokens = max(smaller)
                    log.info("decode steps of more than %d rows run eagerly, not on CPU graphs: %s",
                             self.max_tokens, exc)
                else:
                    self.off_reason = str(exc)
                    log.info("decode steps run eagerly, not on CPU graphs: %s", exc)
                return None
            self.graphs[key] = graph
        return graph


class _DecodeGraph:
    """One bucket's graph and the buffers it reads its inputs from."""

    def __init__(self, graphs: DecodeGraphs, tokens: int) -> None:
        model, block_size = graphs.model, graphs.block_size
        self.embedding = model.model.embed_tokens.weight
        # padding tokens: position 0, K/V into the scratch block, rows with no context
        self.pad_slots = graphs.scratch_block * block_size + torch.arange(tokens) % block_size
        self.slot_mapping = self.pad_slots.clone()
        self.positions = torch.zeros(tokens, dtype=torch.int64)
        self.token_seq_idx = torch.arange(tokens)
        self.query_start_loc = torch.arange(tokens + 1, dtype=torch.int32)
        self.seq_lens = torch.ones(tokens, dtype=torch.int32)  # the recording: one key per row
        self.block_tables = torch.full((tokens, graphs.table_width), graphs.scratch_block, dtype=torch.int32)
        md = AttentionMetadata(slot_mapping=self.slot_mapping, positions=self.positions,
                               token_seq_idx=self.token_seq_idx, query_start_loc=self.query_start_loc,
                               seq_lens=self.seq_lens, block_tables=self.block_tables, max_query_len=1)
        with torch.inference_mode():
            self.embedded = model.embed(torch.zeros(tokens, dtype=torch.int64))  # any token: rewritten per step
            with cpu_graph.record() as graph:
                self.logits = model.compute_logits(model.run_layers(self.embedded, md, graphs.kv_caches))
        self.graph = graph
        self.seq_lens.zero_()

    def replay(self, input_ids: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Write the step's inputs (its first n tokens and rows; the rest padding) and replay:
        the bucket's bf16 logits, one row per token."""
        n = input_ids.shape[0]
        torch.index_select(self.embedding, 0, input_ids, out=self.embedded[:n])
        self.positions[:n].copy_(md.positions)
        self.positions[n:].zero_()
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:].copy_(self.pad_slots[n:])
        self.token_seq_idx[:n].copy_(md.token_seq_idx)
        self.query_start_loc[:n + 1].copy_(md.query_start_loc)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.seq_lens[n:].zero_()
        self.block_tables[:n, :md.block_tables.shape[1]].copy_(md.block_tables)
        self.graph.replay()
        return self.logits
