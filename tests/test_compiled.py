"""Compiled CPU steps (blink.engine.compiled): the tokens equal transformers' greedy ones,
nothing compiles again in steady state, compiler failures and would-be recompiles fall back
to eager with one warning, and the flags reach the engine config.

Only this file (and tests/test_cpu_paged_attention.py) compiles; every other test runs eager
(``BLINK_ENFORCE_EAGER=1`` from conftest). Compiled code is cached under pytest's cache
directory, so only a first run on a machine pays the full compile.
"""
from __future__ import annotations

import concurrent.futures
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_engine import GREEDY, Reference, assert_greedy, make_llm, random_prompts, tiny_model_dir  # noqa: E402

from blink.engine import compiled  # noqa: E402
from blink.llm import LLM  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.shared.structured_outputs import StructuredOutputs  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(request) -> Path:
    return Path(request.config.cache.mkdir("blink-inductor"))


@pytest.fixture(scope="module")
def compiled_llm(tmp_path_factory, cache_dir):
    """A compiled engine with few buckets: tokens (1, 2, 4), sample rows (1, 2)."""
    path = tiny_model_dir(tmp_path_factory.mktemp("compiled_models"), eos_token_id=0)  # structured outputs need one
    with LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=2, kv_cache_tokens=1024,
             max_num_batched_tokens=4, enforce_eager=False, compile_cache_dir=str(cache_dir)) as llm:
        yield llm


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_greedy_matches_transformers_without_recompiles(compiled_llm):
    phase = compiled_llm.engine.runner.compiled
    assert phase is not None, "enforce_eager=False must compile on CPU"
    assert phase.token_buckets == (1, 2, 4) and phase.row_buckets == (1, 2)
    assert phase.layer.failed is None and phase.head.failed is None and phase.sample.failed is None
    assert phase.attention_kernel.failed is None
    graphs = _graphs()
    ref = Reference()
    # Prompts longer than the budget: chunked prefill in 4-token steps, then decode; two
    # at once so steps mix a prefill chunk with a decode row, and rows pad to buckets.
    prompts = random_prompts(4, 3, 11, seed=5)
    outs = compiled_llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), timeout_s=120)
    for p, o in zip(prompts, outs):
        assert_greedy(ref, p, o.token_ids, ref.greedy(p, 8))
    # Seeded temperature sampling takes the other compiled sampler plan.
    compiled_llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=1.0, seed=3),
                          timeout_s=60)
    assert phase.refused == 0, "a steady-state call would have recompiled"
    assert _graphs() == graphs, "steady state compiled a new graph"


def test_compiled_loop_enforces_structured_outputs(compiled_llm):
    """A constrained row's automaton masks the logits in the compiled loop too (the warm
    heads take no token masks: a constrained batch runs the head eager with its masks)."""
    rx = "[a-d]{6}"  # the byte tokenizer: one token per character; no EOS needed
    outs = compiled_llm.generate(
        [[5, 6, 7], [9]],
        [SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputs(regex=rx)),
         SamplingParams(max_tokens=6, temperature=1.0, seed=2,
                        structured_outputs=StructuredOutputs(regex=rx))],
        timeout_s=120)
    for out in outs:
        assert re.fullmatch(rx, out.outputs[0].text), out.outputs[0].text
    assert compiled_llm.engine.runner.compiled.refused == 0


