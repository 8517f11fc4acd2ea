"""The frontend's fast encoding path (blink.dpu.fast_encode) gives exactly the ids of
``tokenizers`` (and of transformers' AutoTokenizer) on the real SmolLM2 tokenizer, and on
SmolLM2's vocabulary re-dressed with each other supported pre-tokenizer regex (Llama 3, Qwen2,
Qwen3.5, Tekken, GPT-4o), with ``ignore_merges``, a bos post-processor and an NFC normalizer.

The pre-tokenizer regexes are re-run by Python's ``re`` (ASCII text) and the ``regex`` package
(non-ASCII text in ``UNICODE_SAFE_RANGES``), so every character of those ranges is checked
against tokenizers' own pre-tokenizer, in the contexts where its class (letter / number / mark /
whitespace / other, upper / lower case, case folding) decides the split.
"""
from __future__ import annotations

import copy
import json
import random
import re

import pytest

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from blink.dpu import fast_encode
from blink.dpu.fast_encode import GPT2_PATTERN, SPLIT_PATTERNS, UNICODE_SAFE_RANGES, FastEncoder, ascii_pattern
from blink.dpu.tokenizer import Tokenizer
from blink.shared.byte_level import bytes_to_unicode

regex = pytest.importorskip("regex")

PATTERN_NAMES = ["gpt2", "llama3", "qwen2", "qwen35", "tekken", "gpt4o"]
PATTERNS = dict(zip(PATTERN_NAMES, (GPT2_PATTERN, *SPLIT_PATTERNS)))
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>"]


@pytest.fixture(scope="module")
def smol_files() -> tuple[str, dict, dict]:
    from blink.loader import load_tokenizer_files

    return load_tokenizer_files("smollm2-135m")


def _pre_tokenizer_spec(name: str) -> dict:
    if name == "gpt2":
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                "use_regex": True}
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": PATTERNS[name]}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}


def _variant(smol_files, *, pattern: str = "gpt2", ignore_merges: bool = False,
             post_bos: bool = False, normalizer: dict | None = None,
             extra_added: list[dict] | None = None) -> tuple[Tokenizer, Tokenizer]:
    """(fast, reference) Tokenizers over SmolLM2's vocabulary with the given pieces swapped."""
    tokenizer_json, config, generation = smol_files
    spec = json.loads(tokenizer_json)
    spec["pre_tokenizer"] = _pre_tokenizer_spec(pattern)
    spec["model"]["ignore_merges"] = ignore_merges
    spec["normalizer"] = normalizer
    if post_bos:
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                "tokens": ["<|im_start|>"]}}}
    if extra_added:
        spec["added_tokens"] = spec["added_tokens"] + extra_added
    text = json.dumps(spec)
    fast = Tokenizer(text, config, generation)
    assert fast._fast is not None, pattern
    return fast, Tokenizer(text, config, generation, fast=False)


# -- every character of the safe ranges, in every context that decides a split ---------------
def _probe(c: str) -> str:
    return f"a{c} A{c} 1{c} !{c}\t{c}'{c}a{c}{c} x\n"


def _safe_code_points() -> list[int]:
    return [cp for a, b in UNICODE_SAFE_RANGES for cp in range(a, b + 1)]


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_regex_splits_like_tokenizers_for_every_safe_character(name: str) -> None:
    if name == "gpt2":
        rust = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        rust = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERNS[name]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    ours = regex.compile(PATTERNS[name])
    spell = bytes_to_unicode()

    def ours_split(text: str) -> list[str]:
        return ["".join(spell[b] for b in w.encode()) for w in ours.findall(text)]

    chars = [chr(cp) for cp in _safe_code_points()] + [chr(cp) for cp in range(128)]
    bad: list[str] = []
    for start in range(0, len(chars), 2000):
        batch = chars[start: start + 2000]
        text = "".join(_probe(c) for c in batch)
        if [w for w, _ in rust.pre_tokenize_str(text)] != ours_split(text):
            bad += [c for c in batch
                    if [w for w, _ in rust.pre_tokenize_str(_probe(c))] != ours_split(_probe(c))]
    assert not bad, [hex(ord(c)) for c in bad[:20]]

    # and the ASCII pattern (Python's re) splits ASCII exactly like the Unicode one
    asc = re.compile(ascii_pattern(PATTERNS[name]), re.ASCII)
    rng = random.Random(name)
    alphabet = [chr(i) for i in range(128)] + ["'s", "'T", "'re", "'LL", "'d", "\r\n", "  "]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        assert asc.findall(text) == ours.findall(text), repr(text)
    text = "".join(_probe(chr(i)) for i in range(128))
    assert asc.findall(text) == ours.findall(text)


def test_unsafe_ranges_exclude_unassigned_code_points() -> None:
    import unicodedata

    assert all(unicodedata.category(chr(cp)) != "Cn" for cp in _safe_code_points())


