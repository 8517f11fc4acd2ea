"""The suite's fast ``xor_sum`` in Triton's interpreter (tests/triton_interpreter.py, installed
by tests/conftest.py) is in place once triton is imported, and gives the bits of the interpreter's own element-by-element reduction,
for every axis, keep_dims and integer width, and ``tl.sort`` (built on it: the fused
scheduler's allocator and queue order) still sorts."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from triton_interpreter import install  # noqa: E402


@triton.jit
def _xor_kernel(x_ptr, out0_ptr, out1_ptr, out2_ptr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    a, b, c = tl.arange(0, A), tl.arange(0, B), tl.arange(0, C)
    x = tl.load(x_ptr + a[:, None, None] * (B * C) + b[None, :, None] * C + c[None, None, :])
    tl.store(out0_ptr + b[:, None] * C + c[None, :], tl.xor_sum(x, 0))
    tl.store(out1_ptr + a[:, None, None] * C + c[None, None, :], tl.xor_sum(x, 1, keep_dims=True))
    tl.store(out2_ptr + a, tl.xor_sum(tl.xor_sum(x, 2), 1))


@triton.jit
def _sort_kernel(x_ptr, out_ptr, N: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, N), tl.sort(tl.load(x_ptr + tl.arange(0, N)), 0))


def test_installed_before_triton_was_imported():
    """conftest installed them before any test module imported triton."""
    assert interpreter.ReduceOps._blink_fast_xor
    assert interpreter._patch_lang._blink_once_per_launch


def _run_xor(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, b, c = x.shape
    outs = (x.new_empty(b, c), x.new_empty(a, c), x.new_empty(a))
    _xor_kernel[(1,)](x, *outs, a, b, c)
    return outs


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64])
def test_fast_xor_sum_gives_the_generic_reductions_bits(dtype):
    install()
    ops = interpreter.ReduceOps
    fast, generic = ops.apply_impl, ops._blink_generic_apply_impl
    assert fast is not generic
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (4, 8, 2), dtype=dtype, generator=torch.Generator().manual_seed(3))
    got = _run_xor(x)
    ops.apply_impl = generic
    try:
        slow = _run_xor(x)
    finally:
        ops.apply_impl = fast
    want = (np.bitwise_xor.reduce(x.numpy(), 0), np.bitwise_xor.reduce(x.numpy(), 1),
            np.bitwise_xor.reduce(x.numpy(), (1, 2)))
    for s, g, w in zip(slow, got, want):
        assert s.dtype == g.dtype == dtype and torch.equal(s, g) and np.array_equal(g.numpy(), w)


def test_sort_still_sorts():
    install()
    assert interpreter.ReduceOps._blink_fast_xor
    x = torch.randint(-2**62, 2**62, (64,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    x[5] = x[9]  # a tie
    out = torch.empty_like(x)
    _sort_kernel[(1,)](x, out, 64)
    assert torch.equal(out, torch.sort(x).values)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    y = _twice(_twice(x)) + tl.cumsum(x, 0)  # a helper of this module, twice, and a library one
    tl.store(out_ptr + tl.arange(0, N), tl.sort(y, 0) ^ tl.xor_sum(x, 0))


def test_helpers_patching_once_per_launch_changes_nothing(monkeypatch):
    install()
    ours = interpreter._patch_lang
    real = ours._blink_real
    x = torch.randint(-1000, 1000, (32,), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    before = {name: getattr(tl, name) for name in ("arange", "load", "sort", "cumsum")}
    calls = []

    def counted(fn):
        calls.append(fn)
        return real(fn)

    outs = []
    for patch in (counted, None):  # the interpreter's own patching at every call, then ours
        if patch is not None:
            monkeypatch.setattr(interpreter, "_patch_lang", patch)
        else:
            monkeypatch.setattr(interpreter, "_patch_lang", ours)
            monkeypatch.setattr(ours, "_blink_real", counted)
        calls.clear()
        out = torch.empty_like(x)
        _helpers_kernel[(1,)](x, out, 32)
        outs.append((out, len(calls)))
        assert {name: getattr(tl, name) for name in before} == before  # restored after the launch
    (every, n_every), (once, n_once) = outs
    assert torch.equal(every, once)
    want = torch.sort(x * 4 + torch.cumsum(x, 0)).values ^ int(np.bitwise_xor.reduce(x.numpy()))
    assert torch.equal(once, want)
    assert n_every > n_once >= 1  # helpers skipped, the launch itself patched
