"""How many claimed rows a worker holds beyond its running ones: the prefetch.

Claiming only as many rows as there are free threads makes a short job
cost a claim commit of its own (plus its success commit), so throughput
follows the database's commit latency: one thread runs at most one job per
two commits. Holding a small buffer of claimed rows lets the threads go from
one job to the next without waiting for the database, and lets the claim
loop take big batches (one commit for hundreds of rows).

The buffer is sized from what the worker observes, not configured in rows:
``capacity`` = threads / average run time (jobs per second this process can
start), and the buffer holds what the threads can start within
``PREFETCH_HORIZON`` seconds. Short jobs are therefore claimed hundreds at a
time; jobs that take seconds are not prefetched at all (their buffer rounds
to zero), so a worker never hoards rows that another worker could start
sooner, and a higher-priority row enqueued later waits at most about one
horizon behind the rows already buffered. A refill starts while the buffer
still holds enough for the time a claim takes (with margin), so the threads
do not run dry.

Until a run time has been observed nothing is prefetched: the first claim
is the free threads, as without prefetch.
"""

from __future__ import annotations

import math
import threading

#: Most rows held beyond the running ones, whatever the estimate says: a
#: bound on the rows a crashed worker leaves to stale recovery.
MAX_PREFETCH = 1000
#: Weight of the newest observation in the moving averages.
SMOOTHING = 0.2
#: A refill starts while the buffer still covers this many claim latencies.
REFILL_MARGIN = 3.0
#: The most seconds of work a worker buffers while fair keys take turns (or the horizon,
#: if shorter). A key's new item is dealt its turn in the next claim, and starts after
#: what is buffered then: behind a horizon of 0.5 s its start took 320 ms at the median
#: and 500 ms at p99 (W12); at 0.05 s, 41 ms and under 100 ms. The claims that come ten
#: times as often cost 8% of the throughput of 10 ms jobs and nothing for short ones (whose
#: buffer is capped by rows, MAX_PREFETCH, either way).
FAIR_HORIZON = 0.05


class Prefetch:
    """The buffer target and refill mark, from observed run times and claim latency.

    Observations come from many threads; reads from the claim loop. A lock
    keeps the averages consistent (the cost is a few hundred nanoseconds per
    job).
    """

    def __init__(self, *, concurrency: int, horizon: float, cap: int = MAX_PREFETCH) -> None:
        self.concurrency = concurrency
        self.horizon = horizon
        self.cap = cap
        self._lock = threading.Lock()
        self._run: float | None = None  # seconds per job, moving average
        self._claim: float | None = None  # seconds per claim statement, moving average

    @property
    def enabled(self) -> bool:
        return self.horizon > 0 and self.cap > 0

    def observe_run(self, seconds: float) -> None:
        """One job's run time (its handler and the hand-off of its outcome)."""
        with self._lock:
            self._run = _average(self._run, seconds)

    def observe_claim(self, seconds: float) -> None:
        with self._lock:
            self._claim = _average(self._claim, seconds)

    def capacity(self, running_for: float = 0.0) -> float:
        """Jobs per second this process can start; ``inf`` before any observation.

        ``running_for`` is how long the youngest running job has run while
        every thread is busy: when jobs suddenly get long, that says so before
        any of them finishes (and stops the worker from claiming rows it
        cannot start soon).
        """
        with self._lock:
            run = self._run
        if run is None:
            return math.inf
        run = max(run, running_for, 1e-6)
        return self.concurrency / run

    def target(self, running_for: float = 0.0, *, fair: bool = False) -> int:
        """Rows to hold claimed and not yet started (0: claim free threads only); ``fair``:
        while fair keys take turns (``FAIR_HORIZON``)."""
        if not self.enabled:
            return 0
        capacity = self.capacity(running_for)
        if math.isinf(capacity):
            return 0
        horizon = min(self.horizon, FAIR_HORIZON) if fair else self.horizon
        return min(self.cap, int(capacity * horizon))

    def refill_at(self, target: int, running_for: float = 0.0) -> int:
        """Refill when no more than this many rows are buffered.

        Half the target, or more if a claim takes long enough that the
        threads would run through the rest of the buffer meanwhile.
        """
        if target <= 0:
            return 0
        with self._lock:
            claim = self._claim or 0.0
        during_claim = self.capacity(running_for) * claim * REFILL_MARGIN
        return min(target, max(target // 2, math.ceil(during_claim)))


def _average(current: float | None, sample: float) -> float:
    if not math.isfinite(sample) or sample < 0:
        return current if current is not None else 0.0
    if current is None:
        return sample
    return current + SMOOTHING * (sample - current)
