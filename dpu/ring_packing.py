"""Request parameters → the slot's packed request record: what the frontend writes, in one place.

numpy only (runs on the DPU image). The record's sampling fields are the one table's
(:data:`blink.shared.sampling_fields.SAMPLING_FIELDS`, which also states the ring
conventions); its dtype is :func:`blink.ring.request_record_dtype`. Two entry points:

- :func:`pack_sampling`: keyword values under the table's names (``logit_bias`` may come as
  one mapping instead of ``logit_bias_ids`` / ``logit_bias_values``) → a 0-d record with every
  sampling field set, checked against the ring's sizes (the only place those checks run).
- :func:`ring_fields`: a validated :class:`SamplingParams` → the same record (it converts:
  ``max_tokens`` made concrete, ``top_k`` -1 → 0, a seed drawn, ``logprobs`` None → 0).

:meth:`~blink.dpu.ring_protocol.RingClient.try_submit` fills in the record's header (seq,
request id, arrival, prompt location, consumed = 0) and writes the whole record at once.
"""
from __future__ import annotations

import uuid
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from blink.ring import RingConfig, request_record_dtype
from blink.shared.sampling_fields import (
    FIELDS_BY_NAME,
    SAMPLING_FIELDS,
    bad_words_entries,
    cache_salt_hash,
)
from blink.shared.sampling_params import SamplingParams, SamplingParamsError, draw_seed

INT32_MAX = 2**31 - 1

#: Values of the fields a caller of :func:`pack_sampling` leaves out (``max_tokens`` has none).
_DEFAULTS: dict[str, Any] = {
    "min_tokens": 0, "ignore_eos": 0, "logprobs": 0, "top_k": 0, "temperature": 1.0,
    "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "seed": 0, "stop_token_ids": (), "logit_bias_ids": (),
    "logit_bias_values": (), "constrained": 0, "allowed_token_ids": (), "bad_words_ids": (),
    "cache_salt": 0, "priority": 0, "prompt_logprobs": -1, "prompt_logprob_lane": -1,
}
#: What a vector field's capacity counts, for the error message.
_UNITS = {"stop_token_ids": "ids", "logit_bias_ids": "entries", "logit_bias_values": "entries",
          "allowed_token_ids": "ids", "bad_words_ids": "token entries"}


class RingRequestError(SamplingParamsError):
    """The request cannot be written into the ring (empty or oversized prompt, more stop ids or
    logit-bias entries than the ring holds...). A client error, not an engine failure."""


@lru_cache(maxsize=8)
def record_dtype(cfg: RingConfig) -> np.dtype:
    return request_record_dtype(cfg)


def _fits(name: str, dtype: np.dtype, values: np.ndarray) -> None:
    if dtype.kind == "i" and values.size:
        info = np.iinfo(dtype)
        lo, hi = int(values.min()), int(values.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise RingRequestError(
                f"{name} must fit in a signed {info.bits}-bit integer, got {bad}"
            )


def pack_sampling(cfg: RingConfig, *, logit_bias: Mapping[int, float] | None = None,
                  **values: Any) -> np.ndarray:
    """A 0-d request record (dtype :func:`record_dtype`) with every sampling field set from
    ``values`` (table names; ``max_tokens`` is required, the rest default to "off").

    Raises :class:`RingRequestError` when a value does not fit the ring (capacity, bound,
    integer width): before anything is written.
    """
    unknown = sorted(set(values) - FIELDS_BY_NAME.keys())
    if unknown:
        raise TypeError(f"unknown ring sampling field(s): {', '.join(unknown)}")
    if "max_tokens" not in values:
        raise TypeError("pack_sampling() needs max_tokens")
    source = {"logit_bias_ids": "logit_bias_ids", "logit_bias_values": "logit_bias_values"}
    if logit_bias is not None:
        bias = dict(logit_bias)
        values["logit_bias_ids"], values["logit_bias_values"] = list(bias), list(bias.values())
        source = {"logit_bias_ids": "logit_bias", "logit_bias_values": "logit_bias"}
    if values["max_tokens"] < 1:
        raise RingRequestError(f"max_tokens must be at least 1, got {values['max_tokens']}")
    values["top_k"] = max(int(values.get("top_k", 0)), 0)  # 0 = off
    values["ignore_eos"] = int(bool(values.get("ignore_eos", 0)))

    record = np.zeros((), dtype=record_dtype(cfg))
    for f in SAMPLING_FIELDS:
        dtype = np.dtype(f.dtype)
        value = values.get(f.name, _DEFAULTS.get(f.name))
        if f.width is not None:
            cap = getattr(cfg, f.width)
            given = np.asarray(list(value), dtype=np.float64 if dtype.kind == "f" else object)
            if given.size > cap:
                name = source.get(f.name, f.name)
                raise RingRequestError(
                    f"{name} can hold at most {cap} {_UNITS[f.name]} in this engine, "
                    f"got {given.size}"
                )
            _fits(f.name, dtype, given)
            entries = np.full(cap, f.pad, dtype=dtype)
            entries[: given.size] = given
            record[f.name] = entries
            continue
        if f.bound is not None:
            bound = getattr(cfg, f.bound)
            if value < 0 and value != f.pad:  # (the pad: "off", e.g. prompt_logprobs -1)
                raise RingRequestError(f"{f.name} must be non-negative, got {value}")
            if value > bound:
                raise RingRequestError(f"{f.name} can be at most {bound} in this engine, got {value}")
        _fits(f.name, dtype, np.asarray([value], dtype=object))
        record[f.name] = value
    return record


def ring_fields(params: SamplingParams, prompt_len: int, max_model_len: int,
                cfg: RingConfig) -> np.ndarray:
    """The packed request record for ``params`` (validated by SamplingParams already; the
    ring's own limits are checked here, once)."""
    if params.n != 1:
        raise RingRequestError(f"the engine takes one sequence per request, got n={params.n}")
    if prompt_len >= max_model_len and params.max_tokens is None:
        raise RingRequestError(
            f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - prompt_len
    if params.bad_words and params.bad_words_token_ids is None:
        raise RingRequestError("bad_words need the tokenizer: call "
                               "SamplingParams.update_from_tokenizer first")
    try:
        bad_words = bad_words_entries(params.bad_words_token_ids, cfg.max_bad_words_tokens)
    except ValueError as e:
        raise RingRequestError(str(e)) from None
    return pack_sampling(
        cfg,
        max_tokens=min(max_tokens, INT32_MAX),
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs or 0,
        top_k=params.top_k,
        temperature=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed if params.seed is not None else draw_seed(),
        stop_token_ids=params.stop_token_ids,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids or (),
        bad_words_ids=bad_words,
        cache_salt=_cache_salt(params),
        priority=params.priority,
        prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
    )


def _cache_salt(params: SamplingParams) -> int:
    """The ring's ``cache_salt``: a request with prompt logprobs gets a salt of its own (its
    salt string, if any, and a random part), so the prefix cache never serves its positions,
    which have no logits then (vLLM skips prefix-cache hits for such requests too)."""
    if params.prompt_logprobs is None:
        return cache_salt_hash(params.cache_salt)
    return cache_salt_hash(f"{params.cache_salt or ''}\0prompt_logprobs:{uuid.uuid4().hex}")
