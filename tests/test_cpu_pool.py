"""The CPU kernels' one worker pool (kernels/cpu/pool.c) and their thread setting
(blink.kernels.cpu.threads): a call split over threads gives the bits of the one-thread call
in every kernel library, concurrent callers and a forked child still get right answers (never
a hang), and the setting refuses nonsense, from the API and from the command line."""
from __future__ import annotations

import ctypes
import itertools
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch

from blink.kernels.cpu import fused as cpu_fused, pool as cpu_pool, q4_linear as cpu_q4_linear
from blink.kernels.cpu.threads import kernel_threads, set_kernel_threads

BF16 = torch.bfloat16

needs_pool = pytest.mark.skipif(cpu_pool.LIBRARY.get() is None or cpu_fused.library() is None,
                                reason="no C compiler here: the kernels run unsplit")


@pytest.fixture
def kernel_thread_setting():
    """Restores the process's setting (the default: torch's threads) after the test."""
    yield set_kernel_threads
    set_kernel_threads(None)


def _fused_outputs(seed: int) -> list[torch.Tensor]:
    """Norm, residual, rope and SiLU of calls big enough to split (a prefill's sizes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 576, generator=g).to(BF16)
    residual = torch.randn(512, 576, generator=g).to(BF16)
    weight = torch.randn(576, generator=g).to(BF16)
    normed, res = cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    qkv = torch.randn(512, 15, 64, generator=g).to(BF16)
    positions = torch.arange(512)
    cos_sin = torch.randn(1024, 64, generator=g)
    q, k = cpu_fused.apply_rope(qkv[:, :9], qkv[:, 9:12], positions, cos_sin)
    silu = cpu_fused.silu_and_mul(torch.randn(512, 3072, generator=g).to(BF16))
    return [normed, res, q, k, silu]


@needs_pool
def test_split_calls_give_the_one_thread_bits(kernel_thread_setting):
    kernel_thread_setting(1)
    one = _fused_outputs(0)
    kernel_thread_setting(2)
    assert kernel_threads() == 2
    two = _fused_outputs(0)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    # the test can fail: other inputs give other outputs
    assert not torch.equal(_fused_outputs(1)[-1], two[-1])


@needs_pool
def test_libraries_share_one_pool_and_concurrent_callers_are_right(kernel_thread_setting):
    """Two Python threads call kernels of two libraries at once, many times: one holds the
    pool, the other runs its parts on its own thread; every result is the serial one."""
    if not cpu_q4_linear.available():
        pytest.skip("no AMX kernel here")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cpu_q4_linear import gguf_like

    weight = cpu_q4_linear.pack(*gguf_like(1024, 2048))
    x = torch.randn(64, 2048).to(BF16)
    kernel_thread_setting(1)
    want_linear = cpu_q4_linear.linear(x, weight, None)
    want_fused = _fused_outputs(3)
    kernel_thread_setting(2)
    errors: list[str] = []

    def linear_caller() -> None:
        for _ in range(20):
            if not torch.equal(cpu_q4_linear.linear(x, weight, None), want_linear):
                errors.append("linear")

    def fused_caller() -> None:
        for _ in range(20):
            if not all(torch.equal(a, b) for a, b in zip(_fused_outputs(3), want_fused)):
                errors.append("fused")

    threads = [threading.Thread(target=linear_caller), threading.Thread(target=fused_caller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a kernel call hung"
    assert not errors


_DECODE_SPLIT_CHILD = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from test_cpu_q4_linear import gguf_like
from blink.kernels.cpu import fused as cpu_fused, q4_linear as cpu_q4_linear
from blink.kernels.cpu.threads import set_kernel_threads
from blink.threads.roles import task_ids, task_name

def workers(wait):
    # a worker names itself once it runs, which may be after the call (its part claimed here)
    for _ in range(500 if wait else 1):
        names = [name for name in map(task_name, task_ids()) if name is not None]  # (a thread may end meanwhile)
        if any(name.startswith("blink-kern-") for name in names):
            break
        time.sleep(0.01)
    return sum(name.startswith("blink-kern-") for name in names)

torch.manual_seed(0)
weight = cpu_q4_linear.pack(*gguf_like(576, 576))
x = torch.randn(16, 576).to(torch.bfloat16)  # a 16-row decode step's o_proj
residual = torch.randn(16, 576).to(torch.bfloat16)
norm_weight = torch.randn(576).to(torch.bfloat16)
set_kernel_threads(1)
want = [cpu_q4_linear.linear(x, weight, None), *cpu_fused.fused_add_rms_norm(x, residual, norm_weight, 1e-5)]
assert workers(wait=False) == 0, "a one-thread call started a worker"
set_kernel_threads(2)
got = [cpu_q4_linear.linear(x, weight, None), *cpu_fused.fused_add_rms_norm(x, residual, norm_weight, 1e-5)]
assert all(torch.equal(a, b) for a, b in zip(want, got)), "a split call changed the bits"
print("workers", workers(wait=True))
"""


