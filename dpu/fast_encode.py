"""An exact fast path for encoding text with a byte-level BPE tokenizer.

``tokenizers.Tokenizer.encode`` (0.23) spends ~95% of its time on English text in the ByteLevel
pre-tokenization, and ``perf`` shows why: most of it is the offset bookkeeping of
``NormalizedString`` (alignments per byte, byte->char offset hash maps, the allocations for
them and for the ``Encoding``), while the Oniguruma regex is ~8% and the cached BPE merges ~5%.
The frontend only needs ids, so this module does the same steps without the offsets:

1. split the text on added tokens, leftmost-longest, the non-normalized ones first (as
   ``AddedVocabulary::extract_and_normalize`` does);
2. split each piece with the *same* pre-tokenizer regex (Python's ``re`` for ASCII text, where
   ``\\p{L}``/``\\p{N}``/``\\s`` have fixed ASCII meanings, and the ``regex`` package for text
   whose characters all lie in :data:`UNICODE_SAFE_RANGES`);
3. look each word up in a word -> ids cache; a miss asks the tokenizer's own BPE model
   (``tokenizer.model.tokenize`` on the byte-level spelling), so merges, ``ignore_merges`` and
   the vocabulary are exactly the library's.

Only configurations whose result is the library's by construction (the regex character
classes: by an exhaustive test) are taken: a BPE model without dropout, no truncation or
padding, added tokens without lstrip/rstrip/single_word, and a pre-tokenizer that is either ``ByteLevel(add_prefix_space=False, use_regex=True)`` or
``Split(<one of the known regexes>, isolated) + ByteLevel(add_prefix_space=False,
use_regex=False)``. With a Unicode normalizer (NFC/NFD/NFKC/NFKD, the identity on ASCII) only
ASCII text takes the fast path. Everything else returns ``None`` and the caller uses
``tokenizers``. ``tests/test_fast_encode.py`` checks every character of the safe ranges and
fuzzes mixed text against ``tokenizers`` for each supported regex.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from blink.shared.byte_level import bytes_to_unicode

try:  # \p{L}, \p{N}, \p{M}: the ``regex`` package (a transformers dependency, small, C)
    import regex as _regex
except ImportError:  # pragma: no cover - then non-ASCII text uses tokenizers
    _regex = None

# -- the pre-tokenizer regexes (exactly as they appear in tokenizer.json / blink's GGUF loader)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SPLIT_PATTERNS: tuple[str, ...] = (
    # Llama 3 / cl100k
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen2 / Qwen3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen3.5
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Tekken (Mistral)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # GPT-4o / o200k (Phi-4)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# ASCII members of the Unicode classes the patterns use (none of M, Lt, Lm, Lo is ASCII).
_ASCII_CLASSES = {"L": "A-Za-z", "N": "0-9", "M": "", "Lu": "A-Z", "Ll": "a-z", "Lt": "",
                  "Lm": "", "Lo": ""}
_PROP = re.compile(r"\\p\{(\w+)\}")

# Non-ASCII code points for which the ``regex`` package and tokenizers' Oniguruma agree on
# \p{L}/\p{N}/\p{M}/\s membership and case folding: common blocks in which every code point
# was assigned by Unicode 14.0 (so both engines' Unicode tables have them), verified character
# by character in tests/test_fast_encode.py. Text with any other non-ASCII character (newer or
# rarer scripts, unassigned or private-use code points, surrogates) goes to tokenizers.
UNICODE_SAFE_RANGES: tuple[tuple[int, int], ...] = (
    (0x0080, 0x0377), (0x037A, 0x037F), (0x0384, 0x038A), (0x038C, 0x038C), (0x038E, 0x03A1),
    (0x03A3, 0x052F),  # Latin-1, Latin Extended-A/B, IPA, diacritics, Greek, Cyrillic
    (0x0531, 0x0556), (0x0561, 0x0587), (0x05D0, 0x05EA), (0x0600, 0x06FF),  # Armenian..Arabic
    (0x0900, 0x097F), (0x0E01, 0x0E3A), (0x0E3F, 0x0E5B),  # Devanagari, Thai
    (0x10A0, 0x10C5), (0x10D0, 0x10FF), (0x1100, 0x11FF),  # Georgian, Hangul Jamo
    (0x1E00, 0x1EFF),  # Latin Extended Additional
    (0x2000, 0x2064), (0x2066, 0x206F), (0x20A0, 0x20BF), (0x2100, 0x214F), (0x2150, 0x218B),
    (0x2190, 0x23FF), (0x2460, 0x24FF), (0x2500, 0x27BF),  # punctuation, symbols, arrows..
    (0x3000, 0x303F), (0x3041, 0x3096), (0x3099, 0x30FF), (0x3131, 0x318E),  # CJK punct, kana
    (0x3400, 0x4DBF), (0x4E00, 0x9FEF), (0xAC00, 0xD7A3),  # CJK Ext A, CJK, Hangul syllables
    (0xFE00, 0xFE0F), (0xFF01, 0xFFBE),  # variation selectors, full/halfwidth forms
    (0x1F1E6, 0x1F1FF), (0x1F300, 0x1F6D7), (0x1F900, 0x1F9FF),  # flags, emoji
)
_UNSAFE_CHAR = re.compile("[^\\x00-\\x7f" + "".join(
    f"\\U{a:08x}-\\U{b:08x}" for a, b in UNICODE_SAFE_RANGES) + "]")

#: words longer than this are not cached (the BPE model itself is still exact for them)
MAX_CACHED_WORD = 256
#: the word cache is emptied when it grows past this many entries
CACHE_CAPACITY = 1 << 16


def ascii_pattern(pattern: str) -> str:
    """``pattern`` for Python's ``re`` with ``re.ASCII``: each ``\\p{X}`` becomes its ASCII
    members (inside a character class, or as a class of its own outside one)."""
    out: list[str] = []
    i, depth = 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            m = _PROP.match(pattern, i)
            if m:
                members = _ASCII_CLASSES[m.group(1)]
                out.append(members if depth else f"[{members}]")
                i = m.end()
                continue
            out.append(pattern[i: i + 2])
            i += 2
            continue
        if ch == "[" and not depth:
            depth = 1
        elif ch == "]" and depth:
            depth = 0
        out.append(ch)
        i += 1
    return "".join(out)


def _pre_tokenizer_pattern(pre: Mapping[str, Any] | None) -> str | None:
    """The split regex of a supported byte-level pre-tokenizer, else None."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") is False and pre.get("use_regex", True) is True:
            return GPT2_PATTERN
        return None
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated"
            or split.get("invert") or level.get("type") != "ByteLevel"
            or level.get("add_prefix_space") is not False or level.get("use_regex") is not False):
        return None
    pattern = (split.get("pattern") or {}).get("Regex")
    return pattern if pattern in SPLIT_PATTERNS else None


