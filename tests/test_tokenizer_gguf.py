"""Tokenizers rebuilt from GGUF metadata give the ids transformers gives for the same file.

The reference is ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``: on the real SmolLM2 GGUF,
and on small GGUFs written here with vocabularies trained on the spot, for each pre-tokenizer
family (GPT-2 regex, Llama-3 regex, Qwen2 regex) and for a SentencePiece vocabulary.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from blink.loader import load_tokenizer_files, open_model

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_loader_gguf import smollm_path, write_gguf  # noqa: E402

TEXTS = [
    "Hello world",
    "  leading spaces\tand\ttabs\n\n\nnewlines   trailing   ",
    "日本語のテキスト、中文字符，한국어 텍스트",
    "emoji 😀🚀 👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷",
    "café naïve résumé Ångström Ελληνικά русский",
    "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
    "12345 3.14159 1,000,000 0x1F 2024-01-01 ١٢٣",
    "it's don't I'll we've THEY'RE you'd",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|im_end|>inside words and <think>tags</think>",
    "\u00a0non-breaking\u2003em space\u200bzero-width",
    "",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and 12345 + 678 = 13023.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Numbers: 1 22 333 4444 55555 666666, version 3.14.159 and 1,000,000 dollars.",
    "Ünïcödé café naïve; 日本語 中文 한국어; emoji 😀🚀.",
    "    indented code\n\n\n\ttabs and   runs of   spaces",
] * 20


def _transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _assert_same_ids(ours: Tokenizer, reference, texts: list[str]) -> None:
    for text in texts:
        assert ours.encode(text).ids == reference(text)["input_ids"], repr(text)


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm_files():
    return load_tokenizer_files(smollm_path())


@pytest.fixture(scope="module")
def smollm_reference():
    return _transformers_tokenizer(smollm_path())


def test_smollm_ids_equal_transformers(smollm_files, smollm_reference):
    ours = Tokenizer.from_str(smollm_files[0])
    _assert_same_ids(ours, smollm_reference, TEXTS)
    assert ours.get_vocab_size() == smollm_reference.backend_tokenizer.get_vocab_size() == 49152


def test_smollm_tokenizer_config(smollm_files, smollm_reference):
    _, config, generation = smollm_files
    assert config["bos_token"] == smollm_reference.bos_token == "<|im_start|>"
    assert config["eos_token"] == smollm_reference.eos_token == "<|im_end|>"
    assert config["pad_token"] == smollm_reference.pad_token
    assert config["unk_token"] == smollm_reference.unk_token
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["chat_template"] == smollm_reference.chat_template
    specials = {int(i) for i, t in config["added_tokens_decoder"].items() if t["special"]}
    assert specials == set(range(17))  # the 17 control tokens of the file
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_smollm_chat_template_render_and_ids(smollm_files, smollm_reference):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tokenizer_json, config, _ = smollm_files
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(config["chat_template"])
    conversations = [
        [{"role": "user", "content": "What is 2+2? Ünïcödé 😀"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"},
            {"role": "assistant", "content": "print(1)"},
            {"role": "user", "content": "日本語で"},
        ],
    ]
    ours = Tokenizer.from_str(tokenizer_json)
    for messages in conversations:
        text = template.render(messages=messages, add_generation_prompt=True, **{
            k: config[k] for k in ("bos_token", "eos_token")})
        expected = smollm_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == expected
        ids = smollm_reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.encode(text).ids == list(ids)


# ----------------------------------------------------------------------------- synthetic vocabularies


@functools.cache
def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """A small byte-level BPE trained here; specials first, as in real files."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _tokenizer_gguf(path: Path, tokenizer_meta: dict[str, Any], arch: str = "llama") -> Path:
    meta = {
        f"{arch}.context_length": 512, f"{arch}.embedding_length": 64, f"{arch}.block_count": 1,
        f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, **tokenizer_meta,
    }
    return write_gguf(path, arch, {}, meta)


@pytest.mark.parametrize(
    "pre, arch, add_bos",
    [("gpt2", "llama", False), ("llama-bpe", "llama", True), ("qwen2", "qwen2", False)],
)
def test_byte_level_ids_equal_transformers(tmp_path, pre, arch, add_bos):
    tokens, merges = _byte_level_vocab()
    path = _tokenizer_gguf(tmp_path / "t.gguf", {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 4, 4] + [1] * (len(tokens) - 5),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": add_bos,
    }, arch)
    tokenizer_json, config, _ = load_tokenizer_files(path)
    reference = _transformers_tokenizer(path)
    ours = Tokenizer.from_str(tokenizer_json)
    _assert_same_ids(ours, reference, TEXTS + CORPUS[:5])
    assert config["add_bos_token"] is add_bos
    assert (ours.encode("hi").ids[:1] == [1]) is add_bos
    # user-defined tokens stay whole but are not special (they are decoded like text)
    assert ours.encode("<think>").ids[-1] == 3
    assert config["added_tokens_decoder"]["3"]["special"] is False
    assert config["added_tokens_decoder"]["2"]["special"] is True


