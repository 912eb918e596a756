"""The queue summary page: counts per queue and status, lag, stale claims, orphans."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models.functions import Now

from django_dbworker.admin import display
from django_dbworker.conf import dbworker_settings
from django_dbworker.models import WorkItem
from django_dbworker.stats import orphaned_handlers, queue_stats, status_columns

#: Stale claims listed on the page (the count is always complete).
STALE_ROWS_SHOWN = 50


def summary_context() -> dict[str, Any]:
    stale_after = float(dbworker_settings.STALE_AFTER)
    stats = queue_stats()
    statuses = status_columns(stats)
    rows = []
    for queue, entry in sorted(stats.items()):
        rows.append(
            {
                "queue": queue,
                "cells": [(s, entry["counts"].get(s, 0)) for s in statuses],
                "estimated": entry["estimated"],
                "oldest_pending_age_display": (
                    "-"
                    if entry["oldest_pending_age"] is None
                    else display.duration(entry["oldest_pending_age"])
                ),
            }
        )
    stale = (
        WorkItem.objects.stale(timedelta(seconds=stale_after))
        .order_by("heartbeat_at")
        .only("id", "handler", "queue", "claimed_by", "heartbeat_at", "attempts", "max_attempts")
        .annotate(db_now=Now())
    )
    stale_rows = list(stale[: STALE_ROWS_SHOWN + 1])
    for item in stale_rows:
        item.heartbeat_age = display.age(item.heartbeat_at, display.db_now(item))  # type: ignore[attr-defined]
    orphans = [
        {**orphan, "oldest_age_display": display.duration(orphan["oldest_age"]) + " ago"}
        for orphan in orphaned_handlers()
    ]
    return {
        "orphans": orphans,
        "statuses": statuses,
        "rows": rows,
        "stale_rows": stale_rows[:STALE_ROWS_SHOWN],
        "stale_more": len(stale_rows) > STALE_ROWS_SHOWN,
        "stale_after": stale_after,
    }
