"""Request logging as vLLM's ``--enable-log-requests`` / ``--enable-log-outputs`` do it.

:class:`LoggedEngineClient` wraps the frontend's engine client: every engine request (one
choice; ``n > 1`` siblings are logged each) logs one INFO line when it is submitted (request
id, prompt length, sampling parameters) and, with ``log_outputs``, one when it finishes
(tokens produced, finish reason). The prompt's and the output's token ids go to DEBUG,
truncated to ``max_log_len`` ids (``--max-log-len``; None = all). The logger is
``blink.requests``; ``--log-level`` filters it like every Blink logger.

This is separate from the access log (one line per HTTP request, :mod:`blink.dpu.app`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from blink.dpu.engine_client import EngineClient, EngineOutput
from blink.shared.sampling_params import SamplingParams

logger = logging.getLogger("blink.requests")


@dataclass(frozen=True)
class RequestLogConfig:
    """``enabled``: log inputs (``--enable-log-requests``); ``log_outputs``: also outputs
    (``--enable-log-outputs``, needs ``enabled``); ``max_log_len``: ids kept in DEBUG lines."""

    enabled: bool = False
    log_outputs: bool = False
    max_log_len: int | None = None

    def __post_init__(self) -> None:
        if self.log_outputs and not self.enabled:
            raise ValueError("--enable-log-outputs requires --enable-log-requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")


def _params_summary(params: SamplingParams) -> str:
    """The fields that differ from the defaults (a full dump would be ~40 fields per line)."""
    default = SamplingParams()
    changed = {name: value for name, value in vars(params).items()
               if not name.startswith("_") and getattr(default, name, object()) != value}
    return ", ".join(f"{k}={v!r}" for k, v in sorted(changed.items())) or "defaults"


class LoggedEngineClient:
    """An :class:`~blink.dpu.engine_client.EngineClient` that logs each request; every other
    attribute is the wrapped client's."""

    def __init__(self, engine: EngineClient, config: RequestLogConfig) -> None:
        self._engine = engine
        self._config = config

    def __getattr__(self, name: str) -> Any:  # model_name, abort, stats, is_accepting, ...
        return getattr(self._engine, name)

    def _ids(self, ids: list[int]) -> list[int]:
        n = self._config.max_log_len
        return ids if n is None else ids[:n]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[EngineOutput]:
        logger.info("Received request %s: %d prompt tokens, params: %s", request_id,
                    len(prompt_ids), _params_summary(params))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Request %s prompt_token_ids: %s", request_id, self._ids(prompt_ids))
        produced: list[int] = []
        stream = self._engine.generate(request_id, prompt_ids, params, **kwargs)
        try:
            async for out in stream:
                if self._config.log_outputs:
                    produced.extend(out.token_ids)
                    if out.finished:
                        logger.info("Finished request %s: %d output tokens, finish_reason: %s",
                                    request_id, len(produced), out.finish_reason)
                        if logger.isEnabledFor(logging.DEBUG):
                            logger.debug("Request %s output_token_ids: %s", request_id,
                                         self._ids(produced))
                yield out
        finally:  # closing this stream (a choice cut short) closes the engine's at once
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
