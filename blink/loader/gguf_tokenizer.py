"""Rebuilding a Hugging Face tokenizer (tokenizer.json + tokenizer_config) from GGUF metadata.

A GGUF stores the vocabulary, merges, token types and special token ids under ``tokenizer.ggml.*``.
This builds the same ``tokenizers`` pipeline transformers builds from them
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), so token ids match
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``:

- ``gpt2`` (byte-level BPE: Llama-3, Qwen, Phi-4, SmolLM): GPT-2's byte-level pre-tokenizer, or a
  split regex chosen by ``tokenizer.ggml.pre``;
- ``llama`` (SentencePiece BPE: Llama-2, Mistral, Phi-3): Metaspace, byte fallback, merges rebuilt
  from the scores when the file has none.

Control tokens become special added tokens, user-defined ones plain added tokens. No torch here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from blink.errors import ModelLoadError, UnsupportedModelError
from blink.shared.byte_level import bytes_to_unicode

_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> split regex. Names not listed (gpt2, smollm, ...) keep GPT-2's own regex,
# as transformers does; for smollm that is exact because its vocabulary has no multi-digit merges.
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def build_tokenizer(get: Callable[[str, Any], Any], path: Path, architecture: str) -> tuple[str, dict[str, Any]]:
    """``(tokenizer_json, tokenizer_config)`` from GGUF metadata read through ``get(key, default)``."""
    tokens = get("tokenizer.ggml.tokens", None)
    if not tokens:
        raise ModelLoadError(path, "GGUF file has no tokenizer (no tokenizer.ggml.tokens in its metadata)")
    kind = get("tokenizer.ggml.model", None)
    token_types = get("tokenizer.ggml.token_type", None) or []

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_IDS.items():
        token_id = get(key, None)
        config[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    add_bos = get("tokenizer.ggml.add_bos_token", None)
    if add_bos is None:
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = kind == "llama"
    config["add_bos_token"] = bool(add_bos)
    config["add_eos_token"] = bool(get("tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    context = get(f"{architecture}.context_length", None)
    if context is not None:
        config["model_max_length"] = int(context)
    template = get("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template

    embedded = get("tokenizer.huggingface.json", None)
    if embedded:
        # The converter kept the original tokenizer.json: nothing to rebuild.
        tokenizer = Tokenizer.from_str(embedded)
    elif kind == "gpt2":
        tokenizer = _byte_level(tokens, get("tokenizer.ggml.merges", None) or [], get("tokenizer.ggml.pre", None))
    elif kind == "llama":
        tokenizer = _sentencepiece(path, tokens, get("tokenizer.ggml.merges", None),
                                   get("tokenizer.ggml.scores", None), architecture)
    else:
        raise UnsupportedModelError(
            path, f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')"
        )

    if not embedded:
        _add_special_tokens(tokenizer, tokens, token_types, config, byte_level=kind == "gpt2")
        _set_post_processor(tokenizer, config)
    config["added_tokens_decoder"] = {
        str(token_id): {
            "content": added.content,
            "lstrip": added.lstrip,
            "normalized": added.normalized,
            "rstrip": added.rstrip,
            "single_word": added.single_word,
            "special": added.special,
        }
        for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return tokenizer.to_str(), config


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A few files store tokens as plain text rather than in the byte alphabet; respell those.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ")) for merge in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(
    path: Path, tokens: list[str], merges: list[str] | None, scores: list[float] | None, architecture: str
) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        merge_pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        if scores is None:
            raise ModelLoadError(path, "SentencePiece GGUF tokenizer has neither merges nor scores")
        merge_pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    if architecture == "phi3":
        # Phi-3's tokenizer.json prepends "▁" with a normalizer instead of Metaspace.
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(prepend="▁"), normalizers.Replace(pattern=" ", content="▁")]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two known
    pieces, best score first (transformers' ``generate_merges``)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(
    tokenizer: Tokenizer, tokens: list[str], token_types: list[int], config: dict[str, Any], byte_level: bool
) -> None:
    # In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel;
    # transformers skips those, and so do we.
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [
        token
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    if control:
        tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    user_defined = [
        token for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED and token in vocab
    ]
    if user_defined:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])


def _set_post_processor(tokenizer: Tokenizer, config: dict[str, Any]) -> None:
    """Add BOS/EOS around encoded text the way transformers' ``update_post_processor`` does."""
    bos, eos = config.get("bos_token"), config.get("eos_token")
    add_bos = bool(config["add_bos_token"]) and bos is not None
    add_eos = bool(config["add_eos_token"]) and eos is not None
    config["add_bos_token"], config["add_eos_token"] = add_bos, add_eos
    if not (add_bos or add_eos):
        return
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    specials = []
    if add_bos:
        specials.append((bos, tokenizer.token_to_id(bos)))
    if add_eos:
        specials.append((eos, tokenizer.token_to_id(eos)))
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

