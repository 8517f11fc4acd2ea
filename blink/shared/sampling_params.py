"""Per-request sampling parameters, validated like vLLM's.

This module must stay torch-free: the frontend (``blink.dpu``) imports it to validate a request
before writing it into the ring. The fixed-size ring fields (stop ids, logit bias, logprobs)
are sized from the ``MAX_*`` constants below.

Semantics follow vLLM (``vllm.SamplingParams``):

- ``temperature == 0`` means greedy; then ``top_p``, ``top_k`` and ``min_p`` are reset to
  "off" because they cannot change an argmax. A temperature in (0, 0.01) is raised to 0.01
  (vLLM does the same: smaller values overflow the scaled logits for no visible gain).
- ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` means "up to max_model_len".
- ``logprobs=N`` asks for the chosen token's logprob plus the top-N alternatives; the values are
  vLLM's default "raw logprobs": the log-softmax of the model's logits before logit bias,
  penalties, temperature and filtering.
- ``allowed_token_ids``: only these ids may be sampled; ``bad_words``: each word's token
  sequence (encoded with and without a leading space, as vLLM does) is banned: its last token
  is masked when the tokens before it were just generated (single-token words always). Both
  are masks on the device, applied after the raw logprobs (vLLM v1's order).
- ``cache_salt``: prefix-cache isolation; a salted request only shares KV blocks with requests
  of the same salt.
- ``seed=None`` does not mean "depends on the batch": the engine draws a random seed once per
  request (:func:`draw_seed`), so every request's tokens depend only on its own seed.
"""

from __future__ import annotations

import logging
import math
import random
import re
import secrets
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from blink.errors import BlinkError
from blink.shared.sampling_fields import BAD_WORD_TOKENS
from blink.shared.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

#: Fixed ring capacities; the ring layout sizes its per-slot arrays from these.
MAX_STOP_TOKEN_IDS = 16
MAX_LOGIT_BIAS = 32
MAX_LOGPROBS = 20
#: allowed_token_ids: most ids one request may allow (the ring's ``max_allowed_token_ids``).
MAX_ALLOWED_TOKEN_IDS = 128
#: bad_words: most words one request may ban; each word's token sequences (with and without a
#: leading space) must fit the ring's bad-word rows (:mod:`blink.shared.sampling_fields`).
MAX_BAD_WORDS = 16
MAX_BAD_WORD_CHARS = 256
#: The ring's bad_words_ids width by default: MAX_BAD_WORDS words, each with its leading-space
#: form, of at most 8 (``sampling_fields.BAD_WORD_TOKENS``) tokens.
MAX_BAD_WORDS_TOKENS = 2 * MAX_BAD_WORDS * 8
#: |logit_bias value| limit, as in the OpenAI API.
MAX_LOGIT_BIAS_VALUE = 100.0
#: stop strings: how many, and how long each may be. The frontend matches every one of them
#: against each new piece of text, on the event loop that serves every request.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
#: Most choices one request may ask for (OpenAI's limit for ``n``). One HTTP request's total
#: fan-out is also bounded by what the ring can hold at once (the frontend checks that).
MAX_N = 128
#: temperature range: OpenAI's documented [0, 2] (vLLM checks the same).
MAX_TEMPERATURE = 2.0
#: repetition_penalty upper bound. vLLM only asks for a finite positive value; a huge one
#: divides or multiplies logits into inf/0 for nothing, and 2 already all but forbids repeats.
MAX_REPETITION_PENALTY = 2.0

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
_MIN_TEMP = 1e-2  # positive temperatures are raised to at least this (vLLM's _MAX_TEMP)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MAX = 2**31 - 1
# A logit_bias key as OpenAI sends it: a plain decimal token id. Python's int() also takes
# " 12 ", "1_0", "+5", "０" (full-width) and "0012"; such keys are refused, not guessed at.
_TOKEN_ID_KEY = re.compile(r"0|-?[1-9][0-9]{0,18}")

# generation_config.json key -> SamplingParams field, the keys vLLM takes defaults from.
_GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class SamplingParamsError(BlinkError):
    """A sampling parameter is out of range or of the wrong type."""


_seed_source: random.Random = secrets.SystemRandom()


def seed_unseeded_requests(seed: int | None) -> None:
    """Where :func:`draw_seed` draws from: a ``random.Random(seed)`` stream (vLLM's
    ``--seed``: a run's sampling repeats when the same requests come in the same order), or
    fresh system randomness (``None``, the default)."""
    global _seed_source
    _seed_source = secrets.SystemRandom() if seed is None else random.Random(seed)


