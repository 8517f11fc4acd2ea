"""Helpers for tests that compare two in-process :class:`~blink.llm.LLM` engines token for token."""
from __future__ import annotations

import threading
from typing import Any


def admit_each_call_at_once(llm: Any) -> Any:
    """Make ``llm.generate``'s requests reach the engine together: the engine loop does not
    step while a call is submitting (from its first submission to its first poll).

    Why: a request's tokens depend on which requests share its steps, because the CPU kernels
    take another path at another token count (4-bit projections beside AMX: the int8 build up
    to 8 tokens a step, AMX tiles above; without AMX the int8 build up to 32). The engine loop
    is a thread of its own, so without this gate a slow moment can let it admit the first
    prompt of a call a step before the others, and two engines given the same prompts need
    not batch them alike. Submissions that wait for a free slot still meet the timing of the
    finishes they wait for; keep a compared call within the ring's slots. Returns ``llm``."""
    lock = threading.Lock()
    holding = False
    step, submit, poll = llm.engine.step, llm._ring.try_submit, llm._ring.poll_many

    def held_step() -> bool:
        with lock:
            return step()

    def submit_holding(*args: Any, **kwargs: Any) -> Any:
        nonlocal holding
        if not holding:  # waits for a step in progress to end
            lock.acquire()
            holding = True
        return submit(*args, **kwargs)

    def poll_releasing(*args: Any, **kwargs: Any) -> Any:
        nonlocal holding
        if holding:
            holding = False
            lock.release()
        return poll(*args, **kwargs)

    llm.engine.step = held_step  # the loop calls self.step(): the instance's attribute wins
    llm._ring.try_submit = submit_holding
    llm._ring.poll_many = poll_releasing
    return llm
