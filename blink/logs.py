"""Log lines with a timestamp, a level and the request they belong to, in every process.

``blink serve``, ``blink engine`` and the frontend process all call :func:`configure_logging`
once at start, so their lines interleave readably on one terminal::

    2026-12-01 10:31:07.412 INFO  blink.access: 127.0.0.1:50412 "POST /v1/completions HTTP/1.1" 200 35.2ms request_id=9f0c...

:data:`request_id` is set by the frontend for the duration of each HTTP request (from the
client's ``x-request-id`` header or a new one); every record logged meanwhile carries it
(``%(request_id)s``, ``-`` outside a request). Torch-free: the frontend imports it.
"""
from __future__ import annotations

import contextvars
import logging
import sys

#: the HTTP request being served, in the frontend ("-" outside one)
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("blink_request_id", default="-")

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-5s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: uvicorn's extra level below DEBUG (``--uvicorn-log-level trace``)
TRACE = 5


class RequestIdFilter(logging.Filter):
    """Puts the current :data:`request_id` on every record (``record.request_id``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


def level_number(name: str) -> int:
    """``"info"`` → ``logging.INFO``; ``"trace"`` → uvicorn's TRACE (5)."""
    return TRACE if name.lower() == "trace" else getattr(logging, name.upper())


def configure_logging(level: str = "info", *, uvicorn_level: str | None = None) -> None:
    """One stderr handler with :data:`LOG_FORMAT` on the root logger, replacing any other;
    ``uvicorn_level`` sets uvicorn's own loggers (``--uvicorn-log-level``), which propagate to
    the same handler (uvicorn is started with ``log_config=None``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_number(level))
    if uvicorn_level is not None:
        for name in ("uvicorn", "uvicorn.error"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
            logger.setLevel(level_number(uvicorn_level))
        # Blink writes its own access log (blink.access, with the request id); uvicorn's is off.
        logging.getLogger("uvicorn.access").disabled = True
