"""The engine's step counter as a clock: when did the engine's step count reach N, in this
process's time?

The engine stamps each request with the number of the step that admitted it (ring stream
field ``admitted_step``) and publishes its step count in the control block (``C_STAT_STEPS``)
as each step ends, but it writes no wall-clock time (a CUDA graph has no host clock). The
frontend's poller reads the count at every tick; :class:`StepClock` keeps those (count, time)
readings and answers "when did the count reach N" by interpolating between the last reading
below N and the first one at or past it. Step N starts when step N-1 ends, so a request
admitted by step N was admitted at ``time_of(N - 1)``: a reading the poller already has when
step N's first tokens arrive (they are published before step N's count). Between two polls
the engine may run many steps (a GPU loop does); interpolation places the admission inside
that interval instead of at its end, where "the poller saw the slot leave WRITTEN" puts it.
"""
from __future__ import annotations

import bisect
import collections


class StepClock:
    """(engine step, monotonic time) readings, the last ``max_readings`` of them."""

    def __init__(self, max_readings: int = 4096) -> None:
        self._readings: collections.deque[tuple[int, float]] = collections.deque(maxlen=max_readings)

    def saw(self, steps: int, now: float) -> None:
        """The control block said ``steps`` steps had ended, read at ``now``. Only changes are
        kept (plus the first reading), so an idle engine does not push history out."""
        if self._readings and self._readings[-1][0] == steps:
            # Same count as before: it was reached by the *first* of these readings.
            return
        if self._readings and steps < self._readings[-1][0]:
            self._readings.clear()  # a new engine (restart): its count starts over
        self._readings.append((steps, now))

    def time_of(self, step: int) -> float | None:
        """When the count reached ``step``, in ``time.monotonic()`` terms; None if no reading
        has reached it yet or it is older than the readings kept."""
        readings = self._readings
        if not readings or step > readings[-1][0]:
            return None
        i = bisect.bisect_left([s for s, _ in readings], step)
        s_hi, t_hi = readings[i]
        if s_hi == step and i == 0:
            return t_hi
        if i == 0:
            return None  # before the oldest reading
        s_lo, t_lo = readings[i - 1]
        # step lies in (s_lo, s_hi]: reached after the reading of s_lo, by the one of s_hi.
        return t_lo + (t_hi - t_lo) * (step - s_lo) / (s_hi - s_lo)
