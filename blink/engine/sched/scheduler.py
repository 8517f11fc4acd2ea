"""The device-resident scheduler: branch-free tensor code over fixed-shape state.

Read :mod:`blink.engine.sched.reference` first: the same policy as a short per-request
Python scheduler (the tests' oracle). This class runs it over all rows at once; each stage
is a mixin in its own file of this package:

- ``admission.py``   cancel, admit WRITTEN slots (FCFS, copy window)
- ``kv_reserve.py``  disaggregation: KV reservation at admission, KV-ready admission
- ``prefix.py``      prefix-cache lookup (schedule) and registration (update)
- ``budget.py``      token budget, block allocation, preemption, release of finished rows
- ``batch.py``       the flat ``StepBatch`` and the sampler's inputs
- ``publish.py``     the engine's side of the ring: streams, finishes, state words
- ``stats.py``       gauges and counters into the ring control block
- ``state.py``       ``EngineState`` (one request: ``state.row(i)``), ``SchedulerConfig``

One step is ``batch = scheduler.schedule()``, the forward pass and sampler, then
``scheduler.update(batch, ...)``. Neither call loops over requests in Python, reads a tensor
value on the host, or branches on one (the tests compile both with
``torch.compile(fullgraph=True)``), so the same code runs on CPU tensors, on GPU tensors
and inside a captured CUDA graph. The only Python branches are on the static config.

Policy (vLLM V1's "no phases" model: a request is ``num_computed`` of ``num_tokens``):
exactly :mod:`blink.engine.sched.reference`'s; each stage's file says its part.

Work per step is proportional to what is pending, not to slots x max_model_len: every stage's
window (the admission copy, the lookup, block assignment, release) is a fixed-shape flat gather/scatter over tokens or blocks (the shapes stay fixed, so a
GPU graph keeps one shape), and the few O(slots x blocks-per-sequence) passes (preemption's
"what would preempting free" scan) run only when a stage needs them. Each stage has a
predicate that says whether it can change anything this step; with ``host_guards`` (the CPU
loop, where reading a tensor is a plain memory read) a stage whose predicate is false is
skipped. Skipping is exact: a stage with nothing to do is an identity. Captured graphs run every stage (``host_guards=False``); a device loop can gate the same
predicates with conditional graph nodes instead (docs/architecture.md, "Work per step").

Row window: with ``host_guards`` a step works on rows [0, R) only, R the smallest of 16, 64,
256, ... (then S) that holds every row in use (not EMPTY) and every slot the frontend has
written. Rows past R are EMPTY with nothing to admit, so every stage is an identity there and
leaving them out is exact; the frontend hands out the lowest free slot first, so R follows
the live requests, not the slot count (an almost idle engine costs the same at 64 slots as
at 4096). Captured graphs run the whole table (R = S); a device loop can pick a graph per
window size from the same on-device maximum, as it picks one per token bucket.

Ring writes keep the protocol's order, with a system-scope fence between each payload and
the word that publishes it (publish.py).

The CPU loop (host guards) runs the stages of every step as C calls instead
(``blink.kernels.cpu.sched``, chosen in :meth:`Scheduler._c_stages`: the step's opening, the
FCFS budget and new blocks when they fit, the batch build, the prefix insert, publishing, the
stats, the sampler's inputs, the compacted metadata); this torch code is their reference.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from blink.engine import prefix_cache
from blink.engine.sampler import _FEATURES as SAMPLER_FEATURES  # the fused admit kernel's check
from blink.engine.sched.admission import Admission
from blink.engine.sched.batch import Batching, SamplerInputs, StepBatch
from blink.engine.sched.budget import Budget
from blink.engine.sched.kv_reserve import KvReservation
from blink.engine.sched.prefix import PrefixHookup
from blink.engine.sched.publish import Publish
from blink.engine.sched.state import (
    K_GENERATED_TOKENS,
    K_PREEMPTIONS,
    K_PREFIX_HITS,
    K_PREFIX_QUERIES,
    K_PREFIX_REJECTS,
    K_PROMPT_TOKENS,
    K_STEPS,
    ROW_AWAITING_KV,
    ROW_EMPTY,
    ROW_RELEASING,
    ROW_RUNNING,
    ROW_WAITING,
    EngineState,
    SchedulerConfig,
    bucket_for,
    geometric_buckets,
)
from blink.engine.sched.stats import STAT_WORDS, Stats
from blink.errors import BlinkError
from blink.kernels.batch_buffers import BatchBuffers
from blink.kernels.system_fence import system_fence_for
from blink.ring import (
    C_ENGINE_SCRATCH,
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

if TYPE_CHECKING:
    from blink.kernels.cpu.sched import CStages

__all__ = ["FUSED_STAGES", "RowWindow", "SamplerInputs", "Scheduler", "StepBatch"]

#: the stages ``Scheduler(fused=...)`` can run as fused Triton kernels (kernels/triton/sched.py)
FUSED_STAGES = ("build_batch", "release", "stats", "allocate", "publish", "register", "lookup", "admit", "cancel")


class RowWindow(NamedTuple):
    """The rows a step works on, [0, size) (module docstring, "Row window"): the state's and
    the ring's per-row fields viewed for them, and their indices."""

    size: int
    state: EngineState
    ring: dict[str, torch.Tensor]
    rows: torch.Tensor  # arange(size)


