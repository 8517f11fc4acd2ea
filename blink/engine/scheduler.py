"""The device-resident scheduler: branch-free tensor code over fixed-shape state.

One step is ``batch = scheduler.schedule()``, the forward pass and sampler, then
``scheduler.update(batch, ...)``. Neither call loops over requests in Python, reads a tensor
value on the host, or branches on one (the tests compile both with
``torch.compile(fullgraph=True)``), so the same code runs on CPU tensors, on GPU tensors
and inside a captured CUDA graph. The only Python branches are on the static config.

Policy (vLLM V1's "no phases" model: a request is ``num_computed`` of ``num_tokens``):

- Cancellation: a slot whose ``cancel`` word is set finishes with FINISH_ABORT this step.
- Admission: up to ``max_admit_per_step`` WRITTEN slots, lowest arrival ticket first, as
  long as their prompts fit the step's copy window (``admit_window_tokens``, at least one
  max-length prompt, so the oldest always fits). The prompt is copied out of the circular
  arena by one flat gather over the window, the sampling fields out of the slot, the stream
  is reset, then the slot state becomes RUNNING. Empty prompts and prompts that leave no
  room for one output token finish with FINISH_ERROR instead.
- Prefix cache: newly admitted (and preempted) rows take the longest verified cached prefix
  of full blocks, never their last token (its logits are needed). Rows are looked up oldest
  first, as many as fit one flat window of ``lookup_window_blocks`` blocks per step.
- Budget: rows in FCFS order each ask for all their uncomputed tokens; a cumulative sum over
  the token budget gives each its share, the last one a partial chunk (chunked prefill mixed
  with decode). Rows whose output stream is full are skipped (backpressure, nothing lost).
- Blocks: let freed(k) = blocks referenced only by rows at FCFS positions >= k. The longest
  prefix of rows whose new blocks fit in free + freed(k) is served (the next row gets what
  is left); then the shortest newest-first suffix of rows whose blocks cover the deficit is
  preempted by recompute: blocks released, ``num_computed = 0``, back to WAITING, tokens
  kept. The oldest request can always progress (``num_blocks`` holds one max-length one).
- Finish (in ``update``): stop/EOS (EOS unless ``ignore_eos``, both only once ``min_tokens``
  outputs exist; the sampler gets them as ``suppress_ids`` before that), ``max_tokens``
  (<= 0 means no limit), or ``max_model_len``. The finishing token is written to the stream.
  A finished row publishes FINISHED at once and becomes RELEASING; the next ``schedule()``
  drops its block references in a flat window of ``release_window_blocks`` blocks (rows past
  the window wait a step), and only then can its slot's next request be admitted.

Work per step is proportional to what is pending, not to slots x max_model_len: every window
above is a fixed-shape flat gather/scatter over tokens or blocks (the shapes stay fixed, so a
GPU graph keeps one shape), and the few O(slots x blocks-per-sequence) passes (preemption's
"what would preempting free" scan) run only when a stage needs them. Each stage has a
predicate that says whether it can change anything this step; with ``host_guards`` (the CPU loop, where reading a tensor is a plain memory read) a stage whose
predicate is false is skipped. Skipping is exact: a stage with nothing to do is an identity.
Captured graphs run every stage (``host_guards=False``); a device loop can gate the same
predicates with conditional graph nodes instead (docs/architecture.md, "Work per step").

Row window: with ``host_guards`` a step works on rows [0, R) only, R the smallest of 16, 64,
256, ... (then S) that holds every row in use (not EMPTY) and every slot the frontend has
written. Rows past R are EMPTY with nothing to admit, so every stage is an identity there and
leaving them out is exact; the frontend hands out the lowest free slot first, so R follows
the live requests, not the slot count (an almost idle engine costs the same at 64 slots as
at 4096). Captured graphs run the whole table (R = S); a device loop can pick a graph per
window size from the same on-device maximum, as it picks one per token bucket.

Ring writes keep the protocol's order: stream payload before ``produced``, finish reason
before the state word, with a system-scope fence between each payload and its word
(``blink.kernels.system_fence``: consecutive kernels of a graph are ordered only for the
GPU itself, not for a CPU or NIC reading the mapped ring over PCIe). The ``state`` word is the one word both sides write, so it is only
ever written lane by lane with ``index_put_`` (lanes with nothing to publish go to the
control block's scratch word), never rewritten wholesale with a masked select.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from blink.engine import prefix_cache
from blink.engine.token_mask import MaskBatch, mask_batch
from blink.engine.sampler import SamplingTensors, row_features
from blink.shared.sampling_fields import SAMPLER_FIELDS
from blink.engine.state import (
    C_ENGINE_SCRATCH,
    INT64_MAX,
    ROW_RELEASING,
    K_GENERATED_TOKENS,
    K_PREEMPTIONS,
    K_PREFIX_HITS,
    K_PREFIX_QUERIES,
    K_PREFIX_REJECTS,
    K_PROMPT_TOKENS,
    K_STEPS,
    ROW_AWAITING_KV,
    ROW_EMPTY,
    ROW_RUNNING,
    ROW_WAITING,
    SAMPLING_FIELDS,
    EngineState,
    SchedulerConfig,
    bucket_for,
    geometric_buckets,
)
from blink.errors import BlinkError
from blink.kernels.reference.layers import AttentionMetadata
from blink.kernels.system_fence import system_fence_for
from blink.ring import (
    CANCEL_FORCE,
    KV_RESERVE,
    C_STAT_GENERATED_TOKENS,
    C_STAT_KV_BLOCKS_TOTAL,
    C_STAT_KV_BLOCKS_USED,
    C_STAT_PREEMPTIONS,
    C_STAT_PREFIX_HITS,
    C_STAT_PREFIX_QUERIES,
    C_STAT_PROMPT_TOKENS,
    C_STAT_RUNNING,
    C_STAT_STEPS,
    C_STAT_WAITING,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    SLOT_FINISHED,
    SLOT_RUNNING,
    SLOT_WRITTEN,
    RingLayout,
    config_of_control,
)

#: the stages ``Scheduler(fused=...)`` can run as fused Triton kernels (kernels/triton/sched.py)
FUSED_STAGES = ("build_batch", "release", "stats", "allocate", "publish", "register", "lookup", "admit", "cancel")

_STAT_WORDS = (
    C_STAT_RUNNING, C_STAT_WAITING, C_STAT_KV_BLOCKS_USED, C_STAT_KV_BLOCKS_TOTAL,
    C_STAT_PREFIX_QUERIES, C_STAT_PREFIX_HITS, C_STAT_PREEMPTIONS, C_STAT_STEPS,
    C_STAT_PROMPT_TOKENS, C_STAT_GENERATED_TOKENS,
)


@dataclass
class StepBatch:
    """One step's work, all fixed-shape tensors. T = the token budget, S = rows.

    input_ids            int64 [T]  token of each scheduled position; 0 for padding
    attn                 AttentionMetadata over the S rows (padding tokens: row 0,
                         position 0, slot in the scratch block; seq_lens 0 = row idle)
    num_scheduled_tokens int64 0-d  real tokens (<= T); the host slices to its bucket
    bucket_index         int64 0-d  index in ``config.buckets`` of the smallest bucket
                                    holding the step (for a device-side graph switch)
    num_new_tokens       int64 [S]  tokens each row computes this step
    sample_rows          int64 [S]  rows that produce a token, compacted first, -1 padded
    num_sample_rows      int64 0-d  (<= num_scheduled_tokens, so a bucket's rows suffice)
    logits_indices       int64 [S]  flat index of each sample row's last token; 0 padded

    The sampler's per-row inputs are gathered for the rows a bucket samples only
    (:meth:`Scheduler.sampler_inputs`), not for all S.
    """

    input_ids: torch.Tensor
    attn: AttentionMetadata
    num_scheduled_tokens: torch.Tensor
    bucket_index: torch.Tensor
    num_new_tokens: torch.Tensor
    sample_rows: torch.Tensor
    num_sample_rows: torch.Tensor
    logits_indices: torch.Tensor


class SamplerInputs(NamedTuple):
    """The sampler's inputs for the first R sample rows of a batch (padding lanes: row 0's).

    sampling      SamplingTensors [R]
    prompt_lens   int64 [R]
    total_lens    int64 [R]  tokens so far per sample row; also the RNG counter
    suppress_ids  int32 [R, max_stop_ids + n_eos]  ids banned while the row has fewer than
                  min_tokens outputs (-1 padded)
    features      int32 [R]  the rows' sampler feature words (``SamplerPlan.from_features``)
    """

    sampling: SamplingTensors
    prompt_lens: torch.Tensor
    total_lens: torch.Tensor
    suppress_ids: torch.Tensor
    features: torch.Tensor


class RowWindow(NamedTuple):
    """The rows a step works on, [0, size) (module docstring, "Row window"): the state's and
    the ring's per-row fields viewed for them, and their indices."""

    size: int
    state: EngineState
    ring: dict[str, torch.Tensor]
    rows: torch.Tensor  # arange(size)


