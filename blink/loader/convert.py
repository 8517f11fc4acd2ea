"""Converting a GGUF file into a Hugging Face model directory (``blink convert GGUF OUTDIR``).

The output holds config.json, safetensors weights (sharded with an index when large),
tokenizer.json, tokenizer_config.json and generation_config.json: what transformers and vLLM load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blink.errors import ModelLoadError
from blink.loader.hf_dir import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from blink.loader.model_files import open_model

if TYPE_CHECKING:
    import torch

DEFAULT_SHARD_BYTES = 2 * 1024**3


def convert_gguf_to_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: "torch.dtype | None" = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write the Hugging Face directory equivalent of ``gguf_path`` into ``out_dir``; return it.

    Weights are dequantized to ``dtype`` (default bfloat16, the dtype of the checkpoints these
    GGUFs are made from; pass torch.float32 to keep the dequantized values exactly). Only one
    shard of at most ``max_shard_bytes`` is held in memory at a time.
    """
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.bfloat16
    model = open_model(str(gguf_path))
    if model.kind != "gguf":
        raise ModelLoadError(model.source, "not a GGUF file")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ModelLoadError(out, "output path exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(out.glob("*.safetensors")) + sorted(out.glob(SAFETENSORS_INDEX))
    if stale:
        raise ModelLoadError(out, f"output directory already holds weights ({stale[0].name}); choose an empty directory")

    # Shards are written to temporary names and renamed once their count is known.
    shards: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        path = out / f"tmp-shard-{len(shards):05d}.safetensors"
        save_file(pending, str(path), metadata={"format": "pt"})
        shards.append((path, list(pending)))
        pending, pending_bytes = {}, 0

    for name, tensor in model.iter_tensors(dtype, progress=progress):
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor
        pending_bytes += size
        total_bytes += size
    flush()

    if len(shards) == 1:
        shards[0][0].rename(out / SAFETENSORS_SINGLE)
    else:
        weight_map: dict[str, str] = {}
        for number, (path, names) in enumerate(shards, start=1):
            final = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            path.rename(out / final)
            weight_map.update(dict.fromkeys(names, final))
        _write_json(out / SAFETENSORS_INDEX, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})

    config = dict(model.hf_config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    _write_json(out / "config.json", config)
    (out / "tokenizer.json").write_text(model.tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", model.tokenizer_config)
    _write_json(out / "generation_config.json", model.generation_config)
    return out


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