@needs_pool
def test_a_decode_steps_projection_splits_and_keeps_its_bits():
    """A 16-row decode step's 576 x 576 projection splits over two kernel threads (a worker
    starts; session 28 split decode steps too) and gives the one-thread call's bits; a fresh
    process, since an earlier test may have started this one's workers."""
    import subprocess
    import sys
    from pathlib import Path

    if not cpu_q4_linear.available():
        pytest.skip("no AMX kernel here")
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", _DECODE_SPLIT_CHILD, str(tests)], capture_output=True,
                          text=True, timeout=300, cwd=tests.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["workers", "1"]


@needs_pool
def test_an_error_in_a_workers_part_reaches_the_caller(kernel_thread_setting):
    """A split call whose bad input lies in either part raises, whichever thread claimed it,
    and the pool serves the next call (512 tokens of rotary embedding split in two)."""
    kernel_thread_setting(2)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(512, 15, 64, generator=g).to(BF16)
    cos_sin = torch.randn(1024, 64, generator=g)
    for bad in (3, 500):  # in the first part, in the second
        positions = torch.arange(512)
        positions[bad] = 1024
        with pytest.raises(IndexError, match="outside the 1024-position table"):
            cpu_fused.apply_rope(qkv[:, :9], qkv[:, 9:12], positions, cos_sin)
    q, k = cpu_fused.apply_rope(qkv[:, :9], qkv[:, 9:12], torch.arange(512), cos_sin)
    kernel_thread_setting(1)
    q1, k1 = cpu_fused.apply_rope(qkv[:, :9], qkv[:, 9:12], torch.arange(512), cos_sin)
    assert torch.equal(q, q1) and torch.equal(k, k1)


def _child_silu(queue) -> None:
    torch.set_num_threads(1)  # no OpenMP team in a forked child (libgomp's own limit)
    set_kernel_threads(2)
    x = torch.ones(512, 3072, dtype=BF16)
    queue.put(float(cpu_fused.silu_and_mul(x).float().sum()))


@needs_pool
def test_a_forked_child_starts_its_own_workers(kernel_thread_setting):
    """The parent's workers do not exist in a forked child: its split calls must not wait for
    them."""
    kernel_thread_setting(2)
    want = float(cpu_fused.silu_and_mul(torch.ones(512, 3072, dtype=BF16)).float().sum())  # parent's pool started
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_silu, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's split call hung")
    assert child.exitcode == 0 and queue.get(timeout=5) == want


def test_the_setting_refuses_nonsense(kernel_thread_setting):
    with pytest.raises(ValueError, match="at least 1"):
        kernel_thread_setting(0)
    kernel_thread_setting(None)
    assert kernel_threads() == torch.get_num_threads()


def test_the_engine_refuses_zero_threads():
    from blink.engine.engine import Engine, EngineConfig
    from blink.errors import BlinkError

    for name in ("threads", "kernel_threads"):
        with pytest.raises(BlinkError, match=f"--{name.replace('_', '-')} must be at least 1"):
            Engine(EngineConfig(model="null", device="cpu", **{name: 0}))


