"""The worker's sense of time: one injectable clock for the runtime's own pacing.

The claim loop, recovery scheduling, the prefetch buffer and the heartbeat
read the time and wait through a ``Clock``, so that an in-process test can
move time (``ManualClock``) instead of sleeping through real intervals.
Only the worker's pacing goes through it: times stored in rows always come
from the database clock (SPEC: stale detection compares database times),
and user code keeps the real clock.
"""

from __future__ import annotations

import random
import threading
import time


class Clock:
    """Monotonic seconds, waits on events, and jitter: the real ones."""

    def now(self) -> float:
        """Monotonic seconds (high resolution), comparable across threads."""
        return time.perf_counter()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``event``; True if it was set."""
        return event.wait(max(0.0, seconds))

    def jitter(self, low: float, high: float) -> float:
        """A random factor in ``[low, high]``: de-synchronises many workers."""
        return random.uniform(low, high)


class ManualClock(Clock):
    """A clock that moves only when told: for tests that drive a worker in-process.

    ``wait`` returns at once if the event is set, or as soon as ``advance``
    moves the time past the wait's end (it never sleeps on the real clock
    for the waited duration); ``jitter`` answers the middle of its range.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._moved = threading.Condition()

    def now(self) -> float:
        with self._moved:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._moved:
            self._now += seconds
            self._moved.notify_all()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        with self._moved:
            end = self._now + max(0.0, seconds)
            while not event.is_set() and self._now < end:
                # Short real waits so that a set event is seen promptly.
                self._moved.wait(0.01)
        return event.is_set()

    def jitter(self, low: float, high: float) -> float:
        return (low + high) / 2


#: The clock of every worker that is not given one.
SYSTEM_CLOCK = Clock()
