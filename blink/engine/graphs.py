"""The engine step as the device loops run it, and the device-independent half of the GPU
loops: graph plan, graph runners, and host models of the device loop's kernels.

**One step function.** ``run_step`` is what the CPU loop calls (``Engine.step``):
``scheduler.schedule()`` then :func:`model_phase` (forward → sampler → ``scheduler.update``).
The GPU tiers capture exactly these two calls into CUDA graphs: ``schedule()`` as the
schedule graph, and ``model_phase`` with capture-friendly options (``compact=False``: the
bucket's fixed token count, all rows, no host-side sampler plan) as one graph per bucket.
Being on the host, the CPU loop instead reads the step's token count and compacts the
metadata (``compact=True``), which only removes padding: the tokens are the same.

**Graph plan** (:func:`plan_graphs`): every bucket of ``SchedulerConfig.buckets`` gets a
graph, because ``StepBatch.bucket_index`` (computed on the device) may name any of them.
Capture order: the schedule graph first (its outputs, the ``StepBatch`` tensors, are the
static inputs of every bucket graph and stay allocated), then the buckets largest first so
that each smaller capture reuses blocks the larger one freed. All captures share one
memory pool; bucket graphs may replay in any order because each one's temporaries are dead
when it ends and the static inputs are never freed.

**Runners**: :class:`EagerRunner` (CPU: "capture" runs the function once and keeps its
outputs as the static buffers; "replay" runs it again and copies the results into them,
which is what replaying a graph does to its output memory) and, in
:mod:`blink.engine.gpu_loop`, the CUDA runner. :class:`HostGraphStep` is tier A's step
over either runner.

**Device loop models**: :func:`gate_decide` / :func:`dispatch_bucket` mirror
``kernels/device_loop_logic.cuh`` (the suite compiles that header for the host and compares
them), :func:`gate_poll_model` and friends mirror the kernels of ``kernels/device_loop.cu``
line by line, reading the same :class:`LoopParams` block through raw addresses.
:class:`EagerGraphApi` records the graph that :func:`build_conditional_loop` builds (the
exact calls the CUDA build makes) and interprets it on the host: WHILE/IF nodes, kernel
nodes run by their models, captured segments run eagerly. That is tier B on CPU.
"""
from __future__ import annotations

import ctypes
import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import numpy as np
import torch

from blink.engine.sampler import Sampler, SamplerPlan, SamplingTensors
from blink.engine.scheduler import Scheduler, StepBatch
from blink.engine.state import SchedulerConfig
from blink.errors import BlinkError
from blink.kernels.reference import AttentionMetadata

# ------------------------------------------------------------------------ the step function


class StepParts(NamedTuple):
    scheduler: Scheduler
    executor: Any  # ModelExecutor-like: execute(input_ids, md, logits_indices) -> logits
    sampler: Sampler


def slice_sampling(st: SamplingTensors, n: int) -> SamplingTensors:
    return SamplingTensors(**{name: getattr(st, name)[:n] for name in st.__dataclass_fields__})


def compact_rows(batch: StepBatch, n: int) -> AttentionMetadata:
    """Host loops only: the step's metadata cut down to its ``n`` real tokens and the rows
    that have tokens this step, so the reference attention neither pads nor gathers idle
    rows. (A captured graph keeps the fixed shapes instead: :func:`bucket_metadata`.)"""
    md = batch.attn
    active = torch.nonzero(batch.num_new_tokens > 0).squeeze(1)
    remap = torch.zeros(batch.num_new_tokens.shape[0], dtype=torch.int64, device=active.device)
    remap[active] = torch.arange(active.shape[0], device=active.device)
    seq_lens = md.seq_lens[active]
    return AttentionMetadata(
        slot_mapping=md.slot_mapping[:n],
        positions=md.positions[:n],
        token_seq_idx=remap[md.token_seq_idx[:n]],
        query_start_loc=torch.cat([md.query_start_loc[active], md.query_start_loc[-1:]]),
        seq_lens=seq_lens,
        block_tables=md.block_tables[active],
        max_context=int(seq_lens.max()),
        max_query_len=int(batch.num_new_tokens.max()),
    )


