"""The on-device sampler: logits -> next tokens (+ logprobs), branch-free and fixed-shape.

One call handles a whole batch whose rows use different parameters. Order (vLLM v1's):

0. structured outputs: a constrained row waits at the gate for the frontend's token mask
   (``ops.wait_token_masks``), then the tokens it forbids are set to -inf
   (``ops.apply_token_mask``, :mod:`blink.engine.token_mask`); everything below sees that.
   A row whose mask did not arrive gets token -1 (the scheduler finishes it with an error).
1. raw logprobs: ``log_softmax(logits)`` of the model's logits, before anything below touches
   them (vLLM's default ``logprobs_mode="raw_logprobs"``). The chosen token's logprob and the
   top-N alternatives are read from these.
2. token masks of the request: tokens outside ``allowed_token_ids`` and the last token of a
   ``bad_words`` sequence whose other tokens were just generated are set to -inf (vLLM v1
   applies both after the raw logprobs, before the logits processors); then
   logit bias (``logits[b, id] += value``), then ``suppress_ids`` set to -inf (the scheduler
   passes EOS/stop ids there while a request has fewer than ``min_tokens`` outputs).
3. penalties: repetition over prompt + output tokens (positive logits divided by the penalty,
   non-positive multiplied), then ``- frequency * count`` and ``- presence * (count > 0)`` over
   output tokens only (OpenAI's definition).
4. greedy rows (temperature 0) take the argmax of these logits.
5. other rows: divide by temperature, min-p / top-k / top-p filtering, Gumbel-max sample with
   the counter-based RNG of :mod:`blink.kernels.reference.sampling` keyed by (seed, counter).
6. ``torch.where(temperature == 0, greedy, sampled)``: both paths are always computed.

The penalties of step 3, the filter and the seeded draw of step 5 are ``ops.apply_penalties``,
``ops.apply_top_k_top_p_min_p`` and ``ops.sample`` from :func:`blink.kernels.ops_for`: C twins of
the torch references (:mod:`blink.kernels.reference.sampling`) on CPU
(:mod:`blink.kernels.cpu.sampling`), the Triton kernels of :mod:`blink.kernels.triton.sampling`
on CUDA for the filter and the draw (same rule, same RNG bits). The choice is made in one place,
``ops_for``; ``Sampler(ops=...)`` overrides it (tests pass the Triton table on CPU tensors under
``TRITON_INTERPRET=1``).

Nothing here reads a tensor value on the host or branches on one, so the call works under
``torch.compile(fullgraph=True)`` and inside a captured CUDA graph. A row's token depends only
on its own logits, parameters, history, seed and counter: never on the rest of the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import NamedTuple, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
import torch.nn.functional as F

from blink.shared.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    draw_seed,
)
from blink.errors import BlinkError
from blink.kernels import ops_for
from blink.kernels.reference.sampling import argmax_rows, row_mask as _row_mask
from blink.engine.token_mask import MaskBatch
from blink.shared.sampling_fields import BAD_WORD_TOKENS, SAMPLER_FIELDS, bad_words_entries
from blink.shared.sampling_params import MAX_ALLOWED_TOKEN_IDS
from blink.shared.sampling_params import MAX_BAD_WORDS_TOKENS as DEFAULT_BAD_WORDS_TOKENS

_TORCH_DTYPES = {"<i4": torch.int32, "<i8": torch.int64, "<f4": torch.float32}


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as fixed-shape tensors on the sampling device.

    B rows, K = logit-bias capacity (``MAX_LOGIT_BIAS`` by default). The attributes are the
    ``sampler`` fields of :data:`blink.shared.sampling_fields.SAMPLING_FIELDS` (same names,
    order and dtypes; ``tests/test_sampling_fields.py`` checks it).

    logprobs           i32 [B]   how many top alternatives the row wants (0 = none)
    top_k              i32 [B]   <= 0 = off
    temperature        f32 [B]   0 = greedy
    top_p              f32 [B]   1 = off
    min_p              f32 [B]   0 = off
    repetition_penalty f32 [B]   1 = off
    presence_penalty   f32 [B]   0 = off
    frequency_penalty  f32 [B]   0 = off
    seed               i64 [B]   always set: unseeded requests get :func:`draw_seed` at admission
    logit_bias_ids     i32 [B,K] token ids, -1 = padding
    logit_bias_values  f32 [B,K] added to the logits of ``logit_bias_ids``
    allowed_token_ids  i32 [B,A] the only ids the row may sample, -1 = padding (none: any)
    bad_words_ids      i32 [B,W] banned sequences, ``BAD_WORD_TOKENS`` entries per word,
                                 right-aligned, -1 padded (W = words * BAD_WORD_TOKENS)
    """

    logprobs: torch.Tensor
    top_k: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seed: torch.Tensor
    logit_bias_ids: torch.Tensor
    logit_bias_values: torch.Tensor
    allowed_token_ids: torch.Tensor
    bad_words_ids: torch.Tensor

    @classmethod
    def empty(
        cls, batch: int, device: torch.device | str = "cpu", max_logit_bias: int = MAX_LOGIT_BIAS,
        max_allowed_token_ids: int = MAX_ALLOWED_TOKEN_IDS,
        max_bad_words_tokens: int = DEFAULT_BAD_WORDS_TOKENS,
    ) -> "SamplingTensors":
        """``batch`` rows of neutral parameters (greedy, no filtering, no penalty, no bias):
        every field's ``pad`` value from the table."""
        sizes = SimpleNamespace(max_logit_bias=max_logit_bias,
                                max_allowed_token_ids=max_allowed_token_ids,
                                max_bad_words_tokens=max_bad_words_tokens)
        return cls(**{
            f.name: torch.full((batch, *f.shape(sizes)), f.pad, dtype=_TORCH_DTYPES[f.dtype],
                               device=device)
            for f in SAMPLER_FIELDS
        })

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str = "cpu",
        max_logit_bias: int = MAX_LOGIT_BIAS,
        seeds: Sequence[int | None] | None = None,
        max_allowed_token_ids: int = MAX_ALLOWED_TOKEN_IDS,
        max_bad_words_tokens: int = DEFAULT_BAD_WORDS_TOKENS,
    ) -> "SamplingTensors":
        """Host-side builder: one row per ``SamplingParams`` (a seed is drawn where none is given).

        ``seeds[i]``, when given, overrides ``params[i].seed`` (e.g. a seed the engine already
        drew for an unseeded request). Not for the per-step path: admission writes rows once.
        """
        st = cls.empty(len(params), "cpu", max_logit_bias, max_allowed_token_ids,
                       max_bad_words_tokens)
        for row, p in enumerate(params):
            st.set_row(row, p, seed=None if seeds is None else seeds[row])
        return st.to(device)

    def set_row(self, row: int, params: SamplingParams, seed: int | None = None) -> None:
        """Write one request's parameters into row ``row`` (a host-side write, at admission)."""
        max_bias = self.logit_bias_ids.shape[1]
        if len(params.logit_bias) > max_bias:
            raise SamplingParamsError(
                f"logit_bias has {len(params.logit_bias)} entries; this sampler holds {max_bias}"
            )
        if seed is None:
            seed = params.seed if params.seed is not None else draw_seed()
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.seed[row] = seed
        ids = list(params.logit_bias) + [-1] * (max_bias - len(params.logit_bias))
        values = list(params.logit_bias.values()) + [0.0] * (max_bias - len(params.logit_bias))
        self.logit_bias_ids[row] = torch.tensor(ids, dtype=torch.int32)
        self.logit_bias_values[row] = torch.tensor(values, dtype=torch.float32)
        self.logprobs[row] = params.logprobs or 0
        allowed = list(params.allowed_token_ids or ())
        if len(allowed) > self.allowed_token_ids.shape[1]:
            raise SamplingParamsError(
                f"allowed_token_ids has {len(allowed)} ids; this sampler holds "
                f"{self.allowed_token_ids.shape[1]}"
            )
        self.allowed_token_ids[row] = -1
        self.allowed_token_ids[row, : len(allowed)] = torch.tensor(allowed, dtype=torch.int32)
        self.bad_words_ids[row] = torch.from_numpy(
            pack_bad_words(params, self.bad_words_ids.shape[1])).to(torch.int32)

    def to(self, device: torch.device | str) -> "SamplingTensors":
        """A copy with every tensor on ``device``."""
        return SamplingTensors(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def gather(self, rows: torch.Tensor) -> "SamplingTensors":
        """The rows ``rows`` (int64 [B'], on the tensors' device), e.g. per-slot -> per-batch."""
        return SamplingTensors(
            **{f.name: getattr(self, f.name).index_select(0, rows) for f in fields(self)}
        )


class SamplerOutput(NamedTuple):
    """What the sampler returns for a batch of B rows, with N = the sampler's ``max_logprobs``.

    tokens        i64 [B]    the chosen tokens
    logprob       f32 [B]    raw logprob of the chosen token (log-softmax of the model logits)
    top_ids       i64 [B,N]  the row's top raw-logprob tokens, best first; -1 past the row's logprobs count
    top_logprobs  f32 [B,N]  their raw logprobs; -inf past it

    Under a plan with no row asking for alternatives (``any_top_logprobs`` False) the last
    two are [B, 0]: there is nothing to publish, and the scheduler then writes no top entries.
    """

    tokens: torch.Tensor
    logprob: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def apply_logit_bias(
    logits: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor
) -> torch.Tensor:
    """``logits[b, bias_ids[b, j]] += bias_values[b, j]`` for every non-padding entry."""
    batch, vocab_size = logits.shape
    ids, valid = _row_mask(bias_ids, vocab_size)
    values = torch.where(valid, bias_values.to(logits.dtype), 0.0)
    bias = torch.zeros(batch, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    bias = bias.scatter_add(1, ids, values)
    return logits + bias[:, :vocab_size]


def apply_suppress(logits: torch.Tensor, suppress_ids: torch.Tensor) -> torch.Tensor:
    """Set ``logits[b, suppress_ids[b, j]]`` to -inf for every id >= 0 (-1 = padding)."""
    batch, vocab_size = logits.shape
    ids, _ = _row_mask(suppress_ids, vocab_size)
    banned = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=logits.device)
    banned = banned.scatter(1, ids, True)
    return logits.masked_fill(banned[:, :vocab_size], float("-inf"))


def apply_allowed_token_ids(logits: torch.Tensor, allowed_ids: torch.Tensor) -> torch.Tensor:
    """Rows with any ``allowed_ids`` entry >= 0 keep only those ids' logits (the rest -inf);
    rows whose entries are all padding (-1) are unchanged."""
    batch, vocab_size = logits.shape
    ids, valid = _row_mask(allowed_ids, vocab_size)
    allowed = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=logits.device)
    allowed = allowed.scatter(1, ids, True)[:, :vocab_size]
    restricted = valid.any(-1, keepdim=True)
    return logits.masked_fill(restricted & ~allowed, float("-inf"))


