"""Streaming OpenAI-compatible client for the serving benchmark (httpx + a small SSE parser).

One coroutine per request: POST with ``stream: true`` (and ``stream_options.include_usage``),
read the server-sent events, timestamp every chunk that carries text, and take the token counts
from the final ``usage`` chunk when the server sends one. Timing follows vLLM's
``backend_request_func.py``: TTFT at the first text chunk, one ITL entry per later text chunk,
E2E latency at ``[DONE]`` (or at the end of the stream when a server omits ``[DONE]``).
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterable, Iterator, Mapping

import httpx

from benchmarks.serve_metrics import RequestOutput

#: times a request is sent again when a pooled connection was closed before any answer
STALE_CONNECTION_RETRIES = 2


class SSEParser:
    """Incremental parser of a ``text/event-stream`` body, fed line by line.

    Implements the parts of the WHATWG event-stream rules that OpenAI-style servers use:
    ``data:`` lines (one optional space after the colon) accumulate, joined by newlines, and a
    blank line dispatches the event; ``:`` comment lines and other fields (``event:``, ``id:``,
    ``retry:``) are ignored; a final event without a trailing blank line is dispatched by
    :meth:`close`.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Feed one line (without its line ending); return a completed event's data, if any."""
        line = line.rstrip("\r\n")
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if not sep:
            name, value = line, ""
        elif value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None

    def close(self) -> str | None:
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def parse_sse_lines(lines: Iterable[str]) -> Iterator[str]:
    """All event data payloads of an event stream given as lines (used by tests)."""
    parser = SSEParser()
    for line in lines:
        ev = parser.feed(line)
        if ev is not None:
            yield ev
    ev = parser.close()
    if ev is not None:
        yield ev


def chunk_text(data: Mapping[str, Any], chat: bool) -> str:
    """The text a completions or chat-completions stream chunk carries ('' if none)."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return delta.get("content") or ""
    return choice.get("text") or ""


def build_payload(*, model: str, prompt: str | list[dict[str, Any]], max_tokens: int, chat: bool,
                  ignore_eos: bool = False, temperature: float = 0.0, include_usage: bool = True,
                  logit_bias: Mapping[int, float] | None = None,
                  extra_body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                               "temperature": temperature, "stream": True}
    if chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        payload["messages"] = messages
    else:
        payload["prompt"] = prompt
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    if ignore_eos:
        payload["ignore_eos"] = True
    if logit_bias:
        payload["logit_bias"] = {str(k): v for k, v in logit_bias.items()}
    if extra_body:
        payload.update(extra_body)
    return payload


async def send_streaming_request(client: httpx.AsyncClient, url: str, payload: Mapping[str, Any],
                                 *, chat: bool, prompt_len: int,
                                 headers: Mapping[str, str] | None = None) -> RequestOutput:
    """Send one streaming request and record what the benchmark needs."""
    out = RequestOutput(prompt_len=prompt_len)
    parser = SSEParser()
    text_parts: list[str] = []
    st = time.perf_counter()
    out.start_time = st
    last = st
    done_at: float | None = None
    usage: Mapping[str, Any] | None = None
    # A server may close a pooled keep-alive connection as the next request goes out on it
    # (llama-server's HTTP library does, now and then, at 16 streams): nothing was answered, so
    # the request is sent again on a fresh connection (as browsers and requests' urllib3 do),
    # counted in ``retries``, not failed.
    for attempt in range(STALE_CONNECTION_RETRIES + 1):
        answered = False
        try:
            async with client.stream("POST", url, json=payload, headers=headers) as response:
                answered = True
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    out.error = f"HTTP {response.status_code}: {body[:500]}"
                    return out
                async for line in response.aiter_lines():
                    data = parser.feed(line)
                    if data is None:
                        continue
                    now = time.perf_counter()
                    if data.strip() == "[DONE]":
                        done_at = now
                        continue
                    obj = json.loads(data)
                    if "error" in obj and not obj.get("choices"):
                        err = obj["error"]
                        out.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        return out
                    if obj.get("usage"):
                        usage = obj["usage"]
                    text = chunk_text(obj, chat)
                    if text:
                        if out.chunks == 0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.chunks += 1
                        text_parts.append(text)
                tail = parser.close()
                if tail is not None and tail.strip() == "[DONE]":
                    done_at = time.perf_counter()
            break
        except httpx.RemoteProtocolError as exc:
            if not answered and attempt < STALE_CONNECTION_RETRIES:
                out.retries += 1
                continue
            out.error = f"{type(exc).__name__}: {exc}"
            return out
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            return out
    out.latency = (done_at if done_at is not None else time.perf_counter()) - st
    out.generated_text = "".join(text_parts)
    if usage is not None:
        if usage.get("completion_tokens") is not None:
            out.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens"):
            out.prompt_len = int(usage["prompt_tokens"])
    out.success = True
    return out


def make_client(max_connections: int, timeout_s: float | None = 6 * 3600.0) -> httpx.AsyncClient:
    """One pooled client for the whole run (enough connections for every open request)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s),
                             trust_env=False)  # never route loopback traffic through a proxy