def test_pre_tokenizer_choice_matters(tmp_path):
    """Guard for the test above: the three regexes really split this vocabulary differently."""
    tokens, merges = _byte_level_vocab()
    encodings = set()
    for pre in ("gpt2", "llama-bpe", "qwen2"):
        path = _tokenizer_gguf(tmp_path / f"{pre}.gguf", {
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * 5 + [1] * (len(tokens) - 5), "tokenizer.ggml.merges": merges,
        })
        ours = Tokenizer.from_str(load_tokenizer_files(path)[0])
        encodings.add(tuple(ours.encode("It's 12345 apples\n\n  and 678!").ids))
    assert len(encodings) == 3


@functools.cache
def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A llama.cpp-style SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, then
    pieces best first with descending scores (no merges, as llama.cpp writes them)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    tokenizer.train_from_iterator([text for text in CORPUS if text.isascii()], trainer)
    pieces = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_ids_equal_transformers(tmp_path, arch):
    tokens, scores, types = _sentencepiece_vocab()
    path = _tokenizer_gguf(tmp_path / "spm.gguf", {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }, arch)
    tokenizer_json, config, _ = load_tokenizer_files(path)
    reference = _transformers_tokenizer(path)
    ours = Tokenizer.from_str(tokenizer_json)
    _assert_same_ids(ours, reference, TEXTS)
    assert config["add_bos_token"] is True and ours.encode("x").ids[0] == 1
    # bytes outside the vocabulary fall back to byte tokens, and decode back
    assert ours.decode(ours.encode("日本 😀").ids) == "日本 😀"


def test_load_tokenizer_files_needs_no_torch(tmp_path):
    """The frontend has no torch: the tokenizer path must not import it (GGUF and HF dir)."""
    tokens, merges = _byte_level_vocab()
    path = _tokenizer_gguf(tmp_path / "t.gguf", {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * 5 + [1] * (len(tokens) - 5), "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": 2,
    })
    expected = Tokenizer.from_str(load_tokenizer_files(path)[0]).encode("Hello world").ids
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_text(Tokenizer(models.BPE()).to_str())
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "from blink.loader import load_tokenizer_files\n"
        "from tokenizers import Tokenizer\n"
        f"tj, tc, gc = load_tokenizer_files({str(path)!r})\n"
        "print(Tokenizer.from_str(tj).encode('Hello world').ids, gc['eos_token_id'])\n"
        f"load_tokenizer_files({str(hf_dir)!r})\n"
        "assert 'transformers' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{expected} 2"


def test_gguf_without_tokenizer_is_an_error(tmp_path):
    from blink.errors import ModelLoadError

    path = _tokenizer_gguf(tmp_path / "none.gguf", {"llama.vocab_size": 300})
    files = open_model(path)  # weights and config do not need the tokenizer...
    with pytest.raises(ModelLoadError, match=r"none\.gguf.*no tokenizer"):
        files.tokenizer_json  # ...but asking for it names the file and the problem
    with pytest.raises(ModelLoadError, match=r"none\.gguf.*no tokenizer"):
        load_tokenizer_files(path)


def test_a_gguf_tokenizer_is_cached_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch):
    """The second load reads the cache (no GGUF parse); a changed file, a corrupt cache entry
    or an unwritable cache directory all still give the same tokenizer."""
    import os
    import shutil

    from blink.loader import tokenizer_files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    shutil.copyfile(smollm_path(), gguf)
    built = load_tokenizer_files(gguf)
    entries = list((tmp_path / "cache" / "blink" / "tokenizers").glob("*.json"))
    assert len(entries) == 1

    class NoParse:
        def __init__(self, *a, **k):
            raise AssertionError("the GGUF was parsed although its tokenizer is cached")

    with monkeypatch.context() as m:
        m.setattr(tokenizer_files, "GGUFFile", NoParse)
        assert load_tokenizer_files(gguf) == built

    os.utime(gguf, ns=(1, 1))  # "edited": a new key, so it is built again
    assert load_tokenizer_files(gguf) == built
    assert len(list(entries[0].parent.glob("*.json"))) == 2

    for entry in entries[0].parent.glob("*.json"):
        entry.write_text("{not json")
    assert load_tokenizer_files(gguf) == built  # a corrupt entry is rebuilt and rewritten
    assert json.loads(tokenizer_files._cache_path(gguf).read_text())["tokenizer_json"] == built[0]

    monkeypatch.setenv("XDG_CACHE_HOME", str(gguf))  # a file, not a directory: nothing can be written
    assert load_tokenizer_files(gguf) == built
