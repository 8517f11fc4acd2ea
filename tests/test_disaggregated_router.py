"""The frontend's router (blink.dpu.disaggregated) over fake engines: which engine gets a
request, and what happens when one is lost before or after the first token."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from blink.dpu.disaggregated import DisaggregatedEngineClient, EngineInstance
from blink.dpu.engine_client import EngineDeadError, EngineOutput
from blink.ring import KV_RESERVE, KV_SEND
from blink.shared.sampling_params import SamplingParams


class FakeEngine:
    """Answers like a ReconnectingEngineClient. ``die_after``: raise EngineDeadError after that
    many deltas of a request (None: never); every request continues the "model" n -> n + 1."""

    def __init__(self, role: str, peers: list[str] = (), load: float = 0.0, die_after=None):
        self.info = SimpleNamespace(connection={"engine_role": role, "kv_peers": list(peers)})
        self.model_name, self.max_model_len = "m", 64
        self.load, self.die_after = load, die_after
        self.accepting = True
        self.calls: list[tuple[str, list[int], int | None, object]] = []
        self.aborts: list[tuple[str, bool]] = []

    def is_accepting(self):
        return self.accepting

    def is_healthy(self):
        return self.accepting

    def stats(self):
        return {"slots_used": int(self.load * 10), "slots_total": 10, "kv_usage": 0.0}

    async def generate(self, request_id, prompt, params, grammar=None, kv=None):
        self.calls.append((request_id, list(prompt), params.max_tokens, kv))
        if not self.accepting:
            raise EngineDeadError("dead")
        sent = 0
        if kv is not None and kv.mode == KV_RESERVE:
            yield EngineOutput(token_ids=[], kv_reservation=(3, 7, [11, 12]))
            prompt = list(prompt) + [prompt[-1] + 1]  # the prefill engine's token
            sent = 1
        last = prompt[-1]
        for i in range(sent, params.max_tokens):
            if self.die_after is not None and i >= self.die_after:
                self.accepting = False
                raise EngineDeadError("killed")
            last += 1
            yield EngineOutput(token_ids=[last], finished=i == params.max_tokens - 1,
                               finish_reason="length" if i == params.max_tokens - 1 else None)

    async def abort(self, request_id, force=False):
        self.aborts.append((request_id, force))


def _run(router, max_tokens=4, prompt=(1, 2, 3)):
    async def go():
        out = []
        async for d in router.generate("r", list(prompt), SamplingParams(max_tokens=max_tokens)):
            out += d.token_ids
        return out
    return asyncio.run(go())


def _router(prefill, decode, *more):
    return DisaggregatedEngineClient([EngineInstance("127.0.0.1:1", prefill),
                                      EngineInstance("127.0.0.1:2", decode),
                                      *(EngineInstance(f"127.0.0.1:{3 + i}", e) for i, e in enumerate(more))])


def test_a_request_is_reserved_on_decode_and_prefilled_with_the_reservation():
    p, d = FakeEngine("prefill", ["localhost:2"]), FakeEngine("decode")
    assert _run(_router(p, d)) == [4, 5, 6, 7]
    (rid, _, max_tokens, kv), = p.calls
    assert max_tokens == 1 and kv.mode == KV_SEND and (kv.peer, kv.slot, kv.seq, kv.blocks) == (0, 3, 7, (11, 12))
    assert d.calls[0][3].mode == KV_RESERVE


def test_the_least_loaded_decode_engine_is_chosen():
    p = FakeEngine("prefill", ["127.0.0.1:2", "127.0.0.1:3"])
    busy, idle = FakeEngine("decode", load=0.8), FakeEngine("decode", load=0.1)
    _run(_router(p, busy, idle))
    assert not busy.calls and idle.calls and p.calls[0][3].peer == 1


def test_prefill_lost_before_the_first_token_frees_the_reservation_and_runs_colocated():
    p, d = FakeEngine("prefill", ["127.0.0.1:2"], die_after=0), FakeEngine("decode")
    router = _router(p, d)
    assert _run(router) == [4, 5, 6, 7]
    assert ("r#decode", True) in d.aborts  # force: nobody will write its KV
    assert d.calls[-1][3] is None and d.calls[-1][1] == [1, 2, 3]  # whole request on decode
    assert router.retries == 1


def test_decode_lost_after_the_first_token_resumes_on_the_prefill_engine():
    p, d = FakeEngine("prefill", ["127.0.0.1:2"]), FakeEngine("decode", die_after=2)
    assert _run(_router(p, d)) == [4, 5, 6, 7]
    rid, prompt, max_tokens, kv = p.calls[-1]
    assert kv is None and prompt == [1, 2, 3, 4, 5] and max_tokens == 2


def test_nothing_left_is_a_clear_error():
    p, d = FakeEngine("prefill", ["127.0.0.1:2"], die_after=0), FakeEngine("decode", die_after=1)
    with pytest.raises(EngineDeadError, match="no engine is left.*prefill engine.*decode engine"):
        _run(_router(p, d))


def test_a_first_token_that_ends_the_request_cancels_the_reservation_normally():
    p, d = FakeEngine("prefill", ["127.0.0.1:2"]), FakeEngine("decode")
    assert _run(_router(p, d), max_tokens=1) == [4]
    assert ("r#decode", False) in d.aborts


def test_serve_flags_for_disaggregation_are_checked():
    from blink.cli import parse_args
    from blink.errors import BlinkError
    from blink.launcher import check_disaggregation_flags, frontend_args

    check_disaggregation_flags(parse_args(["serve", "--disaggregated", "--decode-engines", "2"]))
    with pytest.raises(BlinkError, match="--prefill-engines is for --disaggregated"):
        check_disaggregation_flags(parse_args(["serve", "--prefill-engines", "2"]))
    with pytest.raises(BlinkError, match="at least 1"):
        check_disaggregation_flags(parse_args(["serve", "--disaggregated", "--decode-engines", "0"]))
    with pytest.raises(BlinkError, match="CPU loop"):
        check_disaggregation_flags(parse_args(["serve", "--disaggregated", "--loop", "host"]))
    argv = frontend_args(parse_args(["serve"]), ["127.0.0.1:1", "127.0.0.1:2"])
    assert parse_args(argv).engine == ["127.0.0.1:1", "127.0.0.1:2"]
    assert parse_args(["engine", "--role", "prefill", "--kv-peer", "h:1", "--kv-peer", "h:2"]).kv_peer == ["h:1", "h:2"]


class StuckDecode(FakeEngine):
    """A decode engine whose reservation never sees its KV: its leg ends only when the
    reservation is force-cancelled (like the real one, which aborts it then)."""

    def __init__(self, reserve_delay: float = 0.0):
        super().__init__("decode")
        self.forced = None
        self.reserve_delay = reserve_delay

    async def generate(self, request_id, prompt, params, grammar=None, kv=None):
        self.calls.append((request_id, list(prompt), params.max_tokens, kv))
        self.forced = asyncio.Event()
        await asyncio.sleep(self.reserve_delay)
        yield EngineOutput(token_ids=[], kv_reservation=(3, 7, [11]))
        await self.forced.wait()
        yield EngineOutput(token_ids=[], finished=True, finish_reason="abort")

    async def abort(self, request_id, force=False):
        self.aborts.append((request_id, force))
        if force and self.forced is not None:
            self.forced.set()


def test_a_cancelled_reservation_whose_kv_never_lands_is_forced_after_the_settle_timeout():
    p, d = FakeEngine("prefill", ["127.0.0.1:2"]), StuckDecode()
    router = _router(p, d)
    router.settle_timeout_s = 0.2

    async def go():
        out = []
        async for delta in router.generate("r", [1, 2, 3], SamplingParams(max_tokens=1)):
            out += delta.token_ids
        assert d.aborts == [("r#decode", False)]  # plain first: the KV may be on its way
        await asyncio.wait_for(asyncio.gather(*router._settling), 5)
        return out

    assert asyncio.run(go()) == [4]
    assert d.aborts == [("r#decode", False), ("r#decode", True)]


def test_a_consumer_leaving_before_the_prefill_is_asked_for_frees_the_reservation_at_once():
    p, d = FakeEngine("prefill", ["127.0.0.1:2"]), StuckDecode(reserve_delay=10)
    router = _router(p, d)

    async def go():
        gen = router.generate("r", [1, 2, 3], SamplingParams(max_tokens=4))
        task = asyncio.ensure_future(gen.__anext__())
        while not d.calls:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away while the reservation was on its way
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert ("r#decode", True) in d.aborts and not p.calls