def bad_words_banned(
    bad_words_ids: torch.Tensor, token_ids: torch.Tensor, prompt_lens: torch.Tensor,
    total_lens: torch.Tensor,
) -> torch.Tensor:
    """int32 [B, words]: the token each ``bad_words_ids`` row bans this step, -1 for none.

    A word's row holds its tokens right-aligned in ``BAD_WORD_TOKENS`` entries (-1 before
    them). Its last token is banned when each earlier token equals the generated token at
    the same distance from the end (output tokens only: vLLM matches the output, never the
    prompt); a one-token word is always banned. ``token_ids`` [B, L]: prompt then output."""
    batch, width = bad_words_ids.shape
    n = BAD_WORD_TOKENS
    words = bad_words_ids.view(batch, width // n, n)
    last, before = words[:, :, n - 1], words[:, :, : n - 1]
    # The row's last n - 1 tokens; positions before the output (or before 0) match nothing.
    pos = total_lens.long().unsqueeze(-1) - (n - 1) + torch.arange(n - 1, device=words.device)
    is_output = pos >= prompt_lens.long().unsqueeze(-1)
    recent = token_ids.gather(1, pos.clamp(min=0, max=token_ids.shape[1] - 1))
    recent = torch.where(is_output, recent.to(words.dtype), -2)
    matched = ((before < 0) | (before == recent.unsqueeze(1))).all(-1) & (last >= 0)
    return torch.where(matched, last, -1)


def pack_bad_words(params: SamplingParams, width: int):
    """``params.bad_words_token_ids`` as the ring's ``bad_words_ids`` entries (numpy int32
    [width]): one right-aligned row of ``BAD_WORD_TOKENS`` per sequence. Host-side."""
    if params.bad_words and params.bad_words_token_ids is None:
        raise SamplingParamsError("bad_words need the tokenizer: call "
                                  "SamplingParams.update_from_tokenizer first")
    try:
        return bad_words_entries(params.bad_words_token_ids, width)
    except ValueError as e:
        raise SamplingParamsError(str(e)) from None


@dataclass(frozen=True)
class SamplerPlan:
    """Host-side knowledge of which features a batch uses, so a CPU loop can skip work that
    cannot change the result (the full-vocabulary sort when no row filters, the random draw
    when every row is greedy, the penalty histograms when no row has a penalty).

    Each skipped stage is an exact identity for the rows of that batch, so outputs do not
    depend on the plan. Graph-captured callers pass no plan and run every stage.
    """

    any_random: bool = True
    any_filter: bool = True
    any_penalty: bool = True
    any_top_logprobs: bool = True
    any_logit_bias: bool = True
    any_suppress: bool = True
    any_constrained: bool = True  # any row constrained by a structured-output token mask
    any_allowed: bool = True  # any row with allowed_token_ids
    any_bad_words: bool = True  # any row with bad_words

    @property
    def greedy_untouched(self) -> bool:
        """Every row greedy, no stage that changes the logits, no alternatives and no masks: each
        token is the raw logits' argmax, taken with the log-normaliser in one pass that reads
        the logits in the model's dtype (:meth:`Sampler.__call__`; the CPU loop then asks its
        executor for logits as the head leaves them, no fp32 copy)."""
        return not (self.any_random or self.any_penalty or self.any_top_logprobs or self.any_logit_bias
                    or self.any_suppress or self.any_constrained or self.any_allowed or self.any_bad_words)

    @classmethod
    def of(cls, st: SamplingTensors, suppress_ids: torch.Tensor | None = None,
           constrained: torch.Tensor | None = None) -> "SamplerPlan":
        """Read the batch's parameters (a host read: CPU tensors only). ``constrained``: the
        rows' request field (None: no row is constrained)."""
        fields = {f.name: getattr(st, f.name) for f in SAMPLER_FIELDS}
        fields["constrained"] = (constrained if constrained is not None
                                 else torch.zeros_like(st.top_k))
        return cls.from_features(row_features(fields), suppress_ids)

    @classmethod
    def from_features(cls, features: torch.Tensor,
                      suppress_ids: torch.Tensor | None = None) -> "SamplerPlan":
        """The plan of a batch whose rows have ``features`` (:func:`row_features`, which the
        scheduler keeps per row from admission): four ops and one host read, instead of a
        dozen reductions over the parameters at every step. ``suppress_ids`` changes per step
        (min_tokens), so it is read here; None keeps that stage."""
        bits = _feature_bits(features.device)
        used = ((features.unsqueeze(-1) & bits) != 0).any(0).tolist()
        flags = dict(zip(_FEATURES, used))
        flags["any_suppress"] = suppress_ids is None or bool((suppress_ids >= 0).any())
        return cls(**flags)

    @staticmethod
    @functools.lru_cache(maxsize=None)  # 2^9 plans at most
    def from_word(word: int, any_suppress: bool) -> "SamplerPlan":
        """The plan :meth:`from_features` gives for rows whose feature words OR to ``word``
        and of which ``any_suppress`` has a suppress id set: for a gather that combined them
        as it copied the rows (``kernels/cpu/sched.c``), no torch call."""
        return SamplerPlan(**{name: bool(word >> i & 1) for i, name in enumerate(_FEATURES)},
                           any_suppress=any_suppress)


#: The plan flags a row's feature word carries, bit i = _FEATURES[i] (any_suppress is per step).
_FEATURES = ("any_random", "any_filter", "any_penalty", "any_top_logprobs", "any_logit_bias",
             "any_constrained", "any_allowed", "any_bad_words")
_BITS: dict[torch.device, torch.Tensor] = {}


def _feature_bits(device: torch.device) -> torch.Tensor:
    if device not in _BITS:
        _BITS[device] = torch.tensor([1 << i for i in range(len(_FEATURES))], dtype=torch.int32,
                                     device=device)
    return _BITS[device]


def row_features(fields) -> torch.Tensor:
    """int32 feature word per row (bit i: the row needs ``SamplerPlan``'s ``_FEATURES[i]``
    stage), from the rows' sampling fields by name (``EngineState.sampling`` or a batch's):
    tensor code, so admission computes it on the device with no host read."""
    random = fields["temperature"] > 0
    filtered = random & ((fields["top_k"] > 0) | (fields["top_p"] < 1) | (fields["min_p"] > 0))
    penalty = ((fields["repetition_penalty"] != 1) | (fields["presence_penalty"] != 0)
               | (fields["frequency_penalty"] != 0))
    used = (random, filtered, penalty, fields["logprobs"] > 0,
            (fields["logit_bias_ids"] >= 0).any(-1), fields["constrained"] != 0,
            (fields["allowed_token_ids"] >= 0).any(-1), (fields["bad_words_ids"] >= 0).any(-1))
    word = torch.zeros_like(random, dtype=torch.int32)
    for i, flag in enumerate(used):
        word = word | (flag.to(torch.int32) << i)
    return word


_FULL_PLAN = SamplerPlan()


class Sampler:
    """Turns a step's logits into tokens and logprobs; see the module docstring for the order.

    ``max_logprobs`` fixes N, the width of the top-logprobs output (0 skips the top-k).

    The filter and the seeded draw come from an op table (``apply_top_k_top_p_min_p``,
    ``sample``): ``ops`` when given, else ``ops_for(device)`` when a device is given, else
    ``ops_for(logits.device)`` looked up at each call (so ``Sampler()`` gets the Triton kernels
    for CUDA logits and the references for CPU logits). The lookup is a host-side dict read:
    nothing is launched or synchronised, so it is safe while a CUDA graph is being captured.
    """

    def __init__(
        self,
        max_logprobs: int = MAX_LOGPROBS,
        device: torch.device | str | None = None,
        ops: SimpleNamespace | None = None,
    ) -> None:
        if not 0 <= max_logprobs <= MAX_LOGPROBS:
            raise BlinkError(
                f"max_logprobs must be between 0 and {MAX_LOGPROBS}, got {max_logprobs}"
            )
        self.max_logprobs = max_logprobs
        if ops is None and device is not None:
            ops = ops_for(device)
        self.ops: SimpleNamespace | None = ops  # None: ops_for(logits.device) at each call
        #: (rows, device) -> the empty alternatives a plan without top logprobs returns (made
        #: once: nothing is ever written into a tensor of no elements)
        self._no_alternatives: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def ops_for(self, device: torch.device | str) -> SimpleNamespace:
        """The op table a call on ``device`` tensors uses."""
        return self.ops if self.ops is not None else ops_for(device)

    def __call__(
        self,
        logits: torch.Tensor,
        st: SamplingTensors,
        token_ids: torch.Tensor | None,
        prompt_lens: torch.Tensor,
        total_lens: torch.Tensor,
        step_counters: torch.Tensor,
        suppress_ids: torch.Tensor | None = None,
        plan: SamplerPlan | None = None,
        masks: MaskBatch | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits        f32 [B, V]  the model's last-position logits (other float dtypes upcast)
        st            per-row parameters, B rows
        token_ids     i32 [B, L]  prompt then output tokens so far, any padding past total_len;
                                  may be None when the plan says no row has a penalty or
                                  bad words
        prompt_lens   i32/i64 [B]
        total_lens    i32/i64 [B] prompt + output tokens so far
        step_counters i64 [B]     RNG counter per row; must differ between a row's draws (the
                                  number of tokens so far is a good choice). Siblings of an
                                  n > 1 request need distinct seeds.
        suppress_ids  i32 [B, S]  optional ids to forbid this step (-1 = padding)
        plan          optional host-side :class:`SamplerPlan` (CPU loop) to skip no-op stages
        masks         optional structured-output token masks of the rows
                      (:class:`blink.engine.token_mask.MaskBatch`): after the gate, tokens a
                      row's mask forbids are masked before anything else, raw logprobs
                      included; a row whose mask is missing gets token -1
        """
        plan = plan or _FULL_PLAN
        ops = self.ops_for(logits.device)
        if logits.dtype != torch.float32 and not (plan.greedy_untouched and logits.is_cpu):
            logits = logits.float()  # (a greedy step's one pass reads a CPU step's bf16 logits as they are)
        missing = None
        if masks is not None and plan.any_constrained:  # host-side choices
            if masks.rows is None or masks.rows.numel():
                logits, missing = masks.apply(ops, logits)
        # Raw logprobs are x - logsumexp(x): one reduction instead of a [B, V] log_softmax.
        raw_logits = logits
        # A host-side choice: no stage below changes the logits, so the greedy tokens are the
        # raw logits' argmax, taken in the log-normaliser's pass (plan None: every stage runs)
        untouched = not (plan.any_allowed or plan.any_bad_words or plan.any_logit_bias or plan.any_penalty
                         or (suppress_ids is not None and plan.any_suppress))
        greedy_logprob = None  # the greedy tokens' logprobs, where the argmax's pass gave them
        if untouched:
            greedy_tokens, log_norm, greedy_logprob = ops.argmax_logsumexp_rows(raw_logits)
        else:
            log_norm = ops.logsumexp_rows(raw_logits)

        if plan.any_allowed:
            logits = apply_allowed_token_ids(logits, st.allowed_token_ids)
        if plan.any_bad_words:
            if token_ids is None:
                raise ValueError("a batch with bad_words needs its token history (token_ids)")
            logits = apply_suppress(
                logits, bad_words_banned(st.bad_words_ids, token_ids, prompt_lens, total_lens))
        if plan.any_logit_bias:
            logits = apply_logit_bias(logits, st.logit_bias_ids, st.logit_bias_values)
        if suppress_ids is not None and plan.any_suppress:  # a host-side choice, not a tensor value
            logits = apply_suppress(logits, suppress_ids)
        if plan.any_penalty:
            if token_ids is None:
                raise ValueError("a batch with penalties needs its token history (token_ids)")
            logits = ops.apply_penalties(
                logits,
                token_ids,
                prompt_lens,
                total_lens,
                st.repetition_penalty,
                st.presence_penalty,
                st.frequency_penalty,
            )

        if not untouched:
            greedy_tokens = argmax_rows(logits)
        tokens = greedy_tokens
        if plan.any_random:
            is_greedy = st.temperature <= 0
            temperature = torch.where(is_greedy, 1.0, st.temperature).unsqueeze(-1)
            scaled = logits / temperature
            if plan.any_filter:
                scaled = ops.apply_top_k_top_p_min_p(scaled, st.top_k, st.top_p, st.min_p)
            sampled_tokens = ops.sample(scaled, st.seed, step_counters)
            tokens = torch.where(is_greedy, greedy_tokens, sampled_tokens)

        if tokens is greedy_tokens and greedy_logprob is not None:  # (the same values, taken in one pass)
            logprob = greedy_logprob
        else:
            logprob = (raw_logits.gather(-1, tokens.unsqueeze(-1)) - log_norm).squeeze(-1)
        if missing is not None:  # not sampled: the scheduler finishes these rows with an error
            tokens = torch.where(missing, -1, tokens)
        # A vocabulary smaller than N (tiny test models) leaves the tail as padding.
        if not plan.any_top_logprobs:  # no row asks for alternatives: none to compute or publish
            # (a traced call makes its own: its tensors are fake, or graph values)
            traced = torch.compiler.is_compiling() or isinstance(logits, FakeTensor)
            none = None if traced else self._no_alternatives.get((logits.shape[0], logits.device))
            if none is None:
                ids = torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
                none = (ids, ids.float())
                if not traced:
                    self._no_alternatives[(logits.shape[0], logits.device)] = none
            return SamplerOutput(tokens, logprob, *none)
        k = min(self.max_logprobs, raw_logits.shape[-1])
        top_values, top_ids = ops.top_rows(raw_logits, k)
        top_logprobs = top_values - log_norm
        top_logprobs = F.pad(top_logprobs, (0, self.max_logprobs - k), value=float("-inf"))
        top_ids = F.pad(top_ids, (0, self.max_logprobs - k), value=-1)
        # Rows asking for fewer than N alternatives get -1 / -inf past their count.
        wanted = torch.arange(self.max_logprobs, device=logits.device) < st.logprobs.unsqueeze(-1)
        top_ids = torch.where(wanted, top_ids, -1)
        top_logprobs = torch.where(wanted, top_logprobs, float("-inf"))
        return SamplerOutput(tokens, logprob, top_ids, top_logprobs)
