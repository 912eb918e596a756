"""Aggregates over the work table: counts by queue/status and queue lag.

Grouped queries only (served by the status index), with ages computed by the
database clock. Used by ``dbworker_stats``, the admin summary and metrics.
"""

from __future__ import annotations

from typing import Any, TypedDict

from django.db.models import Count, Min
from django.db.models.functions import Now

from django_dbworker.models import WorkItem


class QueueStats(TypedDict):
    counts: dict[str, int]
    oldest_pending_age: float | None


def queue_stats(using: str | None = None) -> dict[str, QueueStats]:
    """``{queue: {"counts": {status: n}, "oldest_pending_age": seconds | None}}``."""
    stats: dict[str, QueueStats] = {}
    rows = (
        WorkItem.objects.using(using).order_by().values("queue", "status").annotate(n=Count("id"))
    )
    for row in rows:
        entry = stats.setdefault(row["queue"], {"counts": {}, "oldest_pending_age": None})
        entry["counts"][row["status"]] = row["n"]
    lag: Any = (
        WorkItem.objects.using(using)
        .ready()
        .order_by()
        .values("queue")
        .annotate(oldest=Min("run_after"), now=Now())
    )
    for row in lag:
        if row["queue"] in stats:
            stats[row["queue"]]["oldest_pending_age"] = max(
                0.0, (row["now"] - row["oldest"]).total_seconds()
            )
    return stats
