"""The frontend's router over several engines: disaggregated prefill/decode when a prefill and
a decode engine are up, a whole request on one engine ("colocated") otherwise, and never a
lost request (docs/disaggregation.md). numpy only, like the rest of the frontend.

One request, disaggregated:

1. **Reserve** on a decode engine (the least loaded: ring slots in use + KV blocks in use):
   the request goes into its ring with ``kv_mode = KV_RESERVE``; the decode scheduler copies
   the prompt, allocates the prompt's blocks and publishes their ids; the first delta of that
   leg carries them (``EngineOutput.kv_reservation``).
2. **Prefill** on a prefill engine that has that decode engine among its ``kv_peers`` (the
   least loaded): the same request with ``max_tokens = 1`` and ``kv_mode = KV_SEND`` naming
   the decode slot, seq and blocks. Its one token is the request's first token (streamed at
   once: TTFT is the prefill engine's); after the step that computed it, the prefill engine
   writes the prompt's KV into the reserved blocks and publishes "KV ready" in the decode ring.
3. **Decode**: the decode leg's deltas are the rest of the output.

Losses: a leg whose engine dies (or refuses: dead, restarting) is retried. Before any token
reached the client the request starts again on what is left (another pair, or colocated on
one engine); after, it resumes colocated on a live engine with the tokens so far appended to
the prompt (``max_tokens``/``min_tokens`` reduced by as many): greedy and seeded sampling give
the same tokens (the sampler's RNG is keyed by position), penalties count the earlier output
as prompt. A structured-output request is not split (its token masks follow one engine's
tokens: it runs colocated on one engine) and cannot resume mid-output (its matcher would
restart), so it ends with the error instead. When no engine is left the request ends with
:class:`EngineDeadError` naming every loss. A reservation whose prefill is lost or aborted is
force-cancelled (freed at once); one no longer needed (the first token ended the request) is
cancelled normally, which the decode engine honours once the KV has landed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from blink.dpu.engine_client import (
    EngineDeadError,
    EngineOutput,
    EngineStats,
)
from blink.dpu.ring_protocol import KvRoute
from blink.dpu.structured.workers import CompiledGrammar
from blink.errors import BlinkError
from blink.ring import KV_RESERVE, KV_SEND
from blink.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")


def normalize_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host in ("localhost", "") else host, int(port))


@dataclass(eq=False)
class EngineInstance:
    """One engine the frontend serves from: its bootstrap address and its (reconnecting)
    client; role and KV peers come from the engine's welcome."""

    address: str
    client: Any  # ReconnectingEngineClient (or anything with its interface)
    #: requests routed here (diagnostics and tests)
    routed: dict[str, int] = field(default_factory=dict)

    @property
    def role(self) -> str:
        info = getattr(self.client, "info", None)
        role = (getattr(info, "connection", None) or {}).get("engine_role", "both")
        return role if role in ROLES else "both"

    @property
    def kv_peers(self) -> list[tuple[str, int]]:
        info = getattr(self.client, "info", None)
        peers = (getattr(info, "connection", None) or {}).get("kv_peers") or []
        return [normalize_address(p) for p in peers if isinstance(p, str)]

    def accepting(self) -> bool:
        return bool(self.client.is_accepting())

    def load(self) -> float:
        """Ring slots in use plus KV blocks in use, both as fractions: lower is better."""
        try:
            s = self.client.stats()
        except Exception:  # noqa: BLE001 - an engine that cannot answer is the worst choice
            return float("inf")
        slots = s.get("slots_used", 0) / max(s.get("slots_total", 1) or 1, 1)
        return slots + float(s.get("kv_usage", 0.0))

    def count(self, what: str) -> None:
        self.routed[what] = self.routed.get(what, 0) + 1


class _LegLost(Exception):
    def __init__(self, instance: EngineInstance, cause: BaseException) -> None:
        super().__init__(f"{instance.role} engine {instance.address}: {cause}")
        self.instance = instance


