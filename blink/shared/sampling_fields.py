"""The one table of a request's per-slot sampling fields.

Torch-free (the frontend imports it). Every sampling field a request carries from the
frontend to the sampler is declared here once, under one name used end to end: the ring
field (a sub-field of the slot's request record, :mod:`blink.ring`), the engine's per-row
tensor (``EngineState.sampling``), the batch's :class:`~blink.engine.sampler.SamplingTensors`
attribute (``sampler=True``) and the frontend's packed write (:mod:`blink.dpu.ring_packing`).
The names are :class:`~blink.shared.sampling_params.SamplingParams`' where a field comes
straight from one (``logit_bias`` is split into ``logit_bias_ids`` / ``logit_bias_values``).

Derived from this table: the ring's request record (:func:`blink.ring.request_record_dtype`),
``blink.engine.sched.state.SAMPLING_FIELDS`` and the state's shapes, the scheduler's admission copy
and batch, ``SamplingTensors.empty`` and the frontend's packing. Adding a knob means one row
here plus the code that uses it (``tests/test_sampling_fields.py`` fails if a side forgets).

Ring conventions (what the frontend writes, the engine reads):

- ``top_k``: 0 means off (SamplingParams' -1 is written as 0; the sampler treats <= 0 as off).
- ``logprobs``: how many top alternatives to return, 0 = none; the chosen token's logprob is
  always written by the engine and the frontend returns it only if the request asked.
- ``seed``: always set; a request without one gets a random 63-bit seed in the packing.
- ``max_tokens``: always concrete (``max_model_len - prompt_len`` when the request gave none).
- vectors (``stop_token_ids``, ``logit_bias_*``): ``pad`` in unused entries.
- ``allowed_token_ids``: -1 padded; a row with any id >= 0 may sample only those ids.
- ``bad_words_ids``: rows of ``BAD_WORD_TOKENS`` entries (``max_bad_words_tokens //
  BAD_WORD_TOKENS`` rows), one banned token sequence per row, right-aligned and -1 padded on
  the left: the row's last entry is masked when the entries before it equal the row's last
  generated tokens (output tokens only, as vLLM); a one-token row is always masked.
- ``cache_salt``: 0 = unsalted; else a 63-bit hash of the request's salt string, which enters
  every prefix-cache key of the request's blocks and is checked on a hit.
- ``priority``: the request's priority (int32; lower = more urgent, as vLLM). The engine
  orders admission, the token budget, blocks and preemption by (priority, arrival) under
  ``SchedulerConfig.scheduling_policy == "priority"`` and ignores it under fcfs.
- ``prompt_logprobs``: -1 = off; N >= 0: the engine writes each prompt token's logprob and
  rank plus the top N alternatives at each prompt position into lane
  ``prompt_logprob_lane`` of the ring's prompt-logprob region (the frontend picks the lane;
  -1 when off). See :mod:`blink.ring`, "Prompt logprobs".
- ``constrained``: 1 when the frontend publishes a token mask for the request (the ring's
  mask area and ``mask_epoch``; the first mask is written before the record, so the slot's
  state word publishes both), 0 otherwise.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SamplingField:
    """One sampling field of a request slot.

    name:    ring field = engine tensor = SamplingTensors attribute
    dtype:   little-endian numpy dtype string of one entry (``<i4``, ``<i8``, ``<f4``)
    width:   None for one value per slot, else the :class:`~blink.ring.RingConfig` attribute
             giving the vector's length (its capacity, checked once by the packing)
    bound:   None, or the RingConfig attribute a scalar may not exceed (checked by the packing;
             the value must also be non-negative, or equal ``pad``)
    pad:     the neutral value: unused vector entries, empty engine rows, padding batch rows
    sampler: whether :class:`~blink.engine.sampler.SamplingTensors` carries it
    """

    name: str
    dtype: str
    width: str | None = None
    bound: str | None = None
    pad: float | int = 0
    sampler: bool = True
    doc: str = ""

    def shape(self, cfg: Any) -> tuple[int, ...]:
        """Per-slot shape for a ring config (anything with the ``width`` attribute)."""
        return () if self.width is None else (int(getattr(cfg, self.width)),)


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_tokens", "<i4", sampler=False, doc="outputs at most (always concrete)"),
    SamplingField("min_tokens", "<i4", sampler=False, doc="no EOS/stop id before this many outputs"),
    SamplingField("ignore_eos", "<i4", sampler=False, doc="1: EOS does not finish the request"),
    SamplingField("logprobs", "<i4", bound="max_logprobs", doc="top alternatives wanted, 0 = none"),
    SamplingField("top_k", "<i4", doc="<= 0 = off"),
    SamplingField("temperature", "<f4", doc="0 = greedy"),
    SamplingField("top_p", "<f4", pad=1.0, doc="1 = off"),
    SamplingField("min_p", "<f4", doc="0 = off"),
    SamplingField("repetition_penalty", "<f4", pad=1.0, doc="1 = off"),
    SamplingField("presence_penalty", "<f4", doc="0 = off"),
    SamplingField("frequency_penalty", "<f4", doc="0 = off"),
    SamplingField("seed", "<i8", doc="always set"),
    SamplingField("stop_token_ids", "<i4", width="max_stop_ids", pad=-1, sampler=False,
                  doc="ids that finish the request (EOS included unless ignore_eos)"),
    SamplingField("logit_bias_ids", "<i4", width="max_logit_bias", pad=-1,
                  doc="token ids whose logits get a bias"),
    SamplingField("logit_bias_values", "<f4", width="max_logit_bias", pad=0.0,
                  doc="the bias added to logit_bias_ids' logits"),
    SamplingField("allowed_token_ids", "<i4", width="max_allowed_token_ids", pad=-1,
                  doc="the only ids the row may sample (-1 padded; none set: any id)"),
    SamplingField("bad_words_ids", "<i4", width="max_bad_words_tokens", pad=-1,
                  doc="banned token sequences, BAD_WORD_TOKENS entries per word, right-aligned"),
    SamplingField("cache_salt", "<i8", sampler=False,
                  doc="prefix-cache salt hash (0 = unsalted): blocks are shared only within a salt"),
    SamplingField("priority", "<i4", sampler=False,
                  doc="scheduling priority under --scheduling-policy priority (vLLM's: lower "
                      "value = served first, then arrival); always 0 under fcfs"),
    SamplingField("prompt_logprobs", "<i4", bound="max_logprobs", pad=-1, sampler=False,
                  doc="top alternatives wanted at each prompt position, -1 = no prompt logprobs"),
    SamplingField("prompt_logprob_lane", "<i4", pad=-1, sampler=False,
                  doc="the ring's prompt-logprob lane the engine writes them into (-1: none; "
                      "the frontend's ring client assigns it)"),
    SamplingField("constrained", "<i4", sampler=False,
                  doc="1: the sampler masks the row with the slot's token mask from the ring's "
                      "mask area, once its mask_epoch equals the row's output count; 0 = free"),
)

#: Entries of one bad word's row in ``bad_words_ids``: a word of more tokens is refused.
BAD_WORD_TOKENS = 8

def bad_words_entries(sequences: Any, width: int, param: str = "bad_words") -> np.ndarray:
    """The ``bad_words_ids`` entries (int32 [width]) of a request's banned token sequences:
    each right-aligned in a row of ``BAD_WORD_TOKENS`` entries, -1 elsewhere. Raises
    ValueError naming ``param`` when a sequence or their number does not fit."""
    rows = width // BAD_WORD_TOKENS
    out = np.full((rows, BAD_WORD_TOKENS), -1, dtype=np.int32)
    sequences = [list(s) for s in sequences or ()]
    if len(sequences) > rows:
        raise ValueError(f"{param} gives {len(sequences)} token sequences (a word counts once, "
                         f"or twice with its leading-space form); this engine holds {rows}")
    for i, ids in enumerate(sequences):
        if len(ids) > BAD_WORD_TOKENS:
            raise ValueError(f"{param}: a word is {len(ids)} tokens long; at most "
                             f"{BAD_WORD_TOKENS} tokens per word")
        if ids:
            out[i, BAD_WORD_TOKENS - len(ids):] = ids
    return out.reshape(-1)


def cache_salt_hash(salt: str | None) -> int:
    """The ring's ``cache_salt`` of a request's salt string: 0 for none, else a non-zero
    63-bit hash (BLAKE2b), the same on every frontend."""
    if salt is None:
        return 0
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) | 1


FIELDS_BY_NAME: dict[str, SamplingField] = {f.name: f for f in SAMPLING_FIELDS}
#: The fields the sampler takes (SamplingTensors' attributes, in table order).
SAMPLER_FIELDS: tuple[SamplingField, ...] = tuple(f for f in SAMPLING_FIELDS if f.sampler)


def numpy_fields(cfg: Any) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, numpy dtype, per-slot shape) of every sampling field, in table order."""
    return [(f.name, np.dtype(f.dtype), f.shape(cfg)) for f in SAMPLING_FIELDS]