def bucket_metadata(batch: StepBatch, tokens: int) -> AttentionMetadata:
    """Fixed-shape metadata of a ``tokens``-token bucket: views of the step's tensors, every
    row kept (idle rows have ``seq_lens`` 0), padding tokens in the scratch block. No host
    read: this is what a captured graph runs."""
    md = batch.attn
    return AttentionMetadata(
        slot_mapping=md.slot_mapping[:tokens],
        positions=md.positions[:tokens],
        token_seq_idx=md.token_seq_idx[:tokens],
        query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        block_tables=md.block_tables,
    )


def model_phase(
    parts: StepParts,
    batch: StepBatch,
    *,
    tokens: int,
    rows: int,
    compact: bool,
    plan: SamplerPlan | None = None,
) -> None:
    """Forward → sample → update for a scheduled ``batch``: the second half of every step.

    ``tokens``: token positions to run (the real count on the host, the bucket size in a
    graph); ``rows``: sampler rows (>= the step's sample rows); ``compact``: host-side
    metadata compaction (CPU loop) or fixed bucket shapes (graphs); ``plan``: the CPU
    loop's host-side sampler plan, None (every stage) in graphs."""
    scheduler, executor, sampler = parts
    md = compact_rows(batch, tokens) if compact else bucket_metadata(batch, tokens)
    logits = executor.execute(batch.input_ids[:tokens], md, batch.logits_indices[:rows])
    history = scheduler.token_history(batch)[:rows]
    sampling = slice_sampling(batch.sampling, rows)
    out = sampler(
        logits,
        sampling,
        history,
        batch.prompt_lens[:rows],
        batch.total_lens[:rows],
        batch.total_lens[:rows],
        batch.suppress_ids[:rows],
        plan=plan,
    )
    scheduler.update(batch, out.tokens, out.logprob, out.top_ids, out.top_logprobs)


def run_step(parts: StepParts) -> bool:
    """One CPU-loop step (``Engine.step``). Returns False when nothing was scheduled."""
    batch = parts.scheduler.schedule()
    n = int(batch.num_scheduled_tokens)  # CPU loop: a plain memory read, not a device sync
    if n == 0:  # admissions/cancels may have happened, but there is nothing to compute
        return False
    # At least one (padding) sample row: a step of prefill chunks only samples nothing,
    # and update() indexes the sampler outputs (an empty tensor cannot be indexed).
    ns = max(int(batch.num_sample_rows), 1)
    plan = SamplerPlan.of(slice_sampling(batch.sampling, ns))  # skip stages no row uses
    model_phase(parts, batch, tokens=n, rows=ns, compact=True, plan=plan)
    return True


# ----------------------------------------------------------------------------- graph plan


@dataclass(frozen=True)
class GraphPlan:
    """Which graphs a GPU loop captures, in which order, with which shapes.

    buckets[i]      tokens of bucket i (== ``SchedulerConfig.buckets``: bucket_index indexes it)
    rows[i]         sampler rows of bucket i: min(tokens, slots) (a step samples at most one
                    row per scheduled token and per slot)
    capture_order   graph names in capture order: "schedule", then "bucket:<tokens>"
                    largest first
    shared_pool     every capture allocates from one private memory pool
    """

    buckets: tuple[int, ...]
    rows: tuple[int, ...]
    capture_order: tuple[str, ...]
    shared_pool: bool = True

    @staticmethod
    def bucket_name(tokens: int) -> str:
        return f"bucket:{tokens}"

    def bucket_index(self, num_tokens: int) -> int:
        """Host mirror of ``StepBatch.bucket_index`` (``torch.bucketize``, right=False)."""
        for i, b in enumerate(self.buckets):
            if num_tokens <= b:
                return i
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")


def plan_graphs(config: SchedulerConfig, num_slots: int) -> GraphPlan:
    buckets = tuple(config.buckets)
    rows = tuple(min(b, num_slots) for b in buckets)
    order = ("schedule", *(GraphPlan.bucket_name(b) for b in sorted(buckets, reverse=True)))
    return GraphPlan(buckets=buckets, rows=rows, capture_order=order)


# -------------------------------------------------------------------------------- runners


def copy_into(static: Any, fresh: Any) -> None:
    """Copy ``fresh`` into ``static`` tensor by tensor (dataclasses, tuples and dicts are
    walked): what a graph replay does to the memory of its outputs."""
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif dataclasses.is_dataclass(static):
        for f in dataclasses.fields(static):
            copy_into(getattr(static, f.name), getattr(fresh, f.name))
    elif isinstance(static, (tuple, list)):
        for a, b in zip(static, fresh):
            copy_into(a, b)
    elif isinstance(static, dict):
        for k in static:
            copy_into(static[k], fresh[k])


