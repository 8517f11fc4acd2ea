"""Decode steps replayed from CPU graphs (:mod:`blink.kernels.cpu.graph`): the CPU loop's
counterpart of the GPU tiers' per-bucket CUDA graphs.

A step whose every row decodes one token (most steps of a serving load) runs the same C
calls each time, only on other tokens, positions and KV blocks. So does a speculative verify
step (:mod:`blink.engine.speculative`), whose drafting rows carry their last token and the
draft (up to K + 1 positions each): every C kernel reads the step's rows, positions and
causal limits from the metadata buffers, so the same graph of T tokens serves any split of
T tokens into rows (:attr:`DecodeGraphs.max_query_len`, raised by the speculative runner).
Per bucket of token counts, :class:`DecodeGraphs` records the forward and the head once, on
inputs it keeps in buffers of its own; each later step writes its inputs into those buffers
(one C call, ``blink_step_inputs``, made once per step shape) and replays the calls. The Python between the calls (module calls, checks, allocations, ctypes
argument conversion) is gone: measured on SmolLM2-135M, 16 rows, one core, 36.4 ms eager
against 26.5 ms for the same calls replayed (docs/performance.md#decode-graphs).

A step of n rows runs the graph of the smallest bucket holding n; its extra rows are padding
(no context, their K/V written to the scratch block, their logits not returned). Every
kernel computes each row on its own, so the real rows get the eager step's bits, provided
the padded step takes the kernel paths the eager one would: each row count at which a kernel
changes path is a bucket edge (:data:`DECODE_BUCKETS`).

A step of several positions per row replays only where the eager forward would take the
same kernels: its attention on the C kernel (the eager step's cost estimate, which may choose
SDPA for long contexts, is asked first), and its head on as many rows as the graph's, else the
head runs eagerly on the rows asked for (a verify step whose rows are not all sampled lanes).
Verify steps of more than 32 tokens (16 rows of K + 1 = 5) have buckets of their own
(:data:`VERIFY_BUCKETS`), recorded only for the speculative runner.

Where the forward is not replayable (a torch op between the C calls: no AMX or no AVX-512
here, another dtype, a model whose ops have no C kernel), the first recording says why in the
log and every step stays eager.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from blink.kernels.cpu import attention as cpu_attention, fused as cpu_fused, graph as cpu_graph
from blink.kernels.cpu.threads import kernel_threads
from blink.kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from blink.models.decoder import DecoderForCausalLM

log = logging.getLogger("blink.executor")

#: Token counts a decode graph is recorded for. The kernels change path at 16 rows (the 8-bit
#: head's few-rows limit) and 32 (the 4-bit projections' and the Q8 head's), so both are edges:
#: a padded step never crosses one. Larger decode steps stay eager.
DECODE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
#: Token counts above :data:`DECODE_BUCKETS` recorded for verify steps only (the speculative
#: runner, :meth:`DecodeGraphs.allow_rows_of`: up to rows x (K + 1) tokens, never more than a
#: step of ``max_num_seqs`` such rows; up to 16 rows of K = 4, where the eager attention's
#: cost estimate mostly picks SDPA anyway: larger steps stay eager). Their layers
#: replay where the projections take any row count on one kernel path (the 4-bit AMX kernel:
#: the eager bits, tests/test_decode_graphs.py at each bucket's widest padding); where a
#: kernel takes few rows only (the AVX-512 4-bit one's 32: bf16 through oneDNN above) the
#: recording fails and those steps stay eager. The head above 32 rows is oneDNN's (a torch
#: op): not recorded, it runs eagerly on the rows asked for.
VERIFY_BUCKETS = (40, 48, 64, 80)


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
        #: the token counts graphs are recorded for: DECODE_BUCKETS, then VERIFY_BUCKETS too
        #: once :meth:`allow_rows_of` allowed rows of several tokens
        self.buckets = DECODE_BUCKETS
        #: the largest step a graph runs: below buckets[-1] where a larger bucket's
        #: recording failed after smaller ones worked (a kernel that takes few rows only, e.g.
        #: the AVX2 4-bit one's 8: larger steps run bf16 through torch, and stay eager)
        self.max_tokens = DECODE_BUCKETS[-1]
        #: the most new tokens per row a replayed step may have: 1 (decode steps) unless the
        #: speculative runner raised it to K + 1 (verify steps: :meth:`allow_rows_of`)
        self.max_query_len = 1

    def allow_rows_of(self, positions: int) -> None:
        """Let steps whose rows carry up to ``positions`` new tokens replay too (the
        speculative runner: K + 1, a row's last token and its draft), on the same graphs (the
        row split is metadata the kernels read from the buffers) and on graphs of up to
        ``VERIFY_BUCKETS[-1]`` tokens (:meth:`record` records those a step of its ``max_rows``
        rows of ``positions`` tokens can reach). Call before recording."""
        if positions < 1:
            raise ValueError(f"positions must be at least 1, got {positions}")
        self.max_query_len = max(self.max_query_len, positions)
        if positions > 1 and self.buckets == DECODE_BUCKETS:
            self.buckets = DECODE_BUCKETS + VERIFY_BUCKETS
            if self.max_tokens == DECODE_BUCKETS[-1]:  # (lower: a smaller bucket's recording failed)
                self.max_tokens = VERIFY_BUCKETS[-1]

    def takes(self, input_ids: torch.Tensor, md: AttentionMetadata) -> bool:
        """Whether a graph runs this step (the CPU loop's compacted metadata: ``max_query_len``
        set, only rows with tokens): at most the largest bucket, rows of at most
        :attr:`max_query_len` new tokens, no per-layer callback to call, and for rows of
        several tokens the C attention kernel as the eager step's choice."""
        tokens, rows = input_ids.shape[0], md.seq_lens.shape[0]
        if not (self.off_reason is None and md.max_query_len is not None
                and 1 <= md.max_query_len <= self.max_query_len and 0 < tokens <= self.max_tokens
                and 0 < rows <= tokens and md.query_start_loc.shape[0] == rows + 1
                and md.block_tables.shape[1] <= self.table_width and progress_only(self.model.on_layer)):
            return False
        if md.max_query_len == 1:
            return rows == tokens  # decode steps: the C kernel always wins the estimate
        return self._eager_attention_is_native(md, tokens)

    def _eager_attention_is_native(self, md: AttentionMetadata, tokens: int) -> bool:
        """Whether the eager forward of this step takes the C attention kernel (the graphs'
        recording did): its cost estimate, asked with the same arguments, may prefer SDPA for
        rows of several tokens over long contexts, and SDPA's bits are not the kernel's."""
        k_cache = self.kv_caches[0][0]
        q_dtype = self.model.model.embed_tokens.weight.dtype  # the forward's dtype
        tile_min, tile_ns = cpu_attention.prompt_tiles(q_dtype, k_cache.dtype, k_cache.shape[-1])
        return cpu_attention.prefer_native(md, tokens, self.block_size, tile_min, tile_ns)

    def run(self, input_ids: torch.Tensor, md: AttentionMetadata,
            logits_indices: torch.Tensor, fp32: bool = True) -> torch.Tensor | None:
        """fp32 logits ``[len(logits_indices), vocab]`` of a step :meth:`takes`, its K/V written
        to the cache, as the eager forward returns them; None when the graph cannot be recorded
        (the caller runs the step eagerly, and so do all later steps). ``fp32`` False: a step
        whose every token's logits are asked for in order gets the head's own output instead,
        in the model's dtype, no copy (the graph's buffer: the next replay overwrites it).

        The head: replayed when the step asks for every token's logits (decode steps, verify
        steps whose every token is a lane) and the bucket has a head graph, else run eagerly
        on the rows asked for, as the eager forward does (its kernels pick their path by row
        count: a bucket's head on all its rows might take another path, and give other bits)."""
        tokens = input_ids.shape[0]
        graph = self._graph(next(b for b in self.buckets if b >= tokens))
        if graph is None:
            return None
        in_order = graph.replay_layers(input_ids, md, logits_indices)
        if self.model.on_layer is not None:
            self.model.on_layer()  # progress (progress_only): once for the step's layers
        if logits_indices.shape[0] == tokens and graph.head is not None:
            graph.head.replay()
            if in_order:
                # every token's logits in order (a decode step's): one copy, no gather
                logits = graph.logits if graph.logits.shape[0] == tokens else graph.logits[:tokens]
                return logits.to(torch.float32, copy=True) if fp32 else logits
            return graph.logits.index_select(0, logits_indices).float()
        return self.model.compute_logits(graph.hidden.index_select(0, logits_indices)).float()

    def record(self, max_rows: int) -> int:
        """Record now every bucket a step of at most ``max_rows`` rows (of at most
        :attr:`max_query_len` tokens each) can use (the engine's start, as the GPU loops
        capture theirs before serving), so no step pays for a recording. Returns how many
        graphs exist (0: steps stay eager, see ``off_reason``)."""
        most = max_rows * self.max_query_len
        for bucket in self.buckets:
            if self._graph(bucket) is None:
                return 0 if self.off_reason is not None else len(self.graphs)
            if bucket >= most:
                break
        return len(self.graphs)

    @property
    def kept_bytes(self) -> int:
        """Bytes the recorded graphs keep (their buffers, activations and logits)."""
        return sum(g.layers.kept_bytes + (g.head.kept_bytes if g.head is not None else 0)
                   for g in self.graphs.values())

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
                    log.info("steps of more than %d tokens run eagerly, not on CPU graphs: %s",
                             self.max_tokens, exc)
                else:
                    self.off_reason = str(exc)
                    log.info("decode steps run eagerly, not on CPU graphs: %s", exc)
                return None
            self.graphs[key] = graph
        return graph


