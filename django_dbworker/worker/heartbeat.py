"""One thread per process that heartbeats every in-flight attempt in one UPDATE.

The thread must not die: a worker without heartbeats keeps running jobs
that other workers then recover as stale and run again. So every error is
logged, backed off and retried (a failover's read-only window, a trigger, a
bug in a callback alike). What cannot be caught (a ``BaseException``) ends
the thread, and the worker's watchdog then stops the process.

It also keeps this process's row of the register of live workers fresh
(``presence.py``), after the items' heartbeat and as a step of its own: that
write never raises and waits for a lock only briefly, so it can neither stop
nor hold up the items' heartbeats.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Collection

from django_dbworker import transitions
from django_dbworker.transitions import AttemptKey
from django_dbworker.worker.clock import SYSTEM_CLOCK, Clock
from django_dbworker.worker.connections import Backoff, run_until_stopped
from django_dbworker.worker.presence import Presence

logger = logging.getLogger("django_dbworker.worker")

#: Seconds a stopping worker waits for this thread before it deletes the register row
#: (a write still under way could put it back); past that the row ages out instead.
LEAVE_WAIT = 2.0


class Heartbeat(threading.Thread):
    """Keeps claims alive; tells the owner which attempts were lost.

    ``snapshot`` returns the attempts to keep alive; ``on_lost`` receives
    those whose token is gone from the row (recovered as stale and possibly
    re-claimed elsewhere), which are then no longer heartbeated; ``on_held``
    those still held, with the clock's time taken before the snapshot
    (their rows' heartbeat_at is no older than that); ``on_cancel_requested``
    those of them whose rows an operator asked to stop (the same statement
    answers it). ``presence``: this process's register row, written after
    each beat (and at once when the thread starts).
    """

    def __init__(
        self,
        *,
        interval: float,
        snapshot: Callable[[], Collection[AttemptKey]],
        on_lost: Callable[[set[AttemptKey]], None],
        using: str,
        on_held: Callable[[set[AttemptKey], float], None] | None = None,
        on_cancel_requested: Callable[[set[AttemptKey]], None] | None = None,
        observe: Callable[[float], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        presence: Presence | None = None,
    ) -> None:
        super().__init__(name="dbworker-heartbeat", daemon=True)
        self.interval = interval
        self.snapshot = snapshot
        self.on_lost = on_lost
        self.on_held = on_held
        self.on_cancel_requested = on_cancel_requested
        self.using = using
        self.observe = observe
        self.clock = clock
        self.presence = presence
        self.stopped = threading.Event()

    def run(self) -> None:
        run_until_stopped(
            self._step,
            stopped=self.stopped,
            # With a register row to write, the first step runs at once (nothing is
            # claimed yet: the items' part is free), so the worker shows from its start.
            first_delay=0.0 if self.presence is not None else self.interval,
            backoff=Backoff(first=min(0.1, self.interval), cap=self.interval),
            what="Heartbeat",
            using=self.using,
            on_error=lambda: self._observe(math.inf),
            wait=self.clock.wait,
        )

    def _step(self) -> float:
        started = self.clock.now()
        self.beat()
        self._observe(self.clock.now() - started)
        if self.presence is not None:
            self.presence.beat()  # never raises
        return self.interval

    def beat(self) -> None:
        # Taken before the snapshot: every row held gets a heartbeat_at later than this.
        taken = self.clock.now()
        claims = set(self.snapshot())
        if not claims:
            return
        held, asked = transitions.beat(claims, using=self.using)
        lost = claims - held
        if lost:
            self.on_lost(lost)
        if self.on_held is not None and held:
            self.on_held(held, taken)
        if self.on_cancel_requested is not None and asked:
            self.on_cancel_requested(asked)

    def _observe(self, seconds: float) -> None:
        if self.observe is not None:
            self.observe(seconds)

    def stop(self) -> None:
        """Stop beating; then (a clean stop) delete the register row, once this thread ended."""
        self.stopped.set()
        if self.presence is None or self.ident is None:  # never started: no row
            return
        self.join(LEAVE_WAIT)
        if self.is_alive():
            logger.warning(
                "The heartbeat thread is still writing; this worker's row of the Workers "
                "page disappears after STALE_AFTER instead of now."
            )
            return
        self.presence.leave()
