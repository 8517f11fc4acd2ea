"""``--speculative-config``: speculative decoding's settings, as vLLM spells them (torch-free:
the CLI checks the flag at parse time).

Two methods run (eager CPU loop):

- ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": a,
  "prompt_lookup_max": b}``: prompt lookup (blink.engine.speculative);
- ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": K}``: a small model of
  the target's tokenizer drafts K tokens greedily (blink.engine.draft_model). As in vLLM, a
  ``model`` with no ``method`` means draft_model (``"model": "ngram"`` means ngram).

Whether PATH exists and shares the target's vocabulary is checked when the engine loads it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

#: the largest K a step verifies per row (a bound on the step's extra work; also the ring's
#: per-position acceptance words, blink.ring.SPEC_POSITIONS)
MAX_SPECULATIVE_TOKENS = 16
#: the longest n-gram looked up
MAX_LOOKUP = 32


class SpeculativeConfigError(ValueError):
    """An invalid --speculative-config (the message names the field)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    #: ngram only (0 for draft_model)
    prompt_lookup_min: int
    prompt_lookup_max: int
    #: draft_model only: the draft's GGUF file, directory or model name (None for ngram)
    model: str | None = None

    def to_json(self) -> str:
        if self.method == "draft_model":
            return json.dumps({"method": self.method, "model": self.model,
                               "num_speculative_tokens": self.num_speculative_tokens})
        return json.dumps({"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                           "prompt_lookup_min": self.prompt_lookup_min,
                           "prompt_lookup_max": self.prompt_lookup_max})


def _int(obj: dict, name: str, default: int | None, lo: int, hi: int) -> int:
    value = obj.get(name, default)
    if value is None:
        raise SpeculativeConfigError(f"--speculative-config: '{name}' is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"--speculative-config: '{name}' must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpeculativeConfigError(f"--speculative-config: '{name}' must be in [{lo}, {hi}], got {value}")
    return value


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """The config a ``--speculative-config`` value means (None: off). Raises
    :class:`SpeculativeConfigError` naming the field that is wrong."""
    if text is None or text == "":
        return None
    if isinstance(text, dict):
        obj = text
    else:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise SpeculativeConfigError("--speculative-config: must be a JSON object")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise SpeculativeConfigError(f"--speculative-config: unknown field(s) {', '.join(map(repr, unknown))} "
                                     f"(known: {', '.join(sorted(known))})")
    method = obj.get("method")
    model = obj.get("model")
    if method is None and model is not None:  # vLLM: a model without a method is a draft model
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "ngram":
            model = None
    if method == "draft_model":
        return _draft_model(obj, model)
    if method != "ngram":
        raise SpeculativeConfigError(f"--speculative-config: 'method' must be 'ngram' or 'draft_model', "
                                     f"got {method!r}")
    if model is not None:
        raise SpeculativeConfigError("--speculative-config: 'model' is for draft_model; ngram takes none")
    k = _int(obj, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    # vLLM's defaults: each bound defaults to the other, both to 5
    hi = _int(obj, "prompt_lookup_max", obj.get("prompt_lookup_min", 5), 1, MAX_LOOKUP)
    lo = _int(obj, "prompt_lookup_min", hi if "prompt_lookup_max" in obj else 5, 1, MAX_LOOKUP)
    if lo > hi:
        raise SpeculativeConfigError(f"--speculative-config: 'prompt_lookup_min' ({lo}) must be at most "
                                     f"'prompt_lookup_max' ({hi})")
    return SpeculativeConfig("ngram", k, lo, hi)


def _draft_model(obj: dict, model: object) -> SpeculativeConfig:
    if not isinstance(model, str) or not model.strip():
        raise SpeculativeConfigError("--speculative-config: draft_model needs 'model' (the draft's GGUF file, "
                                     f"directory or model name), got {model!r}")
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if name in obj:
            raise SpeculativeConfigError(f"--speculative-config: '{name}' is for ngram; draft_model takes none")
    k = _int(obj, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    return SpeculativeConfig("draft_model", k, 0, 0, model)


def speculative_config_arg(text: str) -> str:
    """argparse ``type=``: the value checked (a clear error naming the field), kept as text."""
    try:
        parse_speculative_config(text)
    except SpeculativeConfigError as e:
        import argparse

        raise argparse.ArgumentTypeError(str(e)) from None
    return text
