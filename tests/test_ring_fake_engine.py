"""A tiny fake engine that plays the ENGINE side of the ring protocol, plus its own checks.

The frontend tests (ring client, loopback across processes) run against it. It is loaded by
path in child processes too, so it imports nothing but numpy and blink (no pytest at module
level). It follows blink/ring.py's docstring to the letter:

    WRITTEN -> copy the prompt, reset the stream (stream_seq=seq, produced=0, finish=NONE)
            -> RUNNING; each token: tokens[produced % cap] (+ logprobs), then produced += 1,
            never when produced - consumed == cap; finish: finish_reason, then FINISHED;
            cancel=1 -> FINISHED with FINISH_ABORT within one step.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from blink.ring import (
    C_ENGINE_STATE,
    C_HEARTBEAT,
    C_STAT_RUNNING,
    C_STAT_STEPS,
    ENGINE_FAILED,
    ENGINE_READY,
    ENGINE_STOPPED,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    SLOT_FINISHED,
    SLOT_RUNNING,
    SLOT_WRITTEN,
    Ring,
    RingConfig,
    RingLayout,
)
from blink.transport.base import memory_fence

#: (prompt, index of the generated token) -> token id
TokenFn = Callable[[list[int], int], int]


def echo_token(prompt: list[int], i: int) -> int:
    """Default script: repeat the prompt."""
    return prompt[i % len(prompt)]


def token_logprob(token: int) -> float:
    """Deterministic logprob of a generated token (tests recompute it)."""
    return -((token % 7) + 1) / 8.0


class FakeEngine:
    """Engine side of the ring in a background thread. Knobs are plain attributes."""

    def __init__(self, ring: Ring, *, token_fn: TokenFn = echo_token, step_sleep_s: float = 2e-4,
                 tokens_per_step: int = 1, cached_tokens: int = 0) -> None:
        self.ring = ring
        self.token_fn = token_fn
        self.step_sleep_s = step_sleep_s
        #: a blink.transport.doorbell.Doorbell the loop rings after each step (None: none)
        self.doorbell = None
        self.tokens_per_step = tokens_per_step
        self.cached_tokens = cached_tokens
        self.paused = False  # heartbeat and work stop (a hung engine)
        self.admit = True  # False: leave WRITTEN slots alone (a busy engine)
        self.claimed: list[dict] = []  # what each admitted request looked like
        self.backpressure_waits = 0
        self.generated: dict[int, int] = {}  # slot -> tokens generated for its current request
        self._prompts: dict[int, list[int]] = {}
        self.steps = 0  # steps begun (published as C_STAT_STEPS when each ends)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        ring.control[C_ENGINE_STATE] = ENGINE_READY

    # -- control -----------------------------------------------------------------------------
    def start(self) -> "FakeEngine":
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, state: int = ENGINE_STOPPED) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.ring.control[C_ENGINE_STATE] = state

    def fail(self) -> None:
        self.ring.control[C_ENGINE_STATE] = ENGINE_FAILED

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.paused:
                self.step()
                if self.doorbell is not None:  # as the engine's loop rings after each step
                    self.doorbell.ring()
            time.sleep(self.step_sleep_s)

    def step(self) -> None:
        r = self.ring
        r.control[C_HEARTBEAT] += 1
        self.steps += 1  # as the scheduler: count the step, stamp admissions, publish at the end
        states = r.state.copy()  # acquire: state words first
        memory_fence()
        if self.admit:
            for slot in np.flatnonzero(states == SLOT_WRITTEN):
                self._claim(int(slot))
        running = np.flatnonzero(r.state == SLOT_RUNNING)
        for slot in running:
            self._advance(int(slot))
        r.control[C_STAT_RUNNING] = len(running)
        r.control[C_STAT_STEPS] = self.steps

    def _claim(self, slot: int) -> None:
        r = self.ring
        a = r.config.arena_tokens
        off, n = int(r.prompt_offset[slot]), int(r.prompt_len[slot])
        prompt = r.arena[(off + np.arange(n)) % a].tolist()
        self._prompts[slot] = prompt
        self.generated[slot] = 0
        self.claimed.append(dict(
            slot=slot, seq=int(r.seq[slot]), request_id=int(r.request_id[slot]), prompt=prompt,
            max_tokens=int(r.max_tokens[slot]), min_tokens=int(r.min_tokens[slot]),
            top_k=int(r.top_k[slot]), seed=int(r.seed[slot]), logprobs=int(r.logprobs[slot]),
            temperature=float(r.temperature[slot]), arrival=int(r.arrival[slot]),
            stop_token_ids=[int(t) for t in r.stop_token_ids[slot] if t >= 0],
            logit_bias={int(t): float(v) for t, v in zip(r.logit_bias_ids[slot], r.logit_bias_values[slot]) if t >= 0},
        ))
        r.stream_seq[slot] = r.seq[slot]
        r.produced[slot] = 0
        r.finish_reason[slot] = FINISH_NONE
        r.num_prompt_tokens[slot] = n
        r.num_cached_tokens[slot] = min(self.cached_tokens, n)
        r.admitted_step[slot] = self.steps
        memory_fence()
        r.state[slot] = SLOT_RUNNING

    def _finish(self, slot: int, reason: int) -> None:
        self.ring.finish_reason[slot] = reason
        memory_fence()
        self.ring.state[slot] = SLOT_FINISHED

    def _advance(self, slot: int) -> None:
        r = self.ring
        cap = r.config.stream_capacity
        if r.cancel[slot]:
            self._finish(slot, FINISH_ABORT)
            return
        for _ in range(self.tokens_per_step):
            produced = int(r.produced[slot])
            if produced - int(r.consumed[slot]) >= cap:
                self.backpressure_waits += 1  # stream full: wait, never overwrite
                return
            i = self.generated[slot]
            token = self.token_fn(self._prompts[slot], i)
            pos = produced % cap
            r.tokens[slot, pos] = token
            r.logprob[slot, pos] = token_logprob(token)
            k = int(r.logprobs[slot])
            if k:
                r.top_ids[slot, pos, :k] = token + np.arange(k)
                r.top_logprobs[slot, pos, :k] = token_logprob(token) - np.arange(k)
            memory_fence()  # tokens before the counter that publishes them
            r.produced[slot] = produced + 1
            self.generated[slot] = i + 1
            stops = set(int(t) for t in r.stop_token_ids[slot] if t >= 0)
            if token in stops and i + 1 > int(r.min_tokens[slot]):
                self._finish(slot, FINISH_STOP)
                return
            if i + 1 >= int(r.max_tokens[slot]):
                self._finish(slot, FINISH_LENGTH)
                return


def make_ring(buffer=None, **cfg_kwargs) -> Ring:
    """A fresh ring with small defaults, over ``buffer`` (default: a private bytearray)."""
    defaults = dict(n_slots=8, arena_tokens=256, stream_capacity=8, max_logprobs=4,
                    max_stop_ids=4, max_logit_bias=4, max_model_len=128)
    cfg = RingConfig(**{**defaults, **cfg_kwargs})
    if buffer is None:
        buffer = bytearray(RingLayout(cfg).total_bytes)
    return Ring.create(buffer, cfg)


# -- self-checks of the fake engine (it must follow the protocol it is used to test) -------


def test_fake_engine_claims_generates_and_finishes() -> None:
    ring = make_ring()
    engine = FakeEngine(ring)
    slot = 3
    ring.arena[:3] = [5, 6, 7]
    ring.prompt_offset[slot], ring.prompt_len[slot] = 0, 3
    ring.max_tokens[slot] = 4
    ring.seq[slot] = 1
    ring.stop_token_ids[slot] = -1
    ring.state[slot] = SLOT_WRITTEN
    for _ in range(10):
        engine.step()
    assert ring.state[slot] == SLOT_FINISHED
    assert ring.finish_reason[slot] == FINISH_LENGTH
    assert ring.stream_seq[slot] == 1
    assert ring.produced[slot] == 4
    assert ring.tokens[slot, :4].tolist() == [5, 6, 7, 5]


def test_fake_engine_respects_backpressure_and_cancel() -> None:
    ring = make_ring(stream_capacity=2)
    engine = FakeEngine(ring)
    ring.arena[:1] = [9]
    ring.prompt_len[0], ring.max_tokens[0], ring.seq[0] = 1, 50, 1
    ring.stop_token_ids[0] = -1
    ring.state[0] = SLOT_WRITTEN
    for _ in range(10):
        engine.step()
    assert ring.produced[0] == 2  # nothing consumed: the stream holds 2 and waits
    assert engine.backpressure_waits > 0
    ring.cancel[0] = 1
    engine.step()
    assert ring.state[0] == SLOT_FINISHED and ring.finish_reason[0] == FINISH_ABORT
