"""What the device loop's CUDA C and the host share: decisions, constants, the parameter
block, the timing options (mirrors of ``kernels/cuda/device_loop_logic.cuh`` and
``kernels/cuda/device_loop_common.cuh``; the suite compiles the headers for the host and compares).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

STOP_NONE, STOP_DRAIN, STOP_NOW = 0, 1, 2
GATE_WAIT, GATE_STEP, GATE_IDLE, GATE_STOP = 0, 1, 2, 3
EXIT_RUNNING, EXIT_STOPPED, EXIT_DRAINED, EXIT_DRAIN_TIMEOUT, EXIT_HUNG = 0, 1, 2, 3, 4
EXIT_NAMES = ("running", "stopped", "drained", "drain timeout", "hung")

# Loop-state words (device memory) and host words: kernels/cuda/device_loop_common.cuh.
# LS_LAUNCHES/LS_RELAUNCHES are the persistent launcher's words (kernels/cuda/device_launch.cu, the
# compile-checked alternative); mirrored so that the header check covers every word.
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
    """Timing knobs of the device loop's gate (all bounded). Its drain limit is the engine's
    one ``drain_timeout_s`` (:func:`blink.engine.gpu.tier_b.loop_params`)."""

    poll_budget_ns: int = 2_000_000  # one gate invocation polls at most 2 ms...
    max_polls: int = 4096  # ...and at most this many times
    max_sleep_ns: int = 20_000  # back-off between polls: 256 ns doubling up to 20 us
    heartbeat_period_ns: int = 1_000_000  # the gate bumps the heartbeat at most every 1 ms
    empty_backoff_ns: int = 50_000  # after a step with no token (full streams), wait 50 us
