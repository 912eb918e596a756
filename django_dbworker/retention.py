"""Retention: deleting old finished rows, by hand (``dbworker_prune``) or hourly by default.

``prune`` deletes finished rows: work items, the links of their dependents,
completed batches. Batched by primary key, so that no single statement locks
or logs millions of rows; pending and claimed rows are never touched. A batch
row goes once it is complete, older than the cut-off and none of its items is
left (the admin's progress of a batch reads its items); the ``Dependency`` rows
of deleted items go with them in the same transaction, so the links table
never outgrows the work table.

Without it every install's table grows forever (``dbworker_prune`` exists,
but nobody schedules a command they have not read about). ``PruneFinished``
is a ``PeriodicHandler`` like any other, so its runs are taken once per
slot in the whole cluster (``PeriodicSchedule``), show on the Schedules
page, and are ordinary work items with a result that says what they
deleted. It runs on the workers that serve its queue (``default``); with
``DBWORKER["RETENTION"] = None`` it is not scheduled at all.

Deleting goes through ``prune``: batches by primary key, each its own
short transaction, finished rows only (never pending or claimed), so a run
over millions of rows never holds a lock for long.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now

from django_dbworker import validation
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.conf import dbworker_settings
from django_dbworker.metrics import default_metrics
from django_dbworker.models import FINISHED_STATUSES, WorkItem
from django_dbworker.periodic.handler import PeriodicHandler
from django_dbworker.routing import work_db_for_write

logger = logging.getLogger("django_dbworker.retention")

#: The database of the run's own work item, while it runs (this thread's).
_running_on: ContextVar[str | None] = ContextVar("dbworker_retention_db", default=None)

#: Rows deleted per statement (and per transaction).
BATCH_SIZE = 1000


def retention_ages() -> dict[str, float | None] | None:
    """Seconds to keep each finished status (None: keep), or None when retention is off."""
    return validation.retention(dbworker_settings.RETENTION)


class PruneFinished(PeriodicHandler):
    """Deletes finished rows older than ``DBWORKER["RETENTION"]`` says, once an hour."""

    name = "dbworker.retention"
    every = 3600.0
    # A run that fails (the database went away) is taken again by the next slot.
    max_attempts = 1

    @classmethod
    def scheduled(cls) -> bool:
        ages = retention_ages()
        return ages is not None and any(age is not None for age in ages.values())

    def handle_item(self, item: WorkItem) -> Any:
        # Prune the table this run's item came from: a worker started with
        # --database runs it there, whatever the routers say.
        token = _running_on.set(item._state.db)
        try:
            return super().handle_item(item)
        finally:
            _running_on.reset(token)

    def run(self) -> dict[str, Any]:
        ages = retention_ages() or {}
        using = work_db_for_write(_running_on.get())
        deleted: dict[str, int] = {}
        for status, age in ages.items():
            if age is None:
                continue
            count = prune(
                older_than=timedelta(seconds=age),
                statuses=[status],
                batch_size=BATCH_SIZE,
                using=using,
            )
            deleted[status] = count
            default_metrics().pruned_rows(status, count)
        if any(deleted.values()):
            logger.info(
                "Retention deleted %s finished work item(s): %s.",
                sum(deleted.values()),
                ", ".join(f"{n} {status}" for status, n in deleted.items() if n),
            )
        return {"deleted": deleted}


def prune(
    *,
    older_than: timedelta,
    statuses: Sequence[str],
    batch_size: int = 1000,
    using: str | None = None,
    queues: Sequence[str] | None = None,
    dry_run: bool = False,
) -> int:
    """Delete finished rows whose ``finished_at`` is older than ``older_than`` (DB clock).

    Batched so that no single statement locks or logs millions of rows;
    pending and claimed rows are never touched, whatever ``statuses`` says,
    nor the items of a batch that is still open (its callback counts them
    when its last item ends, however long that takes). ``queues`` narrows it
    to those queues; ``dry_run`` counts the rows it would delete and deletes
    none.
    """
    using = work_db_for_write(using)  # the deletes and their transactions: one alias
    allowed = [s for s in statuses if s in FINISHED_STATUSES]
    # An open batch's finished items stay: its callback counts them. A subquery on the
    # batches, not a join: a DELETE that joins is Django's ``id IN (SELECT ...)`` of its
    # own table, which PostgreSQL evaluates in the snapshot taken before the lock wait
    # (the re-check below would read the row as it was chosen).
    settled = Q(batch__isnull=True) | Q(
        batch_id__in=Batch.objects.using(using).filter(completed_at__isnull=False).values("pk")
    )
    base = WorkItem.objects.using(using).filter(
        settled,
        status__in=allowed,
        finished_at__lt=Now() - older_than,
    )
    if queues is not None:
        base = base.filter(queue__in=list(queues))
    if dry_run:
        return base.count()
    deleted = 0
    todo = base
    while True:
        # After the last id chosen: the rows deleted before stay in the index as
        # dead entries until VACUUM, and a choice from the start walked them all
        # again (a batch's choice 38 ms against its DELETE's 5 ms, 3.7 million
        # rows into a prune of 10 million, docs/scale.md). A row that becomes
        # eligible behind us waits for the next prune.
        ids = list(todo.order_by("pk").values_list("pk", flat=True)[:batch_size])
        if not ids:
            _prune_batches(older_than, using)
            return deleted
        with transaction.atomic(using=using):
            # Both conditions again: a row retried and ended anew since it was
            # chosen is no longer old (its DELETE waited for its lock).
            count, _ = (
                WorkItem.objects.using(using)
                .filter(
                    settled,
                    pk__in=ids,
                    status__in=allowed,
                    finished_at__lt=Now() - older_than,
                )
                .delete()
            )
            # Only the links of rows deleted here: one retried meanwhile stays, linked.
            kept = set(
                WorkItem.objects.using(using).filter(pk__in=ids).values_list("pk", flat=True)
            )
            gone = [pk for pk in ids if pk not in kept]
            links = Q(child_id__in=gone) | Q(parent_id__in=gone)
            Dependency.objects.using(using).filter(links).delete()
        deleted += count
        todo = base.filter(pk__gt=ids[-1])


def _prune_batches(older_than: timedelta, using: str | None) -> None:
    """Delete the batches completed before the cut-off whose items are all gone."""
    items = WorkItem.objects.using(using).filter(batch_id=OuterRef("pk"))
    old = Batch.objects.using(using).filter(
        completed_at__isnull=False, completed_at__lt=Now() - older_than
    )
    while True:
        ids = list(old.exclude(Exists(items)).order_by("pk").values_list("pk", flat=True)[:1000])
        if not ids:
            return
        Batch.objects.using(using).filter(pk__in=ids).delete()
