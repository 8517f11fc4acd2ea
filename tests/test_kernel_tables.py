"""The CPU back-end's op tables (blink.kernels.ops) under the reference's op names and
signatures, as the Triton table is (tests/test_kernels_compile.py): a kernel lives beside its
torch reference by name, so model and sampler code never branch on which one they got."""
from __future__ import annotations

import inspect

import pytest

from blink.kernels import ops_for
from blink.kernels.ops import compiled_cpu_ops
from blink.kernels.reference import layers, mask, sampling


def _reference(name: str):
    return getattr(layers, name, None) or getattr(sampling, name, None) or getattr(mask, name)


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("table", ["eager", "compiled"])
def test_every_cpu_op_takes_the_reference_signature(table):
    ops = vars(ops_for("cpu") if table == "eager" else compiled_cpu_ops())
    for name, fn in ops.items():
        assert _parameters(fn) == _parameters(_reference(name)), name
        module = getattr(fn, "__module__", "") or ""
        assert module.startswith(("blink.kernels.reference.", "blink.kernels.cpu.")), (name, module)
