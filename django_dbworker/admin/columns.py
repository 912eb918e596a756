"""The columns and change-page fields of the work item pages, as a mixin.

Each method renders one value of a row (a list column or a read-only field
of the change page) through ``display``; ``BaseWorkItemAdmin`` mixes them in
and each page picks its ``list_display`` from them.
"""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_dbworker.admin import display
from django_dbworker.conf import dbworker_settings
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry


class WorkItemColumns:
    """Display methods for ``WorkItem`` rows, shared by every work item page."""

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: WorkItem) -> SafeString:
        if obj.status == Status.CLAIMED and obj.cancel_requested_at is not None:
            # One badge a line: side by side they are wider than the column.
            return format_html(
                "{}<br>{}", display.badge(obj.status), display.cancel_requested_badge()
            )
        if obj.status == Status.PENDING and obj.waiting:
            return format_html("{}<br>{}", display.badge(obj.status), display.waiting_badge())
        return display.badge(obj.status)

    @admin.display(description="handler", ordering="handler")
    def handler_display(self, obj: WorkItem) -> SafeString | str:
        """The handler name, marked when no loaded module registers it (it would never run)."""
        if obj.handler in registry or obj.status not in (Status.PENDING, Status.CLAIMED):
            return obj.handler
        return format_html(
            '{} <strong style="color:#c53030" title="No loaded module registers this handler, '
            "so no worker runs it: is it defined in a workers.py module of an installed app?"
            '">(not registered)</strong>',
            obj.handler,
        )

    @admin.display(description="claimed by", ordering="claimed_by")
    def worker_display(self, obj: WorkItem) -> SafeString | str:
        return display.worker(obj.claimed_by)

    @admin.display(description="claimed by", ordering="claimed_at")
    def worker_and_claimed(self, obj: WorkItem) -> SafeString:
        """Who holds the claim (cut, whole on hover), and under it since when."""
        return format_html(
            '<span class="dbw-cut">{}</span><small class="dbw-quiet">claimed {}</small>',
            display.worker(obj.claimed_by),
            display.relative_time(obj.claimed_at, display.db_now(obj)),
        )

    @admin.display(description="handler / queue, last error", ordering="handler")
    def handler_and_error(self, obj: WorkItem) -> SafeString:
        """The handler, and under it the queue and the first line of the last error.

        One column instead of three keeps the list readable at 1,280 px
        beside Django's navigation sidebar: the handler and queue wrap
        when long, the error takes what the queue leaves of its line (cut,
        whole on hover; whole on the row's page).
        """
        head = getattr(obj, "error_head", None)
        line = display.first_line(head if head is not None else obj.last_error)
        return format_html(
            '<span class="dbw-name" title="{}">{}</span>'
            '<small class="dbw-quiet dbw-sub"><span class="dbw-name" title="queue {}">{}</span>{}'
            "</small>",
            obj.handler,
            self.handler_display(obj),
            obj.queue,
            obj.queue,
            display.one_line(line, width="20em") if line else "",
        )

    @admin.display(description="handler / queue", ordering="handler")
    def handler_and_queue(self, obj: WorkItem) -> SafeString:
        """The handler, and under it the queue: one narrow column (long names wrap)."""
        return format_html(
            '<span class="dbw-name" title="{}">{}</span><br>'
            '<small class="dbw-quiet dbw-name" title="queue {}">{}</small>',
            obj.handler,
            self.handler_display(obj),
            obj.queue,
            obj.queue,
        )

    @admin.display(description="progress")
    def progress(self, obj: WorkItem) -> SafeString | str:
        """Where the row stands: when it runs, who runs it (heartbeat age), or when it ended."""
        if obj.status == Status.PENDING:
            return self.next_run(obj)
        if obj.status == Status.CLAIMED:
            # The heartbeat (and whether it is stale) first: the worker's
            # name is long and is cut at 1,280 px.
            stale = display.is_stale(
                obj.heartbeat_at, display.db_now(obj), float(dbworker_settings.STALE_AFTER)
            )
            return format_html(
                '{}heartbeat {}<small class="dbw-quiet dbw-cut">{}</small>',
                format_html('<span class="dbw-stale">{}</span> ', "stale") if stale else "",
                self.heartbeat_age(obj),
                display.worker(obj.claimed_by),
            )
        if obj.finished_at is not None:
            return format_html(
                "ended {}", display.relative_time(obj.finished_at, display.db_now(obj))
            )
        return "-"

    # List columns: how long ago, the exact time on hover (``relative_time``).
    @admin.display(description="created", ordering="created_at")
    def created(self, obj: WorkItem) -> SafeString | str:
        return display.relative_time(obj.created_at, display.db_now(obj))

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: WorkItem) -> SafeString | str:
        return display.relative_time(obj.finished_at, display.db_now(obj))

    @admin.display(description="attempts")
    def attempts_display(self, obj: WorkItem) -> str:
        return f"{obj.attempts}/{obj.max_attempts}"

    @admin.display(description="heartbeat", ordering="heartbeat_at")
    def heartbeat_age(self, obj: WorkItem) -> str:
        if obj.status != Status.CLAIMED:
            return "-"
        return display.age(obj.heartbeat_at, display.db_now(obj))

    @admin.display(description="next run", ordering="run_after")
    def next_run(self, obj: WorkItem) -> str:
        if obj.status != Status.PENDING:
            return "-"
        if obj.waiting:  # due "never" until its last parent succeeds
            return "after its parents"
        now = display.db_now(obj)
        if now is not None and obj.run_after <= now:
            return "due"
        return display.age(obj.run_after, now)

    @admin.display(description="error")
    def error_summary(self, obj: WorkItem) -> SafeString | str:
        head = getattr(obj, "error_head", None)
        line = display.first_line(head if head is not None else obj.last_error)
        return display.one_line(line) if line else "-"

    def raw_url(self, obj: WorkItem, value: str) -> str | None:
        """Where ``obj``'s whole ``value`` downloads; the admin that mixes this in knows."""
        return None

    def _pretty_value(self, obj: WorkItem, value: str) -> SafeString | str:
        hidden = display.redaction(obj, value)
        if hidden is not None:
            return hidden
        return display.pretty_json(getattr(obj, value), raw_url=self.raw_url(obj, value))

    @admin.display(description="payload")
    def payload_pretty(self, obj: WorkItem) -> SafeString | str:
        return self._pretty_value(obj, "payload")

    @admin.display(description="result")
    def result_pretty(self, obj: WorkItem) -> SafeString | str:
        return self._pretty_value(obj, "result")

    @admin.display(description="last error")
    def error_pre(self, obj: WorkItem) -> SafeString | str:
        if not obj.last_error:
            return "-"
        return display.error_text(obj.last_error)

    # Times to the second on the change page too (Django's default format
    # stops at minutes, or at "10 p.m."), the full value on hover.
    @admin.display(description="run after")
    def run_after_exact(self, obj: WorkItem) -> SafeString | str:
        if obj.status == Status.PENDING and obj.waiting:
            return "after its parents (see Runs after)"
        return display.timestamp(obj.run_after)

    @admin.display(description="created at")
    def created_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.created_at)

    @admin.display(description="updated at")
    def updated_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.updated_at)

    @admin.display(description="finished at")
    def finished_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.finished_at)

    @admin.display(description="cancel requested at")
    def cancel_requested_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.cancel_requested_at)

    @admin.display(description="snoozes")
    def snoozes_display(self, obj: WorkItem) -> str:
        """Times the handler raised ``Snooze`` (not attempts); the 101st fails the row."""
        return str(obj.snoozes)

    @admin.display(description="claimed at")
    def claimed_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.claimed_at)

    @admin.display(description="heartbeat at")
    def heartbeat_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.heartbeat_at)

    @admin.display(description="failed attempts")
    def history_table(self, obj: WorkItem) -> SafeString | str:
        return display.error_history(obj.error_history)

    @admin.display(description="trace id")
    def trace_id(self, obj: WorkItem) -> str:
        return display.trace_id(obj.trace_context) or "-"
