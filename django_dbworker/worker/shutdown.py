"""Stopping: drain running items, hand back the rest, never release a finished one.

On a stop the buffered rows that never started go back to pending at once
(other workers can run them meanwhile); running items get up to
SHUTDOWN_TIMEOUT; finished handlers' outcomes are written (with a grace
period while the database is briefly away); what is left is handed back
with one fenced release, so a row whose outcome did land is not touched.
"Release" is the one verb for handing a row back to pending here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from django_dbworker import transitions
from django_dbworker.worker.attempts import Attempt, Ledger
from django_dbworker.worker.clock import Clock
from django_dbworker.worker.config import RECORD_GRACE, WorkerConfig
from django_dbworker.worker.connections import persist
from django_dbworker.worker.control import Control
from django_dbworker.worker.event_loop import EventLoop
from django_dbworker.worker.handler_loop import HandlerLoop
from django_dbworker.worker.pool import Pool
from django_dbworker.worker.success_writer import SuccessWriter

logger = logging.getLogger("django_dbworker.worker")

#: Seconds a release keeps retrying the database.
RELEASE_PATIENCE = 5.0


class Shutdown:
    def __init__(
        self,
        *,
        config: WorkerConfig,
        control: Control,
        ledger: Ledger,
        clock: Clock,
        aio: EventLoop | None = None,
    ) -> None:
        self.config = config
        #: The event loop of async handlers (None inline): drained, cancelled, closed.
        self.aio = aio
        self.control = control
        self.ledger = ledger
        self.clock = clock
        #: Rows handed back to pending at shutdown.
        self.released = 0

    def release(self, attempts: Sequence[Attempt], what: str) -> int:
        """Hand ``attempts``' rows back to pending (fenced), retrying the database for 5 s."""
        items = [a.item for a in attempts]
        return persist(
            lambda: transitions.release(items, using=self.config.using),
            what=what,
            using=self.config.using,
            give_up=_deadline_event(RELEASE_PATIENCE),
        )

    def drain(
        self,
        *,
        pool: Pool | None,
        writer: SuccessWriter | None,
        loops: Sequence[HandlerLoop],
    ) -> None:
        """Give running items up to SHUTDOWN_TIMEOUT (or until a second signal).

        Async handlers' coroutines still running then on the event loop
        (``aio``) are cancelled, and have ended, before their rows are
        released; the loop is closed.
        """
        cfg, control, clock = self.config, self.control, self.clock
        if control.draining.is_set():
            self.release_buffered()
        aio = self.aio
        if aio is not None:
            aio.stop_starting()
        busy = (
            (pool.running() if pool is not None else 0)
            + (aio.running() if aio is not None else 0)
            + sum(loop.pool.busy() for loop in loops)
        )
        if busy:
            logger.info(
                "Stopping: waiting up to %.0fs for %d running item(s).", cfg.shutdown_timeout, busy
            )
        deadline = clock.now() + cfg.shutdown_timeout
        if pool is not None:
            pool.wait_idle(cfg.shutdown_timeout, abort=control.aborting)
        if aio is not None:
            if not aio.wait_idle(max(0.0, deadline - clock.now()), control.aborting):
                aio.cancel_all()
            aio.close()
        if writer is not None:
            writer.close()  # successes handed over are written now
        # A finished handler's outcome is recorded, never released: releasing
        # it would run a finished job again. Its write may be waiting for the
        # database (a failover's read-only window), so it gets a grace period
        # past the deadline; a second signal stops waiting at once.
        grace_end = max(deadline, clock.now()) + RECORD_GRACE
        while not control.aborting.is_set() and clock.now() < grace_end:
            writing = writer is not None and writer.is_alive()
            if not writing and not self.ledger.any_recording():
                break
            if writer is not None and writing:
                # Returns the moment the writer's last batch is written
                # (a burst run's exit waits on nothing else).
                writer.join(0.05)
            else:
                clock.wait(control.aborting, 0.01)
        for loop in loops:
            loop.drain(max(0.0, deadline - clock.now()), control.aborting)
        leftovers = self.ledger.withdraw_leftovers(everything=control.aborting.is_set())
        if leftovers:
            released = self.release(leftovers, "releasing unfinished work items")
            self.released += released
            logger.warning("Released %d unfinished work item(s) back to pending.", released)

    def release_buffered(self) -> None:
        """Hand back the buffered rows that never started, at once.

        Other workers can run them while this one waits for its running items.
        """
        unstarted = self.ledger.withdraw_unstarted()
        if not unstarted:
            return
        try:
            released = self.release(unstarted, "releasing buffered work items")
        except Exception as exc:
            # Still in flight (heartbeated): the release at the end tries again.
            logger.warning("Could not release buffered work items yet (%s).", exc)
            return
        self.released += released
        for attempt in unstarted:
            self.ledger.retire(attempt)
        logger.info("Released %d buffered work item(s) that had not started.", released)


def _deadline_event(seconds: float) -> threading.Event:
    """An event that sets itself after ``seconds``: a bound for ``persist``."""
    event = threading.Event()
    timer = threading.Timer(seconds, event.set)
    timer.daemon = True
    timer.start()
    return event
