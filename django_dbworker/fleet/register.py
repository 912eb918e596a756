"""What operators read of the register (the admin's Workers page, ``dbworker_stats``),
and the one DELETE that forgets dead processes' rows.

A row counts as a live worker only while its heartbeat is younger than
``STALE_AFTER`` (database clock): a process killed with SIGKILL leaves its
row until a stale-recovery pass deletes it (``forget_stale``), and never
shows meanwhile. Two reads: the live rows, and one grouped count of the
claimed rows (few: they are what the workers hold now) matched to their
workers by the ``host:pid:`` prefix of ``claimed_by``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count
from django.db.models.functions import Now

from django_dbworker.conf import dbworker_settings
from django_dbworker.db import operations
from django_dbworker.fleet.models import LiveWorker
from django_dbworker.models import Status, WorkItem
from django_dbworker.routing import work_db_for_read

#: Seconds ``forget_stale`` waits for a row lock before it gives up (the next pass tries again).
FORGET_LOCK_WAIT = 1.0


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker as operators see it."""

    name: str
    host: str
    pid: int | None
    #: The queues it claims from; None: every queue.
    queues: list[str] | None
    handlers: list[str]
    concurrency: int
    #: Its claimed rows now: running, or claimed ahead to start soon.
    claimed: int
    #: Seconds since its heartbeat thread last wrote the row (database clock).
    heartbeat_age: float
    started_at: datetime
    version: str


def process_of(claimed_by: str) -> str:
    """The ``host:pid`` of a ``claimed_by`` (``host:pid:thread``; a host name has no colon)."""
    return ":".join(claimed_by.split(":", 2)[:2])


def live_workers(using: str | None = None, stale_after: float | None = None) -> list[WorkerInfo]:
    """The workers whose heartbeat is younger than ``stale_after`` (STALE_AFTER), by name."""
    db = work_db_for_read(using)
    seconds = float(dbworker_settings.STALE_AFTER if stale_after is None else stale_after)
    rows = list(
        LiveWorker.objects.using(db)
        .filter(heartbeat_at__gte=Now() - timedelta(seconds=seconds))
        .annotate(db_now=Now())
        .order_by("name")
    )
    if not rows:
        return []
    claimed: Counter[str] = Counter()
    by_claimant = (
        WorkItem.objects.using(db)
        .filter(status=Status.CLAIMED)
        .order_by()
        .values_list("claimed_by")
        .annotate(n=Count("pk"))
    )
    for claimed_by, n in by_claimant:
        claimed[process_of(claimed_by or "")] += n
    return [
        WorkerInfo(
            name=row.name,
            host=row.host,
            pid=row.pid,
            queues=list(row.queues) if row.queues is not None else None,
            handlers=list(row.handlers or []),
            concurrency=row.concurrency,
            claimed=claimed[row.name],
            heartbeat_age=max(0.0, (row.db_now - row.heartbeat_at).total_seconds()),
            started_at=row.started_at,
            version=row.version,
        )
        for row in rows
    ]


def forget_stale(using: str, stale_after: float) -> int:
    """Delete the rows of processes whose heartbeat is older than ``stale_after``: one DELETE.

    For the stale-recovery pass. A live worker whose row went (its heartbeat
    thread was held up for longer) writes it again at its next heartbeat.
    """
    stale = LiveWorker.objects.using(using).filter(
        heartbeat_at__lt=Now() - timedelta(seconds=stale_after)
    )
    with operations(using).bounded_lock_wait(FORGET_LOCK_WAIT):
        # _raw_delete: one statement whatever delete signals a project connects
        # (QuerySet.delete() would read the rows first for them).
        return stale._raw_delete(using)
