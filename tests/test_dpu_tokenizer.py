"""Tokenizer, chat templates and the incremental detokenizer (blink.dpu), checked against
transformers' ``apply_chat_template`` and ``tokenizers``' full decode, on SmolLM2's real
tokenizer (byte-level BPE) and on a sentencepiece-style byte-fallback tokenizer."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from blink.dpu.chat_template import ChatTemplateError, detect_content_format, render_chat_template
from blink.dpu.detokenizer import IncrementalDetokenizer
from blink.dpu.tokenizer import Tokenizer

MULTILINGUAL = "Grüße, 世界! Emoji 😀👍🏽 and ẞ — naïve café. 日本語のテキスト。🇯🇵 done"


@pytest.fixture(scope="module")
def smol_files() -> tuple[str, dict, dict]:
    from blink.loader import load_tokenizer_files

    return load_tokenizer_files("smollm2-135m")


@pytest.fixture(scope="module")
def smol(smol_files: tuple[str, dict, dict]) -> Tokenizer:
    return Tokenizer(*smol_files)


@pytest.fixture(scope="module")
def hf_smol(smol_files: tuple[str, dict, dict], tmp_path_factory: pytest.TempPathFactory):
    """transformers' tokenizer over the same files, as the reference implementation."""
    from transformers import AutoTokenizer

    d: Path = tmp_path_factory.mktemp("smol_tok")
    tokenizer_json, tokenizer_config, _ = smol_files
    (d / "tokenizer.json").write_text(tokenizer_json)
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return AutoTokenizer.from_pretrained(str(d))