def _ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return (x + d - 1) // d


class Scheduler:
    """Admission, batching, paged-KV allocation, prefix caching and output publishing over
    the ring, as tensor code. See the module docstring for the policy.

    ``ring_tensors``: torch views of the ring fields by name plus ``"region"`` (the whole
    ring as uint8, aliasing the fields); :func:`blink.engine.state.ring_tensors` builds it on
    CPU. ``device``: where the engine state lives (the ring views must be usable from it).
    ``host_guards``: skip stages that have nothing to do (default: on CPU; see the module
    docstring).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        ring_tensors: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        host_guards: bool | None = None,
        fused: bool | tuple[str, ...] = False,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        #: skip stages with nothing to do by reading their predicate on the host (module
        #: docstring); default: on CPU. Captured graphs need False (every stage runs).
        self.host_guards = self.device.type == "cpu" if host_guards is None else host_guards
        self.ring = ring_tensors
        # the sizes, read once from the control block (a host read at startup only)
        self.ring_config = ring_cfg = config_of_control(ring_tensors["control"].cpu())
        if config.max_model_len > ring_cfg.max_model_len:
            raise BlinkError(
                f"scheduler max_model_len ({config.max_model_len}) exceeds the ring's "
                f"({ring_cfg.max_model_len})"
            )
        self.num_slots = S = ring_cfg.n_slots
        self.stream_capacity = ring_cfg.stream_capacity
        self.num_top = max(ring_cfg.max_logprobs, 1)
        self.state = EngineState.allocate(config, ring_cfg, self.device)

        # The slot state words, addressed through one int32 view of the whole region so that
        # lanes with nothing to publish can write a scratch word instead (see _publish_state).
        layout = RingLayout(ring_cfg)
        region = ring_tensors["region"]
        state_offset = layout.fields["state"].offset
        if ring_tensors["state"].data_ptr() != region.data_ptr() + state_offset:
            raise BlinkError("ring_tensors['region'] does not alias ring_tensors['state']")
        self._words = region[: layout.total_bytes].view(torch.int32)
        self._state_word0 = state_offset // 4
        self._scratch_word = (layout.fields["control"].offset + 8 * C_ENGINE_SCRATCH) // 4

        M, B = config.max_blocks_per_seq, config.block_size
        dev = self.device
        self._all_rows = torch.arange(S, device=dev)
        # Row windows (module docstring): with host guards, powers of four from 16 (the
        # compiled CPU step's sample-row buckets are powers of four too, so a bucket of a
        # window's rows never outgrows the window), then S; graphs run the whole table.
        self._slot_fields = frozenset(layout.slot_fields)
        self._window_sizes = geometric_buckets(16, 4, S)
        self._windows: dict[int, RowWindow] = {}
        self._w = self._window(S)
        self._cols = torch.arange(M, device=dev)
        self._tok = torch.arange(config.max_num_batched_tokens, device=dev)
        # The flat windows' lane indices (module docstring).
        self._admit_cols = torch.arange(config.admit_window_tokens, device=dev)
        self._lookup_cols = torch.arange(config.lookup_window_blocks, device=dev)
        self._alloc_cols = torch.arange(config.alloc_window_blocks(S), device=dev)
        self._release_cols = torch.arange(config.release_window(S), device=dev)
        # Disaggregation (docs/disaggregation.md): the ring has kv fields of width M.
        self.kv_enabled = ring_cfg.max_kv_blocks > 0
        if self.kv_enabled and ring_cfg.max_kv_blocks != M:
            raise BlinkError(f"ring max_kv_blocks ({ring_cfg.max_kv_blocks}) must be the "
                             f"scheduler's blocks per sequence ({M})")
        self._reserve_cols = torch.arange(M, device=dev)  # a reservation's block window
        self._table_sink = S * M  # block_table_flat's write sink
        eos = list(config.eos_token_ids) or [-1]
        self._eos = torch.tensor(eos, dtype=torch.int64, device=dev)
        self._buckets = torch.tensor(config.buckets, dtype=torch.int64, device=dev)
        self._stat_words = torch.tensor(_STAT_WORDS, dtype=torch.int64, device=dev)
        self._hash = prefix_cache.hash_constants(M * B, dev)
        # Between a ring payload and the word that publishes it (module docstring).
        self._fence = system_fence_for(dev, region)
        #: the fused Triton stages (``blink.kernels.triton.sched``, issue 32) in place of this
        #: tensor code for the stages they implement (see :meth:`use_fused`).
        self.fused: frozenset[str] = frozenset()
        self.use_fused(fused)

    def use_fused(self, fused: bool | tuple[str, ...] = True) -> None:
        """Run the stages in ``fused`` (True: every stage in FUSED_STAGES; or some names) as
        the fused Triton kernels of ``blink.kernels.triton.sched``; on CPU tensors under
        TRITON_INTERPRET=1. They work on the whole slot table (no row window). Called before
        the first step (the GPU tiers call it before they capture)."""
        S, dev, config = self.num_slots, self.device, self.config
        stages = FUSED_STAGES if fused is True else tuple(fused or ())
        if set(stages) - set(FUSED_STAGES):
            raise BlinkError(f"unknown fused stage(s) {sorted(set(stages) - set(FUSED_STAGES))}; "
                             f"known: {', '.join(FUSED_STAGES)}")
        self.fused = frozenset(stages)
        if self.fused:
            from blink.kernels.triton import (  # noqa: PLC0415 - Triton only when asked for
                sched as triton_sched,
            )

            self._triton = triton_sched
            self._batch_out = triton_sched.BatchBuffers(S, config.max_num_batched_tokens, dev)
            self._scratch = torch.zeros(S, dtype=torch.int64, device=dev)
            self._alloc_scratch = triton_sched.AllocScratch(S, config.num_blocks, dev)
            self._alloc_consts = dict(K_PREEMPTIONS=K_PREEMPTIONS, ROW_WAITING=ROW_WAITING,
                                      ROW_RUNNING=ROW_RUNNING, ROW_RELEASING=ROW_RELEASING,
                                      ROW_AWAITING_KV=ROW_AWAITING_KV)
            self._done = torch.zeros(S, dtype=torch.int64, device=dev)
            self._register_scratch = triton_sched.RegisterScratch(config.max_num_batched_tokens, dev)
            self._lookup_scratch = triton_sched.LookupScratch(S, config.lookup_window_blocks, dev)
            self._lookup_consts = dict(K_QUERIES=K_PREFIX_QUERIES, K_HITS=K_PREFIX_HITS, K_REJECTS=K_PREFIX_REJECTS)
            self._admit_scratch = triton_sched.AdmitScratch(S, dev)
            self._cancel_values = torch.zeros(S, dtype=torch.int64, device=dev)
            self._cancel_consts = dict(ROW_WAITING=ROW_WAITING, ROW_RUNNING=ROW_RUNNING, ROW_RELEASING=ROW_RELEASING,
                                       FINISH_ABORT=FINISH_ABORT, SLOT_FINISHED=SLOT_FINISHED)
            self._admit_consts = dict(
                K_PROMPT=K_PROMPT_TOKENS, K_STEPS=K_STEPS, SLOT_WRITTEN=SLOT_WRITTEN, SLOT_RUNNING=SLOT_RUNNING,
                SLOT_FINISHED=SLOT_FINISHED, ROW_EMPTY=ROW_EMPTY, ROW_WAITING=ROW_WAITING,
                FINISH_ABORT=FINISH_ABORT, FINISH_ERROR=FINISH_ERROR, FINISH_NONE=FINISH_NONE)
            self._publish_consts = {
                "finish": dict(K_GENERATED=K_GENERATED_TOKENS, FINISH_STOP=FINISH_STOP,
                               FINISH_LENGTH=FINISH_LENGTH, FINISH_ERROR=FINISH_ERROR),
                "state": dict(SLOT_FINISHED=SLOT_FINISHED, ROW_RELEASING=ROW_RELEASING)}
            self._stat_consts = dict(
                ROW_RUNNING=ROW_RUNNING, ROW_WAITING=ROW_WAITING, ROW_EMPTY=ROW_EMPTY,
                ROW_RELEASING=ROW_RELEASING, SLOT_WRITTEN=SLOT_WRITTEN, K_QUERIES=K_PREFIX_QUERIES,
                K_HITS=K_PREFIX_HITS, K_PREEMPTIONS=K_PREEMPTIONS, K_STEPS=K_STEPS,
                K_PROMPT=K_PROMPT_TOKENS, K_GENERATED=K_GENERATED_TOKENS)

    # ------------------------------------------------------------------------------ step

    def schedule(self) -> StepBatch:
        """Cancel, release, admit, look up prefixes, budget/allocate/preempt, build the batch."""
        cfg = self.config
        self.state.step += 1
        self.state.counters[K_STEPS] += 1
        # Acquire: the slot state words are read once, then a fence, then any payload.
        slot_state = self.ring["state"].clone()
        self._fence()
        w = self._w = self._window_for(slot_state)
        st, ring, slot_state = w.state, w.ring, slot_state[: w.size]
        cancel: torch.Tensor | None = None
        if {"cancel", "admit"} <= self.fused and not self.kv_enabled:  # (admit reads the words itself)
            if self._when(lambda: ((ring["cancel"] != 0) & self._active()).any()):
                self._triton.cancel(st, ring, self._cancel_values, self._cancel_consts)
                self._fence()
                self._triton.publish_words(self._cancel_values, self._words, self._state_word0)
        else:
            cancel = ring["cancel"] != 0
            cancelled = cancel & self._active()
            if self.kv_enabled:  # a row waiting for its KV is freed only by a forced cancel
                cancelled |= (ring["cancel"] == CANCEL_FORCE) & (st.status == ROW_AWAITING_KV)
            if self._when(lambda: cancelled.any()):
                self._finish(cancelled, FINISH_ABORT)
        if self._when(lambda: (st.status == ROW_RELEASING).any()):
            self._release_finished()
        if self._when(lambda: ((slot_state == SLOT_WRITTEN) & (st.status == ROW_EMPTY)).any()):
            self._admit(slot_state, cancel)
        if self.kv_enabled and self._when(lambda: self._kv_ready().any()):
            self._admit_kv_ready(cancel)
        if cfg.enable_prefix_caching and self._when(lambda: st.needs_lookup.any()):
            self._lookup()
        num_new = self._allocate()
        batch = self._build_batch(num_new)
        # Every step ends with fresh stats: update() writes them after a forward; a step
        # that schedules nothing (no update) writes them here.
        if self._when(lambda: batch.num_scheduled_tokens == 0):
            self._write_stats()
        return batch

    def update(
        self,
        batch: StepBatch,
        tokens: torch.Tensor,
        logprob: torch.Tensor,
        top_ids: torch.Tensor,
        top_logprobs: torch.Tensor,
        num_tokens: int | None = None,
    ) -> None:
        """Account the step's forward pass and publish the sampled tokens.

        ``tokens`` [>=num_sample_rows], ``logprob`` likewise, ``top_ids``/``top_logprobs``
        [.., N] (or [.., 0]: no row asked for alternatives, none are written): the sampler's
        outputs, aligned with ``batch.sample_rows``. ``num_tokens``:
        flat positions that can hold the step's tokens (its bucket, or the real count on the
        host; None: all T), so the per-token work is the bucket's, not the budget's."""
        w, cfg = self._w, self.config
        st = w.state
        if cfg.enable_prefix_caching and "register" in self.fused:
            self._triton.register(st, batch, self._tok.shape[0] if num_tokens is None else num_tokens, self._hash,
                                  self._register_scratch, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                                  hash_table_size=cfg.hash_table_size, probes=cfg.prefix_probes)
        elif cfg.enable_prefix_caching:
            md, n = batch.attn, num_tokens
            prefix_cache.register(
                st, cfg, batch.input_ids[:n], md.positions[:n], md.token_seq_idx[:n],
                md.slot_mapping[:n], md.query_start_loc, (self._tok < batch.num_scheduled_tokens)[:n],
                self._hash, self._stamp(self.config.max_blocks_per_seq), self._when,
            )
        st.num_computed += batch.num_new_tokens
        if "publish" in self.fused:  # the tokens and finishes below, in three launches
            self._triton.publish(self, batch, tokens, logprob, top_ids, top_logprobs, self._done,
                                 self._publish_consts)
            self._write_stats()
            return

        # Lane i carries the sampler's output for sample row batch.sample_rows[i]. Padding
        # lanes repeat the last live lane (row, value and all), so every duplicate write
        # below writes the same value: no sink needed, and the work is R lanes, not S rows.
        R = min(tokens.shape[0], w.size)  # a bucket's padding rows past the window sample nothing
        rows = batch.sample_rows[:R]
        n_live = (rows >= 0).sum()
        lane = torch.minimum(w.rows[:R], (n_live - 1).clamp(min=0))
        live = rows[lane] >= 0  # all False only when no row samples
        r = rows[lane].clamp(min=0)
        tok = tokens.long()[lane]

        # Token -1: a constrained row whose mask did not arrive at the sampling gate
        # (blink.engine.token_mask): nothing is published, the row finishes with an error.
        no_mask = live & (tok < 0)
        live = live & ~no_mask
        tok = tok.clamp(min=0)
        n_published = (live & (w.rows[:R] < n_live)).sum()  # padding lanes repeat a live one

        row_tokens = st.num_tokens[r]
        n_out_before = row_tokens - st.num_prompt[r]
        sink = st.tokens.shape[1] - 1
        st.tokens.index_put_((r, torch.where(live, row_tokens, sink)), tok.to(st.tokens.dtype))
        row_tokens = row_tokens + live.long()
        st.num_tokens.index_put_((r,), row_tokens)

        # Stream: payload first, then the produced counter.
        produced = w.ring["produced"]
        at = produced[r] % self.stream_capacity
        self._stream_write("tokens", r, at, tok, live)
        self._stream_write("logprob", r, at, logprob.float()[lane], live)
        width = top_ids.shape[1]
        if width:  # a shape, not a value: 0 when no row asked for alternatives (CPU plan)
            pad = max(0, self.num_top - width)
            top_i = F.pad(top_ids.long()[:, : self.num_top], (0, pad), value=-1)[lane]
            top_l = F.pad(top_logprobs.float()[:, : self.num_top], (0, pad), value=float("-inf"))[lane]
            self._stream_write("top_ids", r, at, top_i, live)
            self._stream_write("top_logprobs", r, at, top_l, live)
        self._fence()
        produced.index_put_((r,), produced[r] + live.long())
        st.counters[K_GENERATED_TOKENS] += n_published

        sp = st.sampling
        stop_token = (sp["stop_token_ids"][r] == tok.unsqueeze(1)).any(1) | (
            (self._eos == tok.unsqueeze(1)).any(1) & (sp["ignore_eos"][r] == 0)
        )
        stop = live & stop_token & (n_out_before >= sp["min_tokens"][r])
        max_tokens = sp["max_tokens"][r].long()
        length = live & (
            ((max_tokens > 0) & (n_out_before + 1 >= max_tokens)) | (row_tokens >= cfg.max_model_len)
        )
        done_lane = stop | length | no_mask
        if self._when(lambda: done_lane.any()):
            done = torch.zeros_like(w.rows, dtype=torch.bool).index_put_((r,), done_lane)
            reason = torch.full_like(w.rows, FINISH_LENGTH).index_put_(
                (r,), torch.where(no_mask, FINISH_ERROR, torch.where(stop, FINISH_STOP, FINISH_LENGTH)))
            self._finish(done, reason)
        self._write_stats()

    def sampler_inputs(self, batch: StepBatch, rows: int) -> SamplerInputs:
        """The sampler's inputs for the batch's first ``rows`` sample rows (a bucket's rows
        in a graph, the real count on the host)."""
        st = self.state
        r = self.sample_rows(batch, rows).clamp(min=0)
        sp = st.sampling
        sampling = SamplingTensors(**{f.name: sp[f.name][r] for f in SAMPLER_FIELDS})
        prompt_lens, total_lens = st.num_prompt[r], st.num_tokens[r]
        eos = torch.where(sp["ignore_eos"][r].unsqueeze(1) != 0, -1, self._eos.unsqueeze(0))
        suppress = torch.cat([sp["stop_token_ids"][r].long(), eos], 1)
        too_early = (total_lens - prompt_lens) < sp["min_tokens"][r]
        suppress_ids = torch.where(too_early.unsqueeze(1), suppress, -1).to(torch.int32)
        return SamplerInputs(sampling, prompt_lens, total_lens, suppress_ids, st.sampler_features[r])

    def token_masks(self, batch: StepBatch, rows: int, host_rows: bool = False) -> MaskBatch:
        """The structured-output masks of the first ``rows`` sample rows
        (:mod:`blink.engine.token_mask`); ``host_rows``: CPU loop only."""
        st = self.state
        return mask_batch(self.ring, st.sampling["constrained"], st.num_tokens, st.num_prompt,
                          self.sample_rows(batch, rows), self.config.mask_timeout_s, host_rows)

    def token_history(self, batch: StepBatch, rows: int | None = None) -> torch.Tensor:
        """int32 [rows, max_model_len]: prompt + output tokens of the first ``rows`` sample
        rows (all S when None), for the sampler's penalties; valid up to ``batch.total_lens``.
        Only a batch with a penalty needs it (the CPU loop skips it otherwise)."""
        r = batch.sample_rows if rows is None else self.sample_rows(batch, rows)
        return self.state.tokens[r.clamp(min=0), : self.config.max_model_len]

    def sample_rows(self, batch: StepBatch, rows: int) -> torch.Tensor:
        """``batch.sample_rows``' first ``rows`` lanes, -1 padded where a bucket of rows is
        wider than the step's row window."""
        lanes = batch.sample_rows[:rows]
        if lanes.shape[0] < rows:  # shapes only: no value is read
            lanes = F.pad(lanes, (0, rows - lanes.shape[0]), value=-1)
        return lanes

    def has_pending_release(self) -> bool:
        """Host check (CPU loop only): finished rows whose blocks are still being released,
        so an otherwise idle loop keeps stepping until the KV pool is whole again."""
        return bool((self.state.status == ROW_RELEASING).any())

    # ---------------------------------------------------------------------- schedule parts

    def _when(self, needed: "torch.Tensor | Callable[[], torch.Tensor]") -> bool:
        """Stage guard: with ``host_guards`` (CPU loop) whether the stage can change anything
        this step, read on the host; in captured graphs every stage runs (always True). A
        callable predicate is not even computed then: its ops would be graph nodes that
        decide nothing."""
        if not self.host_guards:
            return True
        return bool(needed() if callable(needed) else needed)

    def _window(self, size: int) -> RowWindow:
        """The window of rows [0, size), its views made once (they stay valid: the state
        and the ring are never reallocated)."""
        window = self._windows.get(size)
        if window is None:
            ring = {name: view[:size] if name in self._slot_fields else view
                    for name, view in self.ring.items()}
            window = RowWindow(size, self.state.window(size), ring, self._all_rows[:size])
            self._windows[size] = window
        return window

    def _window_for(self, slot_state: torch.Tensor) -> RowWindow:
        """This step's row window: the smallest size that holds every row in use and every
        slot the frontend has written (module docstring, "Row window"). A host read, CPU loop
        only; otherwise the whole table."""
        if not self.host_guards or self.fused:
            return self._window(self.num_slots)
        in_use = (self.state.status != ROW_EMPTY) | (slot_state == SLOT_WRITTEN)
        last = int(torch.where(in_use, self._all_rows, -1).max())
        return self._window(bucket_for(last + 1, self._window_sizes))

    def _active(self) -> torch.Tensor:
        """Rows holding a live request (WAITING or RUNNING)."""
        status = self._w.state.status
        return (status == ROW_WAITING) | (status == ROW_RUNNING)

    def _admit(self, slot_state: torch.Tensor, cancel: torch.Tensor | None) -> None:
        """Take up to ``max_admit_per_step`` WRITTEN slots into their rows, FCFS, as long as
        their prompts fit the copy window; abort cancelled WRITTEN slots and reject invalid
        prompts."""
        w, cfg = self._w, self.config
        st, ring = w.state, w.ring
        S, L, Wt = w.size, cfg.max_model_len, cfg.admit_window_tokens
        if "admit" in self.fused and not self.kv_enabled:  # (KV reservations: the torch code)
            admit = self._triton.admit(st, ring, slot_state, self._admit_scratch, K=min(cfg.max_admit_per_step, S),
                                       max_model_len=L, window=Wt, prefix_caching=cfg.enable_prefix_caching,
                                       consts=self._admit_consts)
            # The sampling fields: one where() each, written in place (no conversion where the
            # ring's dtype is the engine's).
            masks = {1: admit}
            for name, dtype in SAMPLING_FIELDS:
                dst, src = st.sampling[name], ring[name]
                if dst.dim() not in masks:
                    masks[dst.dim()] = admit.view(S, *([1] * (dst.dim() - 1)))
                torch.where(masks[dst.dim()], src if src.dtype == dtype else src.to(dtype), dst, out=dst)
            torch.where(admit, row_features(st.sampling), st.sampler_features, out=st.sampler_features)
            self._fence()
            self._triton.publish_words(self._admit_scratch.publish, self._words, self._state_word0)
            return
        written = (slot_state == SLOT_WRITTEN) & (st.status == ROW_EMPTY)
        aborted = written & cancel
        candidate = written & ~cancel
        K = min(cfg.max_admit_per_step, S)
        # Ascending arrival: the FCFS order of the candidates.
        _, idx = torch.topk(torch.where(candidate, ring["arrival"], INT64_MAX), K, largest=False)
        plen_k = ring["prompt_len"][idx].long()
        ok_k = candidate[idx]
        valid_k = ok_k & (plen_k >= 1) & (plen_k < L)
        if self.kv_enabled:
            # A reservation takes its blocks now: the oldest ones that fit the free pool (and
            # the reservation window) are picked, the others stay WRITTEN until blocks free up.
            reserve_k = ring["kv_mode"][idx] == KV_RESERVE
            blocks_k = torch.where(reserve_k & valid_k, _ceil_div(plen_k, cfg.block_size), 0)
            free_now = (st.block_ref[: cfg.num_blocks] == 0).sum()
            room = torch.clamp(free_now, max=self._reserve_cols.shape[0])
            ok_k = ok_k & (~reserve_k | (blocks_k.cumsum(0) <= room))
        # The oldest prompts whose tokens fit the window (a prefix: the sum only grows).
        take_k = torch.where(valid_k, plen_k, 0)
        ends_k = take_k.cumsum(0)
        picked_k = ok_k & (ends_k <= Wt)
        picked = torch.zeros_like(candidate).index_put_((idx,), picked_k)
        admit = torch.zeros_like(candidate).index_put_((idx,), picked_k & valid_k)
        rejected = picked & ~admit
        plen = ring["prompt_len"].long()

        # The prompts, out of the circular arena (a prompt may wrap around its end), in one
        # flat window: token t belongs to the k-th picked candidate.
        take_k = torch.where(picked_k, take_k, 0)
        ends_k = take_k.cumsum(0)
        t = self._admit_cols
        k = torch.searchsorted(ends_k, t, right=True).clamp(max=K - 1)
        col = t - (ends_k - take_k)[k]
        valid = t < ends_k[-1]
        arena = ring["arena"]
        A = arena.shape[0]
        row = idx[k]
        src = ring["prompt_offset"][row] % A + col
        src = torch.where(src >= A, src - A, src)  # L <= A: one wrap at most
        sink = st.tokens.shape[1] - 1
        st.tokens.index_put_((torch.where(valid, row, 0), torch.where(valid, col, sink)),
                             arena[src].to(st.tokens.dtype))

        for name, dtype in SAMPLING_FIELDS:
            dst = st.sampling[name]
            mask = admit.view(S, *([1] * (dst.dim() - 1)))
            dst.copy_(torch.where(mask, ring[name].to(dtype), dst))
        st.sampler_features.copy_(torch.where(admit, row_features(st.sampling), st.sampler_features))
        st.arrival.copy_(torch.where(admit, ring["arrival"], st.arrival))
        st.num_prompt.copy_(torch.where(admit, plen, st.num_prompt))
        st.num_tokens.copy_(torch.where(admit, plen, st.num_tokens))
        st.num_computed.masked_fill_(admit, 0)
        st.row_hash.masked_fill_(admit.unsqueeze(1), 0)
        st.status.masked_fill_(admit, ROW_WAITING)
        if cfg.enable_prefix_caching:
            st.needs_lookup |= admit
        st.counters[K_PROMPT_TOKENS] += (plen * admit).sum()
        if self.kv_enabled:
            self._admit_kv_fields(admit, plen)

        # Every slot leaving WRITTEN: stream reset and finish reason, then the state word.
        opened = admit | aborted | rejected
        reason = torch.where(aborted, FINISH_ABORT, torch.where(rejected, FINISH_ERROR, FINISH_NONE))
        self._ring_set(opened, "stream_seq", ring["seq"])
        self._ring_set(opened, "produced", 0)
        self._ring_set(opened, "finish_reason", reason)
        self._ring_set(opened, "num_prompt_tokens", plen)
        self._ring_set(opened, "num_cached_tokens", 0)
        self._ring_set(opened, "admitted_step", st.counters[K_STEPS])  # queue time (frontend)
        self._fence()
        self._publish_state(opened, torch.where(admit, SLOT_RUNNING, SLOT_FINISHED))

    def _admit_kv_fields(self, admit: torch.Tensor, plen: torch.Tensor) -> None:
        """Admission's disaggregation part: KV_RESERVE rows get their prompt's blocks now and
        publish the ids (before the state word that follows); every admitted row's KV route
        (KV_SEND: where its prompt's KV goes) is copied out of its request record."""
        st, ring, B = self._w.state, self._w.ring, self.config.block_size
        mode = ring["kv_mode"].long()
        reserve = admit & (mode == KV_RESERVE)
        need = torch.where(reserve, _ceil_div(plen, B), 0)
        if self._when(lambda: need.sum() > 0):
            self._assign_blocks(need, self._reserve_cols)
        st.status.masked_fill_(reserve, ROW_AWAITING_KV)
        st.needs_lookup &= ~reserve
        ids = torch.where(self._cols.unsqueeze(0) < need.unsqueeze(1), st.block_table, -1)
        self._ring_set(reserve.unsqueeze(1), "kv_reserved", ids)
        route = torch.stack([mode, ring["kv_peer"].long(), ring["kv_slot"].long(),
                             ring["kv_seq"]], 1)
        st.kv_route.copy_(torch.where(admit.unsqueeze(1), route, st.kv_route))
        st.kv_dest_blocks.copy_(torch.where(admit.unsqueeze(1), ring["kv_blocks"], st.kv_dest_blocks))

    def _kv_ready(self) -> torch.Tensor:
        """Rows waiting for their KV whose prefill engine has published it (its seq)."""
        st, ring = self._w.state, self._w.ring
        return (st.status == ROW_AWAITING_KV) & (ring["kv_ready_seq"] == ring["stream_seq"])

    def _admit_kv_ready(self, cancel: torch.Tensor) -> None:
        """KV ready: the row starts with computed = prompt_len and the prefill engine's first
        token appended, so its next step decodes. A row
        cancelled while it waited finishes with ABORT now."""
        w = self._w
        st = w.state
        ready = self._kv_ready()
        go = ready & ~cancel
        first = w.ring["kv_first_token"]
        sink = st.tokens.shape[1] - 1
        col = torch.where(go, st.num_prompt, sink)
        st.tokens.index_put_((w.rows, col), torch.where(go, first, st.tokens[w.rows, col]))
        st.num_tokens.copy_(torch.where(go, st.num_prompt + 1, st.num_tokens))
        st.num_computed.copy_(torch.where(go, st.num_prompt, st.num_computed))
        st.status.masked_fill_(go, ROW_WAITING)
        if self._when(lambda: (ready & cancel).any()):
            self._finish(ready & cancel, FINISH_ABORT)

    def _lookup(self) -> None:
        """Prefix-cache lookup for the oldest rows waiting for one, up to
        ``max_admit_per_step`` rows and ``lookup_window_blocks`` blocks."""
        w, cfg = self._w, self.config
        st = w.state
        K = min(cfg.max_admit_per_step, w.size)
        if "lookup" in self.fused:
            self._triton.lookup(st, w.ring["num_cached_tokens"], self._hash, self._lookup_scratch, K=K,
                                window=cfg.lookup_window_blocks, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                                hash_table_size=cfg.hash_table_size, probes=cfg.prefix_probes,
                                consts=self._lookup_consts)
            return
        _, rows = torch.topk(torch.where(st.needs_lookup, st.arrival, INT64_MAX), K, largest=False)
        waiting = st.needs_lookup[rows]
        # Blocks a row may hit: all its full blocks but never its last token.
        eligible = torch.where(waiting, (st.num_tokens[rows] - 1) // cfg.block_size, 0)
        ok = waiting & (eligible.cumsum(0) <= cfg.lookup_window_blocks)  # oldest first, a prefix
        n_hit, hit_hash, rejects = prefix_cache.lookup(
            st, cfg, rows, ok, eligible, self._lookup_cols, self._hash, self._stamp,
        )
        hit_tokens = n_hit * cfg.block_size
        st.num_blocks[rows] = torch.where(ok, n_hit, st.num_blocks[rows])
        st.num_computed[rows] = torch.where(ok, hit_tokens, st.num_computed[rows])
        st.row_hash[rows] = torch.where(ok.unsqueeze(1), hit_hash, st.row_hash[rows])
        st.needs_lookup[rows] = st.needs_lookup[rows] & ~ok

        num_tokens = st.num_tokens[rows]
        st.counters[K_PREFIX_QUERIES] += (num_tokens * ok).sum()
        st.counters[K_PREFIX_HITS] += hit_tokens.sum()
        st.counters[K_PREFIX_REJECTS] += rejects
        first_time = ok & (num_tokens == st.num_prompt[rows])  # not a recompute
        cached = w.ring["num_cached_tokens"]
        cached[rows] = torch.where(first_time, hit_tokens, cached[rows].long()).to(cached.dtype)

    def _allocate(self) -> torch.Tensor:
        """Token budget, block allocation and preemption. Returns the tokens per row this step."""
        w, cfg = self._w, self.config
        st = w.state
        N, B = cfg.num_blocks, cfg.block_size
        if "allocate" in self.fused:
            return self._triton.allocate(
                st, w.ring["produced"], w.ring["consumed"], self._alloc_scratch,
                budget=cfg.max_num_batched_tokens, capacity=self.stream_capacity,
                window=self._alloc_cols.shape[0], num_blocks=N, block_size=B,
                prefix_caching=cfg.enable_prefix_caching, consts=self._alloc_consts)
        active = self._active()
        room = (w.ring["produced"] - w.ring["consumed"]) < self.stream_capacity
        schedulable = active & ~st.needs_lookup & room
        want = torch.where(schedulable, st.num_tokens - st.num_computed, 0)

        # Position p in FCFS order (0 = oldest request); idle rows sort last.
        order = torch.argsort(torch.where(active, st.arrival, INT64_MAX), stable=True)
        # Releasing rows count as holding nothing here: they get no blocks, are never
        # preempted, and their blocks come back through _release_finished alone.
        nc = torch.where(active, st.num_computed, 0)[order]
        held = torch.where(active, st.num_blocks, 0)[order]
        asked = want[order]

        # Token budget: each position gets what is left after the older ones.
        grant = torch.minimum((cfg.max_num_batched_tokens - (asked.cumsum(0) - asked)).clamp(min=0), asked)
        need = (_ceil_div(nc + grant, B) - held).clamp(min=0)
        free_now = (st.block_ref[:N] == 0).sum()
        rank = torch.empty_like(order).scatter_(0, order, w.rows)  # row -> its position
        if self._when(lambda: need.sum() > free_now):  # the blocks do not fit: cut, then preempt
            grant, need = self._preempt(rank, grant, need, nc, held, free_now)
        num_new, need = grant[rank], need[rank]
        if self._when(lambda: need.sum() > 0):
            self._assign_blocks(need)
        st.status.masked_fill_(num_new > 0, ROW_RUNNING)
        return num_new

    def _preempt(
        self,
        rank: torch.Tensor,
        grant: torch.Tensor,
        need: torch.Tensor,
        nc: torch.Tensor,
        held: torch.Tensor,
        free_now: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's blocks do not fit the free pool: serve the longest FCFS prefix that
        fits if everything newer were preempted, and preempt the shortest newest-first
        suffix that covers the deficit. ``rank``: each row's FCFS position; the other
        arguments and the results are in FCFS order. The one pass over the whole block
        table; it runs only when the pool is short."""
        w, cfg = self._w, self.config
        st = w.state
        S, N, B = w.size, cfg.num_blocks, cfg.block_size

        # freed[k]: blocks referenced only by positions >= k (what preempting them frees).
        table = st.block_table.long()
        # A releasing row's blocks are freed by no preemption: position 0, which only
        # freed[0] counts, and no decision reads freed[0].
        # Rows waiting for their KV likewise (their blocks are being written remotely).
        owner = torch.where((st.status == ROW_RELEASING) | (st.status == ROW_AWAITING_KV), 0, rank)
        owner_pos = owner.unsqueeze(1).expand_as(table)
        first_user = torch.full((N + 1,), S, dtype=torch.int64, device=table.device)
        first_user.scatter_reduce_(0, table.flatten(), owner_pos.flatten(), "amin")
        per_pos = torch.zeros(S + 1, dtype=torch.int64, device=table.device)
        per_pos.scatter_add_(0, first_user[:N], torch.ones_like(first_user[:N]))
        freed = F.pad(per_pos[:S].flip(0).cumsum(0).flip(0), (0, 1))  # [S+1], freed[S] = 0

        # Serve the longest prefix of positions whose new blocks fit if everything newer
        # were preempted; the position at the cut gets a chunk of what is left, if any.
        need_before = F.pad(need.cumsum(0), (1, 0))  # [S+1]
        cut = (need_before <= free_now + freed)[1:].sum().view(1)  # 1-d: indexing stays on device
        left = free_now + freed[(cut + 1).clamp(max=S)] - need_before[cut]
        fits = ((held + left.clamp(min=0)) * B - nc).clamp(min=0)
        cut_grant = torch.where(left >= 0, torch.minimum(grant, fits), 0)
        p = w.rows
        grant = torch.where(p < cut, grant, torch.where(p == cut, cut_grant, 0))
        need = (_ceil_div(nc + grant, B) - held).clamp(min=0)

        # Preempt, newest first, the shortest suffix whose blocks cover the deficit.
        deficit = need.sum() - free_now
        first_preempted = (freed[1:] >= deficit).sum()
        preempt = ((p >= first_preempted) & (held > 0))[rank]

        self._release_rows(preempt)
        st.status.masked_fill_(preempt, ROW_WAITING)
        st.num_computed.masked_fill_(preempt, 0)
        st.row_hash.masked_fill_(preempt.unsqueeze(1), 0)
        if cfg.enable_prefix_caching:
            st.needs_lookup |= preempt
        st.counters[K_PREEMPTIONS] += preempt.sum()
        return grant, need

    def _assign_blocks(self, need: torch.Tensor, lanes: torch.Tensor | None = None) -> None:
        """Give each row ``need`` [S] new blocks at the end of its table: free ones,
        never-cached first, then cached ones least recently used. One flat window of
        ``alloc_window_blocks`` lanes (lane j: the j-th new block of the step), or ``lanes``
        (a KV reservation's window)."""
        w, cfg = self._w, self.config
        st = w.state
        N, M = cfg.num_blocks, cfg.max_blocks_per_seq
        free = st.block_ref[:N] == 0
        cached = st.block_slot[:N] >= 0
        order_key = torch.where(free, torch.where(cached, st.block_last_used[:N], -1), INT64_MAX)
        j = self._alloc_cols if lanes is None else lanes
        J = j.shape[0]
        _, free_list = torch.topk(order_key, J, largest=False)  # ascending: the LRU order

        ends = need.cumsum(0)
        row = torch.searchsorted(ends, j, right=True).clamp(max=w.size - 1)
        col = st.num_blocks[row] + j - (ends - need)[row]
        valid = j < ends[-1]
        blocks = torch.where(valid, free_list, N)
        st.block_table_flat.index_put_((torch.where(valid, row * M + col, self._table_sink),),
                                       blocks.to(st.block_table_flat.dtype))
        st.block_ref.index_add_(0, blocks, valid.to(st.block_ref.dtype))
        st.block_slot.index_put_((blocks,), torch.full_like(blocks, -1))  # evict from the cache
        st.block_gen.index_add_(0, blocks, valid.long())  # new content: children stale
        st.block_last_used.scatter_reduce_(0, blocks, torch.where(valid, self._stamp(col), 0), "amax")
        st.num_blocks += need

    def _build_batch(self, num_new: torch.Tensor) -> StepBatch:
        """Flatten the scheduled tokens (rows in index order) and gather the sampler inputs."""
        w, cfg = self._w, self.config
        st = w.state
        S, N, B = w.size, cfg.num_blocks, cfg.block_size
        if "build_batch" in self.fused:
            o = self._batch_out
            self._triton.build_batch(num_new, st.num_computed, st.num_tokens, st.tokens, st.block_table,
                                     self._buckets, o, N, B)
            attn = AttentionMetadata(slot_mapping=o.slot_mapping, positions=o.positions, token_seq_idx=o.seq_idx,
                                     query_start_loc=o.query_start_loc, seq_lens=o.seq_lens,
                                     block_tables=st.block_table)
            return StepBatch(input_ids=o.input_ids, attn=attn, num_scheduled_tokens=o.total,
                             bucket_index=o.bucket, num_new_tokens=num_new, sample_rows=o.sample_rows,
                             num_sample_rows=o.num_sample_rows, logits_indices=o.logits_indices)
        ends = num_new.cumsum(0)
        query_start_loc = F.pad(ends, (1, 0))
        total = ends[-1]
        t = self._tok
        valid = t < total
        row = torch.where(valid, torch.searchsorted(ends, t, right=True).clamp(max=S - 1), 0)
        pos = torch.where(valid, st.num_computed[row] + t - query_start_loc[row], 0)
        input_ids = torch.where(valid, st.tokens[row, pos].long(), 0)
        block = st.block_table[row, pos // B].long()
        slot_mapping = torch.where(valid, block * B + pos % B, N * B)
        seq_lens = torch.where(num_new > 0, st.num_computed + num_new, 0)

        # Rows whose last known token is computed this step produce the next one.
        sampled = (num_new > 0) & (st.num_computed + num_new == st.num_tokens)
        dest = torch.where(sampled, sampled.long().cumsum(0) - 1, S)
        sample_rows = torch.full((S + 1,), -1, dtype=torch.int64, device=t.device)
        sample_rows = sample_rows.scatter(0, dest, w.rows)[:S]
        r = sample_rows.clamp(min=0)
        logits_indices = torch.where(sample_rows >= 0, query_start_loc[r + 1] - 1, 0)

        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            positions=pos,
            token_seq_idx=row,
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=st.block_table,
        )
        return StepBatch(
            input_ids=input_ids,
            attn=attn,
            num_scheduled_tokens=total,
            bucket_index=torch.bucketize(total, self._buckets),
            num_new_tokens=num_new,
            sample_rows=sample_rows,
            num_sample_rows=sampled.sum(),
            logits_indices=logits_indices,
        )

    # ---------------------------------------------------------------------------- helpers

    def _stamp(self, j: torch.Tensor | int) -> torch.Tensor:
        """LRU stamp for block index ``j`` of a sequence at this step: later steps are newer;
        within a step deeper blocks are older, so a released sequence is evicted tail first
        (its shared beginning survives longest)."""
        M = self.config.max_blocks_per_seq
        return self.state.step * (M + 1) + (M - j)

    def _release_rows(self, mask: torch.Tensor) -> None:
        """Drop every block reference of the rows in ``mask`` at once (preemption: the blocks
        are reused this step); freed blocks stay cached. A pass over the whole table."""
        st, N = self._w.state, self.config.num_blocks
        table = st.block_table.long()
        drop = mask.unsqueeze(1) & (table < N)
        lanes = torch.where(drop, table, N).flatten()
        st.block_ref.index_add_(0, lanes, -drop.flatten().to(st.block_ref.dtype))
        stamp = torch.where(drop, self._stamp(self._cols).unsqueeze(0), 0).flatten()
        st.block_last_used.scatter_reduce_(0, lanes, stamp, "amax")
        st.block_table.masked_fill_(mask.unsqueeze(1), N)
        st.num_blocks.masked_fill_(mask, 0)

    def _release_finished(self) -> None:
        """Drop the block references of RELEASING rows, deepest block first, in one flat
        window of ``release_window_blocks`` lanes; rows left with no block become EMPTY.
        Freed blocks stay cached."""
        w, cfg = self._w, self.config
        st = w.state
        N, M = cfg.num_blocks, cfg.max_blocks_per_seq
        if "release" in self.fused:
            self._triton.release(st.status, st.num_blocks, st.num_prompt, st.num_tokens, st.num_computed,
                                 st.block_table_flat, st.block_ref, st.block_last_used, st.step, self._scratch,
                                 M, N, self._release_cols.shape[0], ROW_RELEASING, ROW_EMPTY)
            return
        releasing = st.status == ROW_RELEASING
        count = torch.where(releasing, st.num_blocks, 0)
        ends = count.cumsum(0)
        lane = self._release_cols
        row = torch.searchsorted(ends, lane, right=True).clamp(max=w.size - 1)
        col = (st.num_blocks[row] - 1 - (lane - (ends - count)[row])).clamp(min=0)
        valid = lane < ends[-1]
        at = torch.where(valid, row * M + col, self._table_sink)
        blocks = torch.where(valid, st.block_table_flat[at].long(), N)
        st.block_ref.index_add_(0, blocks, -valid.to(st.block_ref.dtype))
        st.block_last_used.scatter_reduce_(0, blocks, torch.where(valid, self._stamp(col), 0), "amax")
        st.block_table_flat.index_put_((at,), torch.full_like(at, N, dtype=st.block_table_flat.dtype))
        released = (ends.clamp(max=lane.shape[0]) - (ends - count)).clamp(min=0)
        st.num_blocks -= released
        emptied = releasing & (st.num_blocks == 0)
        st.status.masked_fill_(emptied, ROW_EMPTY)
        for counter in (st.num_prompt, st.num_tokens, st.num_computed):
            counter.masked_fill_(emptied, 0)

    def _finish(self, mask: torch.Tensor, reason: torch.Tensor | int) -> None:
        """Finish the rows in ``mask``: publish the reason, then the FINISHED state word; the
        rows become RELEASING (their blocks are dropped by the next ``schedule()``, which
        then empties them)."""
        st = self._w.state
        self._ring_set(mask, "finish_reason", reason)
        self._fence()
        self._publish_state(mask, SLOT_FINISHED)
        st.status.masked_fill_(mask, ROW_RELEASING)
        st.needs_lookup &= ~mask

    def _ring_set(self, mask: torch.Tensor, name: str, value: torch.Tensor | int) -> None:
        """``ring[name][mask] = value`` for an engine-owned per-slot field (the frontend
        never writes it, so rewriting the other lanes with their own value is harmless)."""
        field = self._w.ring[name]
        field.copy_(torch.where(mask, value, field))

    def _publish_state(self, mask: torch.Tensor, value: torch.Tensor | int) -> None:
        """Write slot state words of ``mask`` lanes only. The frontend writes the state words
        of FREE/FINISHED slots concurrently, so rewriting other lanes (even with the value
        just read) could undo its write; those lanes go to a scratch word instead."""
        lanes = torch.where(mask, self._state_word0 + self._w.rows, self._scratch_word)
        values = torch.where(mask, value, 0).to(torch.int32)
        self._words.index_put_((lanes,), values)

    def _stream_write(self, name: str, rows: torch.Tensor, at: torch.Tensor, value: torch.Tensor,
                      live: torch.Tensor) -> None:
        """Write ``value`` [R, ...] at stream position ``at`` [R] of ``rows`` [R] where
        ``live``; other lanes write back what is there (the field is the engine's own)."""
        field = self._w.ring[name]
        old = field[rows, at]
        new = value.to(field.dtype).view_as(old)
        keep = live.view(-1, *([1] * (old.dim() - 1)))
        field.index_put_((rows, at), torch.where(keep, new, old))

    def _write_stats(self) -> None:
        """Mirror the gauges and counters into the ring control block."""
        w, cfg = self._w, self.config
        st = w.state
        if "stats" in self.fused:
            self._triton.write_stats(st.status, w.ring["state"], st.block_ref, st.counters, self.ring["control"],
                                     self._stat_words, cfg.num_blocks, self._stat_consts)
            return
        unadmitted = ((w.ring["state"] == SLOT_WRITTEN)
                      & ((st.status == ROW_EMPTY) | (st.status == ROW_RELEASING))).sum()
        c = st.counters
        values = torch.stack([
            (st.status == ROW_RUNNING).sum(),
            (st.status == ROW_WAITING).sum() + unadmitted,
            (st.block_ref[: cfg.num_blocks] > 0).sum(),
            torch.full_like(c[0], cfg.num_blocks),
            c[K_PREFIX_QUERIES], c[K_PREFIX_HITS], c[K_PREEMPTIONS], c[K_STEPS],
            c[K_PROMPT_TOKENS], c[K_GENERATED_TOKENS],
        ])
        self.ring["control"][self._stat_words] = values
