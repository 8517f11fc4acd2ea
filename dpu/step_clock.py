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

The same readings give the engine's **cadence** (:meth:`StepClock.cadence`): when the count
last moved and how long a step has taken lately, from which the poller predicts when the
running step ends and sleeps until just before then.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import statistics


class StepClock:
    """(engine step, monotonic time) readings, the last ``max_readings`` of them."""

    #: how many of the latest readings' intervals the step period is the median of
    PERIOD_INTERVALS = 8

    def __init__(self, max_readings: int = 4096) -> None:
        self._readings: collections.deque[tuple[int, float]] = collections.deque(maxlen=max_readings)
        self._period: float | None = None  # of the readings as they are; None: not computed yet

    def saw(self, steps: int, now: float) -> None:
        """The control block said ``steps`` steps had ended, read at ``now``. Only changes are
        kept (plus the first reading), so an idle engine does not push history out."""
        if self._readings and self._readings[-1][0] == steps:
            # Same count as before: it was reached by the *first* of these readings.
            return
        if self._readings and steps < self._readings[-1][0]:
            self._readings.clear()  # a new engine (restart): its count starts over
        self._readings.append((steps, now))
        self._period = None

    def cadence(self) -> tuple[float, float] | None:
        """(when the count last moved, seconds per step). The step time is each interval
        between readings divided by the steps it spans: the median over the latest
        :attr:`PERIOD_INTERVALS` (one long prefill step or an idle spell between requests does
        not raise it), or the latest alone where that is shorter (steps that got faster, a
        smaller batch: a poller that sleeps by this estimate must not sleep through several
        of them). None until two readings exist."""
        readings = self._readings
        if len(readings) < 2:
            return None
        if self._period is None:
            latest = list(itertools.islice(reversed(readings), self.PERIOD_INTERVALS + 1))
            per_step = [(t_hi - t_lo) / (s_hi - s_lo) for (s_hi, t_hi), (s_lo, t_lo) in zip(latest, latest[1:])]
            self._period = min(statistics.median(per_step), per_step[0])
        return readings[-1][1], self._period

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
