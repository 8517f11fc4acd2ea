"""Speculative decoding with a draft model (issue 36 item 4; ``--speculative-config
'{"method": "draft_model", "model": PATH, "num_speculative_tokens": K}'``). Eager CPU loop
only (the eager and cpu-graphs runners); the other runners refuse it by name.

The draft is a second :class:`~blink.executor.ModelExecutor` (PATH: a GGUF file, an HF
directory or a model name, through Blink's own loaders) with the target's vocabulary, dtype,
block size and ``max_model_len``. It plugs into :mod:`blink.engine.speculative` as a drafter
(the n-gram lookup's interface: ``propose`` in the draft stage, ``before_forward`` between the
schedule and the target's forward):

- **Its own paged KV cache, on the target's block ids.** The draft's pool has as many blocks
  as the target's, and a row's block table and slot mapping serve both models (both cache the
  same token positions), so no second allocator exists and the prefix cache, preemption and
  release hold for the draft's cache as they do for the target's. Every forward the target runs
  (prefill chunks, decode steps, verify steps) the draft runs first over the same tokens and
  metadata, writing only K/V (:meth:`~blink.executor.ModelExecutor.fill_cache`): at every slot
  the draft's cache holds the draft's K/V of the token the target's cache holds there.
- **Draft stage** (:meth:`DraftModel.propose`, before the token budget): an eligible decode row
  (the n-gram's rules, without its "the last token occurred earlier" shortcut) asks for K
  draft positions; their tokens are placeholders, so the budget, block and batch stages
  reserve 1 + K positions (a partial grant: fewer) in the row's own blocks.
- **Drafting** (:meth:`DraftModel.before_forward`, after the batch is built): for each row
  granted g = 1 + k positions, k single-token greedy steps of the draft at positions n - 1 ..
  n + k - 2, each on the batch's own slot of that position (whose block is reserved), write the
  draft tokens d_0 .. d_{k-1} into the row's tokens and the batch's input ids. Then the
  draft's pass over the whole step (above), then the target's verify.

A greedy draft is a point-mass proposal, for which the verify rule of
:mod:`blink.engine.speculative` is the rejection rule of the speculative sampling papers:
greedy and seeded outputs are the non-speculative ones, whatever the draft proposes. Rejected
positions' draft K/V lies past the row's length and is overwritten later, as the target's is.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from blink.engine.step import StepParts, compact_rows
from blink.errors import BlinkError
from blink.executor import ModelExecutor
from blink.kernels.attention_metadata import AttentionMetadata
from blink.model_config import ModelConfig
from blink.shared.speculative_config import SpeculativeConfig

log = logging.getLogger("blink.engine")

#: the step runners that run a draft model (the eager CPU loop's)
DRAFT_MODEL_RUNNERS = ("eager", "cpu-graphs")


def _refuse(problem: str) -> BlinkError:
    return BlinkError(f"--speculative-config: draft_model {problem}")


def check_draft_runner(runner: str, *, role: str, null_target: bool) -> None:
    """Refuse, by name, the engines a draft model cannot run in: runners other than the
    eager CPU loop's, the disaggregation roles (a decode engine's KV arrives from a prefill
    engine, without the draft's), and ``--model null`` (no target to verify against)."""
    if runner not in DRAFT_MODEL_RUNNERS:
        raise _refuse(f"runs on the eager CPU loop only (--cpu-graphs auto/off), not the {runner} runner")
    if role != "both":
        raise _refuse(f"is not supported with --role {role} (the draft's KV cache is not transferred)")
    if null_target:
        raise _refuse("needs a real target model, not --model null")


def open_draft(spec: SpeculativeConfig, target_files: Any) -> Any:
    """The draft's files (:func:`blink.loader.open_model`), checked against the target's: the
    same vocabulary size and, where both have one, the same tokenizer vocabulary (token -> id,
    added tokens). Raises :class:`BlinkError` naming the field."""
    from blink.loader import open_model

    try:
        files = open_model(spec.model)
    except BlinkError as e:
        raise _refuse(f"'model' {spec.model!r}: {e}") from None
    target_vocab = target_files.hf_config.get("vocab_size")
    draft_vocab = files.hf_config.get("vocab_size")
    if draft_vocab != target_vocab:
        raise _refuse(f"'model' {spec.model!r} has vocab_size {draft_vocab}, the target {target_vocab}: "
                      f"the draft must share the target's tokenizer")
    if Path(files.source).resolve() != Path(target_files.source).resolve():
        mine, theirs = _tokenizer_vocab(files), _tokenizer_vocab(target_files)
        if mine is None and theirs is not None:
            raise _refuse(f"'model' {spec.model!r} has no tokenizer to check against the target's")
        if mine is not None and theirs is not None and mine != theirs:
            raise _refuse(f"'model' {spec.model!r} has a different tokenizer from the target's "
                          f"(token ids differ): the draft must share the target's tokenizer")
    return files