def _byte_fallback_tokenizer() -> Tokenizer:
    """A Llama/Mistral-style tokenizer: ▁ for spaces, <0xNN> byte fallback, Strip decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁", "a", "b", "c", "d", "e", "l", "o", "h", "w", "r", "▁h", "▁he", "▁hel",
              "▁hello", "▁w", "▁wor", "▁world", "lo", "or", "ld", "é", "世"]
    for p in pieces:
        vocab[p] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "lo"), ("l", "o"), ("o", "r"),
              ("l", "d"), ("▁", "w"), ("▁w", "or"), ("▁wor", "ld")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                 byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(tok.to_str(), {"bos_token": "<s>", "eos_token": "</s>",
                                    "add_bos_token": True}, {})


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    return _byte_fallback_tokenizer()


def _detokenize(tok: Tokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True
                ) -> list[str]:
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip)
    return [detok.step(t) for t in ids] + [detok.flush()]


# -- chat templates --------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Write a haiku about 世界 😀"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smol: Tokenizer, hf_smol, conversation,
                                               add_generation_prompt: bool) -> None:
    expected = hf_smol.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    assert smol.render_chat(conversation, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = hf_smol.apply_chat_template(conversation, tokenize=True,
                                               add_generation_prompt=add_generation_prompt,
                                               return_dict=False)
    ours = smol.encode_chat(conversation, add_generation_prompt=add_generation_prompt)
    assert ours == list(expected_ids)
    assert ours[:2] != [smol.bos_token_id] * 2  # bos (<|im_start|>) comes from the template only


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_list_content_renders_like_the_joined_string(smol: Tokenizer, hf_smol,
                                                     add_generation_prompt: bool) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                          {"type": "text", "text": "second 😀"}]}]
    joined = [{"role": "user", "content": "first part\nsecond 😀"}]
    expected = hf_smol.apply_chat_template(joined, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    assert smol.render_chat(parts, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_matches_transformers(smol: Tokenizer, hf_smol) -> None:
    conversation = [{"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "The colour is"}]
    expected = hf_smol.apply_chat_template(conversation, tokenize=False,
                                           continue_final_message=True)
    ours = smol.render_chat(conversation, add_generation_prompt=False,
                            continue_final_message=True)
    assert ours == expected and ours.endswith("The colour is")


CUSTOM_TEMPLATES = {
    # loops over content parts (the "openai" content format)
    "parts": "{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}"
             "[{{ p['text'] }}]{% endfor %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}",
    # tojson without HTML escaping, namespace, loop controls, a kwarg, bos_token
    "features": "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
                "{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
                "{{ m | tojson }}{% endfor %}n={{ ns.n }} flag={{ flag }}"
                "{{ {'k': '<&>'} | tojson(indent=2) }}",
}


@pytest.mark.parametrize("name", sorted(CUSTOM_TEMPLATES))
def test_custom_templates_match_transformers(hf_smol, smol: Tokenizer, name: str) -> None:
    template = CUSTOM_TEMPLATES[name]
    if name == "parts":
        conversation = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                     {"type": "text", "text": "b"}]}]
        kwargs: dict = {}
    else:
        conversation = [{"role": "user", "content": "x <b>"}, {"role": "skip", "content": "-"},
                        {"role": "assistant", "content": "ü"}]
        kwargs = {"flag": True}
    expected = hf_smol.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                           add_generation_prompt=True, **kwargs)
    ours = smol.render_chat(conversation, chat_template=template, add_generation_prompt=True,
                            chat_template_kwargs=kwargs)
    assert ours == expected


def test_content_format_detection() -> None:
    assert detect_content_format(CUSTOM_TEMPLATES["parts"]) == "openai"
    assert detect_content_format(CUSTOM_TEMPLATES["features"]) == "string"
    assert detect_content_format("{% for x in message.content | reverse %}{% endfor %}") == "openai"


def test_template_errors_are_clear(smol: Tokenizer) -> None:
    raising = "{{ raise_exception('only user messages, got ' + messages[0]['role']) }}"
    with pytest.raises(ChatTemplateError, match="only user messages, got system"):
        render_chat_template(raising, [{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="only text parts"):
        smol.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ChatTemplateError, match="at least one message"):
        smol.render_chat([])
    # the sandbox refuses attribute access to Python internals
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "u", "content": ""}])


def test_strftime_now_is_available() -> None:
    out = render_chat_template("{{ strftime_now('%Y') }}", [{"role": "user", "content": ""}])
    assert out.isdigit() and len(out) == 4


# -- encoding / bos ------------------------------------------------------------------------
def test_bos_is_added_once(byte_fallback: Tokenizer) -> None:
    tok = byte_fallback
    bos = tok.bos_token_id
    assert tok.encode("hello")[0] == bos and tok.encode("hello")[1] != bos
    assert tok.encode("<s> hello")[:2] != [bos, bos]  # the text brought its own bos
    assert tok.encode("<s> hello").count(bos) == 1
    assert bos not in tok.encode("hello", add_special_tokens=False)


def test_template_with_bos_does_not_get_a_second_one(byte_fallback: Tokenizer) -> None:
    tok = byte_fallback
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    conversation = [{"role": "user", "content": "hello world"}]
    for add_special_tokens in (False, True):  # vLLM's chat request field
        ids = tok.encode_chat(conversation, chat_template=template,
                              add_special_tokens=add_special_tokens)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == "hello world"


def test_token_bytes_for_logprobs(smol: Tokenizer, byte_fallback: Tokenizer) -> None:
    ids = smol.encode("😀", add_special_tokens=False)
    assert b"".join(smol.token_bytes(t) for t in ids) == "😀".encode()
    ids = byte_fallback.encode("😀", add_special_tokens=False)
    assert b"".join(byte_fallback.token_bytes(t) for t in ids) == " 😀".encode()
    assert byte_fallback.token_text(byte_fallback.encode("hello", False)[0]) == " hello"


# -- incremental detokenizer ---------------------------------------------------------------
def test_detokenizer_equals_full_decode_on_random_ids(smol: Tokenizer) -> None:
    rng = random.Random(0)
    specials = sorted(smol.special_ids)
    for _ in range(60):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids += [rng.choice(specials) for _ in range(rng.randrange(3))]
        rng.shuffle(ids)
        for skip in (True, False):
            assert "".join(_detokenize(smol, ids, skip=skip)) == smol.decode(ids, skip), ids


def test_detokenizer_with_prompt_context(smol: Tokenizer, byte_fallback: Tokenizer) -> None:
    for tok in (smol, byte_fallback):
        prompt = tok.encode("Say hello to the world")
        output = tok.encode(" hello wörld 😀 end", add_special_tokens=False)
        text = "".join(_detokenize(tok, output, prompt))
        full = tok.decode(prompt + output)
        assert full == tok.decode(prompt) + text  # leading space kept, as after the prompt


@pytest.mark.parametrize("which", ["smol", "byte_fallback"])
def test_multibyte_split_over_byte_tokens_never_emits_replacement_char(
        which: str, smol: Tokenizer, byte_fallback: Tokenizer) -> None:
    tok = smol if which == "smol" else byte_fallback
    ids = tok.encode(MULTILINGUAL, add_special_tokens=False)
    if which == "smol":
        # Force the worst case: every UTF-8 byte as its own byte-level token.
        from blink.shared.byte_level import unicode_to_bytes

        char_of = {b: c for c, b in unicode_to_bytes().items()}
        ids = [tok._tok.token_to_id(char_of[b]) for b in MULTILINGUAL.encode()]
    else:
        assert any(tok.id_to_token(t).startswith("<0x") for t in ids)  # really byte-fallback
    deltas = _detokenize(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert tok.decode(ids).strip() == MULTILINGUAL


def test_byte_fallback_random_sequences_equal_full_decode(byte_fallback: Tokenizer) -> None:
    """Random mixes of pieces, special tokens and characters spelled as <0xNN> bytes.

    (ByteFallback turns a whole run of byte tokens into U+FFFDs when any byte in it is
    invalid, valid characters in the run included, so for byte garbage a full decode and any
    stream disagree; a model emits the bytes of real characters, as generated here.)
    """
    tok = byte_fallback
    rng = random.Random(1)
    pieces = [i for i in range(tok.vocab_size)
              if not tok.id_to_token(i).startswith("<0x") and i not in tok.special_ids]
    chars = "aé世😀👍🏽ẞ\n"
    byte_id = {b: tok._tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    for _ in range(200):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 15)):
            kind = rng.random()
            if kind < 0.5:
                ids.append(rng.choice(pieces))
            elif kind < 0.6:
                ids.append(rng.choice(sorted(tok.special_ids)))
            else:
                ids += [byte_id[b] for b in rng.choice(chars).encode()]
        for skip in (True, False):
            assert "".join(_detokenize(tok, ids, skip=skip)) == tok.decode(ids, skip), ids


def test_stream_cut_inside_a_character(byte_fallback: Tokenizer, smol: Tokenizer) -> None:
    """A stream that ends mid-character: the complete text first, U+FFFD only at the end."""
    for tok, byte_ids in (
        (byte_fallback, [byte_fallback._tok.token_to_id(f"<0x{b:02X}>")
                         for b in "😀".encode()[:3]]),
        (smol, smol.encode("😀", add_special_tokens=False)[:-1]),
    ):
        ids = tok.encode(" hello world", add_special_tokens=False) + byte_ids
        deltas = _detokenize(tok, ids)
        assert "".join(deltas[:-1]) == tok.decode(ids[: -len(byte_ids)])
        assert deltas[-1] and set(deltas[-1]) == {"\ufffd"}


def test_detokenizer_work_per_token_is_bounded(smol: Tokenizer) -> None:
    """Each step decodes a window of a few tokens, however long the output gets."""
    sizes: list[int] = []
    real_decode = smol.decode

    class Spy:
        special_ids = smol.special_ids

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            sizes.append(len(ids))
            return real_decode(ids, skip_special_tokens)

    ids = smol.encode(MULTILINGUAL * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), [], skip_special_tokens=True)  # type: ignore[arg-type]
    text = "".join(detok.step(t) for t in ids) + detok.flush()
    assert text == smol.decode(ids)
    assert len(ids) > 1000 and max(sizes) <= 12
    assert len(detok._ids) < 300  # emitted tokens are trimmed
