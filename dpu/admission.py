"""The frontend's count of requests it is admitting: accepted by an HTTP handler, not yet
written into a ring slot (nor refused).

Why: requests that arrive together (a client's burst, or closed-loop clients whose requests
all finished in one step) reach the ring ~1 ms apart, the time the frontend takes to parse
and tokenize each. An engine with nothing to decode would start a step for the first one or
two, and the rest would wait behind that step before their own: at 16 streams of 128-token
prompts the last prompt's first token came one small step later, and the waves stayed split
from then on (docs/benchmarks.md, "Bursts"). Each ring client publishes this count in its
control word ``C_FRONTEND_ADMITTING``; the engine, when nothing is running, waits while it is
nonzero (bounded by ``--admission-wait-ms``) and prefills the burst in one step. A lone
request costs nothing: its count is back to zero when its slot is written.

Use: a request handler runs its admission inside :meth:`Admissions.admitting`; whatever
writes the request's slot calls :func:`written` (the context variable carries the request's
ticket into the tasks it starts). Leaving the block ends the ticket too (refusals, errors,
clients that left), so the count cannot leak.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Sink = Callable[[int], None]


class _Ticket:
    """One request's share of the count; ends once."""

    __slots__ = ("_owner", "open")

    def __init__(self, owner: Admissions) -> None:
        self._owner = owner
        self.open = True

    def end(self) -> None:
        if self.open:
            self.open = False
            self._owner._add(-1)


_current: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("blink_admission", default=None)


class Admissions:
    """The count, and the sinks (one per ring client) it is published to on every change.
    Event-loop code only (no lock): the handlers and the ring clients run on one loop."""

    def __init__(self) -> None:
        self.count = 0
        self._sinks: list[Sink] = []

    def attach(self, sink: Sink) -> None:
        """Publish to ``sink`` from now on (it gets the current count at once)."""
        self._sinks.append(sink)
        sink(self.count)

    def detach(self, sink: Sink) -> None:
        if sink in self._sinks:
            self._sinks.remove(sink)

    def _add(self, delta: int) -> None:
        self.count += delta
        for sink in list(self._sinks):
            sink(self.count)

    @contextmanager
    def admitting(self) -> Iterator[None]:
        """One request being admitted for the duration of the block, or until :func:`written`."""
        ticket = _Ticket(self)
        self._add(1)
        token = _current.set(ticket)
        try:
            yield
        finally:
            _current.reset(token)
            ticket.end()


def written() -> None:
    """The current request's slot is written: its admission ends (the first call counts)."""
    ticket = _current.get()
    if ticket is not None:
        ticket.end()


#: The frontend process's count (one event loop serves all its handlers and ring clients).
ADMISSIONS = Admissions()