def clone_outputs(x: Any) -> Any:
    """Own copies of every tensor in ``x`` (static buffers that later calls do not alias)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: clone_outputs(getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, tuple):
        return type(x)(clone_outputs(v) for v in x) if not hasattr(x, "_fields") else type(x)(
            *(clone_outputs(v) for v in x))
    if isinstance(x, list):
        return [clone_outputs(v) for v in x]
    if isinstance(x, dict):
        return {k: clone_outputs(v) for k, v in x.items()}
    return x


class GraphRunner(Protocol):
    """Captures callables as graphs and replays them (tier A's view of a device)."""

    def capture(self, name: str, fn: Callable[[], Any]) -> Any: ...
    def replay(self, name: str) -> None: ...
    def publish_mailbox(self, num_tokens: torch.Tensor, bucket_index: torch.Tensor) -> None: ...
    def read_mailbox(self) -> tuple[int, int]: ...


class EagerRunner:
    """A :class:`GraphRunner` for CPU tensors: capture runs ``fn`` once and keeps clones of
    its outputs as the static buffers; replay runs it again and copies the new outputs into
    them. Code written against it sees graph semantics (fixed output memory) without a GPU."""

    def __init__(self) -> None:
        self.fns: dict[str, Callable[[], Any]] = {}
        self.outputs: dict[str, Any] = {}
        self.replays: list[str] = []
        self._mailbox: tuple[torch.Tensor, torch.Tensor] | None = None

    def capture(self, name: str, fn: Callable[[], Any]) -> Any:
        self.fns[name] = fn
        self.outputs[name] = clone_outputs(fn())
        return self.outputs[name]

    def replay(self, name: str) -> None:
        self.replays.append(name)
        fresh = self.fns[name]()
        if self.outputs[name] is not None:
            copy_into(self.outputs[name], fresh)

    def publish_mailbox(self, num_tokens: torch.Tensor, bucket_index: torch.Tensor) -> None:
        # Captured inside the schedule function: on CPU the mailbox is the values themselves.
        self._mailbox = (num_tokens, bucket_index)

    def read_mailbox(self) -> tuple[int, int]:
        out = self.outputs["schedule"]
        return int(out.num_scheduled_tokens), int(out.bucket_index)


class HostGraphStep:
    """Tier A's step: replay the schedule graph, read (tokens, bucket) on the host (the one
    host read per step that tier A pays), replay that bucket's graph.

    The graphs are ``scheduler.schedule()`` and :func:`model_phase` with ``compact=False``:
    the CPU loop's own functions, captured."""

    def __init__(self, parts: StepParts, plan: GraphPlan, runner: GraphRunner) -> None:
        self.parts, self.plan, self.runner = parts, plan, runner
        self.steps = 0

        def schedule() -> StepBatch:
            batch = parts.scheduler.schedule()
            runner.publish_mailbox(batch.num_scheduled_tokens, batch.bucket_index)
            return batch

        self.batch: StepBatch = runner.capture("schedule", schedule)
        by_tokens = dict(zip(plan.buckets, plan.rows))
        for name in plan.capture_order[1:]:
            tokens = int(name.split(":")[1])
            runner.capture(name, self._bucket_fn(tokens, by_tokens[tokens]))

    def _bucket_fn(self, tokens: int, rows: int) -> Callable[[], None]:
        def run() -> None:
            model_phase(self.parts, self.batch, tokens=tokens, rows=rows, compact=False, plan=None)
        return run

    def step(self) -> bool:
        self.runner.replay("schedule")
        n, b = self.runner.read_mailbox()
        if n == 0:
            return False
        self.runner.replay(GraphPlan.bucket_name(self.plan.buckets[b]))
        self.steps += 1
        return True


# ----------------------------------------------------- device loop: decisions (mirror of .cuh)

STOP_NONE, STOP_DRAIN, STOP_NOW = 0, 1, 2
GATE_WAIT, GATE_STEP, GATE_IDLE, GATE_STOP = 0, 1, 2, 3
EXIT_RUNNING, EXIT_STOPPED, EXIT_DRAINED, EXIT_DRAIN_TIMEOUT, EXIT_HUNG = 0, 1, 2, 3, 4
EXIT_NAMES = ("running", "stopped", "drained", "drain timeout", "hung")

# Loop-state words (device memory) and host words: kernels/device_loop_common.cuh.
(LS_GATE_CALLS, LS_IDLE_CALLS, LS_STEPS, LS_EMPTY_STEPS, LS_LAST_STEP_EMPTY, LS_LAST_EMPTY_NS,
 LS_DRAIN_START_NS, LS_LAST_HEARTBEAT_NS, LS_EXIT, LS_LAST_BUCKET, LS_LAUNCHES,
 LS_RELAUNCHES) = range(12)
LS_WORDS = 16
HC_STOP = 0
HC_WORDS = 8
MAX_BUCKETS = 32
GATE_THREADS = 256


@dataclass
class GateInput:
    """Mirror of ``BlinkGateInput``."""

    now_ns: int = 0
    start_ns: int = 0
    last_empty_ns: int = 0
    drain_start_ns: int = 0
    poll_budget_ns: int = 0
    empty_backoff_ns: int = 0
    drain_timeout_ns: int = 0
    stop_request: int = STOP_NONE
    shutdown: int = 0
    any_busy: int = 0
    any_new: int = 0
    last_step_empty: int = 0
    polls: int = 0
    max_polls: int = 1


def gate_decide(i: GateInput) -> tuple[int, int]:
    """Mirror of ``blink_gate_decide``: (decision, exit reason)."""
    if i.stop_request == STOP_NOW:
        return GATE_STOP, EXIT_STOPPED
    draining = i.stop_request == STOP_DRAIN or i.shutdown != 0
    if draining:
        if not i.any_busy:
            return GATE_STOP, EXIT_DRAINED
        if i.drain_start_ns != 0 and i.now_ns - i.drain_start_ns > i.drain_timeout_ns:
            return GATE_STOP, EXIT_DRAIN_TIMEOUT
    if i.any_busy and (i.any_new or not i.last_step_empty or i.now_ns - i.last_empty_ns >= i.empty_backoff_ns):
        return GATE_STEP, EXIT_RUNNING
    if i.polls + 1 >= i.max_polls or i.now_ns - i.start_ns >= i.poll_budget_ns:
        return GATE_IDLE, EXIT_RUNNING
    return GATE_WAIT, EXIT_RUNNING


def dispatch_bucket(num_scheduled_tokens: int, bucket_index: int, n_buckets: int) -> int:
    """Mirror of ``blink_dispatch_bucket``."""
    if num_scheduled_tokens <= 0 or bucket_index < 0 or bucket_index >= n_buckets:
        return -1
    return int(bucket_index)


def poll_sleep_ns(polls: int, max_ns: int) -> int:
    """Mirror of ``blink_poll_sleep_ns`` (unsigned 32-bit arithmetic)."""
    ns = 256
    for _ in range(polls):
        if ns >= max_ns:
            break
        ns = (ns << 1) & 0xFFFFFFFF
    return ns if ns < max_ns else max_ns


# ------------------------------------------------------- device loop: parameter block (ABI)


class LoopParams(ctypes.Structure):
    """Mirror of ``BlinkLoopParams`` (passed by value to the loop's kernels). Pointers are
    device addresses: on a GPU, device or mapped-host pointers; in the host models, the CPU
    addresses of the same tensors."""

    _fields_ = [
        ("control", ctypes.c_uint64),
        ("slot_state", ctypes.c_uint64),
        ("slot_cancel", ctypes.c_uint64),
        ("host_ctl", ctypes.c_uint64),
        ("loop_state", ctypes.c_uint64),
        ("num_scheduled_tokens", ctypes.c_uint64),
        ("bucket_index", ctypes.c_uint64),
        ("poll_budget_ns", ctypes.c_int64),
        ("heartbeat_period_ns", ctypes.c_int64),
        ("empty_backoff_ns", ctypes.c_int64),
        ("drain_timeout_ns", ctypes.c_int64),
        ("n_slots", ctypes.c_int32),
        ("n_buckets", ctypes.c_int32),
        ("max_polls", ctypes.c_int32),
        ("max_sleep_ns", ctypes.c_int32),
        ("c_engine_state", ctypes.c_int32),
        ("c_heartbeat", ctypes.c_int32),
        ("c_shutdown", ctypes.c_int32),
        ("engine_draining", ctypes.c_int32),
        ("engine_stopped", ctypes.c_int32),
        ("engine_failed", ctypes.c_int32),
        ("slot_free", ctypes.c_int32),
        ("slot_written", ctypes.c_int32),
        ("h_loop", ctypes.c_uint64),
        ("h_step", ctypes.c_uint64),
        ("h_bucket", ctypes.c_uint64 * MAX_BUCKETS),
    ]


LOOP_PARAMS_BYTES = 7 * 8 + 4 * 8 + 12 * 4 + 2 * 8 + MAX_BUCKETS * 8


@dataclass(frozen=True)
class LoopOptions:
    """Timing knobs of the device loop (all bounded)."""

    poll_budget_ns: int = 2_000_000  # one gate invocation polls at most 2 ms...
    max_polls: int = 4096  # ...and at most this many times
    max_sleep_ns: int = 20_000  # back-off between polls: 256 ns doubling up to 20 us
    heartbeat_period_ns: int = 1_000_000  # the gate bumps the heartbeat at most every 1 ms
    empty_backoff_ns: int = 50_000  # after a step with no token (full streams), wait 50 us
    drain_timeout_ns: int = 30_000_000_000  # like Engine.drain_timeout_s


def _words(addr: int, ctype: Any, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * n).from_address(addr))