# -- ids, on a varied corpus and on random strings ---------------------------------------------
CORPUS = [
    "", " ", "a", "Hello world", "Hello world!", "  leading spaces\tand\ttabs\n\n\nnewlines   ",
    "trailing spaces   ", "\n", "\r\n\r\n", " \t \n \x0b \x0c \r", "\x1c\x1d\x1e\x1f\x85 x",
    "it's don't I'll we've THEY'RE you'd 'S 'Ll", "'''' \"quoted\" ``code``",
    "12345 3.14159 1,000,000 0x1F 2024-01-01 ١٢٣ ½ ² Ⅻ",
    "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
    "café naïve résumé Ångström Ελληνικά русский Україна ẞ ß ſt",
    "日本語のテキスト、中文字符，한국어 텍스트 ｶﾀｶﾅ ＦＵＬＬ",
    "emoji 😀🚀 👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷 ❤️ ✨",
    "\u00a0non-breaking\u2003em space\u200bzero-width\u3000ideographic",
    "combining e\u0301 a\u0308 \u0915\u094d\u0937 ไทย العربية עברית",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|im_end|>inside<|im_start|>words <|im_ <|im_end| <reponame><repo_name>",
    "<|endoftext|><|endoftext|>x<|endoftext|>",
    # not in the safe ranges (newer than some Unicode tables, private use, U+FFFD): fall back
    "new scripts \U00010d40\U00010d41 \U00010940\U00010941 a\u088f private \ue000 \ufffd",
    "a" * 3000 + " " + "b" * 300 + "\n" * 50 + " " * 40 + "x",
    "The quick brown fox jumps over the lazy dog. " * 200,
]


def _random_text(rng: random.Random) -> str:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789",
        " " * 6 + "\t\n\r\x0b\x0c", ".,;:!?-_()[]{}<>|/\\\"'`~@#$%^&*+=",
        "éüñçøåßÆŒſΩπжЯ", "日本語中文한국어ｶﾅ", "😀👍🏽🇫🇷✨❤\u200d\ufe0f",
        "\u0301\u0308\u094d\u0e31", "\u00a0\u2003\u3000\u200b\x85\x1c",
        "\U00010d40\U00010940\u088f\ue000\ufffd\U0001fae8",  # unsafe: the text falls back
    ]
    words = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "<|im_start|>",
             "<|im_end|>", "<|endoftext|>", "<|im_", "im_end|>", "hello", " world", "\r\n"]
    out = []
    for _ in range(rng.randrange(1, 40)):
        if rng.random() < 0.25:
            out.append(rng.choice(words))
        else:
            weights = [8, 3, 5, 3, 1, 1, 1, 0.5, 0.5, 0.15]
            pool = rng.choices(pools, weights)[0]
            out.append("".join(rng.choice(pool) for _ in range(rng.randrange(1, 8))))
    return "".join(out)


def _check(fast: Tokenizer, ref: Tokenizer, texts: list[str]) -> int:
    """Asserts equal ids (with and without special tokens); returns how many took the fast
    path, so the tests cannot pass by falling back."""
    taken = 0
    for text in texts:
        for special in (False, True):
            assert fast.encode(text, special) == ref.encode(text, special), repr(text)
            expected = ref._tok.encode(text, add_special_tokens=special).ids
            assert fast._encode_ids(text, special) == expected, repr(text)
        taken += fast._fast.encode(text) is not None
    return taken