def _literal_alternation(contents: list[str]) -> re.Pattern[str] | None:
    """Leftmost-longest matching of literal strings (longest alternative first)."""
    if not contents:
        return None
    ordered = sorted(set(contents), key=lambda s: (-len(s), s))
    return re.compile("(" + "|".join(map(re.escape, ordered)) + ")")


class FastEncoder:
    """Ids of a text without special tokens (what ``encode(text, add_special_tokens=False)``
    returns), or ``None`` when the text must go to ``tokenizers``. Build with :meth:`build`."""

    def __init__(self, model: Any, pattern: str, added: list[tuple[str, int, bool]],
                 ascii_only: bool) -> None:
        self._tokenize = model.tokenize
        self._ascii_findall: Callable[[str], list[str]] = re.compile(
            ascii_pattern(pattern), re.ASCII).findall
        self._unicode_findall: Callable[[str], list[str]] | None = None
        if not ascii_only and _regex is not None:
            self._unicode_findall = _regex.compile(pattern).findall
        self._added_ids = {content: token_id for content, token_id, _ in added}
        # pass 1 on the raw text: added tokens with normalized=False; pass 2 on the pieces
        # between them: the normalized ones (our normalizer is the identity on accepted text)
        self._raw_split = _literal_alternation([c for c, _, norm in added if not norm])
        self._norm_split = _literal_alternation([c for c, _, norm in added if norm])
        # bytes -> GPT-2 spelling, as one str.translate over the bytes read as Latin-1
        self._spelling = str.maketrans(bytes_to_unicode())
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def build(cls, spec: Mapping[str, Any], rust: Any) -> "FastEncoder | None":
        """A fast encoder for the tokenizer described by ``spec`` (tokenizer.json as a dict)
        and loaded as ``rust`` (a ``tokenizers.Tokenizer``), or None when not supported."""
        from tokenizers import models

        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0) \
                or not isinstance(rust.model, models.BPE):
            return None
        if rust.truncation is not None or rust.padding is not None \
                or getattr(rust, "encode_special_tokens", False):
            return None
        normalizer = spec.get("normalizer")
        if normalizer is None:
            ascii_only = False
        elif normalizer.get("type") in ("NFC", "NFD", "NFKC", "NFKD"):
            ascii_only = True  # the identity on ASCII text; other text goes to tokenizers
        else:
            return None
        pattern = _pre_tokenizer_pattern(spec.get("pre_tokenizer"))
        if pattern is None:
            return None
        # the added tokens as the library holds them (an added token whose content is already
        # in the model's vocabulary takes the vocabulary's id, whatever tokenizer.json says)
        added: list[tuple[str, int, bool]] = []
        for token_id, tok in sorted(rust.get_added_tokens_decoder().items()):
            if tok.lstrip or tok.rstrip or tok.single_word or not tok.content:
                return None
            added.append((tok.content, int(token_id), bool(tok.normalized)))
        if len({c for c, _, _ in added}) != len(added):
            return None
        return cls(rust.model, pattern, added, ascii_only)

    def encode(self, text: str) -> list[int] | None:
        if text.isascii():
            findall = self._ascii_findall
        elif self._unicode_findall is not None and _UNSAFE_CHAR.search(text) is None:
            findall = self._unicode_findall
        else:
            return None
        out: list[int] = []
        raw_split, norm_split = self._raw_split, self._norm_split
        if raw_split is None and norm_split is None:
            self._words(text, findall, out)
            return out
        added_ids = self._added_ids
        for i, piece in enumerate(raw_split.split(text) if raw_split is not None else [text]):
            if i & 1:
                out.append(added_ids[piece])
            elif piece:
                if norm_split is None:
                    self._words(piece, findall, out)
                    continue
                for j, sub in enumerate(norm_split.split(piece)):
                    if j & 1:
                        out.append(added_ids[sub])
                    elif sub:
                        self._words(sub, findall, out)
        return out

    def _words(self, text: str, findall: Callable[[str], list[str]], out: list[int]) -> None:
        cache = self._cache
        get = cache.get
        for word in findall(text):
            ids = get(word)
            if ids is None:
                ids = self._miss(word)
            out += ids

    def _miss(self, word: str) -> list[int]:
        spelled = word.encode("utf-8").decode("latin-1").translate(self._spelling)
        ids = [t.id for t in self._tokenize(spelled)]
        if len(word) <= MAX_CACHED_WORD:
            if len(self._cache) >= CACHE_CAPACITY:
                self._cache.clear()
            self._cache[word] = ids
        return ids
