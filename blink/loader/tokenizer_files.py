"""A model's tokenizer files, from a Hugging Face directory or a GGUF file, without torch
(the frontend loads its tokenizer through this).

A GGUF file's tokenizer is rebuilt from its metadata, and reading that metadata (gguf's reader
walks ~100,000 vocabulary and merge strings) took ~3.6 s of every start, on the path to
serving: the frontend loads its tokenizer after the engine is up. The result is therefore
cached as one JSON file under ``~/.cache/blink/tokenizers`` (``$XDG_CACHE_HOME``), keyed by the
GGUF file's path, size and modification time and by the source of the code that builds it, so
an edited file or builder is rebuilt; an unreadable or unwritable cache is just a rebuild.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from blink.loader import gguf_file as gguf_file_module
from blink.loader import gguf_tokenizer
from blink.loader.gguf_file import GGUFFile
from blink.loader.gguf_tokenizer import build_tokenizer
from blink.loader.hf_dir import read_tokenizer_files
from blink.loader.resolve import resolve_model
from blink.shared.native_build import cache_dir

log = logging.getLogger("blink.loader")

TokenizerFiles = tuple[str, dict[str, Any], dict[str, Any]]


def load_tokenizer_files(name_or_path: str | Path) -> TokenizerFiles:
    """``(tokenizer_json, tokenizer_config, generation_config)`` of a model; needs no torch."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        return read_tokenizer_files(path)
    cached = _cache_path(path)
    try:
        data = json.loads(cached.read_text())
        return data["tokenizer_json"], data["tokenizer_config"], data["generation_config"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet (or unreadable): build it
    gguf_file = GGUFFile(path)
    tokenizer_json, tokenizer_config = build_tokenizer(gguf_file.get, path, gguf_file.architecture)
    files = tokenizer_json, tokenizer_config, gguf_generation_config(gguf_file.hf_config)
    _store(cached, files)
    return files


def _cache_path(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    # the code that builds it: this module, the builder, and the metadata reader it asks
    builder = b"".join(Path(m.__file__).read_bytes() for m in (gguf_tokenizer, gguf_file_module)) \
        + Path(__file__).read_bytes()
    key = hashlib.sha256(b"\0".join([str(gguf_path.resolve()).encode(), str(stat.st_size).encode(),
                                      str(stat.st_mtime_ns).encode(), builder])).hexdigest()[:20]
    return cache_dir() / "tokenizers" / f"{gguf_path.stem}-{key}.json"


#: cached tokenizers kept (the most recently written); older ones are removed
_KEEP = 16


def _store(target: Path, files: TokenizerFiles) -> None:
    tokenizer_json, tokenizer_config, generation_config = files
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "w") as out:
            json.dump({"tokenizer_json": tokenizer_json, "tokenizer_config": tokenizer_config,
                       "generation_config": generation_config}, out)
        os.replace(tmp, target)  # atomic: a concurrent writer's file is as good as ours
        tmp = None
        kept = sorted(target.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[_KEEP:]:
            old.unlink(missing_ok=True)
    except (OSError, TypeError, ValueError) as exc:
        log.debug("tokenizer cache not written (%s): the next start rebuilds it", exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def gguf_generation_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """What generation_config.json would hold: the GGUF only knows the special token ids."""
    return {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
