"""The old name of :mod:`blink.model_config` (``ModelConfig``, a model's normalised
``config.json``; not the engine's configuration, which is ``EngineConfig`` from
:mod:`blink.engine_options`). Kept for imports written before the rename; import
``blink.model_config`` instead."""
from __future__ import annotations

from blink.model_config import SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, ModelConfig

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES"]
