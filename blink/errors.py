"""User-facing errors. Each names the file (or thing) and the problem in one line.

The CLI catches :class:`BlinkError` and prints ``error: <message>`` with a non-zero exit,
never a traceback. Code that validates user input raises these instead of asserting.
"""
from __future__ import annotations

from pathlib import Path


class BlinkError(Exception):
    """An error caused by user input or the environment, with a readable message."""


class ModelLoadError(BlinkError):
    """A model file or directory cannot be used: missing, truncated, inconsistent or unsupported."""

    def __init__(self, path: str | Path | None, problem: str) -> None:
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class UnsupportedModelError(ModelLoadError):
    """The model's architecture, model_type or rope scaling is not implemented."""