class DisaggregatedEngineClient:
    """:class:`~blink.dpu.engine_client.EngineClient` over several engines (module docstring)."""

    def __init__(self, instances: list[EngineInstance]) -> None:
        if not instances:
            raise BlinkError("the router needs at least one engine")
        first = instances[0].client
        for inst in instances[1:]:
            c = inst.client
            if (c.model_name, c.max_model_len) != (first.model_name, first.max_model_len):
                raise BlinkError(
                    f"engine {inst.address} serves {c.model_name!r} (max_model_len "
                    f"{c.max_model_len}), engine {instances[0].address} {first.model_name!r} "
                    f"({first.max_model_len}): one frontend serves one model")
        self.instances = instances
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.info = getattr(first, "info", None)
        #: requests that resumed or restarted on another engine (diagnostics and tests)
        self.retries = 0
        #: background tasks freeing cancelled reservations (_settle)
        self._settling: set[asyncio.Task[None]] = set()
        #: how long a cancelled reservation may wait for a KV that may be on its way
        self.settle_timeout_s = 30.0

    # -- EngineClient ----------------------------------------------------------------------

    @property
    def ring(self) -> Any:
        """The smallest ring among the engines (its slot count bounds a request's fan-out)."""
        rings = [r for r in (getattr(i.client, "ring", None) for i in self.instances) if r is not None]
        return min(rings, key=lambda r: r.config.n_slots, default=None)

    def is_healthy(self) -> bool:
        return any(i.client.is_healthy() for i in self.instances)

    def is_accepting(self) -> bool:
        return any(i.accepting() for i in self.instances)

    def unavailable_retry_after_s(self) -> float | None:
        waits = [w for w in (getattr(i.client, "unavailable_retry_after_s", lambda: None)()
                             for i in self.instances) if w is not None]
        return min(waits) if waits else None

    def stats(self) -> EngineStats:
        """The engines' counters summed (KV usage: the mean)."""
        parts = [i.client.stats() for i in self.instances]
        total = EngineStats(running=0, waiting=0, kv_usage=0.0, prefix_cache_queries=0,
                            prefix_cache_hits=0, preemptions=0)
        for s in parts:
            for key, value in s.items():
                if key == "kv_usage":
                    total["kv_usage"] += value / len(parts)  # type: ignore[operator]
                elif key == "heartbeat_age_s":
                    total[key] = max(total.get(key, 0.0), value)  # type: ignore[literal-required]
                else:
                    total[key] = total.get(key, 0) + value  # type: ignore[literal-required]
        return total

    def step_token_samples(self) -> list[tuple[int, int]]:
        return []

    def start(self) -> None:
        for inst in self.instances:
            inst.client.start()

    async def close(self) -> None:
        for inst in self.instances:
            await inst.client.close()

    async def abort(self, request_id: str) -> None:
        for inst in self.instances:
            for suffix in ("", "#prefill", "#decode"):
                await inst.client.abort(request_id + suffix)

    # -- routing ---------------------------------------------------------------------------

    def _pick(self, lost: set[int], resuming: bool) -> tuple[str, EngineInstance, EngineInstance | None] | None:
        """("disaggregated", prefill, decode), ("colocated", engine, None), or None."""
        live = [i for i in self.instances if id(i) not in lost and i.accepting()]
        if not live:
            return None
        if not resuming:
            decodes = sorted((i for i in live if i.role == "decode"), key=EngineInstance.load)
            for d in decodes:
                where = normalize_address(d.address)
                prefills = [p for p in live if p.role == "prefill" and where in p.kv_peers]
                if prefills:
                    return "disaggregated", min(prefills, key=EngineInstance.load), d
        return "colocated", min(live, key=EngineInstance.load), None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       grammar: CompiledGrammar | None = None) -> AsyncIterator[EngineOutput]:
        emitted: list[int] = []  # tokens the consumer has already received
        lost: set[int] = set()
        losses: list[str] = []
        while True:
            resuming = bool(emitted)
            if resuming and grammar is not None:
                raise EngineDeadError("the engine serving this structured-output request was lost "
                                      "mid-output and it cannot resume: " + "; ".join(losses))
            # A constrained request runs on one engine: its masks follow that engine's tokens.
            plan = self._pick(lost, resuming or grammar is not None)
            if plan is None:
                raise EngineDeadError("no engine is left to serve this request"
                                      + (": " + "; ".join(losses) if losses else ""))
            kind, first, second = plan
            try:
                if kind == "disaggregated":
                    assert second is not None
                    legs = self._disaggregated(first, second, request_id, prompt_ids, params, grammar)
                else:
                    legs = self._colocated(first, request_id, prompt_ids, params, grammar, emitted)
                async for out in legs:
                    emitted += out.token_ids
                    yield out
                return
            except _LegLost as exc:
                lost.add(id(exc.instance))
                losses.append(str(exc))
                self.retries += 1
                logger.warning("request %s: %s; %s", request_id, exc,
                               "resuming elsewhere" if emitted else "retrying elsewhere")

    async def _colocated(self, inst: EngineInstance, request_id: str, prompt_ids: list[int],
                         params: SamplingParams, grammar: CompiledGrammar | None,
                         emitted: list[int]) -> AsyncIterator[EngineOutput]:
        """The whole request (or its rest, after ``emitted``) on one engine."""
        inst.count("colocated" if not emitted else "resumed")
        prompt = list(prompt_ids) + list(emitted)
        rest = params
        if emitted:
            left = None if params.max_tokens is None else params.max_tokens - len(emitted)
            rest = dataclasses.replace(params, max_tokens=left,
                                       min_tokens=max(0, params.min_tokens - len(emitted)))
        try:
            async for out in inst.client.generate(request_id, prompt, rest, grammar):
                if emitted:  # the client sees the original prompt, not the resumed one
                    out = dataclasses.replace(out, num_prompt_tokens=len(prompt_ids),
                                              queue_time_s=None, admitted_at=None)
                yield out
        except EngineDeadError as exc:
            raise _LegLost(inst, exc) from exc

    async def _disaggregated(self, prefill: EngineInstance, decode: EngineInstance,
                             request_id: str, prompt_ids: list[int], params: SamplingParams,
                             grammar: CompiledGrammar | None) -> AsyncIterator[EngineOutput]:
        prefill.count("prefill")
        decode.count("decode")
        decode_id, prefill_id = request_id + "#decode", request_id + "#prefill"
        decode_leg = decode.client.generate(decode_id, prompt_ids, params, grammar,
                                            kv=KvRoute(KV_RESERVE))
        prefill_leg: AsyncIterator[EngineOutput] | None = None
        settle = False  # a cancelled reservation whose KV is (or may be) on its way
        prefill_done = False  # the prefill leg ended (finished, or its engine lost)
        try:
            try:
                reserved = await decode_leg.__anext__()
            except (EngineDeadError, StopAsyncIteration) as exc:
                raise _LegLost(decode, exc) from exc
            if reserved.kv_reservation is None:  # refused outright (an invalid prompt)
                yield reserved
                return
            slot, seq, blocks = reserved.kv_reservation
            peer = prefill.kv_peers.index(normalize_address(decode.address))
            route = KvRoute(KV_SEND, peer=peer, slot=slot, seq=seq, blocks=tuple(blocks))
            head = dataclasses.replace(params, max_tokens=1)
            last: EngineOutput | None = None
            prefill_leg = prefill.client.generate(prefill_id, prompt_ids, head, grammar, kv=route)
            try:
                async for out in prefill_leg:
                    last = out
                    if not out.finished:
                        yield out
            except EngineDeadError as exc:
                prefill_done = True
                await decode.client.abort(decode_id, force=True)  # nobody will write its KV
                raise _LegLost(prefill, exc) from exc
            prefill_done = True
            assert last is not None and last.finished
            done = (last.finish_reason != "length" or params.max_tokens == 1
                    or len(prompt_ids) + 1 >= self.max_model_len)
            if last.finish_reason in ("abort", "error"):
                await decode.client.abort(decode_id, force=True)  # the KV is not coming
            elif done:
                await decode.client.abort(decode_id)  # freed once its KV has landed
                settle = True
            if done:
                yield last
                return
            yield dataclasses.replace(last, finished=False, finish_reason=None)
            try:
                async for out in decode_leg:
                    yield dataclasses.replace(out, queue_time_s=None, admitted_at=None)
            except EngineDeadError as exc:
                raise _LegLost(decode, exc) from exc
        finally:
            if prefill_leg is None:
                # No prefill was asked for: a reservation (if the decode engine made one
                # already) would wait for a KV that never comes.
                await decode.client.abort(decode_id, force=True)
                await decode_leg.aclose()
            elif not prefill_done or settle:
                if not prefill_done:  # the consumer left mid-prefill
                    await prefill.client.abort(prefill_id)
                    await decode.client.abort(decode_id)
                self._settle_later(decode, decode_id, decode_leg)
            else:
                await decode_leg.aclose()

    def _settle_later(self, decode: EngineInstance, decode_id: str, decode_leg: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._settle(decode, decode_id, decode_leg))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, decode: EngineInstance, decode_id: str, decode_leg: Any) -> None:
        """A cancelled reservation whose KV may still be written (its prefill was past its
        prompt, or may have been): drain its decode leg, which ends once the KV has landed
        (the row then aborts); if it has not ended after ``settle_timeout_s``, no KV is
        coming (the prefill was cancelled in time, or its transfer failed): force-cancel."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout_s
        forced = False
        try:
            while True:
                step = asyncio.ensure_future(decode_leg.__anext__())
                done, _ = await asyncio.wait(
                    {step}, timeout=None if forced else max(0.0, deadline - loop.time()))
                if not done:  # the stream is still the client's: the force reaches it
                    await decode.client.abort(decode_id, force=True)
                    forced = True
                    await asyncio.wait({step})
                try:
                    step.result()
                except (StopAsyncIteration, EngineDeadError):
                    return
        except Exception:  # noqa: BLE001 - a background task must not die silently
            logger.exception("freeing the KV reservation of %s failed", decode_id)
        finally:
            await decode_leg.aclose()
