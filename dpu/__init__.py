"""Blink's frontend (runs on the BlueField DPU in production): the OpenAI-compatible HTTP API,
tokenizer and chat templates, incremental detokenizer, stop strings, metrics.

Imports no torch/triton/cupy. Main entry points:

- :func:`blink.dpu.app.create_app` (the FastAPI app over an engine client)
- :class:`blink.dpu.engine_client.EngineClient` (the interface to the engine)
- :class:`blink.dpu.tokenizer.Tokenizer`
- :class:`blink.dpu.fake_engine.FakeEngineClient` (a scripted engine for tests)
"""
