"""Retention by default: the workers delete old finished rows themselves, hourly.

Without it every install's table grows forever (``dbworker_prune`` exists,
but nobody schedules a command they have not read about). ``PruneFinished``
is a ``PeriodicHandler`` like any other, so its runs are taken once per
slot in the whole cluster (``PeriodicSchedule``), show on the Schedules
page, and are ordinary work items with a result that says what they
deleted. It runs on the workers that serve its queue (``default``); with
``DBWORKER["RETENTION"] = None`` it is not scheduled at all.

Deleting goes through ``pruning.prune``: batches by primary key, each
its own short transaction, finished rows only (never pending or claimed),
so a run over millions of rows never holds a lock for long.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django_dbworker import validation
from django_dbworker.conf import dbworker_settings
from django_dbworker.metrics import default_metrics
from django_dbworker.periodic import PeriodicHandler
from django_dbworker.pruning import prune
from django_dbworker.routing import work_db_for_write

if TYPE_CHECKING:
    from django_dbworker.models import WorkItem

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
