"""Model code: one decoder implementation for every supported family."""
from __future__ import annotations

from blink.models import packed_linear
from blink.models.decoder import DecoderForCausalLM, build_model

__all__ = ["DecoderForCausalLM", "build_model", "packed_linear"]
