"""Aggregates over the work table: counts by queue and status, queue lag, orphans.

Live rows (pending, claimed) and failed rows are always counted exactly:
they are what operators act on, and the status index keeps those counts
cheap. Finished rows (succeeded, cancelled) can be millions; on a large
PostgreSQL table they are estimated from the planner's statistics instead
of counted, and marked as estimates. Ages use the database clock. Reads go
to the routers' read alias unless ``using`` says otherwise (``routing.py``).
"""

from __future__ import annotations

from typing import Any, TypedDict

from django.db.models import Count, Min
from django.db.models.functions import Now

from django_dbworker.db import operations
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import Status, WorkItem, live_or_failed
from django_dbworker.registry import registry
from django_dbworker.routing import work_db_for_read

#: Below this many rows (planner estimate) everything is counted exactly.
EXACT_BELOW = 200_000
ESTIMATED_STATUSES = (Status.SUCCEEDED, Status.CANCELLED)


class QueueStats(TypedDict):
    counts: dict[str, int]
    #: Statuses whose count is a planner estimate.
    estimated: set[str]
    oldest_pending_age: float | None


def status_columns(stats: dict[str, QueueStats]) -> list[str]:
    """The statuses to show: the known ones in life-cycle order, then any others found.

    A row may carry a status this version does not know (written by a newer
    version, or by hand); it is shown under its own name, not dropped.
    """
    known = [s.value for s in Status]
    found = {status for entry in stats.values() for status in entry["counts"]}
    return known + sorted(found - set(known))


def queue_stats(using: str | None = None) -> dict[str, QueueStats]:
    """``{queue: {"counts": {status: n}, "estimated": {...}, "oldest_pending_age": s}}``."""
    db = work_db_for_read(using)
    estimate = operations(db).table_estimate(["queue", "status"])
    approximate = estimate is not None and estimate.rows >= EXACT_BELOW
    stats: dict[str, QueueStats] = {}

    def entry(queue: str) -> QueueStats:
        return stats.setdefault(
            queue, {"counts": {}, "estimated": set(), "oldest_pending_age": None}
        )

    rows = WorkItem.objects.using(db).order_by()
    if approximate:
        rows = rows.filter(live_or_failed())
    for row in rows.values("queue", "status").annotate(n=Count("id")):
        entry(row["queue"])["counts"][row["status"]] = row["n"]
    if approximate:
        assert estimate is not None
        queue_col, status_col = estimate.columns["queue"], estimate.columns["status"]
        queues = set(stats) | set(queue_col.frequencies)
        for queue in queues:
            for status in ESTIMATED_STATUSES:
                guess = estimate.rows * queue_col.frequency(queue) * status_col.frequency(status)
                if guess >= 0.5:
                    item = entry(queue)
                    item["counts"][status.value] = round(guess)
                    item["estimated"].add(status.value)
    lag: Any = (
        WorkItem.objects.using(db)
        .ready()
        .order_by()
        .values("queue")
        .annotate(oldest=Min("run_after"), now=Now())
    )
    for row in lag:
        entry(row["queue"])["oldest_pending_age"] = max(
            0.0, (row["now"] - row["oldest"]).total_seconds()
        )
    return stats


class OrphanedHandler(TypedDict):
    handler: str
    pending: int
    #: Seconds since the oldest of these rows was enqueued (database clock).
    oldest_age: float


def orphaned_handlers(using: str | None = None) -> list[OrphanedHandler]:
    """Handler names with pending rows that no WorkItemHandler here registers, by name.

    Nothing runs such rows: the handler was renamed or removed, or its
    ``workers`` module is not installed in this process. They would wait
    forever without a sign, so the stats and the admin list them. Only this
    process's registry is known; a name registered only in the workers'
    deployment shows up here too, and is worth fixing anyway (the admin
    cannot tell whether its payloads are sensitive). One query over the
    pending rows, grouped by handler; not-yet-due rows count too.
    """
    runnable = [name for name, cls in registry.items() if issubclass(cls, WorkItemHandler)]
    rows: Any = (
        WorkItem.objects.using(work_db_for_read(using))
        .pending()
        .exclude(handler__in=runnable)
        .order_by()
        .values("handler")
        .annotate(n=Count("id"), oldest=Min("created_at"), now=Now())
        .order_by("handler")
    )
    return [
        {
            "handler": row["handler"],
            "pending": row["n"],
            "oldest_age": max(0.0, (row["now"] - row["oldest"]).total_seconds()),
        }
        for row in rows
    ]