class _StepInputs(NamedTuple):
    """Views of one bucket's input buffers for a step's shape (:meth:`_DecodeGraph.replay_layers`)."""

    embedded: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq_idx: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


class _DecodeGraph:
    """One bucket's graphs (the layers, then the head: a step may run its head eagerly on
    fewer rows, :meth:`DecodeGraphs.run`) and the buffers they read their inputs from."""

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
            with cpu_graph.record() as layers:
                self.hidden = model.run_layers(self.embedded, md, graphs.kv_caches)
            #: the head's graph; None above DECODE_BUCKETS (a verify bucket) where the head is
            #: not replayable (oneDNN above 32 rows): it runs eagerly
            self.head: cpu_graph.CpuGraph | None = None
            try:
                with cpu_graph.record() as head:
                    self.logits = model.compute_logits(self.hidden)
                self.head = head
            except cpu_graph.GraphRecordingError:
                if tokens <= DECODE_BUCKETS[-1]:
                    raise
        self.layers = layers
        self.seq_lens.zero_()
        self._inputs: dict[tuple[int, int, int], _StepInputs] = {}
        #: per step shape, the C call that writes the inputs (cpu_fused.StepInputs)
        self._writers: dict[tuple[int, int, int], cpu_fused.StepInputs] = {}
        self._arange = torch.arange(tokens)

    def replay_layers(self, input_ids: torch.Tensor, md: AttentionMetadata, logits_indices: torch.Tensor) -> bool:
        """Write the step's inputs (its n tokens and r <= n rows; the rest padding: tokens
        past n are rows of their own with no context) and replay the layers into
        :attr:`hidden` (then :attr:`head` replays into :attr:`logits`, one row per token).
        Returns whether ``logits_indices`` are 0 .. k - 1 (int64): a decode step's order."""
        n, r, width = input_ids.shape[0], md.seq_lens.shape[0], md.block_tables.shape[1]
        key = (n, r, width)
        writer = self._writers.get(key)
        if writer is None or not writer.serves(input_ids, md, logits_indices):
            writer = cpu_fused.StepInputs.make(self.embedding, input_ids, md, logits_indices, {
                "embedded": self.embedded, "positions": self.positions, "slot_mapping": self.slot_mapping,
                "pad_slots": self.pad_slots, "token_seq_idx": self.token_seq_idx,
                "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens, "block_tables": self.block_tables})
            if writer is not None:
                self._writers[key] = writer
        if writer is not None:
            in_order = writer.write()
        else:
            self._write_inputs(input_ids, md)
            k = logits_indices.shape[0]
            in_order = logits_indices.dtype == torch.int64 and torch.equal(logits_indices, self._arange[:k])
        self.layers.replay()
        return in_order

    def _write_inputs(self, input_ids: torch.Tensor, md: AttentionMetadata) -> None:
        """:meth:`replay_layers`' inputs with torch, where the C call does not take them."""
        n, r, width = input_ids.shape[0], md.seq_lens.shape[0], md.block_tables.shape[1]
        views = self._inputs.get((n, r, width))
        if views is None:
            views = self._inputs[(n, r, width)] = self._input_views(n, r, width)
        torch.index_select(self.embedding, 0, input_ids, out=views.embedded)
        views.positions.copy_(md.positions)
        views.slot_mapping.copy_(md.slot_mapping)
        views.token_seq_idx.copy_(md.token_seq_idx)
        views.query_start_loc.copy_(md.query_start_loc)
        views.seq_lens.copy_(md.seq_lens)
        views.block_tables.copy_(md.block_tables)
        if n < self.positions.shape[0]:  # padding tokens: position 0, K/V into the scratch block
            self.positions[n:].zero_()
            self.slot_mapping[n:].copy_(self.pad_slots[n:])
        if r < self.seq_lens.shape[0]:  # rows past r: no tokens (and no context)
            self.query_start_loc[r + 1:].fill_(n)
            self.seq_lens[r:].zero_()

    def _input_views(self, n: int, r: int, width: int) -> _StepInputs:
        """The buffers' parts a step of n tokens, r rows and block tables ``width`` wide
        writes: made once per shape (each slice is a torch call on the host's step)."""
        return _StepInputs(self.embedded[:n], self.positions[:n], self.slot_mapping[:n], self.token_seq_idx[:n],
                           self.query_start_loc[:r + 1], self.seq_lens[:r], self.block_tables[:r, :width])
