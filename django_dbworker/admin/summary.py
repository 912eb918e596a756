"""The queue summary page, a dashboard: the last hour of finished work in pictures,
counts per queue and status, lag, run times, failures by error, stale claims, orphans.

Every figure comes from ``stats`` (bounded queries: see there); this module
only shapes them for the template. The page refreshes itself: the template
re-fetches it every ``REFRESH_SECONDS`` with a small inline script.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models.functions import Now

from django_dbworker.admin import charts, display
from django_dbworker.conf import dbworker_settings
from django_dbworker.flow.queues import paused_queues
from django_dbworker.models import WorkItem
from django_dbworker.stats import (
    FAILURE_SAMPLE,
    RECENT,
    RUN_TIME_SAMPLE,
    failure_groups,
    orphaned_handlers,
    queue_stats,
    run_times,
    status_columns,
    throughput,
)

#: Stale claims listed on the page (the count is always complete).
STALE_ROWS_SHOWN = 50
#: How often the page re-reads itself, in seconds: often enough to see work
#: move, rarely enough that a few open dashboards cost the database little
#: (about ten bounded queries each time).
REFRESH_SECONDS = 5


def summary_context() -> dict[str, Any]:
    stale_after = float(dbworker_settings.STALE_AFTER)
    stats = queue_stats()
    statuses = status_columns(stats)
    paused = set(paused_queues())
    rows = []
    for queue, entry in sorted(stats.items()):
        rows.append(
            {
                "queue": queue,
                "paused": queue in paused,
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
        item.worker = display.worker(item.claimed_by)  # type: ignore[attr-defined]
    orphans = [
        {**orphan, "oldest_age_display": display.duration(orphan["oldest_age"]) + " ago"}
        for orphan in orphaned_handlers()
    ]
    recent = throughput()
    now = recent["now"]
    queues = sorted(set(stats) | set(recent["queues"]))
    empty = [(0, 0)] * len(recent["minutes"])
    charts_by_queue = [
        (
            queue,
            charts.throughput_chart(
                recent["minutes"],
                recent["queues"].get(queue, empty),
                recent["totals"].get(queue, (0, 0)),
            ),
        )
        for queue in queues
    ]
    times = run_times()
    longest = max((t.p95 for t in times), default=0.0)
    run_time_rows = [
        {
            "handler": t.handler,
            "count": t.count,
            "p50": display.run_time(t.p50),
            "p95": display.run_time(t.p95),
            "p50_width": widths[0],
            "p95_width": widths[1],
            "sampled": t.sampled,
        }
        for t in times
        for widths in [charts.run_time_widths(t.p50, t.p95, longest)]
    ]
    failures = [
        {
            **group,
            "error": display.first_line(group["error"]) or "(no error recorded)",
            "example_display": display.first_line(group["example"]),
            "last_seen_display": display.age(group["last_seen"], now),
        }
        for group in failure_groups()
    ]
    return {
        "now": now,
        "updated_at": display.timestamp(now),
        "refresh_seconds": REFRESH_SECONDS,
        "recent_minutes": round(RECENT.total_seconds() / 60),
        "charts": charts_by_queue,
        "chart_width": charts_by_queue[0][1].width if charts_by_queue else 0,
        "chart_height": charts.CHART_HEIGHT,
        "bar_width": charts.BAR_WIDTH,
        "succeeded_colour": charts.SUCCEEDED_COLOUR,
        "failed_colour": charts.FAILED_COLOUR,
        "run_times": run_time_rows,
        "run_time_width": charts.RUN_TIME_WIDTH,
        "run_time_sampled": any(t.sampled for t in times),
        "run_time_sample": RUN_TIME_SAMPLE,
        "failures": failures,
        "failures_sampled": any(group["sampled"] for group in failures),
        "failure_sample": FAILURE_SAMPLE,
        "orphans": orphans,
        "statuses": statuses,
        "rows": rows,
        "stale_rows": stale_rows[:STALE_ROWS_SHOWN],
        "stale_more": len(stale_rows) > STALE_ROWS_SHOWN,
        "stale_after": stale_after,
    }