def _word(addr: int, index: int = 0) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(addr + 8 * index)


# ------------------------------------------------------- device loop: kernel models (host)


def gate_poll_model(p: LoopParams, clock_ns: Callable[[], int] = time.monotonic_ns,
                    sleep_ns: Callable[[int], None] = lambda ns: time.sleep(ns * 1e-9)) -> tuple[int, int]:
    """Host model of ``blink_gate_poll``: the same reads and writes through ``p``'s
    addresses, in the same order. (Loads and stores here are plain: the host is the
    only agent in the model; the ordering qualifiers are the CUDA source's business.)"""
    ls = _words(p.loop_state, ctypes.c_int64, LS_WORDS)
    control = _words(p.control, ctypes.c_int64, max(p.c_heartbeat, p.c_shutdown, p.c_engine_state) + 1)
    host = _words(p.host_ctl, ctypes.c_int64, HC_WORDS)
    states = _words(p.slot_state, ctypes.c_int32, p.n_slots)
    cancel = _words(p.slot_cancel, ctypes.c_int32, p.n_slots)
    start = clock_ns()
    decision, reason = GATE_WAIT, EXIT_RUNNING
    for polls in range(p.max_polls):
        st = states.copy()
        busy = bool((st != p.slot_free).any())
        fresh = bool(((st == p.slot_written) | ((st != p.slot_free) & (cancel != 0))).any())
        now = clock_ns()
        if now - int(ls[LS_LAST_HEARTBEAT_NS]) >= p.heartbeat_period_ns:
            control[p.c_heartbeat] += 1
            ls[LS_LAST_HEARTBEAT_NS] = now
        gi = GateInput(
            now_ns=now, start_ns=start, last_empty_ns=int(ls[LS_LAST_EMPTY_NS]),
            poll_budget_ns=p.poll_budget_ns, empty_backoff_ns=p.empty_backoff_ns,
            drain_timeout_ns=p.drain_timeout_ns, stop_request=int(host[HC_STOP]),
            shutdown=int(control[p.c_shutdown] != 0), any_busy=int(busy), any_new=int(fresh),
            last_step_empty=int(ls[LS_LAST_STEP_EMPTY]), polls=polls, max_polls=p.max_polls,
        )
        if (gi.stop_request == STOP_DRAIN or gi.shutdown) and ls[LS_DRAIN_START_NS] == 0:
            ls[LS_DRAIN_START_NS] = now
            control[p.c_engine_state] = p.engine_draining
        gi.drain_start_ns = int(ls[LS_DRAIN_START_NS])
        decision, reason = gate_decide(gi)
        if decision != GATE_WAIT:
            break
        sleep_ns(poll_sleep_ns(polls, p.max_sleep_ns))
    if decision == GATE_WAIT:
        decision = GATE_IDLE
    return decision, reason


