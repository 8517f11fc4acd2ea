"""The frontend's line for ring room (issue 33): requests that find every ring slot taken
wait in (priority, arrival) order, the engine's queue order (:meth:`RingEngineClient.
_submit_in_line`); arrival order when every priority is 0 (fcfs, where the frontend refuses
others); a waiter whose caller is cancelled leaves the line without taking a slot. A fake
engine over a loopback ring (tests/test_ring_client.py's Setup), two slots: one held by a
stalled request, one freed on cue."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from test_ring_client import Setup, make_async, wait_for  # noqa: E402

from blink.shared.sampling_params import SamplingParams  # noqa: E402


async def _hold_slot(client, request_id: str, token: int):
    """A request that takes a slot and keeps it (its stream stalls: nobody reads it)."""
    agen = client.generate(request_id, [token], SamplingParams(max_tokens=10_000))
    await agen.__anext__()
    return agen


def _run_line(waiters: list[tuple[str, int, int]], cancel: str | None = None) -> list[list[int]]:
    """Both slots held; ``waiters`` ((name, priority, token), in arrival order) queue; the
    waiter named ``cancel`` is cancelled; then one slot frees. Returns the prompts the engine
    claimed after that, in order."""
    setup = Setup(n_slots=2)
    setup.engine.start()

    async def main() -> list[list[int]]:
        client = make_async(setup)
        holders = [await _hold_slot(client, f"hold{i}", 90 + i) for i in range(2)]
        tasks = {}
        for name, priority, token in waiters:
            params = SamplingParams(max_tokens=1, priority=priority)
            tasks[name] = asyncio.ensure_future(
                _collect(client.generate(name, [token], params)))
            await wait_for(lambda: len(client._line) == len(tasks), 5, f"{name} in line")
        claimed = len(setup.engine.claimed)
        if cancel is not None:
            tasks[cancel].cancel()
            await wait_for(lambda: len(client._line) == len(tasks) - 1, 5, "the cancelled waiter gone")
        await holders[0].aclose()  # its slot is drained and freed
        rest = [t for name, t in tasks.items() if name != cancel]
        await asyncio.wait_for(asyncio.gather(*rest), 10)
        await holders[1].aclose()
        await wait_for(lambda: not setup.client.active, 5, "every slot back")
        assert client._line == []
        await client.close()
        return [c["prompt"] for c in setup.engine.claimed[claimed:]]

    try:
        return asyncio.run(main())
    finally:
        setup.close()


async def _collect(agen) -> list:
    return [o async for o in agen]


def test_an_urgent_waiter_gets_the_next_free_slot_before_earlier_low_ones():
    order = _run_line([("low-a", 10, 1), ("low-b", 10, 2), ("urgent", 0, 3), ("low-c", 5, 4)])
    assert order == [[3], [4], [1], [2]]  # (priority, arrival)


def test_equal_priorities_wait_in_arrival_order():
    """fcfs: every priority is 0 (the frontend refuses others): first come, first served."""
    assert _run_line([("a", 0, 1), ("b", 0, 2), ("c", 0, 3)]) == [[1], [2], [3]]


def test_a_cancelled_waiter_takes_no_slot():
    order = _run_line([("low-a", 10, 1), ("urgent", 0, 2), ("low-b", 10, 3)], cancel="urgent")
    assert order == [[1], [3]]
