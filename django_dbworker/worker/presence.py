"""This process's row in the register of live workers (``fleet``), kept by the heartbeat.

The heartbeat thread writes it after each heartbeat of the items, as a
step of its own: the write waits for a row lock at most ``LOCK_WAIT``
seconds, and its errors are logged once (then retried quietly at every
heartbeat) and never raised, so a register that cannot be written never
holds up or stops the heartbeats of the items. The row is for operators:
nothing that claims or recovers items reads it. A clean stop deletes it
(``leave``); a killed process's row ages out (``fleet.register``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import connections, transaction
from django.db.models.functions import Now

from django_dbworker.db import operations
from django_dbworker.fleet.models import LiveWorker
from django_dbworker.version import __version__
from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.connections import close_quietly, report_error
from django_dbworker.worker.identity import process_id

logger = logging.getLogger("django_dbworker.worker")

#: Most seconds a write of the row waits for a lock (never longer than a heartbeat interval).
LOCK_WAIT = 1.0


class Presence:
    """Writes (``beat``) and deletes (``leave``) the ``LiveWorker`` row named ``name``."""

    def __init__(
        self,
        *,
        name: str,
        using: str,
        queues: Sequence[str] | None,
        concurrency: int,
        handlers: Callable[[], Iterable[str]],
        lock_wait: float = LOCK_WAIT,
    ) -> None:
        self.name = name
        self.using = using
        self.queues = list(queues) if queues else None
        self.concurrency = concurrency
        self.handlers = handlers
        self.lock_wait = lock_wait
        #: The handler names the row holds; None until it is written.
        self._written: list[str] | None = None
        self._started_at: datetime | None = None
        self._failing = False

    @classmethod
    def of(cls, config: WorkerConfig, handlers: Callable[[], Iterable[str]]) -> Presence:
        """This process's row (``host:pid``) for a worker of ``config``."""
        return cls(
            name=process_id(),
            using=config.using,
            queues=config.queues,
            concurrency=config.concurrency,
            handlers=handlers,
            lock_wait=min(LOCK_WAIT, config.heartbeat_interval),
        )

    def beat(self) -> None:
        """Write the row; never raises. A failure is logged once until a write succeeds."""
        try:
            self.write()
        except Exception as exc:
            self._failed(exc)
        else:
            if self._failing:
                self._failing = False
                logger.info("This worker's row of the Workers page is written again.")

    def write(self) -> None:
        """Refresh ``heartbeat_at`` (and the handlers, when more were added); insert if gone."""
        handlers = sorted(set(self.handlers()))
        rows = LiveWorker.objects.using(self.using).filter(pk=self.name)
        with operations(self.using).bounded_lock_wait(self.lock_wait):
            if self._written is not None:
                changes: dict[str, Any] = {"heartbeat_at": Now()}
                if handlers != self._written:
                    changes["handlers"] = handlers
                if rows.update(**changes):
                    self._written = handlers
                    return
            # First write, or the row went (a stale-recovery pass deleted it while this
            # heartbeat was held up): a row of a process that had this host and pid
            # before (a restarted container's pid 1) is replaced, not added to.
            with transaction.atomic(using=self.using):
                rows._raw_delete(self.using)
                row = LiveWorker(
                    name=self.name,
                    queues=self.queues,
                    handlers=handlers,
                    concurrency=self.concurrency,
                    version=__version__,
                )
                if self._started_at is not None:
                    row.started_at = self._started_at
                row.save(using=self.using, force_insert=True)
            if self._started_at is None:
                self._started_at = rows.values_list("started_at", flat=True).first()
            self._written = handlers

    def leave(self) -> None:
        """Delete the row (a clean stop); a failure is logged, and the row ages out."""
        try:
            with operations(self.using).bounded_lock_wait(self.lock_wait):
                LiveWorker.objects.using(self.using).filter(pk=self.name)._raw_delete(self.using)
        except Exception as exc:
            logger.warning(
                "Could not delete this worker's row of the Workers page (%s); it disappears "
                "from the page after STALE_AFTER.",
                _first_line(exc),
            )

    def _failed(self, exc: Exception) -> None:
        if not report_error(self.using, "writing the workers register", exc):
            if self._failing:
                logger.debug("Writing this worker's row of the Workers page failed again: %s", exc)
            else:
                logger.warning(
                    "Could not write this worker's row of the Workers page (%s: %s); its "
                    "items' heartbeats go on, and the write is retried at every heartbeat.",
                    type(exc).__name__,
                    _first_line(exc),
                )
        self._failing = True
        # A connection the error left unusable is dropped, so the items' next beat
        # opens a new one instead of failing on it.
        conn = connections[self.using]
        try:
            broken = conn.connection is not None and not conn.is_usable()
        except Exception:
            broken = True
        if broken and not conn.in_atomic_block:
            close_quietly(self.using)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