def gate_record_model(p: LoopParams, decision: int, reason: int) -> None:
    """Host model of ``blink_gate_record``."""
    ls = _words(p.loop_state, ctypes.c_int64, LS_WORDS)
    ls[LS_GATE_CALLS] += 1
    if decision == GATE_IDLE:
        ls[LS_IDLE_CALLS] += 1
    if decision == GATE_STOP:
        ls[LS_EXIT] = reason
        _word(p.control, p.c_engine_state).value = p.engine_stopped


def dispatch_record_model(p: LoopParams, clock_ns: Callable[[], int] = time.monotonic_ns) -> int:
    """Host model of ``blink_dispatch_record``."""
    ls = _words(p.loop_state, ctypes.c_int64, LS_WORDS)
    d = dispatch_bucket(_word(p.num_scheduled_tokens).value, _word(p.bucket_index).value, p.n_buckets)
    ls[LS_LAST_BUCKET] = d
    if d < 0:
        ls[LS_EMPTY_STEPS] += 1
        ls[LS_LAST_STEP_EMPTY] = 1
        ls[LS_LAST_EMPTY_NS] = clock_ns()
    else:
        ls[LS_STEPS] += 1
        ls[LS_LAST_STEP_EMPTY] = 0
    return d


def gate_kernel_model(p: LoopParams, set_conditional: Callable[[int, int], None]) -> None:
    """Host model of the ``blink_gate`` kernel."""
    decision, reason = gate_poll_model(p)
    gate_record_model(p, decision, reason)
    set_conditional(p.h_step, int(decision == GATE_STEP))
    set_conditional(p.h_loop, int(decision != GATE_STOP))