def _tokenizer_vocab(files: Any) -> tuple[Any, Any] | None:
    """(the tokenizer model's vocabulary, the added tokens' (id, text)) of ``files``; None
    when it has no readable tokenizer."""
    try:
        tok = json.loads(files.tokenizer_json)
    except (BlinkError, AttributeError, ValueError):
        return None
    added = sorted((t.get("id"), t.get("content")) for t in tok.get("added_tokens") or [])
    return (tok.get("model") or {}).get("vocab"), added


def draft_kv_bytes_per_token(files: Any, dtype: torch.dtype) -> int:
    """The draft cache's bytes per token (K and V, all layers): the engine sizes the pools
    (the same number of blocks) from the target's and the draft's bytes together."""
    cfg = ModelConfig.from_hf(files.hf_config, str(files.source))
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element


class DraftModel:
    """The draft-model drafter (module docstring): ``propose`` for
    :meth:`blink.engine.speculative.SpecScheduler._draft`, ``before_forward`` for the step."""

    #: drafts do not depend on the row's history repeating (the n-gram's host shortcut is off)
    repeats_only = False

    def __init__(self, files: Any, target: ModelExecutor, *, cpu_graphs: bool) -> None:
        try:
            #: the draft's executor: its weights (4-bit codes where the file has them: the
            #: cheapest draft) and its KV cache, as many blocks as the target's
            self.executor = ModelExecutor(
                files, dtype=target.dtype, device=target.device, block_size=target.block_size,
                num_blocks=target.num_blocks, max_model_len=target.max_model_len,
                pack_weights=True, int4_decode=True, cpu_graphs=cpu_graphs)
        except BlinkError as e:
            raise _refuse(f"'model' {str(files.source)!r}: {e}") from None
        log.info("speculative draft model %s: %d layers, KV cache of %d blocks on the target's block ids",
                 files.source, self.executor.config.num_hidden_layers, target.num_blocks)

    def propose(self, tokens: torch.Tensor, lengths: torch.Tensor, k: int, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft stage: K placeholder positions for every eligible row (``lengths`` > 0),
        so the step reserves them; :meth:`before_forward` writes the real tokens."""
        S = lengths.shape[0]
        draft = torch.zeros(S, k, dtype=torch.int64, device=lengths.device)
        return draft, torch.where(lengths > 0, k, 0)

    @torch.inference_mode()
    def before_forward(self, parts: StepParts, batch: Any, tokens: int) -> None:
        """Between the schedule and the target's forward: draft the granted positions of the
        drafting rows, then run the step's ``tokens`` positions through the draft (its cache)."""
        sched = parts.scheduler
        if sched.drafted:
            S = sched._w.size
            steps = torch.where(sched.draft_len[:S] > 0, batch.num_new_tokens - 1, 0).clamp(min=0)
            if bool((steps > 0).any()):
                self._draft(sched._w.state, batch, steps)
        self.executor.fill_cache(batch.input_ids[:tokens], compact_rows(batch, tokens))

    def _draft(self, st: Any, batch: Any, steps: torch.Tensor) -> None:
        """``steps[r]`` greedy single-token steps for row r (its granted draft positions)."""
        md = batch.attn
        rows = steps.nonzero().squeeze(1)
        k = steps[rows]
        start = md.query_start_loc.long()[rows]  # the row's last token: position n - 1
        base = st.num_tokens[rows]  # n (the drafts are not counted: SpecScheduler._build_batch)
        tok = batch.input_ids[start]
        for i in range(int(k.max())):
            if i:
                keep = k > i
                if not bool(keep.all()):
                    rows, k, start, base, tok = rows[keep], k[keep], start[keep], base[keep], tok[keep]
            flat = start + i
            pos = md.positions[flat]
            R = rows.shape[0]
            step_md = AttentionMetadata(
                slot_mapping=md.slot_mapping[flat], positions=pos,
                token_seq_idx=torch.arange(R, dtype=md.token_seq_idx.dtype),
                query_start_loc=torch.arange(R + 1, dtype=md.query_start_loc.dtype),
                seq_lens=(pos + 1).to(md.seq_lens.dtype), block_tables=md.block_tables[rows],
                max_context=int(pos.max()) + 1, max_query_len=1)
            tok = self.executor.execute(tok, step_md, torch.arange(R)).argmax(-1)
            batch.input_ids[flat + 1] = tok
            st.tokens[rows, base + i] = tok.to(st.tokens.dtype)
