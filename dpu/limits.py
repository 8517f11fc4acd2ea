"""What one request may cost the frontend: the bounds :mod:`blink.dpu.serving` and
:mod:`blink.dpu.app` enforce before doing the work (see "Request limits" in
docs/architecture.md).

Every bound answers a clear OpenAI-style 4xx at once, so no single request can freeze the
event loop, exhaust memory, or ask for more than the engine could ever run.
"""
from __future__ import annotations

from dataclasses import dataclass

from blink.dpu.chat_template import DEFAULT_RENDER_TIMEOUT_S

#: Default request-body limit (MiB): far above any prompt a context window holds (a 128k-token
#: prompt of JSON-escaped CJK text is ~1.5 MiB), far below what hurts the frontend.
DEFAULT_MAX_REQUEST_BODY_MB = 8.0
#: How many engine requests (prompts x n) one HTTP request may fan out to when the engine
#: client cannot say how many it holds at once (the ring's default slot count).
DEFAULT_MAX_FANOUT = 256
#: Longest request-supplied chat template (characters). Real ones are under 20k; compiling is
#: not under the render deadline and takes up to ~0.5 s for 64k characters of nested code.
DEFAULT_MAX_CHAT_TEMPLATE_CHARS = 1 << 16
#: Request bodies up to this size are parsed and validated on the event loop (well under a
#: millisecond); bigger ones in the worker pool (8 MiB of small objects take ~1 s).
INLINE_PARSE_BYTES = 1 << 16
#: JSON values (array items, object members, arrays, objects) a request body may hold, beyond
#: two per token of the context (a token-id prompt). Building Python objects for them holds
#: the GIL (no thread switch happens inside the JSON parser or pydantic-core): a million
#: "[1]" lists in 5 MiB stalled the whole frontend 1.2 s even from a worker thread, 600k
#: logit_bias entries 0.6 s. Real requests hold a few per message.
MAX_JSON_ITEMS = 1 << 16
#: Texts up to this many characters are encoded on the event loop (well under a
#: millisecond); longer ones, and every chat-template render, go to a worker thread.
INLINE_ENCODE_CHARS = 4096


@dataclass(frozen=True)
class RequestLimits:
    """The frontend's per-request bounds (``blink serve`` flags of the same names)."""

    #: request bodies above this are refused with 413 before they are read
    max_request_body_bytes: int = int(DEFAULT_MAX_REQUEST_BODY_MB * (1 << 20))
    #: most engine requests per HTTP request; ``None``: the engine's slot count (or 256)
    max_fanout: int | None = None
    #: wall-clock budget of one chat-template render
    chat_template_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S
    #: longest chat template a request may carry (with trust_request_chat_template)
    max_chat_template_chars: int = DEFAULT_MAX_CHAT_TEMPLATE_CHARS
    #: accept a ``chat_template`` in requests (vLLM's --trust-request-chat-template)
    trust_request_chat_template: bool = False
    #: structured outputs (blink.dpu.structured.workers): wall-clock and memory limits of one
    #: grammar check in a worker process, and the byte budget of the accepted-grammar cache
    grammar_compile_timeout_s: float = 1.0
    grammar_compile_memory_mb: float = 1024.0
    grammar_cache_mb: float = 64.0

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be positive, got "
                             f"{self.max_request_body_bytes}")
        if self.max_fanout is not None and self.max_fanout < 1:
            raise ValueError(f"max_fanout must be positive, got {self.max_fanout}")
        if not self.chat_template_timeout_s > 0:
            raise ValueError(f"chat_template_timeout_s must be positive, got "
                             f"{self.chat_template_timeout_s}")
        for name in ("grammar_compile_timeout_s", "grammar_compile_memory_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.grammar_cache_mb >= 0:
            raise ValueError(f"grammar_cache_mb must be >= 0, got {self.grammar_cache_mb}")


def json_item_count(body: bytes, limit: int) -> int:
    """How many JSON values ``body`` holds (commas, ``[`` and ``{`` outside strings): exact, or
    an upper bound when that is at most ``limit``, or a lower bound when that is over it.

    Bytes operations only (milliseconds for 8 MiB). Escaped backslashes and quotes are
    removed first, so every quote left delimits a string; the even-numbered pieces between
    quotes lie outside strings.
    """
    naive = body.count(b",") + body.count(b"[") + body.count(b"{")
    if naive <= limit:
        return naive
    cleaned = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = cleaned.count(b'"') // 2
    if strings > limit:  # each string is a value or a member's key: over already
        return strings  # (and splitting millions of them would cost a GIL-held 0.2 s)
    outside = b"".join(cleaned.split(b'"')[::2])
    return outside.count(b",") + outside.count(b"[") + outside.count(b"{")