def dispatch_kernel_model(p: LoopParams, set_conditional: Callable[[int, int], None]) -> None:
    """Host model of the ``blink_dispatch`` kernel."""
    d = dispatch_record_model(p)
    for i in range(p.n_buckets):
        set_conditional(p.h_bucket[i], int(i == d))


KERNEL_MODELS: dict[str, Callable[..., None]] = {
    "blink_gate": gate_kernel_model,
    "blink_dispatch": dispatch_kernel_model,
    "blink_publish_fence": lambda p, set_conditional: None,
}


# --------------------------------------------------------- device loop: graph construction


class GraphApi(Protocol):
    """What :func:`build_conditional_loop` needs from a graph library. Implemented over the
    CUDA driver (``blink.engine.gpu_loop.CudaGraphApi``) and on the host
    (:class:`EagerGraphApi`)."""

    def create_graph(self) -> Any: ...
    def conditional_handle(self, graph: Any, default: int) -> int: ...
    def add_conditional(self, graph: Any, deps: list[Any], handle: int, kind: str) -> tuple[Any, Any]: ...
    def add_kernel(self, graph: Any, deps: list[Any], kernel: str, grid: int, block: int,
                   params: LoopParams | None) -> Any: ...
    def add_dependency(self, graph: Any, src: Any, dst: Any) -> None: ...
    def begin_capture(self, graph: Any) -> None: ...
    def segment(self, fn: Callable[[], Any]) -> Any: ...
    def launch(self, kernel: str, grid: int, block: int, params: LoopParams | None) -> None: ...
    def capture_dependencies(self) -> list[Any]: ...
    def set_capture_dependencies(self, nodes: list[Any]) -> None: ...
    def end_capture(self) -> None: ...
    def abort_capture(self) -> None: ...
    def instantiate(self, graph: Any) -> Any: ...
    def pointer(self, tensor: torch.Tensor) -> int: ...


@dataclass
class ConditionalLoop:
    """Tier B's graph, built: the executable, the parameter block, the static buffers."""

    exec: Any
    graph: Any
    params: LoopParams
    batch: StepBatch
    loop_state: torch.Tensor
    host_ctl: torch.Tensor
    handles: dict[str, Any]
    plan: GraphPlan
    keep: list[Any] = field(default_factory=list)  # objects the graph's memory depends on