def draw_seed() -> int:
    """A random seed for a request that gave none (a non-negative int64).

    Drawn once when the request is admitted, so the request's tokens still depend only on its
    own seed and never on which other requests share its batch.
    """
    return _seed_source.getrandbits(63)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_id_key(key: Any) -> int | None:
    """A logit_bias key as a token id: an int, an integral float, or a canonical decimal
    string (``"42"``, ``"-1"``); ``None`` for anything else."""
    if _is_int(key):
        return key
    if isinstance(key, float):
        return int(key) if key.is_integer() else None
    if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key):
        return int(key)
    return None


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (field names and defaults as in vLLM)."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    #: vLLM's ``prompt_logprobs``: each prompt token's logprob and rank plus the top N at its
    #: position (0: the prompt token's only); None = off. Such a request never reads the
    #: prefix cache (its positions need logits).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    #: A constraint the output must satisfy (JSON schema, regex, choice, any JSON object),
    #: enforced on the device by a token automaton; None = unconstrained.
    structured_outputs: StructuredOutputs | None = None
    #: Only these token ids may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    #: Words whose token sequences may not be generated (vLLM's ``bad_words``).
    bad_words: list[str] = field(default_factory=list)
    #: ``bad_words`` as token sequences (:meth:`update_from_tokenizer`; None until then).
    bad_words_token_ids: list[list[int]] | None = None
    #: Prefix-cache isolation between tenants (None: the shared, unsalted cache).
    cache_salt: str | None = None
    #: Scheduling priority (vLLM's request ``priority``: lower = served first), honoured
    #: under ``--scheduling-policy priority``; a 32-bit signed integer.
    priority: int = 0

    def __post_init__(self) -> None:
        # Normalise the loose forms a JSON request carries before checking ranges.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is None:
            self.logit_bias = {}
        if self.bad_words is None:
            self.bad_words = []
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = list(self.stop)
        self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self.validate()
        if 0.0 < self.temperature < _MIN_TEMP:
            logger.warning(
                "temperature %s is below %s; it is set to %s to avoid overflow",
                self.temperature,
                _MIN_TEMP,
                _MIN_TEMP,
            )
            self.temperature = _MIN_TEMP
        if self.temperature < _SAMPLING_EPS:
            # Greedy: filtering cannot change an argmax, so turn it off (as vLLM does).
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float]:
        """Accept OpenAI's JSON form (token ids as strings) as well as int keys."""
        if not isinstance(bias, dict):
            raise SamplingParamsError(
                f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}"
            )
        if len(bias) > MAX_LOGIT_BIAS:  # before the per-key work below
            raise SamplingParamsError(
                f"logit_bias can hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}."
            )
        out: dict[int, float] = {}
        for key, value in bias.items():
            token_id = _token_id_key(key)
            if token_id is None:
                raise SamplingParamsError(
                    f"logit_bias keys must be token ids (decimal integers), got {key!r}"
                )
            if not _is_number(value):
                raise SamplingParamsError(
                    f"logit_bias value for token {token_id} must be a number, got {value!r}"
                )
            out[token_id] = float(value)
        return out

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise :class:`SamplingParamsError` for any out-of-range or mistyped value."""
        self._check_types()
        if self.n < 1:
            raise SamplingParamsError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            raise SamplingParamsError(f"n must be at most {MAX_N}, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."
            )
        if not self.repetition_penalty > 0.0:
            raise SamplingParamsError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.repetition_penalty > MAX_REPETITION_PENALTY:
            raise SamplingParamsError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}."
            )
        if not self.temperature >= 0.0:
            raise SamplingParamsError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > MAX_TEMPERATURE:
            raise SamplingParamsError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise SamplingParamsError(
                f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise SamplingParamsError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        for name in ("top_k", "max_tokens", "min_tokens"):
            value = getattr(self, name)
            if value is not None and value > _INT32_MAX:  # the ring stores these as int32
                raise SamplingParamsError(f"{name} must be at most {_INT32_MAX}, got {value}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}."
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}."
            )
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise SamplingParamsError(f"seed must fit in a signed 64-bit integer, got {self.seed}.")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop cannot contain an empty string.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                f"stop can hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}."
            )
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise SamplingParamsError(
                f"stop strings can be at most {MAX_STOP_STRING_CHARS} characters long, got "
                f"{max(len(s) for s in self.stop)}."
            )
        _check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                f"logit_bias can hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}."
            )
        for token_id, value in self.logit_bias.items():
            if token_id < 0:
                raise SamplingParamsError(
                    f"logit_bias token id must be non-negative, got {token_id}."
                )
            if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS_VALUE):
                raise SamplingParamsError(
                    f"logit_bias value for token {token_id} must be in "
                    f"[-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {value}."
                )

        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids is not None and empty!")
            _check_token_ids("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise SamplingParamsError(
                f"bad_words can hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}."
            )
        if any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise SamplingParamsError(
                f"bad_words entries can be at most {MAX_BAD_WORD_CHARS} characters long."
            )
        if self.cache_salt is not None and not self.cache_salt:
            raise SamplingParamsError(
                "Parameter 'cache_salt' must be a non-empty string if provided."
            )

        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise SamplingParamsError(
                    "structured_outputs must be a StructuredOutputs, got "
                    f"{type(self.structured_outputs).__name__}."
                )
            self.structured_outputs.validate()
            # The automaton decides where the output may end: EOS is allowed exactly in its
            # accepting states, so these two could only break the constraint.
            if self.ignore_eos:
                raise SamplingParamsError(
                    "ignore_eos cannot be combined with structured_outputs (the constraint "
                    "ends the output in an accepting state)."
                )
            if self.min_tokens:
                raise SamplingParamsError(
                    "min_tokens cannot be combined with structured_outputs (the constraint "
                    "decides where the output may end)."
                )

    def _check_types(self) -> None:
        for name in ("n", "min_tokens", "top_k"):
            value = getattr(self, name)
            if not _is_int(value):
                raise SamplingParamsError(f"{name} must be an int, got {value!r}.")
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise SamplingParamsError(f"{name} must be an int or None, got {value!r}.")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value):
                raise SamplingParamsError(f"{name} must be a number, got {value!r}.")
            if not math.isfinite(value):
                raise SamplingParamsError(f"{name} must be finite, got {value!r}.")
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError(
                f"stop must be a string or a list of strings, got {self.stop!r}."
            )
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise SamplingParamsError(
                f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}."
            )
        if self.allowed_token_ids is not None and not all(
                _is_int(t) for t in self.allowed_token_ids):
            raise SamplingParamsError(
                f"allowed_token_ids must be a list of ints, got {self.allowed_token_ids!r}."
            )
        if not all(isinstance(w, str) for w in self.bad_words):
            raise SamplingParamsError(
                f"bad_words must be a list of strings, got {self.bad_words!r}."
            )
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise SamplingParamsError(
                f"cache_salt must be a string, got {self.cache_salt!r}."
            )
        if not _is_int(self.priority) or not -2**31 <= self.priority < 2**31:
            raise SamplingParamsError(
                f"priority must be a 32-bit signed integer, got {self.priority!r}."
            )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`SamplingParamsError` for token ids outside a ``vocab_size`` vocabulary.

        Separate from :meth:`validate` because the vocabulary is known only once a model is.
        """
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids contains {token_id}, outside the vocabulary of "
                    f"{vocab_size} tokens."
                )
        for token_id in self.logit_bias:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"logit_bias contains token {token_id}, outside the vocabulary of "
                    f"{vocab_size} tokens."
                )
        for token_id in self.allowed_token_ids or ():
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"allowed_token_ids contains {token_id}, outside the vocabulary of "
                    f"{vocab_size} tokens."
                )
        for ids in self.bad_words_token_ids or ():
            if any(not 0 <= t < vocab_size for t in ids):
                raise SamplingParamsError(
                    f"bad_words contains token ids {ids}, outside the vocabulary of "
                    f"{vocab_size} tokens."
                )

    def update_from_tokenizer(self, encode: Callable[[str], list[int]]) -> None:
        """Resolve ``bad_words`` into ``bad_words_token_ids`` with ``encode`` (text -> ids,
        no special tokens), as vLLM does: each word without its leading spaces, then with one
        leading space where that gives a different first token in as many tokens (so the word
        is banned at the start of the text and in the middle)."""
        out: list[list[int]] = []
        for word in self.bad_words:
            plain = list(encode(word.lstrip()))
            spaced = list(encode(" " + word.lstrip()))
            if len(plain) > BAD_WORD_TOKENS:
                raise SamplingParamsError(
                    f"bad_words entries can be at most {BAD_WORD_TOKENS} tokens long; "
                    f"{word!r} is {len(plain)} tokens."
                )
            if plain:
                out.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        self.bad_words_token_ids = out

    @classmethod
    def from_generation_config(
        cls, cfg: dict[str, Any] | None, **overrides: Any
    ) -> "SamplingParams":
        """Parameters with a model's ``generation_config.json`` defaults, then ``overrides``.

        Like vLLM, only ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``
        and ``max_new_tokens`` (-> ``max_tokens``) are taken from the file, and they are taken
        whatever ``do_sample`` says. An override whose value is ``None`` counts as "not given"
        (an OpenAI request's unset field), so the model default stays.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for key, name in _GENERATION_CONFIG_KEYS.items():
            value = (cfg or {}).get(key)
            if value is not None:
                kwargs[name] = value
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)


def _check_token_ids(name: str, ids: list[int], limit: int) -> None:
    """A request's list of token ids: at most ``limit`` of them, none negative."""
    if len(ids) > limit:
        raise SamplingParamsError(f"{name} can hold at most {limit} ids, got {len(ids)}.")
    if any(t < 0 for t in ids):
        raise SamplingParamsError(f"{name} must be non-negative token ids, got {ids}.")
