"""The null model: an executor that does no model work, for measuring the control plane alone.

``blink serve --model null`` (or ``blink engine --model null``) runs the real engine (ring,
scheduler, sampler, device loop, output streams) and the real frontend (HTTP, tokenizer,
detokenizer), but the forward pass is replaced by :class:`NullExecutor`, whose ``execute()``
returns logits in which one fixed token wins by a wide margin. What a benchmark measures
against it is therefore everything *except* the model: frontend + ring + loop + sampler.

The null model borrows the default model's (SmolLM2's) config and tokenizer, read from the
GGUF header only (no weights are loaded, no KV cache is allocated), so that token ids,
vocabulary size, EOS and the chat template are the real ones. The fixed token is `` the``
(id 260 in SmolLM2's vocabulary): a plain word, not EOS, so streams run to ``max_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NULL_MODEL_NAME = "null"
#: SmolLM2's id of " the": not a special token, decodes to plain text.
DEFAULT_NULL_TOKEN = 260
#: logit of the fixed token; every other logit is 0, so its probability is 1 - V * e^-30.
_WINNING_LOGIT = 30.0


def is_null_model(name: Any) -> bool:
    """True for the model name that selects the null model (``null``, any case)."""
    return isinstance(name, str) and name.strip().lower() == NULL_MODEL_NAME


@dataclass
class NullModelFiles:
    """What :func:`blink.loader.open_model` returns, minus the weights."""

    source: Path
    hf_config: dict[str, Any]
    generation_config: dict[str, Any]
    kind: str = "null"

    def iter_tensors(self, dtype: torch.dtype, progress: bool = True):  # pragma: no cover
        return iter(())


def open_null_model(name: str = NULL_MODEL_NAME) -> NullModelFiles:
    """The default model's config and tokenizer source, without its weights."""
    from blink.loader import DEFAULT_MODEL, resolve_model
    from blink.loader.gguf_file import GGUFFile

    path = resolve_model(DEFAULT_MODEL)
    hf_config = dict(GGUFFile(path).hf_config)
    generation_config = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                         if k in hf_config}
    return NullModelFiles(path, hf_config, generation_config)


class NullExecutor:
    """Executor-compatible (``execute``, ``max_model_len``, ``num_blocks``...) and instant.

    Takes the same constructor arguments as :class:`blink.executor.ModelExecutor`; ignores the
    cache sizing (there is no KV cache) and returns, for each requested row, logits that are 0
    everywhere except ``token_id``. The returned tensor is a view of a preallocated buffer
    (the sampler never writes into its input), so a step costs no allocation here.
    """

    def __init__(self, model: NullModelFiles | Any, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", block_size: int = 16,
                 num_blocks: int | None = None, max_model_len: int | None = None,
                 num_threads: int | None = None, token_id: int = DEFAULT_NULL_TOKEN) -> None:
        from blink.model_config import ModelConfig

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.files = model
        self.source = str(model.source)
        self.config = ModelConfig.from_hf(model.hf_config, self.source)
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks or 1
        self.scratch_block = self.num_blocks
        limit = self.config.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        vocab = self.config.vocab_size
        if not 0 <= token_id < vocab:
            raise ValueError(f"token_id {token_id} is outside the vocabulary of {vocab}")
        self.token_id = token_id
        self.kv_caches: list = []
        self._logits = torch.zeros(0, vocab, dtype=torch.float32, device=self.device)

    def _template(self, rows: int) -> torch.Tensor:
        if self._logits.shape[0] < rows:
            size = max(rows, 2 * self._logits.shape[0], 16)
            logits = torch.zeros(size, self.config.vocab_size, dtype=torch.float32,
                                 device=self.device)
            logits[:, self.token_id] = _WINNING_LOGIT
            self._logits = logits
        return self._logits[:rows]

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, md: Any, logits_indices: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """fp32 logits ``[len(logits_indices), vocab]`` in which ``token_id`` wins (whatever
        ``fp32`` asks: the model's dtype is fp32)."""
        return self._template(int(logits_indices.shape[0]))
