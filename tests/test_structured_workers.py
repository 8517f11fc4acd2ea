"""The grammar workers' lifecycle (blink.dpu.structured.workers): a compile whose client has
gone is cancelled (its worker killed and replaced), and compiles run side by side without a
global lock: a cached constraint is answered while another one compiles."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import byte_tokenizer_json  # noqa: E402

from blink.dpu.structured.workers import GrammarService  # noqa: E402
from blink.dpu.tokenizer import Tokenizer  # noqa: E402
from blink.shared.structured_outputs import StructuredOutputs as SO  # noqa: E402

#: ~0.3 s to build alone (a 30 x 30 anyOf of bounded integers)
WIDE = SO(json={"anyOf": [{"type": "object", "properties": {
    f"p{j}_{i}": {"type": "integer", "minimum": -i, "maximum": i * 1000} for i in range(30)}}
    for j in range(30)]})


@pytest.fixture()
def service():
    tok = Tokenizer(byte_tokenizer_json(), {}, {"eos_token_id": 0})
    svc = GrammarService(tok, timeout_s=30.0, workers=2)
    svc.compile(SO(regex="a+"))  # the first worker started (not what is measured)
    yield svc
    svc.close()


def test_a_cancelled_compile_kills_its_worker(service, monkeypatch):
    # The compile holds its worker until its client has gone, so the cancel always comes
    # while the worker compiles (a fixed sleep raced a compile of ~0.1 s on a quiet machine).
    taken, release = threading.Event(), threading.Event()
    take = service.workers._take

    def take_then_hold():
        worker = take()
        taken.set()
        release.wait(10)
        return worker

    monkeypatch.setattr(service.workers, "_take", take_then_hold)

    async def main():
        task = asyncio.ensure_future(service.compile_async(WIDE))
        while not taken.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        deadline = time.monotonic() + 10
        while service.workers.killed == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert service.workers.killed == 1 and len(service._cache) == 1  # "a+" only
    assert service.compile(SO(regex="b+")) is not None  # the replaced worker serves


def test_cached_constraints_do_not_wait_for_a_compile(service):
    async def main():
        slow = asyncio.ensure_future(service.compile_async(WIDE))
        await asyncio.sleep(0.02)
        t0 = time.monotonic()
        cached = await service.compile_async(SO(regex="a+"))
        waited = time.monotonic() - t0
        await slow
        return cached, waited, slow.done()

    cached, waited, _ = asyncio.run(main())
    assert cached is service.compile(SO(regex="a+")) and waited < 0.1, waited


def test_a_mask_past_its_time_limit_ends_the_request(service):
    """A grammar whose mask costs more than the per-token limit is ended with an error naming
    the limit (the poller computes every stream's masks: it must not stall them)."""
    from blink.dpu.structured.masker import MaskError

    grammar = service.compile(SO(grammar='start: x\nx: x x | x x x | "a" | "aa" | "b" x'))
    masker = grammar.new_masker()
    masker.time_limit_s = 0.0  # any real computation is past it
    with pytest.raises(MaskError, match="over the limit of 0 ms per token"):
        masker.mask()
    fine = grammar.new_masker()
    assert fine.mask() is not None  # the default limit: far above a normal mask