class Scheduler(Admission, KvReservation, PrefixHookup, Budget, Batching, Publish, Stats):
    """Admission, batching, paged-KV allocation, prefix caching and output publishing over
    the ring, as tensor code. See the module docstring for the policy.

    ``ring_tensors``: torch views of the ring fields by name plus ``"region"`` (the whole
    ring as uint8, aliasing the fields); :func:`blink.engine.sched.state.ring_tensors` builds it on
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
        c_stages: bool | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self._c: CStages | None = None  # set below, once the state exists
        # Skip stages with nothing to do (module docstring): on CPU by default; captured
        # graphs need False (every stage runs).
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
        self._state_words: dict[int, torch.Tensor] = {}  # per window size (_state_words_of)
        self._slot_state = ring_tensors["state"].clone()  # the step's snapshot of the slot states (schedule)
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
        self._prompt_logprobs_words = None  # numpy view of the state's column (wants_prompt_logprobs)
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
        self._stat_words = torch.tensor(STAT_WORDS, dtype=torch.int64, device=dev)
        self._hash = prefix_cache.hash_constants(M * B, dev)
        # Between a ring payload and the word that publishes it (module docstring).
        self._fence = system_fence_for(dev, region)
        #: the fused Triton stages (``blink.kernels.triton.sched``, issue 32) in place of this
        #: tensor code for the stages they implement (see :meth:`use_fused`).
        self.fused: frozenset[str] = frozenset()
        self.use_fused(fused)
        #: the CPU loop's C stages (blink.kernels.cpu.sched) for the stages run every step:
        #: with host guards, no fused stage and the library built (``c_stages``: None = so,
        #: False = never, True = required)
        self._c = self._c_stages(c_stages)

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
            self._c = None  # the fused stages replace the C ones
            from blink.kernels.triton import (  # noqa: PLC0415 - Triton only when asked for
                sched as triton_sched,
            )

            self._triton = triton_sched
            self._batch_out = BatchBuffers(S, config.max_num_batched_tokens, dev)
            self._scratch = torch.zeros(S, dtype=torch.int64, device=dev)
            self._alloc_scratch = triton_sched.AllocScratch(S, config.num_blocks, dev)
            priority = config.scheduling_policy == "priority"  # (priority, arrival) queue order
            self._alloc_consts = dict(K_PREEMPTIONS=K_PREEMPTIONS, ROW_WAITING=ROW_WAITING, PRIORITY=priority,
                                      OTHER_PREFILL=config.priority_other_prefill_tokens,
                                      URGENT_WINDOW=config.priority_urgent_window_steps,
                                      ROW_RUNNING=ROW_RUNNING, ROW_RELEASING=ROW_RELEASING,
                                      ROW_AWAITING_KV=ROW_AWAITING_KV)
            self._done = torch.zeros(S, dtype=torch.int64, device=dev)
            self._register_scratch = triton_sched.RegisterScratch(config.max_num_batched_tokens, dev)
            self._lookup_scratch = triton_sched.LookupScratch(S, config.lookup_window_blocks, dev)
            self._lookup_consts = dict(K_QUERIES=K_PREFIX_QUERIES, K_HITS=K_PREFIX_HITS, K_REJECTS=K_PREFIX_REJECTS,
                                       PRIORITY=priority)
            if triton_sched.FEATURES != SAMPLER_FEATURES:
                raise BlinkError(f"the fused admit kernel computes the sampler's feature bits "
                                 f"{triton_sched.FEATURES}; the sampler now has {SAMPLER_FEATURES}: "
                                 f"update _admit_sampling in kernels/triton/sched.py")
            try:
                self._admit_scratch = triton_sched.AdmitScratch(S, self._words, self.state.sampling_words,
                                                                self.state.sampling, self.ring)
            except ValueError as e:
                raise BlinkError(f"fused admission: {e}") from None
            self._cancel_values = torch.zeros(S, dtype=torch.int64, device=dev)
            self._cancel_consts = dict(ROW_WAITING=ROW_WAITING, ROW_RUNNING=ROW_RUNNING, ROW_RELEASING=ROW_RELEASING,
                                       FINISH_ABORT=FINISH_ABORT, SLOT_FINISHED=SLOT_FINISHED)
            self._admit_consts = dict(
                K_PROMPT=K_PROMPT_TOKENS, K_STEPS=K_STEPS, SLOT_WRITTEN=SLOT_WRITTEN, SLOT_RUNNING=SLOT_RUNNING,
                SLOT_FINISHED=SLOT_FINISHED, ROW_EMPTY=ROW_EMPTY, ROW_WAITING=ROW_WAITING,
                FINISH_ABORT=FINISH_ABORT, FINISH_ERROR=FINISH_ERROR, FINISH_NONE=FINISH_NONE, PRIORITY=priority)
            self._publish_consts = {
                "finish": dict(K_GENERATED=K_GENERATED_TOKENS, FINISH_STOP=FINISH_STOP,
                               FINISH_LENGTH=FINISH_LENGTH, FINISH_ERROR=FINISH_ERROR),
                "state": dict(SLOT_FINISHED=SLOT_FINISHED, ROW_RELEASING=ROW_RELEASING)}
            self._stat_consts = dict(
                ROW_RUNNING=ROW_RUNNING, ROW_WAITING=ROW_WAITING, ROW_EMPTY=ROW_EMPTY,
                ROW_RELEASING=ROW_RELEASING, SLOT_WRITTEN=SLOT_WRITTEN, K_QUERIES=K_PREFIX_QUERIES,
                K_HITS=K_PREFIX_HITS, K_PREEMPTIONS=K_PREEMPTIONS, K_STEPS=K_STEPS,
                K_PROMPT=K_PROMPT_TOKENS, K_GENERATED=K_GENERATED_TOKENS)

    @property
    def host_guards(self) -> bool:
        """Skip stages that have nothing to do, reading their predicates on the host (the
        CPU loop); False for captured graphs, where every stage runs."""
        return self._host_guards

    @host_guards.setter
    def host_guards(self, on: bool) -> None:
        self._host_guards = on
        if not on:
            self._c = None  # the C stages run on the host: graphs capture the torch code

    def _c_stages(self, wanted: bool | None) -> CStages | None:
        """The C stages, or None: the torch code runs (module docstring)."""
        usable = self.host_guards and not self.fused and self.device.type == "cpu"
        if wanted is False or (wanted is None and not usable):
            return None
        if not usable:
            raise BlinkError("the scheduler's C stages run on CPU tensors with host guards and no fused stage")
        from blink.kernels.cpu import sched as c_sched  # noqa: PLC0415 - built on first use

        library = c_sched.LIBRARY.get()
        if library is None:
            if wanted:
                raise BlinkError(f"the scheduler's C stages are not available: {c_sched.LIBRARY.unavailable()}")
            return None
        config = self.config
        consts = dict(ROW_EMPTY=ROW_EMPTY, ROW_WAITING=ROW_WAITING, ROW_RUNNING=ROW_RUNNING,
                      ROW_RELEASING=ROW_RELEASING, SLOT_WRITTEN=SLOT_WRITTEN, SLOT_FINISHED=SLOT_FINISHED,
                      FINISH_STOP=FINISH_STOP, FINISH_LENGTH=FINISH_LENGTH, FINISH_ERROR=FINISH_ERROR,
                      K_PREFIX_QUERIES=K_PREFIX_QUERIES, K_PREFIX_HITS=K_PREFIX_HITS, K_PREEMPTIONS=K_PREEMPTIONS,
                      K_STEPS=K_STEPS, K_PROMPT_TOKENS=K_PROMPT_TOKENS, K_GENERATED_TOKENS=K_GENERATED_TOKENS)
        try:
            stages = c_sched.CStages(library, consts, num_blocks=config.num_blocks, block_size=config.block_size,
                                     max_model_len=config.max_model_len, eos=self._eos, stat_words=self._stat_words,
                                     rows=self.num_slots, tokens=config.max_num_batched_tokens,
                                     blocks_per_seq=config.max_blocks_per_seq)
        except ValueError as e:
            raise BlinkError(f"the scheduler's C stages: {e}") from None
        # Inference tensors, as the torch code's batch is in the engine loop (inference mode):
        # the compiled CPU steps guard on their inputs' dispatch keys.
        with torch.inference_mode():
            self._batch_out = BatchBuffers(self.num_slots, config.max_num_batched_tokens, self.device)
        self._done = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        self._c_sampler_views: dict[int, SamplerInputs] = {}  # by row count (batch.py)
        self._c_sampler_inputs: dict[tuple[int, int], SamplerInputs] = {}  # by row count and plan (batch.py)
        self._c_batches: dict[tuple[int, int], StepBatch] = {}  # by (lanes, window) (batch.py)
        # the step's token and sample-row counts, read by the host through numpy (host_counts)
        self._c_counts = (self._batch_out.total.numpy(), self._batch_out.num_sample_rows.numpy())
        self._window_sizes_t = torch.tensor(self._window_sizes, dtype=torch.int64)
        return stages

    # ------------------------------------------------------------------------------ step

    def schedule(self) -> StepBatch:
        """One step's control plane up to the forward pass: the stages in order, each skipped
        (host guards) when it has nothing to do. Returns the step's batch."""
        cfg, st0 = self.config, self.state
        # Acquire: the slot state words are read once (into the step's snapshot, one buffer
        # for every step), then a fence, then any payload.
        slot_state = self._slot_state
        if self._c is None or self.kv_enabled:
            slot_state.copy_(self.ring["state"])
            self._fence()
            g = None
            st0.step += 1
            st0.counters[K_STEPS] += 1
        else:  # the CPU loop's C stages: the snapshot, the fence, the counters, the row window
            # and the guards in one call
            g = self._c.begin_step(st0, self.ring["state"], slot_state, self.ring["cancel"], self._window_sizes_t)
        w = self._w = self._window_for(slot_state) if g is None else self._window(g.window)
        st = w.state

        # A step where none of the four stages below has work (read at once, before any of them
        # runs: each only creates work for those after it) skips them all.
        if g is None or g.cancelled or g.releasing or g.admissible or g.lookup:
            slot_state = slot_state[: w.size]
            cancel = self._cancel()                                       # admission.py
            if self._when(lambda: (st.status == ROW_RELEASING).any()):
                self._release_finished()                                  # budget.py
            if self._when(lambda: ((slot_state == SLOT_WRITTEN) & (st.status == ROW_EMPTY)).any()):
                self._admit(slot_state, cancel)                           # admission.py
            if self.kv_enabled and self._when(lambda: self._kv_ready().any()):
                self._admit_kv_ready(cancel)                              # kv_reserve.py
            if cfg.enable_prefix_caching and self._when(lambda: st.needs_lookup.any()):
                self._lookup()                                            # prefix.py
        num_new = self._allocate()                                        # budget.py
        batch = self._build_batch(num_new)                                # batch.py
        # Every step ends with fresh stats: update() writes them after a forward; a step
        # that schedules nothing (no update) writes them here.
        nothing = (self.host_counts(batch)[0] == 0 if self._c is not None  # (C stages: host guards)
                   else self._when(lambda: batch.num_scheduled_tokens == 0))
        if nothing:
            self._write_stats()                                           # stats.py
        return batch

    def _state_words_of(self, size: int) -> torch.Tensor:
        """The slot state words of the window's ``size`` rows in the ring's int32 view (a view
        made once per size)."""
        words = self._state_words.get(size)
        if words is None:
            words = self._state_words[size] = self._words[self._state_word0: self._state_word0 + size]
        return words

    def wants_prompt_logprobs(self, rows: int) -> bool:
        """Whether any of the first ``rows`` rows asks for prompt logprobs: a host read (the CPU
        loop's: its state is in host memory) through a numpy view of the state's column."""
        if rows <= 0:
            return False
        if self._prompt_logprobs_words is None:  # (the state is never reallocated)
            self._prompt_logprobs_words = self.state.sampling["prompt_logprobs"].numpy()
        return max(self._prompt_logprobs_words[:rows].tolist()) >= 0  # (a list's max: no numpy reduction)

    def host_counts(self, batch: StepBatch) -> tuple[int, int]:
        """(tokens, sample rows) of a scheduled batch, read on the host (the CPU loop): from
        the C stages' buffers without a torch call where they built it."""
        if self._c is not None and batch.num_scheduled_tokens is self._batch_out.total:
            total, sample_rows = self._c_counts
            return int(total), int(sample_rows)
        return int(batch.num_scheduled_tokens), int(batch.num_sample_rows)

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
        if self.config.enable_prefix_caching:
            self._register(batch, num_tokens)                             # prefix.py
        self._w.state.num_computed += batch.num_new_tokens
        self._publish_tokens(batch, tokens, logprob, top_ids, top_logprobs)  # publish.py
        self._write_stats()                                               # stats.py

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

