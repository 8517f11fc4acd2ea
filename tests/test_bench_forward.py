"""benchmarks/bench_forward.py runs end to end (on a tiny model) and prints its table."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_forward_prints_before_and_now(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_forward

    model = make_tiny_model("llama", tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "bench_forward", "--model", str(model), "--dtype", "bfloat16", "float32", "--decode", "1", "3",
        "--prefill", "2x8", "--context", "8", "--steps", "1", "--rounds", "1",
    ])
    bench_forward.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| bfloat16", "| float32"))]
    assert len(rows) == 6, out
    assert all(line.count("x |") == 2 for line in rows), out