def build_conditional_loop(
    api: GraphApi,
    parts: StepParts,
    plan: GraphPlan,
    base: LoopParams,
    loop_state: torch.Tensor,
    host_ctl: torch.Tensor,
) -> ConditionalLoop:
    """Build tier B's graph (layout in ``kernels/device_loop.cu``) through ``api``.

    ``base`` holds the ring pointers, sizes and options; this fills in the schedule's
    output pointers and the conditional handles. Capture order follows ``plan``."""
    if len(plan.buckets) > MAX_BUCKETS:
        raise ValueError(f"{len(plan.buckets)} buckets; the device loop handles at most {MAX_BUCKETS}")
    root = api.create_graph()
    h_loop = api.conditional_handle(root, 1)
    _, body = api.add_conditional(root, [], h_loop, "while")
    h_step = api.conditional_handle(body, 0)
    step_node, step_graph = api.add_conditional(body, [], h_step, "if")
    h_buckets = [api.conditional_handle(step_graph, 0) for _ in plan.buckets]

    # The step: [schedule] -> dispatch -> IF(bucket b) for every b.
    with _capturing(api, step_graph, "the schedule"):
        step = _capture_step(api, parts, plan, base, loop_state, host_ctl, step_graph,
                             h_loop, h_step, h_buckets)
    batch, params, bucket_graphs = step.batch, step.params, step.bucket_graphs

    # Bucket bodies, largest first: [forward + sampler + update] -> publish fence.
    rows = dict(zip(plan.buckets, plan.rows))
    for name in plan.capture_order[1:]:
        tokens = int(name.split(":")[1])
        with _capturing(api, bucket_graphs[tokens], f"bucket {tokens}"):
            api.segment(lambda t=tokens: model_phase(parts, batch, tokens=t, rows=rows[t], compact=False))
            api.launch("blink_publish_fence", 1, 32, None)

    # The gate, ahead of the step in the WHILE body.
    gate = api.add_kernel(body, [], "blink_gate", 1, GATE_THREADS, params)
    api.add_dependency(body, gate, step_node)
    exec_ = api.instantiate(root)
    return ConditionalLoop(exec=exec_, graph=root, params=params, batch=batch, loop_state=loop_state,
                           host_ctl=host_ctl, plan=plan,
                           handles={"loop": h_loop, "step": h_step, "buckets": h_buckets})


@contextmanager
def _capturing(api: GraphApi, graph: Any, what: str) -> Iterator[None]:
    """A capture into ``graph`` that is ended on every path: a failure inside it aborts the
    capture (and the allocator's routing to the private pool) before the error propagates,
    so the process is never left capturing."""
    api.begin_capture(graph)
    try:
        yield
    except BaseException as exc:
        api.abort_capture()
        raise BlinkError(f"capturing {what} into tier B's graph failed: {type(exc).__name__}: {exc}") from exc
    api.end_capture()


@dataclass
class _StepCapture:
    batch: StepBatch
    params: LoopParams
    bucket_graphs: dict[int, Any]


def _capture_step(api: GraphApi, parts: StepParts, plan: GraphPlan, base: LoopParams,
                  loop_state: torch.Tensor, host_ctl: torch.Tensor, step_graph: Any,
                  h_loop: int, h_step: int, h_buckets: list[int]) -> _StepCapture:
    """The step graph's captured part: schedule, dispatch, one IF node per bucket."""
    batch: StepBatch = api.segment(parts.scheduler.schedule)
    params = LoopParams.from_buffer_copy(base)
    params.num_scheduled_tokens = api.pointer(batch.num_scheduled_tokens)
    params.bucket_index = api.pointer(batch.bucket_index)
    params.loop_state = api.pointer(loop_state)
    params.host_ctl = api.pointer(host_ctl)
    params.n_buckets = len(plan.buckets)
    params.h_loop, params.h_step = h_loop, h_step
    for i, h in enumerate(h_buckets):
        params.h_bucket[i] = h
    api.launch("blink_dispatch", 1, 32, params)
    after_dispatch = api.capture_dependencies()
    bucket_nodes, bucket_graphs = [], {}
    for tokens, h in zip(plan.buckets, h_buckets):
        node, g = api.add_conditional(step_graph, after_dispatch, h, "if")
        bucket_nodes.append(node)
        bucket_graphs[tokens] = g
    api.set_capture_dependencies(bucket_nodes)
    return _StepCapture(batch, params, bucket_graphs)


# ------------------------------------------------------ device loop: host graph interpreter


@dataclass
class _Node:
    kind: str  # "kernel" | "segment" | "conditional"
    deps: list["_Node"]
    kernel: str = ""
    params: LoopParams | None = None
    fn: Callable[[], Any] | None = None
    out: Any = None
    cond: str = ""
    handle: int = 0
    body: "_Graph | None" = None


@dataclass
class _Graph:
    nodes: list[_Node] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)


