"""The Triton op table, and an ahead-of-time compile of every kernel for an H100/H200.

The interpreter tests check numerics but not what the GPU compiler accepts (it runs kernel
bodies as Python). Here every op is called with real model shapes and each launch is
compiled to a cubin for sm_90 by Triton's CUDA backend, in a subprocess without
``TRITON_INTERPRET`` (no GPU needed): compile errors, shared-memory overflow and register
spills fail the test.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest

from blink.kernels import _OP_NAMES, _triton_ops
from blink.kernels.reference import (
    mask as mask_reference,
    layers as reference,
    sampling as sampling_reference,
)

triton = pytest.importorskip("triton")


def test_triton_table_covers_every_reference_op_with_the_same_signature():
    table = _triton_ops()
    assert set(_OP_NAMES) <= set(table), f"missing: {set(_OP_NAMES) - set(table)}"
    for name, fn in table.items():
        ref_fn = (getattr(reference, name, None) or getattr(sampling_reference, name, None)
                  or getattr(mask_reference, name))
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(ref_fn).parameters), name
        assert fn.__module__.startswith("blink.kernels.triton."), name


def _compiled(*argv: str) -> subprocess.CompletedProcess:
    """A compile check (``python *argv --arch 90``) in a process without ``TRITON_INTERPRET``,
    which has exited 0 and reported no error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, *argv, "--arch", "90"], capture_output=True, text=True, env=env,
                          timeout=600)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " 0 error(s)" in proc.stdout, report
    return proc


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_spills():
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no CUDA backend")
    proc = _compiled("-m", "blink.kernels.triton.compile_check")
    kernels = {line.split()[0] for line in proc.stdout.splitlines()[1:] if line.startswith("_")}
    expected = {
        "_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel", "_write_kv_kernel",
        "_attn_kernel", "_attn_reduce_kernel", "_route_kernel", "_moe_gate_up_kernel",
        "_moe_down_kernel", "_filter_kernel", "_sample_kernel", "_uniform_kernel",
        "_mask_kernel", "_wait_kernel",
    }
    assert expected <= kernels, f"not compiled: {expected - kernels}"
    for line in proc.stdout.splitlines()[1:]:
        cols = line.split()
        if line.startswith("_") and cols[-1] != "?":
            assert int(cols[-1]) == 0, f"register spills: {line}"


@pytest.mark.slow
def test_the_fused_scheduler_stages_compile_for_sm90():
    """Every Triton stage of one captured scheduler step compiles for sm_90
    (tests/sched_compile_check.py); the prefix insert keeps its tiles in registers, and the
    allocator's sort of 16,384 blocks spills little on ``_pool_warps``' 16 warps (1.7 KB
    measured; 152 KB on 4)."""
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no CUDA backend")
    proc = _compiled(str(Path(__file__).with_name("sched_compile_check.py")))
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[1:] if line.startswith("_")}
    expected = {
        "_cancel_kernel", "_release_kernel", "_admit_kernel", "_lookup_kernel", "_allocate_kernel",
        "_build_batch_kernel", "_stats_kernel", "_register_kernel", "_publish_words_kernel",
        "_publish_payload_kernel", "_publish_finish_kernel", "_publish_state_kernel",
    }
    assert expected <= set(rows), f"not compiled: {expected - set(rows)}"
    assert rows["_register_kernel"][-1] == "0", f"the prefix insert spills: {rows['_register_kernel']}"
    assert int(rows["_allocate_kernel"][-1]) <= 4096, f"the allocator spills: {rows['_allocate_kernel']}"
