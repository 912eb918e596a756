"""When the claim loop runs the stale-recovery pass, and what it tells afterwards.

The pass itself (one fenced statement per batch) is ``transitions.recover_stale``;
this module decides *when*: at a bounded, jittered rate, and never while
this process's own writes are held up (a heartbeat that could not be
written is not a sign of a dead worker). Rows the pass failed for good
are handed to ``Settler.settle_recovered`` for their handlers' hooks.
After each pass, one DELETE forgets the register rows of worker processes
whose heartbeat is as old (``fleet.register.forget_stale``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from django.db import connections

from django_dbworker import transitions
from django_dbworker.db import operations
from django_dbworker.fleet.register import forget_stale
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.metrics import WORK_ITEM_LOOP, WorkerMetrics
from django_dbworker.models import WorkItem
from django_dbworker.worker.clock import Clock
from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.connections import report_error
from django_dbworker.worker.settle import Settler, listens

logger = logging.getLogger("django_dbworker.worker")


class _RecoveryWaited(Exception):
    """Rolls back a recovery pass that waited for the database."""


class Recovery:
    def __init__(
        self,
        *,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        settler: Settler,
        clock: Clock,
        handlers: Callable[[], dict[str, WorkItemHandler]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.settler = settler
        self.clock = clock
        self.handlers = handlers
        self._next = -math.inf
        #: When one of this process's writes (claim, heartbeat) last waited
        #: longer than HEARTBEAT_INTERVAL.
        self._slow_write_at = -math.inf
        self._deferred_since: float | None = None
        #: Whether the last DELETE of dead workers' register rows failed (said once).
        self._forget_failed = False

    def interval(self) -> float:
        # Often enough to notice a crash soon after STALE_AFTER, rarely
        # enough that many workers add little load; jitter de-synchronises them.
        base = max(0.5, min(self.config.stale_after / 4.0, 60.0))
        return base * self.clock.jitter(0.8, 1.2)

    def observe_write(self, seconds: float) -> None:
        """How long one of this process's writes waited (``inf``: it failed)."""
        if seconds > self.config.heartbeat_interval:
            self._slow_write_at = self.clock.now()

    def maybe_recover(self) -> None:
        """Run the stale-recovery pass if it is due, unless heartbeats may be held up.

        On SQLite every write waits while any transaction holds the database
        write lock (a long atomic handler, in any process): no heartbeat gets
        through, and the first pass after the lock is released would take
        live rows for crashed ones. So the pass is put off while this
        process's own writes are waiting, and rolled back if it had to wait
        itself; a pass put off for longer than STALE_AFTER runs regardless,
        so recovery is delayed, never lost.
        """
        cfg = self.config
        now = self.clock.now()
        if now < self._next:
            return
        self._next = now + self.interval()
        overdue = self._deferred_since is not None and now - self._deferred_since > cfg.stale_after
        if not overdue and now - self._slow_write_at < 2 * cfg.heartbeat_interval:
            self._defer(now, "this worker's own writes were waiting")
            return
        started = self.clock.now()
        handlers = self.handlers()
        # Inside a caller's transaction (run_until_empty in a test) a pass that waited
        # cannot be rolled back alone: its transaction is the caller's, and an error
        # leaving it would break it for the claim that follows. Nothing there waits
        # on this pass (an inline worker has no heartbeat thread), so it keeps it.
        may_put_off = not overdue and not connections[cfg.using].in_atomic_block
        try:
            # At READ COMMITTED (ending_transaction): the endings it settles read
            # after their locks what the locks' previous holders committed.
            with operations(cfg.using).ending_transaction():
                recovered = transitions.recover_stale(
                    handlers=list(handlers),
                    stale_after=cfg.stale_after,
                    using=cfg.using,
                    log=False,  # said once committed
                )
                if may_put_off and self.clock.now() - started > cfg.heartbeat_interval:
                    raise _RecoveryWaited
        except _RecoveryWaited:
            self._defer(now, "the recovery pass itself had to wait")
            return
        except Exception as exc:
            # Recovery is best effort per pass; claiming must go on.
            self.observe_write(math.inf)
            if not report_error(self.config.using, "stale recovery", exc):
                logger.warning("Stale recovery failed (%s); trying again later.", exc)
            return
        self._deferred_since = None
        recovered.log()
        self.metrics.recover_took(WORK_ITEM_LOOP, self.clock.now() - started)
        for name, count in recovered.by_handler.items():
            self.metrics.recovered(name, count)
        self._tell_failures(handlers, recovered.failed_rows)
        self._forget_dead_workers()

    def _forget_dead_workers(self) -> None:
        """Delete the register rows of processes that died (no row of a live one: its
        heartbeat is younger than STALE_AFTER, or it writes the row again)."""
        try:
            forget_stale(self.config.using, self.config.stale_after)
        except Exception as exc:
            if not report_error(self.config.using, "forgetting dead workers", exc):
                log = logger.debug if self._forget_failed else logger.warning
                log("Could not delete dead workers' rows of the Workers page (%s).", exc)
            self._forget_failed = True
        else:
            self._forget_failed = False

    def _tell_failures(
        self, handlers: dict[str, WorkItemHandler], rows: list[tuple[int, str]]
    ) -> None:
        """The hooks of rows this pass failed, for the handlers that listen."""
        wanted = [pk for pk, name in rows if name in handlers and listens(handlers[name])]
        if not wanted:
            return
        try:
            items = list(WorkItem.objects.using(self.config.using).filter(pk__in=wanted))
        except Exception as exc:
            logger.warning("Could not read the rows stale recovery failed: %s", exc)
            return
        for item in items:
            self.settler.settle_recovered(handlers[item.handler], item)

    def _defer(self, now: float, why: str) -> None:
        if self._deferred_since is None:
            self._deferred_since = now
        logger.debug("Stale recovery put off: %s, so heartbeats may be held up too.", why)
