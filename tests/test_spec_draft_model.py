"""Speculative decoding with a draft model (issue 36 item 4, blink/engine/draft_model.py), on
tiny random Llamas (fp32) sharing the byte tokenizer:

- greedy outputs token for token the same as without speculation, with a draft that mostly
  agrees (the target's weights plus noise: accepted and rejected drafts both happen) and with a
  smaller one (one layer: its own KV shape on the target's block ids), under preemption too;
- the target as its own draft: every draft token is accepted (acceptance rate 1.0);
- seeded sampled outputs (and their logprobs) the same as without speculation;
- the KV pool whole at quiescence;
- refusals, by name: a missing file, another vocabulary, another tokenizer, bad K, the
  ngram-only fields, runners other than the eager CPU loop's, disaggregation roles.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from helpers_models import build_hf_model  # noqa: E402
from test_engine import ARCH, byte_tokenizer_json, make_llm, tiny_model_dir  # noqa: E402
from test_spec_decode import PROMPTS, _pool_whole  # noqa: E402

from blink.engine.speculative import (  # noqa: E402
    SPEC_NUM_ACCEPTED_TOKENS,
    SPEC_NUM_DRAFT_TOKENS,
    SPEC_NUM_DRAFTS,
)
from blink.errors import BlinkError  # noqa: E402
from blink.shared.sampling_params import SamplingParams  # noqa: E402
from blink.shared.speculative_config import SpeculativeConfigError, parse_speculative_config  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _spec(model: Path | str, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": k})


def _save_draft(path: Path, *, noise: float, layers: int | None = None) -> Path:
    """The target's weights (helpers_models seed 0) plus ``noise`` x N(0, 1), optionally only
    its first ``layers`` decoder layers, saved with the byte tokenizer."""
    if (path / "config.json").exists():
        return path
    model = build_hf_model(ARCH)
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_models")
    return {"target": tiny_model_dir(root),
            "near": _save_draft(root / "near", noise=0.01),
            "small": _save_draft(root / "small", noise=0.0, layers=1)}


@pytest.fixture(scope="module")
def plain(dirs):
    with make_llm(dirs["target"], cpu_graphs=False) as engine:
        yield engine


def _counters(llm) -> torch.Tensor:
    return llm.engine.scheduler.spec_counters.clone()


def test_config_spelling():
    cfg = parse_speculative_config(_spec("/x", 4))
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/x", 4)
    # vLLM: a model with no method is a draft model; "ngram" as the model is the n-gram method
    assert parse_speculative_config('{"model": "/x", "num_speculative_tokens": 2}').method == "draft_model"
    assert parse_speculative_config('{"model": "ngram", "num_speculative_tokens": 2}').method == "ngram"
    assert json.loads(cfg.to_json())["model"] == "/x"
    bad = {
        '{"method": "draft_model", "num_speculative_tokens": 2}': "'model'",
        '{"method": "draft_model", "model": "", "num_speculative_tokens": 2}': "'model'",
        '{"method": "draft_model", "model": "/x"}': "'num_speculative_tokens'",
        '{"method": "draft_model", "model": "/x", "num_speculative_tokens": 0}': "'num_speculative_tokens'",
        '{"method": "draft_model", "model": "/x", "num_speculative_tokens": 17}': "'num_speculative_tokens'",
        '{"method": "draft_model", "model": "/x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}':
            "'prompt_lookup_max'",
        '{"method": "ngram", "model": "/x", "num_speculative_tokens": 2}': "'model'",
    }
    for text, word in bad.items():
        with pytest.raises(SpeculativeConfigError, match=word):
            parse_speculative_config(text)


def test_greedy_identical_with_drafts_accepted_and_rejected(plain, dirs):
    params = SamplingParams(max_tokens=32, **GREEDY)
    want = plain.generate(PROMPTS, params, timeout_s=120)
    for name in ("near", "small"):
        with make_llm(dirs["target"], speculative_config=_spec(dirs[name], 3)) as spec:
            assert type(spec.engine.runner).__name__ == "SpecCpuGraphsRunner"
            got = spec.generate(PROMPTS, params, timeout_s=120)
            for p, w, g in zip(PROMPTS, want, got):
                assert g.token_ids == w.token_ids, (name, p)
            for i in (0, 7):  # one stream (where a draft pays)
                [g] = spec.generate([PROMPTS[i]], params, timeout_s=60)
                assert g.token_ids == want[i].token_ids, name
            c = _counters(spec)
            assert int(c[SPEC_NUM_DRAFTS]) > 0, name
            if name == "near":  # the near copy agrees mostly, not always
                assert 0 < int(c[SPEC_NUM_ACCEPTED_TOKENS]) < int(c[SPEC_NUM_DRAFT_TOKENS])
            _pool_whole(spec)


@pytest.mark.parametrize("budget", [512, 24])
def test_target_as_its_own_draft_accepts_everything(plain, dirs, budget):
    """Every draft token is the target's own greedy pick, so every one is accepted: the
    draft's cache is right at every position it attends to. A 24-token budget chunks the
    long prompt's prefill beside the other rows' drafting steps (the draft fills those
    positions in its pass over the rows that do not draft)."""
    prompts = PROMPTS[:4] + [(PROMPTS[7] * 8)[:150]]
    params = SamplingParams(max_tokens=24, **GREEDY)
    want = plain.generate(prompts, params, timeout_s=120)
    with make_llm(dirs["target"], cpu_graphs=False, max_num_batched_tokens=budget,
                  speculative_config=_spec(dirs["target"], 4)) as spec:
        got = spec.generate(prompts, params, timeout_s=120)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
        c = _counters(spec)
        assert int(c[SPEC_NUM_DRAFT_TOKENS]) > 0
        assert int(c[SPEC_NUM_ACCEPTED_TOKENS]) == int(c[SPEC_NUM_DRAFT_TOKENS]), c.tolist()
        _pool_whole(spec)


def test_seeded_sampling_identical(plain, dirs):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=24, ignore_eos=True, logprobs=2)
              for s in range(len(PROMPTS))]
    want = plain.generate(PROMPTS, params, timeout_s=120)
    with make_llm(dirs["target"], speculative_config=_spec(dirs["near"], 4)) as spec:
        got = spec.generate(PROMPTS, params, timeout_s=120)
        assert int(_counters(spec)[SPEC_NUM_ACCEPTED_TOKENS]) > 0
        _pool_whole(spec)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_identical_under_preemption(dirs, prefix_caching):
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=40, **GREEDY)
    small = dict(max_model_len=128, kv_cache_tokens=160, enable_prefix_caching=prefix_caching)
    with make_llm(dirs["target"], cpu_graphs=False, **small) as plain_llm:
        want = plain_llm.generate(prompts, params, timeout_s=180)
    with make_llm(dirs["target"], speculative_config=_spec(dirs["near"], 3), **small) as spec:
        got = spec.generate(prompts, params, timeout_s=180)
        _pool_whole(spec)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids


def test_refusals(dirs, tmp_path):
    with pytest.raises(BlinkError, match="draft_model 'model'.*no such file"):
        make_llm(dirs["target"], speculative_config=_spec(tmp_path / "missing"))

    def small_with(name: str, **config: Any) -> Path:
        """A copy of the small draft with ``config`` changed in its config.json."""
        path = tmp_path / name
        shutil.copytree(dirs["small"], path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config)
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    other_vocab = small_with("vocab", vocab_size=300)
    with pytest.raises(BlinkError, match="vocab_size 300"):
        make_llm(dirs["target"], speculative_config=_spec(other_vocab))
    # positions for fewer tokens than the target's max_model_len
    short = small_with("short", max_position_embeddings=64)
    with pytest.raises(BlinkError, match="draft_model 'model'.*max_model_len 256"):
        make_llm(dirs["target"], speculative_config=_spec(short))
    other_tok = tmp_path / "tok"
    shutil.copytree(dirs["small"], other_tok)
    tok = json.loads(byte_tokenizer_json())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same size, not the same tokenizer
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(BlinkError, match="different tokenizer"):
        make_llm(dirs["target"], speculative_config=_spec(other_tok))
    with pytest.raises(BlinkError, match="eager CPU loop only"):  # --compile
        make_llm(dirs["target"], enforce_eager=False, speculative_config=_spec(dirs["small"]))


def test_runner_and_role_refusals():
    from blink.engine.draft_model import check_draft_runner

    for runner in ("compiled", "tier-a", "tier-b"):
        with pytest.raises(BlinkError, match=f"draft_model runs on the eager CPU loop only.*{runner}"):
            check_draft_runner(runner, role="both", null_target=False)
    with pytest.raises(BlinkError, match="--role decode"):
        check_draft_runner("eager", role="decode", null_target=False)
    with pytest.raises(BlinkError, match="--model null"):
        check_draft_runner("eager", role="both", null_target=True)
    check_draft_runner("cpu-graphs", role="both", null_target=False)
