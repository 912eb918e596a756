"""Handler threads abandoned after a timeout: counted, exposed, and capped.

Python cannot stop a thread, so a handler that overruns its ``timeout`` keeps
running after its attempt was recorded as timed out (and may hold a
database connection). Each such thread is counted here until it ends; the
worker stops claiming once the count reaches its cap, so a handler that
hangs forever cannot pile up threads and connections without bound.
"""

from __future__ import annotations

import threading

from django_dbworker.metrics import WorkerMetrics


class AbandonedThreads:
    """How many abandoned handler threads of this process are still running."""

    def __init__(self, metrics: WorkerMetrics | None = None) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._metrics = metrics

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def track(self) -> tuple[threading.Event, threading.Event]:
        """Events for one guarded run: ``(finished, abandoned)``.

        The runner sets ``finished`` when it ends (via ``finish``); the
        caller that stops waiting calls ``abandon``. Whichever comes second
        settles the count, so a run that ends just as it is abandoned is
        counted in and out exactly once.
        """
        return threading.Event(), threading.Event()

    def abandon(self, finished: threading.Event, abandoned: threading.Event) -> bool:
        """Count the run as abandoned unless it already finished; True if counted."""
        with self._lock:
            if finished.is_set():
                return False
            abandoned.set()
            self._count += 1
            self._publish()
            return True

    def finish(self, finished: threading.Event, abandoned: threading.Event) -> bool:
        """Called by the runner as it ends: counts it out; True if it was abandoned."""
        with self._lock:
            finished.set()
            if not abandoned.is_set():
                return False
            self._count -= 1
            self._publish()
            return True

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.abandoned_threads(self._count)