def test_serve_gives_the_kernels_every_core():
    from blink.launcher import serve_engine_threads, serve_kernel_threads

    import os
    cores = len(os.sched_getaffinity(0))
    assert serve_kernel_threads() == cores and serve_kernel_threads(2) == max(1, cores // 2)
    assert serve_engine_threads() == max(1, cores - 1)


class _Part(ctypes.Structure):
    """kernels.h's blink_part_t."""

    _fields_ = [("args", ctypes.c_void_p), ("lo", ctypes.c_int64), ("hi", ctypes.c_int64), ("status", ctypes.c_int)]


_RUN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_Part))


@needs_pool
def test_the_pool_hands_out_every_part_once_whether_its_workers_poll_or_sleep():
    """blink_pool_split straight from Python: each call's parts are the even cut of its items
    into ``parts`` (more parts than threads, claimed in turn), each run exactly once, on the
    caller and the worker; between calls the gaps are shorter than the workers' poll (a polling
    worker takes the call) and longer (a sleeping one is woken, or the caller takes every part),
    and no call is lost or hangs; a part's nonzero status reaches the caller."""
    pool = cpu_pool.LIBRARY.get()
    seen: list[tuple[int, int, int]] = []

    def run(part):
        p = part.contents
        seen.append((p.lo, p.hi, threading.get_ident()))
        if p.lo <= 37 < p.hi and fail[0]:
            p.status = 7
        return None

    fail = [False]
    callback = _RUN(run)  # (kept alive for the calls)
    run_address = ctypes.cast(callback, ctypes.c_void_p)
    threads_seen: set[int] = set()
    results: list[str] = []

    def calls() -> None:
        # 240 calls, then more (up to 60 s) until a worker has taken a part: the caller may
        # rightly take every part of a call while the worker is not running, and on a loaded
        # host (a CI run) it did so for all 240 calls.
        deadline = time.monotonic() + 60
        for call in itertools.count():
            if call >= 240 and (len(threads_seen) == 2 or time.monotonic() > deadline):
                break
            seen.clear()
            items, parts = 100 + call % 7, (2, 5, 16)[call % 3]
            if pool.blink_pool_split(run_address, None, items, 2, parts) != 0:
                results.append(f"call {call}: a nonzero status")
            want = [(items * c // parts, items * (c + 1) // parts) for c in range(parts)]
            if sorted((lo, hi) for lo, hi, _ in seen) != want:
                results.append(f"call {call}: parts {sorted(seen)}, not {want}")
            threads_seen.update(ident for *_, ident in seen)
            time.sleep((0, 5e-5, 1e-3)[call % 3])  # the poll is 200 us
        fail[0] = True
        results.append(f"status {pool.blink_pool_split(run_address, None, 100, 2, 16)}")
        fail[0] = False
        results.append(f"status {pool.blink_pool_split(run_address, None, 100, 2, 16)}")

    caller = threading.Thread(target=calls, daemon=True)
    caller.start()
    caller.join(timeout=120)
    assert not caller.is_alive(), "a call of the pool hung"
    assert results == ["status 7", "status 0"]
    assert len(threads_seen) == 2, "no worker took a part of any call in 60 s"


def test_the_pool_runs_every_item_once_under_a_stress_of_calls(tmp_path):
    """tests/native/pool_stress.c built with pool.c: 60,000 calls of varying items, threads (2-4)
    and parts, back to back and around the workers' poll, each item run exactly once inside its
    call and each call's status returned. (A late worker that read the next call's part count
    once claimed a part of the finished call and ran items twice: the call now closes its claim
    word before the next call's fields are written.)"""
    import subprocess

    from blink.shared.native_build import find_compiler

    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    source = Path(cpu_pool.__file__).with_name("pool.c")
    binary = tmp_path / "pool_stress"
    subprocess.run([compiler, "-O2", "-pthread", "-I", str(source.parent),
                    str(Path(__file__).with_name("native") / "pool_stress.c"), str(source), "-o", str(binary)],
                   check=True, capture_output=True, timeout=120)
    done = subprocess.run([str(binary), "60000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok 60000", done.stdout + done.stderr
