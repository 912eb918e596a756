"""A batch's progress as the admin draws it: a bar of its items by state, the counts in words.

Used by the Batches page (``batches``) and by a work item's page
(``relations``); the figures are ``batch_stats.Progress``.
"""

from __future__ import annotations

from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from django_dbworker.admin import display
from django_dbworker.batches.stats import Progress
from django_dbworker.models import Status

#: The bar's segments, left to right: (Progress attribute, label, colour).
SEGMENTS = (
    ("succeeded", "succeeded", display.STATUS_COLOURS[Status.SUCCEEDED.value]),
    ("failed", "failed", display.STATUS_COLOURS[Status.FAILED.value]),
    ("cancelled", "cancelled", display.STATUS_COLOURS[Status.CANCELLED.value]),
    ("claimed", "running", display.STATUS_COLOURS[Status.CLAIMED.value]),
    ("queued", "pending", display.STATUS_COLOURS[Status.PENDING.value]),
)


def _segment_counts(progress: Progress) -> dict[str, int]:
    return {
        "succeeded": progress.succeeded,
        "failed": progress.failed,
        "cancelled": progress.cancelled,
        # An open batch's pending items: those running, and those still queued.
        "claimed": 0 if progress.completed else progress.claimed,
        "queued": 0 if progress.completed else progress.pending - progress.claimed,
    }


def _count(n: int, label: str, colour: str) -> SafeString:
    """``n label`` kept on one line, in the state's colour unless it is zero."""
    if not n:
        return format_html('<span class="dbw-count">{} {}</span>', n, label)
    return format_html('<span class="dbw-count" style="color:{}">{} {}</span>', colour, n, label)


def progress_bar(progress: Progress, items: str | None = None) -> SafeString:
    """A bar of the batch's items by state, and the counts under it in words.

    ``items``: where the words "N items" link to (the batch's Work items list).
    """
    counts = _segment_counts(progress)
    whole = max(progress.total, sum(counts.values()), 1)
    segments = format_html_join(
        "",
        '<span class="dbw-seg dbw-seg-{}" style="width:{}%;background:{}" title="{} {}"></span>',
        (
            (name, f"{100 * counts[name] / whole:.2f}", colour, counts[name], label)
            for name, label, colour in SEGMENTS
            if counts[name]
        ),
    )
    total = format_html(
        "<strong>{}</strong> {}", progress.total, "item" if progress.total == 1 else "items"
    )
    words = [format_html('<a href="{}">{}</a>', items, total) if items else total]
    words += [
        _count(n, label, colour)
        for label, n, colour in (
            ("succeeded", progress.succeeded, SEGMENTS[0][2]),
            ("failed", progress.failed, SEGMENTS[1][2]),
            ("cancelled", progress.cancelled, SEGMENTS[2][2]),
        )
    ]
    if not progress.completed:
        running = f" ({progress.claimed} running)" if progress.claimed else ""
        words.append(_count(progress.pending, f"pending{running}", SEGMENTS[4][2]))
    if progress.retried:
        words.append(
            format_html(
                '<span class="dbw-count" title="{}">{} retried since</span>',
                "Pending or claimed again after the batch completed (an operator retried "
                "them): the batch stays complete and its callback does not run again.",
                progress.retried,
            )
        )
    if progress.gone:
        words.append(
            format_html(
                '<span class="dbw-count" title="{}">{} gone</span>',
                "Items of this open batch no longer in the table (deleted by hand): "
                "the stale-recovery sweep completes the batch without them.",
                progress.gone,
            )
        )
    title = (
        f"{progress.done} of {progress.total} ended: {progress.succeeded} succeeded, "
        f"{progress.failed} failed, {progress.cancelled} cancelled"
    )
    return format_html(
        '<div class="dbw-progress" title="{}"><div class="dbw-bar">{}</div>'
        '<small class="dbw-counts">{}</small></div>',
        title,
        segments,
        # A line breaks after a dot, never before one.
        SafeString("&nbsp;· ".join(str(word) for word in words)),
    )


def items_url(batch_id: int) -> str:
    """The Work items list filtered by batch ``batch_id`` (``filters.BatchFilter``)."""
    return reverse("admin:django_dbworker_workitem_changelist") + f"?batch={batch_id}"
