"""The scheduler's per-step stages in C for the CPU loop (``sched.c``).

Why: a decode step of SmolLM2-135M spent ~1.4 ms of its ~5 on the host's control plane,
~385 torch calls on tensors of a few rows, a few microseconds of dispatch each whatever they
compute. The stages that run every step are one C call each here, over the scheduler's row
window: the step's opening (counters, row window, admission-side guards), the FCFS token
budget and new blocks (when they fit), the batch build, the prefix-cache insert, publishing
the sampled tokens, the stats, the sampler's inputs and the compacted attention metadata
(docs/performance.md#sched-c: the host's share 1.4 -> 0.45 ms a step).

The torch code of :mod:`blink.engine.sched` stays the reference and the path everywhere
else (graphs, GPUs, the fused stages, preemption, the priority policy's allocation, the rarer
stages, a missing compiler, said once in the log; ``$BLINK_CPU_SCHED=torch``).
``tests/test_scheduler_c.py`` runs the two side by side on the scheduler tests' workloads and
compares every step's batch, compacted metadata, sampler inputs, the whole engine state and
the whole ring region.

The C reads the state through ctypes structures that mirror its own (the same fields in the
same order); each wrapper checks the dtypes and layouts it relies on once and refuses
(ValueError) what it was not written for.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from blink.kernels.attention_metadata import AttentionMetadata
from blink.kernels.cpu import abi
from blink.shared.native_build import NativeBuildError, NativeLibrary

log = logging.getLogger("blink.kernels")

#: sched.c's constants, in its enum's order (the scheduler passes their values)
CONSTANTS = ("ROW_EMPTY", "ROW_WAITING", "ROW_RUNNING", "ROW_RELEASING", "SLOT_WRITTEN", "SLOT_FINISHED",
             "FINISH_STOP", "FINISH_LENGTH", "FINISH_ERROR", "K_PREFIX_QUERIES", "K_PREFIX_HITS",
             "K_PREEMPTIONS", "K_STEPS", "K_PROMPT_TOKENS", "K_GENERATED_TOKENS")
ENV = "BLINK_CPU_SCHED"
#: tests only: every prefix key 0, so every lookup collides and verification alone decides
#: (what the reference's tests force by replacing ``prefix_cache.table_key``)
COLLIDE_KEYS = False
_FILL_BYTES = 80  # sizeof(fill_t) in sched.c


class StepGuards(NamedTuple):
    """What :meth:`CStages.begin_step` read: the row window's size and whether each guarded
    stage of the schedule has work (a cancelled live row, a RELEASING row, a slot to admit, a
    row waiting for its prefix lookup)."""

    window: int
    cancelled: bool
    releasing: bool
    admissible: bool
    lookup: bool


class _RingStreams(ctypes.Structure):
    _fields_ = [("produced", ctypes.c_void_p), ("produced_stride", ctypes.c_int64),
                ("tokens", ctypes.c_void_p), ("tokens_s0", ctypes.c_int64), ("tokens_s1", ctypes.c_int64),
                ("logprob", ctypes.c_void_p), ("logprob_s0", ctypes.c_int64), ("logprob_s1", ctypes.c_int64),
                ("top_ids", ctypes.c_void_p), ("top_ids_s0", ctypes.c_int64), ("top_ids_s1", ctypes.c_int64),
                ("top_logprobs", ctypes.c_void_p), ("top_logprobs_s0", ctypes.c_int64),
                ("top_logprobs_s1", ctypes.c_int64),
                ("finish_reason", ctypes.c_void_p), ("finish_stride", ctypes.c_int64),
                ("state_words", ctypes.c_void_p), ("capacity", ctypes.c_int64), ("num_top", ctypes.c_int64)]


class _Sampled(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_void_p), ("tokens_are_64", ctypes.c_int64), ("logprob", ctypes.c_void_p),
                ("top_ids", ctypes.c_void_p), ("top_ids_are_64", ctypes.c_int64),
                ("top_logprobs", ctypes.c_void_p), ("top_stride", ctypes.c_int64), ("width", ctypes.c_int64)]


class _Rows(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_void_p), ("num_prompt", ctypes.c_void_p), ("tokens", ctypes.c_void_p),
                ("tokens_stride", ctypes.c_int64), ("status", ctypes.c_void_p), ("needs_lookup", ctypes.c_void_p),
                ("counters", ctypes.c_void_p), ("stop_ids", ctypes.c_void_p), ("stop_stride", ctypes.c_int64),
                ("n_stop", ctypes.c_int64), ("ignore_eos", ctypes.c_void_p), ("min_tokens", ctypes.c_void_p),
                ("max_tokens", ctypes.c_void_p), ("eos", ctypes.c_void_p), ("n_eos", ctypes.c_int64),
                ("max_model_len", ctypes.c_int64)]


class _Prefix(ctypes.Structure):
    _fields_ = [("block_tokens", ctypes.c_void_p), ("row_hash", ctypes.c_void_p), ("pows", ctypes.c_void_p),
                ("pows_len", ctypes.c_int64), ("block_table", ctypes.c_void_p), ("hash_table", ctypes.c_void_p),
                ("block_slot", ctypes.c_void_p), ("block_key", ctypes.c_void_p), ("block_parent", ctypes.c_void_p),
                ("block_parent_gen", ctypes.c_void_p), ("block_gen", ctypes.c_void_p), ("block_ref", ctypes.c_void_p),
                ("block_last_used", ctypes.c_void_p), ("arrival", ctypes.c_void_p), ("cache_salt", ctypes.c_void_p),
                ("step", ctypes.c_void_p), ("S", ctypes.c_int64), ("N", ctypes.c_int64), ("B", ctypes.c_int64),
                ("M", ctypes.c_int64), ("H", ctypes.c_int64), ("probes", ctypes.c_int64), ("collide", ctypes.c_int64),
                ("primes", ctypes.c_int64 * 2)]


class _Alloc(ctypes.Structure):
    _fields_ = [("status", ctypes.c_void_p), ("needs_lookup", ctypes.c_void_p), ("num_tokens", ctypes.c_void_p),
                ("num_computed", ctypes.c_void_p), ("arrival", ctypes.c_void_p), ("num_blocks", ctypes.c_void_p),
                ("produced", ctypes.c_void_p), ("consumed", ctypes.c_void_p), ("produced_stride", ctypes.c_int64),
                ("consumed_stride", ctypes.c_int64), ("block_ref", ctypes.c_void_p), ("block_slot", ctypes.c_void_p),
                ("block_last_used", ctypes.c_void_p), ("block_gen", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("step", ctypes.c_void_p), ("S", ctypes.c_int64), ("N", ctypes.c_int64), ("B", ctypes.c_int64),
                ("M", ctypes.c_int64), ("budget", ctypes.c_int64), ("capacity", ctypes.c_int64),
                ("order", ctypes.c_void_p), ("grant", ctypes.c_void_p), ("need", ctypes.c_void_p),
                ("free_list", ctypes.c_void_p)]


class _Gather(ctypes.Structure):
    _fields_ = [("src", ctypes.c_void_p), ("src_row_bytes", ctypes.c_int64), ("dst", ctypes.c_void_p),
                ("row_bytes", ctypes.c_int64)]


class _Suppress(ctypes.Structure):
    _fields_ = [("num_prompt", ctypes.c_void_p), ("num_tokens", ctypes.c_void_p), ("stop_ids", ctypes.c_void_p),
                ("stop_stride", ctypes.c_int64), ("n_stop", ctypes.c_int64), ("ignore_eos", ctypes.c_void_p),
                ("min_tokens", ctypes.c_void_p), ("eos", ctypes.c_void_p), ("n_eos", ctypes.c_int64),
                ("suppress", ctypes.c_void_p), ("features", ctypes.c_void_p)]


def _setup(library: ctypes.CDLL) -> None:
    """Declare the functions and check that sched.c's structures are as large as their
    ctypes mirrors below (a field added on one side only would be a silent misread)."""
    abi.declare(library, abi.SCHED)
    mirrors = (_RingStreams, _Sampled, _Rows, _Prefix, _FILL_BYTES, _Alloc, _Gather, _Suppress)
    sizes = (ctypes.c_int64 * len(mirrors))()
    count = library.blink_sched_struct_sizes(sizes, len(mirrors))
    expected = [m if isinstance(m, int) else ctypes.sizeof(m) for m in mirrors]
    if count != len(mirrors) or list(sizes) != expected:
        raise NativeBuildError(f"sched.c's structures ({list(sizes)[:count]} bytes) differ from sched.py's "
                               f"ctypes mirrors ({expected})")


LIBRARY = NativeLibrary(
    Path(__file__).with_name("sched.c"), what="the scheduler's stages in C", logger=log,
    fallback="the scheduler's stages run as torch code", flags=("-O2",), env=ENV, env_value="torch",
    setup=_setup)


def _check(tensor: torch.Tensor, dtype: torch.dtype, what: str, rows_contiguous: bool = True) -> None:
    """The layouts sched.c reads: a refusal here is a change to the state's or the ring's
    dtypes that sched.c has not followed."""
    if tensor.dtype != dtype or tensor.device.type != "cpu" or (rows_contiguous and tensor.stride(-1) != 1):
        raise ValueError(f"sched.c reads {what} as a CPU {dtype} with contiguous rows; it is "
                         f"{tensor.dtype} on {tensor.device} with strides {tensor.stride()}")


class CStages:
    """The C stages bound to one scheduler's state and ring: the tensors' addresses are taken
    once per row window (the state and the ring are never reallocated), so a step's call
    passes only what changes. ``consts``: the values of :data:`CONSTANTS` by name."""

    def __init__(self, library: ctypes.CDLL, consts: dict[str, int], *, num_blocks: int, block_size: int,
                 max_model_len: int, eos: torch.Tensor, stat_words: torch.Tensor, rows: int, tokens: int,
                 blocks_per_seq: int) -> None:
        values = (ctypes.c_int64 * len(CONSTANTS))(*(consts[name] for name in CONSTANTS))
        if library.blink_sched_constants(values, len(CONSTANTS)) != 0:
            raise ValueError("sched.c's constants do not match sched.py's CONSTANTS")
        self.lib, self.num_blocks, self.block_size, self.max_model_len = library, num_blocks, block_size, max_model_len
        _check(eos, torch.int64, "the EOS ids")
        _check(stat_words, torch.int64, "the stat words")
        self.eos, self.stat_words = eos, stat_words
        self._publish: dict[int, tuple[_Rows, _RingStreams]] = {}
        #: a stage's C arguments by key: (its tensors' ids, the arguments, the tensors) (_args_of)
        self._args: dict[object, tuple] = {}
        self._prefix: dict[int, _Prefix] = {}
        self._alloc: dict[int, tuple[_Alloc, torch.Tensor, torch.Tensor]] = {}
        self._gather: _SamplerGather | None = None
        self._begin: torch.Tensor | None = None
        self._checked: set[str] = set()  # stages whose layouts were checked (their first call)
        with torch.inference_mode():  # the compacted metadata (compact): as the torch code's, in the loop
            self._compact = {"seq_idx": torch.zeros(tokens, dtype=torch.int64),
                             "query_start_loc": torch.zeros(rows + 1, dtype=torch.int32),
                             "seq_lens": torch.zeros(rows, dtype=torch.int32),
                             "block_tables": torch.zeros(rows, blocks_per_seq, dtype=torch.int32),
                             "remap": torch.zeros(rows, dtype=torch.int64), "counts": torch.zeros(3, dtype=torch.int64)}
        # The host reads the small results through numpy views (a tensor's tolist() is two
        # torch calls), and a step's compacted metadata is views made once per shape.
        self._counts = self._compact["counts"].numpy()
        self._compacted: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = {}
        self._fills = torch.empty(0, dtype=torch.uint8)

    def _check_first(self, stage: str, *checks: tuple) -> None:
        """On ``stage``'s first call only, :func:`_check` of each ``(what, tensor, dtype[,
        rows_contiguous])``: the layouts it reads stay those of the state and buffers it was
        built over."""
        if stage not in self._checked:
            for what, tensor, dtype, *contiguous in checks:
                _check(tensor, dtype, what, *contiguous)
            self._checked.add(stage)

    def _args_of(self, key: object, tensors: tuple, make) -> tuple:
        """A stage's C arguments under ``key``: ``make()``'s, made once and again only when one
        of ``tensors`` (the objects whose addresses they hold) is another object. Each is a
        torch call or more per argument on the step's host path otherwise; the state, its
        windows' views, the ring and the batch buffers are never reallocated. The tensors are
        kept, so their ids stay theirs."""
        ids = tuple(map(id, tensors))
        cached = self._args.get(key)
        if cached is None or cached[0] != ids:
            cached = self._args[key] = (ids, make(), tensors)
        return cached[1]

    # ------------------------------------------------------------------ the step's guards

    def begin_step(self, st, ring_state: torch.Tensor, slot_state: torch.Tensor, cancel: torch.Tensor,
                   window_sizes: torch.Tensor) -> StepGuards:
        """:meth:`Scheduler.schedule`'s opening over the whole table ``st``: the snapshot of
        the ring's slot state words into ``slot_state`` and the fence after it (acquire: the
        payloads are read after the words), the step counters, the row window and the stage
        guards (read by the host)."""
        if self._begin is None:
            self._check_first("begin_step", ("status", st.status, torch.int32),
                              ("needs_lookup", st.needs_lookup, torch.bool), ("the ring's slot states", ring_state, torch.int32),
                              ("the slot states", slot_state, torch.int32),
                              ("cancel", cancel, torch.int32, False), ("the window sizes", window_sizes, torch.int64))
            if ring_state.shape != slot_state.shape or slot_state.shape[0] != st.status.shape[0]:
                raise ValueError(f"begin_step: the snapshot {tuple(slot_state.shape)} is not the ring's slot states "
                                 f"{tuple(ring_state.shape)} for {st.status.shape[0]} rows")
            self._begin = torch.zeros(5, dtype=torch.int64)
            self._begin_words = self._begin.numpy()
        self.lib.blink_sched_begin_step(*self._args_of("begin", (ring_state, slot_state, st.status, st.needs_lookup,
                                                                  st.step, st.counters, cancel, window_sizes), lambda: (
            st.status.shape[0], st.status.data_ptr(), ring_state.data_ptr(), slot_state.data_ptr(), cancel.data_ptr(),
            cancel.stride(0), st.needs_lookup.data_ptr(), window_sizes.data_ptr(), window_sizes.shape[0],
            st.step.data_ptr(), st.counters.data_ptr(), self._begin.data_ptr())))
        size, cancelled, releasing, admissible, lookup = self._begin_words.tolist()
        return StepGuards(size, bool(cancelled), bool(releasing), bool(admissible), bool(lookup))

    # ------------------------------------------------------------------------ batch build

    def build_batch(self, st, num_new: torch.Tensor, buckets: torch.Tensor, out, host_lanes: bool) -> int:
        """:meth:`Scheduler._build_batch` into ``out`` (BatchBuffers) for the window's rows;
        returns the flat lanes written (all T, or with ``host_lanes`` the step's bucket)."""
        S, M = st.block_table.shape

        def make() -> tuple:
            self._check_first("build_batch", ("num_new", num_new, torch.int64),
                              ("num_computed", st.num_computed, torch.int64), ("num_tokens", st.num_tokens, torch.int64),
                              ("the tokens table", st.tokens, torch.int32), ("block_table", st.block_table, torch.int32),
                              ("the buckets", buckets, torch.int64))
            return (S, out.input_ids.shape[0], self.num_blocks, self.block_size, M, int(host_lanes),
                    num_new.data_ptr(), st.num_computed.data_ptr(), st.num_tokens.data_ptr(), st.tokens.data_ptr(),
                    st.tokens.stride(0), st.block_table.data_ptr(), buckets.data_ptr(), buckets.shape[0],
                    out.input_ids.data_ptr(), out.positions.data_ptr(), out.seq_idx.data_ptr(),
                    out.slot_mapping.data_ptr(), out.query_start_loc.data_ptr(), out.seq_lens.data_ptr(),
                    out.total.data_ptr(), out.bucket.data_ptr(), out.sample_rows.data_ptr(),
                    out.num_sample_rows.data_ptr(), out.logits_indices.data_ptr())
        lanes = self.lib.blink_sched_build_batch(*self._args_of(
            ("build", S, host_lanes), (num_new, out, buckets, st.block_table, st.num_computed, st.num_tokens, st.tokens),
            make))
        if lanes < 0:
            raise ValueError(f"{int(num_new.sum())} tokens exceed the largest bucket {int(buckets[-1])}")
        return lanes

    # ------------------------------------------------------------------------------ stats

    def write_stats(self, st, ring_state: torch.Tensor, control: torch.Tensor) -> None:
        """:meth:`Scheduler._write_stats` for the window's rows."""
        def make() -> tuple:
            self._check_first("stats", ("status", st.status, torch.int32),
                              ("the slot states", ring_state, torch.int32, False), ("block_ref", st.block_ref, torch.int32),
                              ("counters", st.counters, torch.int64), ("the control block", control, torch.int64))
            return (st.status.shape[0], self.num_blocks, st.status.data_ptr(), ring_state.data_ptr(),
                    ring_state.stride(0), st.block_ref.data_ptr(), st.counters.data_ptr(), control.data_ptr(),
                    self.stat_words.data_ptr())
        self.lib.blink_sched_write_stats(*self._args_of(
            ("stats", st.status.shape[0]), (ring_state, st.status, st.block_ref, st.counters, control), make))

    # ---------------------------------------------------------------------------- publish

    def _publish_views(self, st, ring: dict[str, torch.Tensor], state_words: torch.Tensor,
                       stream_capacity: int, num_top: int) -> tuple[_Rows, _RingStreams]:
        S = st.status.shape[0]
        views = self._publish.get(S)
        if views is not None:
            return views
        sp = st.sampling
        for name, tensor, dtype in (
                ("num_tokens", st.num_tokens, torch.int64), ("num_prompt", st.num_prompt, torch.int64),
                ("the tokens table", st.tokens, torch.int32), ("status", st.status, torch.int32),
                ("needs_lookup", st.needs_lookup, torch.bool), ("counters", st.counters, torch.int64),
                ("stop_token_ids", sp["stop_token_ids"], torch.int32), ("ignore_eos", sp["ignore_eos"], torch.int32),
                ("min_tokens", sp["min_tokens"], torch.int32), ("max_tokens", sp["max_tokens"], torch.int32),
                ("produced", ring["produced"], torch.int64), ("the stream tokens", ring["tokens"], torch.int32),
                ("logprob", ring["logprob"], torch.float32), ("top_ids", ring["top_ids"], torch.int32),
                ("top_logprobs", ring["top_logprobs"], torch.float32),
                ("finish_reason", ring["finish_reason"], torch.int32), ("the state words", state_words, torch.int32)):
            # sched.c indexes these by row (and channel) with their own strides
            strided = name in ("produced", "finish_reason", "the stream tokens", "logprob")
            _check(tensor, dtype, name, rows_contiguous=not strided)
        stop = sp["stop_token_ids"]
        rows = _Rows(st.num_tokens.data_ptr(), st.num_prompt.data_ptr(), st.tokens.data_ptr(), st.tokens.stride(0),
                     st.status.data_ptr(), st.needs_lookup.data_ptr(), st.counters.data_ptr(), stop.data_ptr(),
                     stop.stride(0), stop.shape[1], sp["ignore_eos"].data_ptr(), sp["min_tokens"].data_ptr(),
                     sp["max_tokens"].data_ptr(), self.eos.data_ptr(), self.eos.shape[0], self.max_model_len)
        top_ids, top_lps = ring["top_ids"], ring["top_logprobs"]
        if top_ids.shape[-1] and (top_ids.shape[-1] != num_top or top_ids.stride(2) != 1 or top_lps.stride(2) != 1):
            raise ValueError(f"sched.c writes {num_top} contiguous alternatives a position; the ring's "
                             f"top_ids are {tuple(top_ids.shape)} with strides {top_ids.stride()}")
        streams = _RingStreams(
            ring["produced"].data_ptr(), ring["produced"].stride(0),
            ring["tokens"].data_ptr(), *ring["tokens"].stride(),
            ring["logprob"].data_ptr(), *ring["logprob"].stride(),
            top_ids.data_ptr(), top_ids.stride(0), top_ids.stride(1),
            top_lps.data_ptr(), top_lps.stride(0), top_lps.stride(1),
            ring["finish_reason"].data_ptr(), ring["finish_reason"].stride(0),
            state_words.data_ptr(), stream_capacity, num_top)
        rows.ref, streams.ref = ctypes.byref(rows), ctypes.byref(streams)  # (made once, not per call)
        self._publish[S] = views = (rows, streams)
        return views

    def publish(self, st, ring: dict[str, torch.Tensor], state_words: torch.Tensor, sample_rows: torch.Tensor,
                tokens: torch.Tensor, logprob: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                done: torch.Tensor, *, stream_capacity: int, num_top: int) -> None:
        """:meth:`Scheduler._publish_tokens` for the window's rows (``state_words``: the
        window's slot state words, int32 [S]; ``done``: int64 scratch of at least the rows)."""
        rows, streams = self._publish_views(st, ring, state_words, stream_capacity, num_top)
        R = min(tokens.shape[0], st.status.shape[0])
        if tokens.dtype not in (torch.int32, torch.int64):
            tokens = tokens.long()
        if logprob.dtype != torch.float32:
            logprob = logprob.float()
        if logprob.ndim != 1 or logprob.stride(0) != 1:
            logprob = logprob.contiguous()
        width = top_ids.shape[1]
        if width:
            if top_ids.dtype not in (torch.int32, torch.int64):
                top_ids = top_ids.long()
            top_ids, top_logprobs = top_ids.contiguous(), top_logprobs.float().contiguous()
        if tokens.ndim != 1 or tokens.stride(0) != 1:
            tokens = tokens.contiguous()
        sampled = _Sampled(tokens.data_ptr(), tokens.dtype == torch.int64, logprob.data_ptr(),
                           top_ids.data_ptr() if width else None, width and top_ids.dtype == torch.int64,
                           top_logprobs.data_ptr() if width else None, top_ids.stride(0) if width else 0, width)
        self.lib.blink_sched_publish(R, sample_rows.data_ptr(), ctypes.byref(sampled), rows.ref, streams.ref,
                                     done.data_ptr())

    # --------------------------------------------------------------- prefix-cache insert

    def _prefix_views(self, st, hc, hash_table_size: int, probes: int) -> _Prefix:
        S = st.status.shape[0]
        view = self._prefix.get(S)
        if view is not None:
            view.collide = COLLIDE_KEYS
            return view
        for name, tensor, dtype in (
                ("block_tokens", st.block_tokens, torch.int32), ("row_hash", st.row_hash, torch.int64),
                ("the hash powers", hc.pows, torch.int64), ("block_table", st.block_table, torch.int32),
                ("hash_table", st.hash_table, torch.int64), ("block_slot", st.block_slot, torch.int64),
                ("block_key", st.block_key, torch.int64), ("block_parent", st.block_parent, torch.int64),
                ("block_parent_gen", st.block_parent_gen, torch.int64), ("block_gen", st.block_gen, torch.int64),
                ("block_ref", st.block_ref, torch.int32), ("block_last_used", st.block_last_used, torch.int64),
                ("arrival", st.arrival, torch.int64), ("cache_salt", st.sampling["cache_salt"], torch.int64),
                ("step", st.step, torch.int64)):
            _check(tensor, dtype, name, rows_contiguous=tensor.dim() > 0)
            if tensor.dim() > 1 and not tensor.is_contiguous():
                raise ValueError(f"sched.c reads {name} as a contiguous table; its strides are {tensor.stride()}")
        primes = hc.primes.flatten().tolist()
        view = _Prefix(st.block_tokens.data_ptr(), st.row_hash.data_ptr(), hc.pows.data_ptr(), hc.pows.shape[1],
                       st.block_table.data_ptr(), st.hash_table.data_ptr(), st.block_slot.data_ptr(),
                       st.block_key.data_ptr(), st.block_parent.data_ptr(), st.block_parent_gen.data_ptr(),
                       st.block_gen.data_ptr(), st.block_ref.data_ptr(), st.block_last_used.data_ptr(),
                       st.arrival.data_ptr(), st.sampling["cache_salt"].data_ptr(), st.step.data_ptr(), S,
                       self.num_blocks, self.block_size, st.block_table.shape[1], hash_table_size, probes,
                       COLLIDE_KEYS, (ctypes.c_int64 * 2)(*primes))
        self._prefix[S] = view
        return view

    def register(self, st, batch, n: int, hc, *, hash_table_size: int, probes: int) -> None:
        """``prefix_cache.register`` for the first ``n`` lanes of ``batch`` (a StepBatch of
        this window's rows): the step's tokens into their blocks, the rows' prefix hashes,
        and the blocks it filled into the table."""
        view = self._prefix_views(st, hc, hash_table_size, probes)
        if self._fills.numel() < n * _FILL_BYTES:
            self._fills = torch.empty(n * _FILL_BYTES, dtype=torch.uint8)
        md = batch.attn
        # (every batch of these stages is build_batch's buffers: checked once)
        if "register" not in self._checked:
            self._check_first("register", *((f"the batch's {name}", tensor, torch.int64, tensor.dim() > 0)
                                            for name, tensor in (
                ("input_ids", batch.input_ids), ("positions", md.positions), ("token_seq_idx", md.token_seq_idx),
                ("slot_mapping", md.slot_mapping), ("num_scheduled_tokens", batch.num_scheduled_tokens))))
        self.lib.blink_sched_register(n, batch.input_ids.data_ptr(), md.positions.data_ptr(),
                                      md.token_seq_idx.data_ptr(), md.slot_mapping.data_ptr(),
                                      batch.num_scheduled_tokens.data_ptr(), ctypes.byref(view),
                                      self._fills.data_ptr())

    # ------------------------------------------------------------------ budget and blocks

    def _alloc_views(self, st, ring: dict[str, torch.Tensor], budget: int,
                     stream_capacity: int) -> tuple[_Alloc, torch.Tensor, torch.Tensor]:
        S = st.status.shape[0]
        views = self._alloc.get(S)
        if views is not None:
            return views
        for name, tensor, dtype in (
                ("status", st.status, torch.int32), ("needs_lookup", st.needs_lookup, torch.bool),
                ("num_tokens", st.num_tokens, torch.int64), ("num_computed", st.num_computed, torch.int64),
                ("arrival", st.arrival, torch.int64), ("num_blocks", st.num_blocks, torch.int64),
                ("produced", ring["produced"], torch.int64), ("consumed", ring["consumed"], torch.int64),
                ("block_ref", st.block_ref, torch.int32), ("block_slot", st.block_slot, torch.int64),
                ("block_last_used", st.block_last_used, torch.int64), ("block_gen", st.block_gen, torch.int64),
                ("block_table", st.block_table, torch.int32), ("step", st.step, torch.int64)):
            _check(tensor, dtype, name, rows_contiguous=name not in ("produced", "consumed", "step"))
        # order, grant, need [S] and the free list [N]; num_new [S] (the step's, read by update())
        scratch = torch.empty(3 * S + self.num_blocks, dtype=torch.int64)
        with torch.inference_mode():  # as the torch code's, in the engine loop (compiled steps' guards)
            num_new = torch.zeros(S, dtype=torch.int64)
        view = _Alloc(st.status.data_ptr(), st.needs_lookup.data_ptr(), st.num_tokens.data_ptr(),
                      st.num_computed.data_ptr(), st.arrival.data_ptr(), st.num_blocks.data_ptr(),
                      ring["produced"].data_ptr(), ring["consumed"].data_ptr(), ring["produced"].stride(0),
                      ring["consumed"].stride(0), st.block_ref.data_ptr(), st.block_slot.data_ptr(),
                      st.block_last_used.data_ptr(), st.block_gen.data_ptr(), st.block_table.data_ptr(),
                      st.step.data_ptr(), S, self.num_blocks, self.block_size, st.block_table.shape[1], budget,
                      stream_capacity, scratch.data_ptr(), scratch[S:].data_ptr(), scratch[2 * S:].data_ptr(),
                      scratch[3 * S:].data_ptr())
        self._alloc[S] = views = (view, scratch, num_new)
        return views

    def allocate(self, st, ring: dict[str, torch.Tensor], *, budget: int, stream_capacity: int) -> torch.Tensor | None:
        """:meth:`Scheduler._allocate` under the FCFS policy for the window's rows when the
        step's new blocks fit the free pool: the tokens per row this step (a buffer the next
        call rewrites). None, having changed nothing, when they do not fit (the caller runs
        the torch code, which preempts)."""
        view, _, num_new = self._alloc_views(st, ring, budget, stream_capacity)
        if self.lib.blink_sched_allocate(ctypes.byref(view), num_new.data_ptr()):
            return None
        return num_new

    # ------------------------------------------------------------------ sampler's inputs

    def sampler_inputs(self, st, names: tuple[str, ...], sample_rows: torch.Tensor, rows: int) -> int | None:
        """:meth:`Scheduler.sampler_inputs`' gathers for lanes [0, ``rows``) of
        ``sample_rows`` (padding lanes read row 0) into buffers the next call rewrites (their
        views: :meth:`sampler_views`): the sampling fields ``names`` and ``num_prompt``,
        ``num_tokens``, ``sampler_features`` of ``st`` (the whole state), and
        ``suppress_ids``. Returns the lanes' feature words OR-ed, plus ``1 << 32`` if any of
        their suppress ids is set (what ``SamplerPlan.from_features`` reads); None when
        ``rows`` exceeds the table (the caller gathers with torch)."""
        gather = self._gather
        if gather is None:
            gather = self._gather = _SamplerGather(st, names, self.eos)
        if rows > gather.rows:
            return None
        return self.lib.blink_sched_sampler_inputs(rows, sample_rows.data_ptr(), sample_rows.shape[0],
                                                   len(gather.fields), gather.fields, ctypes.byref(gather.suppress))

    def sampler_views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of the sampler inputs' buffers by name (as
        :meth:`sampler_inputs` names them); the caller keeps them per row count."""
        with torch.inference_mode():
            return {name: t[:rows] for name, t in self._gather.buffers.items()}

    # ------------------------------------------------------------- compacted metadata

    def compact(self, batch, n: int) -> AttentionMetadata | None:
        """``blink.engine.step.compact_rows(batch, n)`` from one C call, into buffers the next
        call rewrites; None for a batch it was not built for (the caller compacts with torch)."""
        md, num_new, b = batch.attn, batch.num_new_tokens, self._compact
        S, M = md.block_tables.shape
        if (S > b["seq_lens"].shape[0] or n > b["seq_idx"].shape[0] or M != b["block_tables"].shape[1]
                or md.token_seq_idx.dtype != torch.int64 or num_new.dtype != torch.int64
                or md.query_start_loc.dtype != torch.int32 or md.seq_lens.dtype != torch.int32
                or md.block_tables.dtype != torch.int32 or not md.block_tables.is_contiguous()):
            return None
        self.lib.blink_sched_compact(S, n, M, num_new.data_ptr(), md.token_seq_idx.data_ptr(),
                                     md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(), md.block_tables.data_ptr(),
                                     b["seq_idx"].data_ptr(), b["query_start_loc"].data_ptr(), b["seq_lens"].data_ptr(),
                                     b["block_tables"].data_ptr(), b["remap"].data_ptr(), b["counts"].data_ptr())
        A, max_context, max_query = self._counts.tolist()
        cached = self._compacted.get((n, A))
        if cached is None or cached[0] is not md.slot_mapping or cached[1] is not md.positions:
            views = AttentionMetadata(
                slot_mapping=md.slot_mapping[:n], positions=md.positions[:n], token_seq_idx=b["seq_idx"][:n],
                query_start_loc=b["query_start_loc"][: A + 1], seq_lens=b["seq_lens"][:A],
                block_tables=b["block_tables"][:A])
            # (keyed by the batch's views too: the C batch's are made once per shape)
            cached = self._compacted[(n, A)] = (md.slot_mapping, md.positions, views)
        # the same object each step of this shape, as its tensors are (a forward that memoises
        # per step takes its own copy: blink.models.decoder)
        compacted = cached[2]
        compacted.max_context, compacted.max_query_len, compacted.step_cache = max_context, max_query, None
        return compacted


class _SamplerGather:
    """The sampler inputs' buffers (the table's rows: a step samples at most that many) and
    sched.c's descriptors of their sources, made once."""

    def __init__(self, st, names: tuple[str, ...], eos: torch.Tensor) -> None:
        sp = st.sampling
        sources = {**{name: sp[name] for name in names}, "num_prompt": st.num_prompt,
                   "num_tokens": st.num_tokens, "sampler_features": st.sampler_features}
        self.rows = S = st.num_tokens.shape[0]
        for name in ("stop_token_ids", "ignore_eos", "min_tokens"):  # the suppress list reads these
            _check(sp[name], torch.int32, name)
        _check(st.num_prompt, torch.int64, "num_prompt")
        _check(st.num_tokens, torch.int64, "num_tokens")
        _check(st.sampler_features, torch.int32, "sampler_features")
        for name, t in sources.items():
            if t.dim() > 1 and not t[0].is_contiguous():
                raise ValueError(f"sched.c copies {name}'s rows whole; its strides are {t.stride()}")
        with torch.inference_mode():  # as the torch code's gathers in the engine loop
            self.buffers = {name: torch.empty((S, *t.shape[1:]), dtype=t.dtype) for name, t in sources.items()}
            stop = sp["stop_token_ids"]
            self.buffers["suppress_ids"] = torch.empty((S, stop.shape[1] + eos.shape[0]), dtype=torch.int32)
        self.fields = (_Gather * len(sources))(*(
            _Gather(t.data_ptr(), t.stride(0) * t.element_size(), self.buffers[name].data_ptr(),
                    t[0].numel() * t.element_size()) for name, t in sources.items()))
        self.suppress = _Suppress(st.num_prompt.data_ptr(), st.num_tokens.data_ptr(), stop.data_ptr(), stop.stride(0),
                                  stop.shape[1], sp["ignore_eos"].data_ptr(), sp["min_tokens"].data_ptr(),
                                  eos.data_ptr(), eos.shape[0], self.buffers["suppress_ids"].data_ptr(),
                                  st.sampler_features.data_ptr())
