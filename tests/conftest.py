"""Suite-wide settings. Runs before any test module imports torch or triton."""
from __future__ import annotations

import os

# Triton kernels run on CPU tensors only through the interpreter; the flag is read when
# triton is first imported, so it must be set before any test module imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