def test_smollm2_corpus_matches_tokenizers_and_transformers(smol_files, tmp_path) -> None:
    from transformers import AutoTokenizer

    tokenizer_json, config, generation = smol_files
    fast = Tokenizer(tokenizer_json, config, generation)
    ref = Tokenizer(tokenizer_json, config, generation, fast=False)
    assert fast._fast is not None
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    texts = CORPUS + [_random_text(random.Random(seed)) for seed in range(300)]
    assert _check(fast, ref, texts) > 0.6 * len(texts)
    for text in texts:
        assert fast.encode(text) == hf(text).input_ids, repr(text)
        assert fast.encode(text, False) == hf(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("name", PATTERN_NAMES[1:])
def test_split_regex_variants_match_tokenizers(smol_files, name: str) -> None:
    fast, ref = _variant(smol_files, pattern=name, ignore_merges=name == "llama3",
                         post_bos=name in ("llama3", "gpt4o"))
    texts = CORPUS + [_random_text(random.Random(f"{name}{seed}")) for seed in range(300)]
    assert _check(fast, ref, texts) > 0.6 * len(texts)
    if name in ("llama3", "gpt4o"):
        assert fast._encode_ids("hi", True)[0] == 1 and fast._post_affixes == ([1], [])


def test_nfc_normalizer_uses_the_fast_path_for_ascii_only(smol_files) -> None:
    fast, ref = _variant(smol_files, pattern="qwen2", normalizer={"type": "NFC"})
    texts = CORPUS + [_random_text(random.Random(f"nfc{seed}")) for seed in range(200)]
    _check(fast, ref, texts)
    assert fast._fast.encode("Hello world <|im_end|>") is not None
    assert fast._fast.encode("cafe\u0301") is None  # NFC would change it: tokenizers does it


def test_normalized_and_raw_added_tokens_split_like_tokenizers(smol_files) -> None:
    # a normalized (non-special) added token overlapping a raw one: tokenizers matches the raw
    # ones on the text first, then the normalized ones inside the pieces between them
    extra = [{"id": 49152, "content": "<|im_end|>X", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": True, "special": False},
             {"id": 49153, "content": "hello wor", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": True, "special": False},
             {"id": 49154, "content": "hello world!", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": False},
             # prefixes of other tokens of the same pass: the longest match wins
             {"id": 49155, "content": "<|im_end|>>>", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True},
             {"id": 49156, "content": "hello w", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": True, "special": False},
             # special and normalized; and contents already in the vocabulary (tokenizers then
             # uses the vocabulary's id, not the one written here)
             {"id": 49157, "content": "<|im_end|>Y", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": True, "special": True},
             {"id": 49158, "content": "ab", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": True, "special": True},
             {"id": 49159, "content": "abc", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": False}]
    fast, ref = _variant(smol_files, extra_added=extra)
    texts = ["<|im_end|>X hello world hello world! hello wor", "x<|im_end|>Xhello world!!",
             "a<|im_end|>>> b<|im_end|>> hello w hello wo hello wor<|im_end|>>>>",
             "x<|im_end|>Y ab abc abab abcab", "<|im_end|>Yab", "aabcc ab"]
    assert _check(fast, ref, texts + CORPUS) > 0


def test_word_cache_is_bounded_and_exact(smol_files, monkeypatch) -> None:
    monkeypatch.setattr(fast_encode, "CACHE_CAPACITY", 50)
    monkeypatch.setattr(fast_encode, "MAX_CACHED_WORD", 5)
    fast, ref = _variant(smol_files)
    texts = [_random_text(random.Random(f"cache{seed}")) for seed in range(100)]
    _check(fast, ref, texts * 2)
    assert len(fast._fast._cache) <= 50
    assert all(len(w) <= 5 for w in fast._fast._cache)


def test_unsupported_tokenizers_have_no_fast_path(smol_files) -> None:
    tokenizer_json, config, generation = smol_files
    spec = json.loads(tokenizer_json)

    def build(change) -> FastEncoder | None:
        s = copy.deepcopy(spec)
        change(s)
        return FastEncoder.build(s, HFTokenizer.from_str(json.dumps(s)))

    assert build(lambda s: None) is not None
    assert build(lambda s: s["model"].update(dropout=0.1)) is None
    assert build(lambda s: s["added_tokens"][1].update(lstrip=True)) is None
    assert build(lambda s: s["pre_tokenizer"].update(add_prefix_space=True)) is None
    assert build(lambda s: s.update(normalizer={"type": "Lowercase"})) is None
    assert build(lambda s: s.update(truncation={
        "direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0})) is None
    assert build(lambda s: s.update(pre_tokenizer=_pre_tokenizer_spec("llama3"))) is not None
    unknown = _pre_tokenizer_spec("llama3")
    unknown["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+|."
    assert build(lambda s: s.update(pre_tokenizer=unknown)) is None


def test_long_natural_text(smol_files) -> None:
    from benchmarks.serve_datasets import _SENTENCES

    tokenizer_json, config, generation = smol_files
    fast = Tokenizer(tokenizer_json, config, generation)
    ref = Tokenizer(tokenizer_json, config, generation, fast=False)
    text = " ".join(_SENTENCES) * 5
    ids = fast.encode(text)
    assert len(ids) > 2048 and ids == ref.encode(text)
    conversation = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": text}]
    assert fast.encode_chat(conversation) == ref.encode_chat(conversation)


def test_every_byte_level_tokenizer_blink_builds_from_a_gguf_has_the_fast_path() -> None:
    from blink.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS, _byte_level

    assert set(PRE_TOKENIZER_SPLITS.values()) <= set(SPLIT_PATTERNS)
    tokens = [chr(c) for c in range(33, 127)] + ["Ġ", "Ġt", "he"]
    for pre in [None, "gpt2", *sorted(PRE_TOKENIZER_SPLITS)]:
        tok = _byte_level(tokens, ["Ġ t", "h e"], pre)
        fast = FastEncoder.build(json.loads(tok.to_str()), tok)
        assert fast is not None, pre
        for text in ("the thet 12 'S x", "Ünï 日本 😀 the"):
            assert fast.encode(text) == tok.encode(text, add_special_tokens=False).ids, pre