def test_compiled_steps_mask_only_the_constrained_rows(compiled_llm):
    """A constrained row next to an unconstrained one in compiled steps: the constrained row
    is masked (only its logits, the rows found on the host), the other left alone."""
    rx = r"[a-d]{2,6}!"
    outs = compiled_llm.generate([[5, 6], [9, 4]], [
        SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                       structured_outputs=StructuredOutputs(regex=rx)),
        SamplingParams(max_tokens=6, **GREEDY)], timeout_s=120)
    text = outs[0].outputs[0].text.removesuffix("\x00")
    assert outs[0].outputs[0].finish_reason == "stop" and re.fullmatch(rx, text), text
    free = compiled_llm.generate([[9, 4]], SamplingParams(max_tokens=6, **GREEDY), timeout_s=60)
    assert free[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_compiled_speculation_is_exact(tmp_path_factory, cache_dir):
    """--compile with speculation: verify steps run the compiled layers (eager head and
    sampler), the other steps the compiled step; greedy as without speculation, including
    drafts cut by a 4-token budget. In this file, after :func:`compiled_llm`, its layers and
    heads are this process's already (no second compile)."""
    from test_spec_decode import GREEDY as SPEC_GREEDY, PROMPTS as SPEC_PROMPTS, SPEC, _pool_whole

    from blink.engine.speculative import SPEC_NUM_DRAFTS

    model_dir = tiny_model_dir(tmp_path_factory.mktemp("spec_models"))
    small = dict(max_model_len=128, max_num_seqs=2, kv_cache_tokens=1024, max_num_batched_tokens=4)
    params = SamplingParams(max_tokens=24, **SPEC_GREEDY)
    prompts = SPEC_PROMPTS[:3]
    with make_llm(model_dir, cpu_graphs=False, **small) as llm:
        want = llm.generate(prompts, params, timeout_s=120)
    with make_llm(model_dir, enforce_eager=False, compile_cache_dir=str(cache_dir), speculative_config=SPEC,
                  **small) as llm:
        assert llm.engine.runner.name == "compiled" and llm.engine.runner.compiled is not None
        got = llm.generate(prompts, params, timeout_s=240)
        assert int(llm.engine.scheduler.spec_counters[SPEC_NUM_DRAFTS]) > 0
        assert llm.engine.runner.compiled.refused == 0
        _pool_whole(llm)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids


def test_compile_failure_falls_back_to_eager_with_one_warning(capsys):
    def branchy(x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # a host read: fullgraph compilation refuses it
            return x + 1
        return x - 1

    fn = compiled.compile_fn(branchy, "the test function", backend="eager")
    x = torch.ones(3)
    assert fn.warm(x) is False
    assert torch.equal(fn(x), x + 1) and torch.equal(fn(-x), -x - 1)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "compiling the test function failed" in lines[0]
    assert "running it eager" in lines[0]


def test_steady_state_recompile_is_refused_and_runs_eager(capsys):
    fn = compiled.compile_fn(lambda x: x * 2, "the doubler", backend="eager")
    assert fn.warm(torch.ones(2)) is True
    graphs = _graphs()
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    assert fn.refused == 0
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))  # new shape: eager
    assert torch.equal(fn(torch.ones(5)), torch.full((5,), 2.0))
    assert fn.refused == 2 and _graphs() == graphs
    warnings = [line for line in capsys.readouterr().err.splitlines() if "would recompile" in line]
    assert len(warnings) == 1


def test_buckets():
    assert compiled.token_buckets((8, 16, 32)) == (1, 2, 4, 8, 16, 32)
    assert compiled.token_buckets((2,)) == (1, 2)
    assert compiled.row_buckets(256) == (1, 4, 16, 64, 256)
    assert compiled.row_buckets(20) == (1, 4, 16, 20)
    assert compiled.row_buckets(1) == (1,)


