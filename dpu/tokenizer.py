"""The frontend's tokenizer: a ``tokenizers.Tokenizer`` plus what the model repo says about it.

Built from the three things ``blink.loader.tokenizer_files.load_tokenizer_files`` returns (tokenizer.json text,
tokenizer_config.json and generation_config.json as dicts), so a GGUF file and an HF directory
behave the same. Torch-free.
"""
from __future__ import annotations

import json
import re
from functools import cached_property, lru_cache
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as HFTokenizer

from blink.dpu.chat_template import ChatTemplateError, RenderLimits, render_chat_template
from blink.dpu.fast_encode import FastEncoder
from blink.shared.byte_level import unicode_to_bytes
from blink.errors import BlinkError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Texts longer than this go through tokenizers' encode_batch (see Tokenizer._encode_ids).
_GIL_FREE_ENCODE_CHARS = 4096
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")
# Normalizers that cannot shrink a text's UTF-8 by more than _NORMALIZER_SHRINK (composition:
# three jamo of 3 bytes each become one 3-byte syllable) — see Tokenizer.max_prompt_chars.
_BOUNDED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Prepend", "Lowercase"}
_NORMALIZER_SHRINK = 3


@lru_cache(maxsize=1)
def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _normalizer_is_bounded(normalizer: Mapping[str, Any] | None) -> bool:
    """True if ``normalizer`` never shrinks a text by more than ``_NORMALIZER_SHRINK``."""
    if not normalizer:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_normalizer_is_bounded(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":  # sentencepiece's " " -> "▁" grows; "  " -> " " would not be safe
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content")
        return isinstance(pattern, str) and isinstance(content, str) and \
            len(content.encode()) >= len(pattern.encode())
    return kind in _BOUNDED_NORMALIZERS


def _decoder_types(decoder: Mapping[str, Any] | None) -> list[str]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [t for d in decoder.get("decoders", []) for t in _decoder_types(d)]
    return [str(decoder.get("type"))]


class Tokenizer:
    """Encode/decode, special tokens, and chat-template rendering for one model."""

    def __init__(self, tokenizer_json: str, tokenizer_config: Mapping[str, Any] | None = None,
                 generation_config: Mapping[str, Any] | None = None, *, fast: bool = True) -> None:
        """``fast=False`` always encodes through ``tokenizers`` (same ids, slower)."""
        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.config: dict[str, Any] = dict(tokenizer_config or {})
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)

        added = self._tok.get_added_tokens_decoder()
        #: ids that ``skip_special_tokens`` drops (added tokens flagged special)
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_content: dict[int, str] = {i: t.content for i, t in added.items()}

        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(self.config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids: list[int] = []
        if self.eos_token and (eid := self._tok.token_to_id(self.eos_token)) is not None:
            eos_ids.append(eid)
        gen_eos = self.generation_config.get("eos_token_id")
        for eid in ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])):
            if eid not in eos_ids:
                eos_ids.append(int(eid))
        #: every id that ends generation (tokenizer eos first, then generation_config's)
        self.eos_token_ids: list[int] = eos_ids
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None

        # chat_template is a string, or a list of {"name", "template"} (default / tool_use).
        template = self.config.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(template, list):
            named = {t["name"]: t["template"] for t in template
                     if isinstance(t, Mapping) and isinstance(t.get("template"), str)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._tool_template: str | None = named.get("tool_use")

        # Does encode(add_special_tokens=True) need us to add bos? The post-processor in
        # tokenizer.json may already do it; tokenizer_config's add_bos_token is the model's word.
        probe = self._tok.encode("a", add_special_tokens=True).ids
        self._post_adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        add_bos = self.config.get("add_bos_token")
        self.add_bos: bool = self._post_adds_bos if add_bos is None else bool(add_bos)

        spec = json.loads(tokenizer_json)
        decoder = spec.get("decoder")
        kinds = _decoder_types(decoder)
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._token_bytes_cache: dict[int, bytes] = {}
        # Every text byte lands in some token of known length (no "unknown word" token that
        # swallows any amount of text), and normalization cannot shrink the text much.
        self._length_bound_holds = (self._byte_level or self._byte_fallback) and \
            _normalizer_is_bounded(spec.get("normalizer"))

        # The exact fast path for byte-level BPE (blink.dpu.fast_encode), with the ids the
        # post-processor puts around a text when add_special_tokens is set: a constant prefix
        # and suffix (TemplateProcessing, Roberta/Bert processors, ByteLevel's offset trimming),
        # checked on probes; None when it is not constant (then tokenizers adds them).
        self._fast: FastEncoder | None = FastEncoder.build(spec, self._tok) if fast else None
        self._post_affixes: tuple[list[int], list[int]] | None = ([], [])
        if self._fast is not None and spec.get("post_processor") is not None:
            self._post_affixes = self._probe_post_affixes()

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, fast: bool = True) -> "Tokenizer":
        """Load through ``blink.loader.tokenizer_files.load_tokenizer_files`` (HF directory, GGUF, or preset)."""
        from blink.loader.tokenizer_files import load_tokenizer_files  # torch-free; imported late (optional)

        tokenizer_json, tokenizer_config, generation_config = load_tokenizer_files(name_or_path)
        return cls(tokenizer_json, tokenizer_config, generation_config, fast=fast)

    def use_chat_template(self, template: str) -> None:
        """Render every conversation with ``template`` instead of the model's (``--chat-template``);
        the model's tool-use template goes too, as in vLLM."""
        self.chat_template = template
        self._tool_template = None

    def _probe_post_affixes(self) -> tuple[list[int], list[int]] | None:
        with_special = self._tok.encode("Hello world", add_special_tokens=True).ids
        plain = self._tok.encode("Hello world", add_special_tokens=False).ids
        for start in range(len(with_special) - len(plain) + 1):
            if with_special[start: start + len(plain)] == plain:
                prefix, suffix = with_special[:start], with_special[start + len(plain):]
                break
        else:
            return None
        for probe in ("", "a", " 12 x\n", "<|x|> ü 😀"):
            if self._tok.encode(probe, add_special_tokens=True).ids != \
                    prefix + self._tok.encode(probe, add_special_tokens=False).ids + suffix:
                return None
        return prefix, suffix

    # -- encode / decode -----------------------------------------------------------------
    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """What ``tokenizers`` returns for ``encode(text, add_special_tokens).ids``."""
        affixes = self._post_affixes if add_special_tokens else ([], [])
        ids = self._fast.encode(text) if self._fast is not None and affixes is not None else None
        if ids is None:
            if len(text) > _GIL_FREE_ENCODE_CHARS:
                # Same ids; encode_batch releases the GIL while it works, encode holds it
                # (1.5M characters froze every other thread of the frontend for a second).
                return self._tok.encode_batch([text], add_special_tokens=add_special_tokens
                                              )[0].ids
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        prefix, suffix = affixes
        return prefix + ids + suffix if prefix or suffix else ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's bos (etc.) are added,
        but a bos already written at the start of ``text`` is not doubled."""
        ids = self._encode_ids(text, add_special_tokens)
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        bos = self.bos_token_id
        if self.add_bos and not self._post_adds_bos:
            ids = [bos] + ids
        elif not self.add_bos and self._post_adds_bos and ids[:1] == [bos] \
                and not text.startswith(self.bos_token or "\0"):
            ids = ids[1:]  # the config says no bos; the post-processor added one anyway
        if ids[:2] == [bos, bos] and self.bos_token and text.startswith(self.bos_token):
            ids = ids[1:]  # the text carried its own bos (a template, or the user)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token of this tokenizer, else None."""
        token_id = self._tok.token_to_id(text)
        return token_id if token_id is not None and token_id in self.special_ids else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for logprobs' ``bytes`` field).

        Exact for byte-level BPE (GPT-2 alphabet) and byte-fallback ``<0xNN>`` tokens, where a
        token may be part of a multi-byte character; otherwise the UTF-8 of its text with
        sentencepiece's ``▁`` read as a space.
        """
        cached = self._token_bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_content:
            out = self._added_content[token_id].encode()
        else:
            piece = self._tok.id_to_token(token_id)
            if piece is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary "
                                 f"({self.vocab_size} tokens)")
            table = unicode_to_bytes()
            if self._byte_level and all(c in table for c in piece):
                out = bytes(table[c] for c in piece)
            elif self._byte_fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
                out = bytes([int(m.group(1), 16)])
            else:
                out = piece.replace("\u2581", " ").encode()
        self._token_bytes_cache[token_id] = out
        return out

    @cached_property
    def max_token_bytes(self) -> int:
        """The most text bytes one token stands for (special tokens included)."""
        longest = 1
        for token_id in range(self.vocab_size):
            try:
                longest = max(longest, len(self.token_bytes(token_id)))
            except ValueError:  # a hole in the vocabulary
                continue
        return longest

    def max_prompt_chars(self, max_tokens: int) -> int | None:
        """A text longer than this many characters surely encodes to more than ``max_tokens``
        tokens, so it can be refused without encoding it; ``None`` when the tokenizer gives no
        such bound (an "unknown" token may cover any length of text, or its normalizer may
        drop text).

        Each token covers at most :attr:`max_token_bytes` bytes of normalized text, a
        character is at least one byte, and the accepted normalizers shrink text at most
        ``_NORMALIZER_SHRINK``-fold: ``max_tokens`` tokens cover at most
        ``max_tokens * max_token_bytes * _NORMALIZER_SHRINK`` characters.
        """
        if not self._length_bound_holds:
            return None
        return max_tokens * self.max_token_bytes * _NORMALIZER_SHRINK

    def token_text(self, token_id: int) -> str:
        """One token as text (U+FFFD where it holds only part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # -- chat ----------------------------------------------------------------------------
    def template_source(self, tools: bool, chat_template: str | None = None) -> str | None:
        """The template a conversation renders with: the request's, else the model's
        ``tool_use`` template when tools are offered and it has one, else its default."""
        return chat_template or (self._tool_template if tools and self._tool_template
                                 else self.chat_template)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        limits: RenderLimits | None = None,
    ) -> str:
        """The prompt text for a conversation (``apply_chat_template(tokenize=False)``),
        rendered under ``limits`` (see :mod:`blink.dpu.chat_template`)."""
        source = self.template_source(bool(tools), chat_template)
        if source is None:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions with a plain prompt")
        if not messages:
            raise ChatTemplateError("messages must contain at least one message")
        return render_chat_template(
            source, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, documents=documents,
            special_tokens=self.special_tokens, chat_template_kwargs=chat_template_kwargs,
            limits=limits)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_special_tokens: bool = False, **render_kwargs: Any) -> list[int]:
        """Render and encode a conversation. Like transformers and vLLM, special tokens are
        not added by default: the template writes the ones the model expects (bos included),
        and :meth:`encode` never doubles a bos the text already starts with."""
        return self.encode(self.render_chat(messages, **render_kwargs),
                           add_special_tokens=add_special_tokens)


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the jinja text itself (vLLM's rule: what cannot be
    opened is taken as a template only if it looks like one: it holds ``{``, ``}`` or a newline)."""
    from pathlib import Path

    path = Path(value)
    try:
        return path.read_text()
    except OSError as exc:
        if any(c in value for c in "{}\n"):
            return value
        raise BlinkError(f"--chat-template {value!r}: looks like a file name but cannot be "
                         f"read ({exc.strerror or exc})") from None
