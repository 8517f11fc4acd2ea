"""benchmarks/gpu_sched_launches.py: the launch count of the captured control-plane step
(issue 32), reference and fused, on a small table (the fused stages under the interpreter)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks import gpu_sched_launches as gsl  # noqa: E402


def test_the_count_adds_up_and_the_fused_step_launches_far_less():
    ref = gsl.count(16, 3, fused=False)
    assert ref["progress"] > 0
    assert ref["launches_per_step"] == pytest.approx(
        ref["aten_per_step"] + ref["views_per_step"] + ref["fences_per_step"] + ref["triton_per_step"])
    assert ref["triton_per_step"] == 0 and ref["fences_per_step"] > 0
    assert {"admit", "prefix_lookup", "build_batch"} <= set(ref["by_stage"])
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused stages were imported without TRITON_INTERPRET=1")
    fused = gsl.count(16, 3, fused=True)
    assert fused["progress"] == ref["progress"]  # the same work was done
    assert fused["triton_per_step"] > 0
    # The interpreter's own copies are not counted; the fused step is a small fraction.
    assert fused["launches_per_step"] < ref["launches_per_step"] / 5