def test_cache_dir_and_eager_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv(compiled.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiled.compile_cache_dir() == tmp_path / "blink" / "inductor"
    monkeypatch.setenv(compiled.CACHE_DIR_ENV, str(tmp_path / "env"))
    assert compiled.compile_cache_dir() == tmp_path / "env"
    assert compiled.compile_cache_dir(tmp_path / "flag") == tmp_path / "flag"
    from blink.engine.engine import EngineConfig

    monkeypatch.delenv(compiled.ENFORCE_EAGER_ENV, raising=False)
    assert EngineConfig().enforce_eager is True  # blink serve's default on CPU: eager (measured)
    monkeypatch.setenv(compiled.ENFORCE_EAGER_ENV, "0")
    assert EngineConfig().enforce_eager is False
    monkeypatch.setenv(compiled.ENFORCE_EAGER_ENV, "1")
    assert EngineConfig().enforce_eager is True


def test_cli_flags_reach_the_engine_config(monkeypatch):
    from blink.cli import build_parser
    from blink.launcher import engine_config_from_args

    monkeypatch.setenv(compiled.ENFORCE_EAGER_ENV, "0")
    args = build_parser().parse_args(["engine", "--enforce-eager", "--compile-cache-dir", "/tmp/c"])
    config = engine_config_from_args(args)
    assert config.enforce_eager is True and config.compile_cache_dir == "/tmp/c"
    assert engine_config_from_args(build_parser().parse_args(["engine"])).enforce_eager is False
    assert engine_config_from_args(build_parser().parse_args(["engine", "--compile"])).enforce_eager is False
    monkeypatch.delenv(compiled.ENFORCE_EAGER_ENV)
    assert engine_config_from_args(build_parser().parse_args(["engine"])).enforce_eager is True
    assert engine_config_from_args(build_parser().parse_args(["engine", "--compile"])).enforce_eager is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--compile", "--enforce-eager"])


def test_compiled_engine_computes_prompt_logprobs(compiled_llm):
    """--compile: a step with a row asking for prompt logprobs runs eagerly (its hidden
    states), chunked in 4-token steps; the values are transformers', and the compiled steps
    around it neither recompile nor grow new graphs."""
    from test_prompt_logprobs import check

    phase = compiled_llm.engine.runner.compiled
    assert compiled_llm.engine.ring_config.prompt_logprob_lanes > 0
    graphs = _graphs()
    prompts = random_prompts(2, 6, 13, seed=8)
    outs = compiled_llm.generate(prompts, SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY),
                                 timeout_s=120)
    ref = Reference()
    for p, o in zip(prompts, outs):
        check(ref, p, o.prompt_logprobs, 2)
    assert phase.refused == 0 and _graphs() == graphs


def test_the_compiled_sampler_draws_the_eager_samplers_tokens(compiled_llm):
    """The sampler compiles with inductor options of its own (compiled.SAMPLER_COMPILE_OPTIONS,
    for compile time): at every row bucket its seeded draws are the eager sampler's, row for
    row, and its logprobs within fp32 rounding; every call here ran compiled (none refused)."""
    phase = compiled_llm.engine.runner.compiled
    plan = compiled.WARM_PLANS[1]
    assert plan.any_random
    refused = phase.sample.refused

    def compare() -> None:
        torch.manual_seed(0)
        for rows in phase.row_buckets:
            with torch.inference_mode(), phase._onednn(rows):  # as the engine's loop makes its tensors
                x, residual, sampling, history, prompt_lens, total_lens, suppress = compiled._dummy_head_args(
                    phase.executor, rows, phase.suppress_width, phase.max_logit_bias)
                vocab = phase.head(phase.model, x, residual).shape[1]
                for draw in range(25):
                    sampling.temperature.fill_(0.7)
                    sampling.seed.copy_(torch.arange(rows) + 100 * draw + 1)
                    logits = torch.randn(rows, vocab) * 4
                    args = (logits, sampling, history, prompt_lens, total_lens, suppress)
                    got = phase.sample(phase.sampler, plan, *args)
                    want = compiled._sample(phase.sampler, plan, *args)
                    assert torch.equal(got.tokens, want.tokens), (rows, draw)
                    torch.testing.assert_close(got.logprob, want.logprob, rtol=0, atol=1e-5)

    # On a thread of its own, as the engine's loop: the compiled graphs guard thread-local
    # state (whether a CPU graph is recording on this thread), which earlier tests set here.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(compare).result(timeout=300)  # (re-raises its failure here)
    assert phase.sample.refused == refused, "a call ran eager: nothing was compared"
