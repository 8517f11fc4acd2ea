"""Blink's frontend (runs on the BlueField DPU in production): the OpenAI-compatible HTTP API,
tokenizer and chat templates, incremental detokenizer, stop strings, metrics.

Imports no torch/triton/cupy. Main entry points:

- :func:`blink.dpu.app.create_app` (the FastAPI app over an engine client)
- :class:`blink.dpu.engine_client.EngineClient` (the interface to the engine)
- :class:`blink.dpu.tokenizer.Tokenizer`
- :class:`blink.dpu.ring_engine_client.ReconnectingEngineClient` (what the frontend process
  serves with: the ring client of one engine at a time, :mod:`blink.dpu.ring_engine_client`)

This folder installs as ``blink.dpu``; imported from a checkout's root as a top-level ``dpu``
(an unrelated PyPI package's name) the import is handed on (:mod:`blink._shadowing`).
"""
if __name__ != "blink.dpu":
    from blink._shadowing import hand_on as _hand_on

    _hand_on(__name__, globals())
    del _hand_on