class EagerGraphApi:
    """:class:`GraphApi` that records the graph and runs it on the host.

    Kernel nodes run their models (:data:`KERNEL_MODELS`) on the same parameter block the
    GPU kernels get; segments (the torch work a CUDA build captures) run eagerly, their
    outputs copied into the memory of the first run (graph semantics); conditional nodes
    follow their handles like the CUDA graph executor. ``launch(exec)`` runs to the end
    (the WHILE handle reaching 0)."""

    def __init__(self) -> None:
        self._next_handle = 1
        self.values: dict[int, int] = {}
        self.defaults: dict[int, int] = {}
        self._capture: _Graph | None = None
        self._capture_deps: list[_Node] = []
        self.kernel_runs: dict[str, int] = {}
        self.aborted_captures = 0

    # -- building
    def create_graph(self) -> _Graph:
        return _Graph()

    def conditional_handle(self, graph: _Graph, default: int) -> int:
        h = self._next_handle
        self._next_handle += 1
        graph.handles.append(h)
        self.defaults[h] = default
        return h

    def add_conditional(self, graph: _Graph, deps: list[_Node], handle: int, kind: str) -> tuple[_Node, _Graph]:
        if kind not in ("if", "while"):
            raise ValueError(kind)
        node = _Node("conditional", list(deps), cond=kind, handle=handle, body=_Graph())
        graph.nodes.append(node)
        return node, node.body  # type: ignore[return-value]

    def add_kernel(self, graph: _Graph, deps: list[_Node], kernel: str, grid: int, block: int,
                   params: LoopParams | None) -> _Node:
        node = _Node("kernel", list(deps), kernel=kernel,
                     params=None if params is None else LoopParams.from_buffer_copy(params))
        graph.nodes.append(node)
        return node

    def add_dependency(self, graph: _Graph, src: _Node, dst: _Node) -> None:
        dst.deps.append(src)

    def begin_capture(self, graph: _Graph) -> None:
        if self._capture is not None:
            raise RuntimeError("a capture is already under way")
        self._capture, self._capture_deps = graph, []

    def _append(self, node: _Node) -> None:
        assert self._capture is not None, "not capturing"
        self._capture.nodes.append(node)
        self._capture_deps = [node]

    def segment(self, fn: Callable[[], Any]) -> Any:
        node = _Node("segment", list(self._capture_deps), fn=fn)
        node.out = clone_outputs(fn())
        self._append(node)
        return node.out

    def launch(self, kernel: str, grid: int, block: int, params: LoopParams | None) -> None:
        self._append(_Node("kernel", list(self._capture_deps), kernel=kernel,
                           params=None if params is None else LoopParams.from_buffer_copy(params)))

    def capture_dependencies(self) -> list[_Node]:
        return list(self._capture_deps)

    def set_capture_dependencies(self, nodes: list[_Node]) -> None:
        self._capture_deps = list(nodes)

    def end_capture(self) -> None:
        self._capture = None

    def abort_capture(self) -> None:
        self._capture = None
        self.aborted_captures += 1

    def instantiate(self, graph: _Graph) -> _Graph:
        return graph

    def pointer(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr()

    # -- running
    def set_conditional(self, handle: int, value: int) -> None:
        self.values[handle] = value

    def launch_graph(self, graph: _Graph, max_iterations: int | None = None) -> int:
        """Run ``graph`` to completion; returns WHILE iterations run. ``max_iterations``
        bounds them (tests)."""
        for h, v in self.defaults.items():
            self.values[h] = v
        return self._run(graph, max_iterations)

    def _run(self, graph: _Graph, max_iterations: int | None) -> int:
        iterations = 0
        done: set[int] = set()
        pending = list(graph.nodes)
        while pending:
            ready = [n for n in pending if all(id(d) in done for d in n.deps)]
            if not ready:
                raise RuntimeError("graph has a dependency cycle")
            for node in ready:
                if node.kind == "kernel":
                    self.kernel_runs[node.kernel] = self.kernel_runs.get(node.kernel, 0) + 1
                    KERNEL_MODELS[node.kernel](node.params, self.set_conditional)
                elif node.kind == "segment":
                    fresh = node.fn()  # type: ignore[misc]
                    if node.out is not None:
                        copy_into(node.out, fresh)
                elif node.cond == "if":
                    if self.values.get(node.handle, 0):
                        iterations += self._run(node.body, max_iterations)  # type: ignore[arg-type]
                else:  # while
                    while self.values.get(node.handle, 0):
                        self._run(node.body, max_iterations)  # type: ignore[arg-type]
                        iterations += 1
                        if max_iterations is not None and iterations >= max_iterations:
                            break
                done.add(id(node))
                pending.remove(node)
        return iterations
