"""Request parameters → the ring slot's fields: what the frontend writes, in one place.

numpy only (runs on the DPU image). Two steps, both here so that the table of sampling fields
can be changed in one module (:mod:`blink.dpu.ring_protocol` only writes what
:func:`slot_field_values` returns, in its order):

- :func:`ring_fields`: :class:`SamplingParams` → the keyword fields
  :meth:`~blink.dpu.ring_protocol.RingClient.try_submit` takes (the conventions below).
- :func:`slot_field_values`: those keyword fields → the value of every per-request sampling
  field of the slot (ring field name → value), validated against the ring's sizes.

Ring field conventions the frontend writes (the engine side reads them the same way):

- ``top_k``: 0 means off (SamplingParams' -1 is written as 0; the sampler treats <= 0 as off).
- ``n_logprobs``: how many top alternatives to return, 0 = none; the chosen token's logprob is
  always written by the engine and the frontend returns it only if the request asked.
- ``seed``: always set; a request without one gets a random 63-bit seed here.
- ``max_tokens``: always concrete (``max_model_len - prompt_len`` when the request gave none).
- ``stop_ids`` / ``logit_bias_ids``: -1 padded; more than the ring holds is refused.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from blink.shared.sampling_params import SamplingParams, SamplingParamsError, draw_seed
from blink.ring import RingConfig

INT32_MAX = 2**31 - 1


class RingRequestError(SamplingParamsError):
    """The request cannot be written into the ring (empty or oversized prompt, more stop ids or
    logit-bias entries than the ring holds...). A client error, not an engine failure."""


def ring_fields(params: SamplingParams, prompt_len: int, max_model_len: int,
                cfg: RingConfig) -> dict[str, Any]:
    """The slot fields for ``params`` (see the module docstring for the conventions)."""
    if params.n != 1:
        raise RingRequestError(f"the engine takes one sequence per request, got n={params.n}")
    if prompt_len >= max_model_len and params.max_tokens is None:
        raise RingRequestError(
            f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - prompt_len
    if len(params.stop_token_ids) > cfg.max_stop_ids:
        raise RingRequestError(
            f"stop_token_ids can hold at most {cfg.max_stop_ids} ids in this engine, "
            f"got {len(params.stop_token_ids)}"
        )
    if len(params.logit_bias) > cfg.max_logit_bias:
        raise RingRequestError(
            f"logit_bias can hold at most {cfg.max_logit_bias} entries in this engine, "
            f"got {len(params.logit_bias)}"
        )
    n_logprobs = params.logprobs or 0
    if n_logprobs > cfg.max_logprobs:
        raise RingRequestError(
            f"logprobs can be at most {cfg.max_logprobs} in this engine, got {n_logprobs}"
        )
    return dict(
        max_tokens=min(max_tokens, INT32_MAX),
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        n_logprobs=n_logprobs,
        top_k=params.top_k if params.top_k > 0 else 0,
        temperature=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed if params.seed is not None else draw_seed(),
        stop_ids=list(params.stop_token_ids),
        logit_bias=dict(params.logit_bias),
    )


def slot_field_values(
    cfg: RingConfig,
    *,
    max_tokens: int,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    n_logprobs: int = 0,
    top_k: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    logit_bias: Mapping[int, float] | None = None,
) -> dict[str, Any]:
    """Ring field name → value for every sampling field of a request slot, in write order.

    Raises :class:`RingRequestError` before anything is written when a value does not fit.
    """
    stop = np.full(cfg.max_stop_ids, -1, dtype="<i4")
    bias_ids = np.full(cfg.max_logit_bias, -1, dtype="<i4")
    bias_vals = np.zeros(cfg.max_logit_bias, dtype="<f4")
    if len(stop_ids) > cfg.max_stop_ids:
        raise RingRequestError(f"at most {cfg.max_stop_ids} stop token ids fit in the ring, got {len(stop_ids)}")
    logit_bias = dict(logit_bias or {})
    if len(logit_bias) > cfg.max_logit_bias:
        raise RingRequestError(f"at most {cfg.max_logit_bias} logit_bias entries fit in the ring, got {len(logit_bias)}")
    if not 0 <= n_logprobs <= cfg.max_logprobs:
        raise RingRequestError(f"n_logprobs must be in [0, {cfg.max_logprobs}], got {n_logprobs}")
    if max_tokens < 1:
        raise RingRequestError(f"max_tokens must be at least 1, got {max_tokens}")
    stop[: len(stop_ids)] = list(stop_ids)
    bias_ids[: len(logit_bias)] = list(logit_bias.keys())
    bias_vals[: len(logit_bias)] = list(logit_bias.values())
    return {
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "ignore_eos": int(bool(ignore_eos)),
        "n_logprobs": n_logprobs,
        "top_k": top_k if top_k > 0 else 0,
        "temperature": temperature,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
        "stop_ids": stop,
        "logit_bias_ids": bias_ids,
        "logit_bias_values": bias_vals,
    }
