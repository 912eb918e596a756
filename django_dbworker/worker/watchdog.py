"""The watchdog: stop the process when it can no longer keep its promises.

Without heartbeats every job longer than STALE_AFTER would run twice;
without the writer no success would be recorded; without the scheduler
no periodic slot would be taken; past the cap of abandoned threads, hung
handlers would pile up threads and connections. A supervisor restarting
the process is the cure: the worker stops claiming, drains like on
SIGTERM, and ``run_workers`` exits non-zero. Every helper thread a worker
starts (its watchers included) is registered here.
"""

from __future__ import annotations

import logging
import threading
import time

from django_dbworker.worker.abandoned import AbandonedThreads
from django_dbworker.worker.control import Control

logger = logging.getLogger("django_dbworker.worker")

#: Seconds a look at the watched threads holds: every job start asks, and a
#: look at every thread costs a lock each; a death is acted on within this time.
CHECK_EVERY = 0.05


class Watchdog:
    def __init__(self, *, control: Control, abandoned: AbandonedThreads, cap: int) -> None:
        self.control = control
        self.abandoned = abandoned
        self.cap = cap
        self._threads: list[tuple[str, threading.Thread, bool]] = []
        #: Why the process stopped itself, or None; exit non-zero if set.
        self.unhealthy: str | None = None
        self._healthy_until = 0.0

    def watch(self, what: str, thread: threading.Thread, *, ends_on_stop: bool = False) -> None:
        """``thread`` must stay alive while the worker runs; ``what`` names it in the log.

        ``ends_on_stop``: the thread ends by itself once the worker stops
        claiming (the watchers), which is then no sign of trouble.
        """
        self._threads.append((what, thread, ends_on_stop))

    def healthy(self) -> bool:
        """``check()``, reusing the watched threads' liveness of the last ``CHECK_EVERY`` s.

        What pool threads ask before each job starts; the claim loop asks
        ``check()`` itself before every claim. The cap of abandoned threads
        is read every time (a counter under a lock): the next overrunning
        handler must not start in the window.
        """
        if (
            self.unhealthy is None
            and time.monotonic() < self._healthy_until
            and self.abandoned.count < self.cap
        ):
            return True
        return self.check()

    def check(self) -> bool:
        """False (and the worker stopping) if a watched thread died or the cap is reached."""
        reason = None
        stopping = self.control.stopping.is_set()
        for what, thread, ends_on_stop in self._threads:
            if not thread.is_alive() and not (ends_on_stop and stopping):
                reason = f"the {what} thread died"
                break
        if reason is None and self.abandoned.count >= self.cap:
            reason = (
                f"{self.abandoned.count} handler thread(s) that overran their timeout are still "
                f"running (abandoned threads), the cap is {self.cap} (MAX_ABANDONED_THREADS)"
            )
        if reason is None:
            self._healthy_until = time.monotonic() + CHECK_EVERY
            return True
        self.control.draining.set()
        if self.unhealthy is None:
            self.unhealthy = reason
            logger.critical(
                "Stopping this worker: %s. It finishes or releases its running items and "
                "exits non-zero so that a supervisor restarts it.",
                reason,
            )
        self.control.stopping.set()
        self.control.wake.set()
        return False
