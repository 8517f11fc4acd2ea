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
  release hold for the draft's cache as they do for the target's. Every position the target
  computes (prefill chunks, decode steps, verify steps) the draft computes first, with the
  same token in the same slot (the rows that do not draft: one pass over their part of the
  step, writing only K/V, :meth:`~blink.executor.ModelExecutor.fill_cache`; the drafting rows:
  the drafting steps below): at every slot the draft's cache holds the draft's K/V of the
  token the target's cache holds there.
- **Draft stage** (:meth:`DraftModel.propose`, before the token budget): an eligible decode row
  (the n-gram's rules, without its "the last token occurred earlier" shortcut) asks for K
  draft positions; their tokens are placeholders, so the budget, block and batch stages
  reserve 1 + K positions (a partial grant: fewer) in the row's own blocks.
- **Drafting** (:meth:`DraftModel.before_forward`, after the batch is built): for each row
  granted g = 1 + k positions, g single-token greedy steps of the draft at positions n - 1 ..
  n + k - 1, each on the batch's own slot of that position (whose block is reserved): the
  first k write the draft tokens d_0 .. d_{k-1} into the row's tokens and the batch's input
  ids, the last only writes d_{k-1}'s K/V (needed when every draft is accepted). Then the
  draft's pass over the other rows' positions (above), then the target's verify.

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

    def prepare(self, max_rows: int) -> None:
        """Before READY, on the loop thread: record the draft's decode graphs for steps of up
        to ``max_rows`` rows (its drafting steps replay them), so no step pays a recording."""
        graphs = self.executor.decode_graphs
        if graphs is not None:
            with torch.inference_mode():
                graphs.record(max_rows)

    @torch.inference_mode()
    def before_forward(self, parts: StepParts, batch: Any, tokens: int) -> None:
        """Between the schedule and the target's forward of ``tokens`` positions: draft the
        granted positions of the drafting rows, then run the other rows' positions through
        the draft (its cache)."""
        sched = parts.scheduler
        num_new = batch.num_new_tokens
        if sched.drafted:
            S = sched._w.size
            drafting = (sched.draft_len[:S] > 0) & (num_new > 1)  # granted at least one draft position
            if bool(drafting.any()):
                self._draft(sched._w.state, batch, torch.where(drafting, num_new, 0))
                rest = ~drafting & (num_new > 0)
                if bool(rest.any()):
                    self._fill_rows(batch, tokens, rest)
                return
        self.executor.fill_cache(batch.input_ids[:tokens], compact_rows(batch, tokens))

    def _fill_rows(self, batch: Any, tokens: int, rows_mask: torch.Tensor) -> None:
        """The draft's K/V of the positions of the rows in ``rows_mask`` (the step's other rows)."""
        md = batch.attn
        rows = rows_mask.nonzero().squeeze(1)
        flat = rows_mask[md.token_seq_idx[:tokens].long()].nonzero().squeeze(1)  # rows in order
        counts = batch.num_new_tokens[rows]
        qsl = torch.zeros(rows.shape[0] + 1, dtype=md.query_start_loc.dtype)
        qsl[1:] = counts.cumsum(0)
        remap = torch.zeros(rows_mask.shape[0], dtype=md.token_seq_idx.dtype)
        remap[rows] = torch.arange(rows.shape[0], dtype=md.token_seq_idx.dtype)
        seq_lens = md.seq_lens[rows]
        self.executor.fill_cache(batch.input_ids[flat], AttentionMetadata(
            slot_mapping=md.slot_mapping[flat], positions=md.positions[flat],
            token_seq_idx=remap[md.token_seq_idx[flat].long()], query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=md.block_tables[rows], max_context=int(seq_lens.max()),
            max_query_len=int(counts.max())))

    def _draft(self, st: Any, batch: Any, steps: torch.Tensor) -> None:
        """``steps[r]`` (= 1 + k) greedy single-token steps for row r at its granted positions:
        the first k give its draft tokens, the last writes the last draft token's K/V."""
        md = batch.attn
        rows = steps.nonzero().squeeze(1)
        g = steps[rows]
        start = md.query_start_loc.long()[rows]  # the row's last token: position n - 1
        base = st.num_tokens[rows]  # n (the drafts are not counted: SpecScheduler._build_batch)
        tok = batch.input_ids[start]
        for i in range(int(g.max())):
            if i:
                keep = g > i
                if not bool(keep.all()):
                    rows, g, start, base, tok = rows[keep], g[keep], start[keep], base[keep], tok[keep]
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
            drafts = g > i + 1  # the rows whose step i gave a draft token (not their last step)
            if not bool(drafts.all()):
                if not bool(drafts.any()):
                    break
                keep_rows, keep_flat, keep_base, keep_tok = rows[drafts], flat[drafts], base[drafts], tok[drafts]
            else:
                keep_rows, keep_flat, keep_base, keep_tok = rows, flat, base, tok
            batch.input_ids[keep_flat + 1] = keep_tok
            st.tokens[keep_rows, keep_base + i] = keep_tok.to(st.tokens.dtype)
