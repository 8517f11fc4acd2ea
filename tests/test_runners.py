"""Step runners (blink.engine.runners): one decision per engine, named in the start log."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from blink.engine.runners import RUNNER_NAMES, choose_step_runner

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import tiny_model_dir  # noqa: E402


@pytest.mark.parametrize("loop, device, eager, graphs, model, want", [
    ("cpu", "cpu", True, True, True, "cpu-graphs"),
    ("cpu", "cpu", True, False, True, "eager"),
    ("cpu", "cpu", False, True, True, "compiled"),
    ("cpu", "cpu", False, True, False, "eager"),  # --model null: nothing to compile
    ("host", "cuda", True, True, True, "tier-a"),
    ("device", "cuda", True, True, True, "tier-b"),
    ("host", "cpu", True, True, True, "tier-a"),  # a host simulation of the tier
])
def test_one_function_chooses_the_runner(loop, device, eager, graphs, model, want):
    choice = choose_step_runner(loop=loop, device=device, enforce_eager=eager, cpu_graphs=graphs,
                                has_model=model)
    assert choice.name == want and choice.name in RUNNER_NAMES and choice.reason
    assert not choice.speculative
    spec = choose_step_runner(loop=loop, device=device, enforce_eager=eager, cpu_graphs=graphs,
                              has_model=model, speculative=True)
    assert spec.name == want and spec.speculative  # the choice names the speculative variant


def test_the_engine_runs_its_chosen_runner_and_says_which(tmp_path, caplog):
    from blink.engine.engine import Engine, EngineConfig

    model = tiny_model_dir(tmp_path)
    for graphs, want in ((True, "cpu-graphs"), (False, "eager")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="blink.engine"):
            engine = Engine(EngineConfig(model=str(model), device="cpu", kv_cache_tokens=1024,
                                         max_model_len=128, cpu_graphs=graphs))
        try:
            assert engine.runner.name == want
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step runner:")]
            assert len(lines) == 1 and lines[0].startswith(f"step runner: {want} ("), lines
            assert (engine.executor.decode_graphs is not None) == graphs  # only its runner records
        finally:
            engine.close()
