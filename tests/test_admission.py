"""blink.dpu.admission: the frontend's count of requests being admitted, published to the
ring clients, ended once by the slot write or by leaving the handler."""
from __future__ import annotations

import asyncio

import pytest

from blink.dpu import admission
from blink.dpu.admission import Admissions


def test_the_count_rises_per_request_and_falls_once_at_the_write_or_the_exit():
    counts = Admissions()
    seen: list[int] = []
    counts.attach(seen.append)
    assert seen == [0]  # a sink gets the count at once
    with counts.admitting():
        with counts.admitting():
            assert counts.count == 2
            admission.written()
            admission.written()  # the first call counts
            assert counts.count == 1
        assert counts.count == 1  # the inner one ended at its write, not again at its exit
    assert counts.count == 0
    assert seen == [0, 1, 2, 1, 0]
    counts.detach(seen.append)
    with counts.admitting():
        pass
    assert seen == [0, 1, 2, 1, 0]


def test_a_refused_request_ends_its_admission_too():
    counts = Admissions()
    with pytest.raises(ValueError):
        with counts.admitting():
            raise ValueError("bad request")
    assert counts.count == 0
    admission.written()  # outside any admission: nothing to end
    assert counts.count == 0


def test_the_write_may_happen_in_a_task_the_handler_started():
    """The ring client writes the slot in the fan-out's tasks: the ticket travels with the
    context they copy, and each handler's ticket ends once however many tasks write."""
    counts = Admissions()
    seen: list[int] = []
    counts.attach(seen.append)

    async def handler(delay: float):
        with counts.admitting():
            await asyncio.sleep(delay)

            async def write_slot():
                await asyncio.sleep(0)
                admission.written()

            await asyncio.gather(asyncio.create_task(write_slot()), asyncio.create_task(write_slot()))
            await asyncio.sleep(0.05)  # its stream goes on: the count no longer holds it

    async def burst():
        await asyncio.gather(handler(0.0), handler(0.01), handler(0.02))

    asyncio.run(burst())
    assert max(seen) == 3 and seen[-1] == 0
    assert seen == [0, 1, 2, 3, 2, 1, 0]  # each handler ended once, at its write
