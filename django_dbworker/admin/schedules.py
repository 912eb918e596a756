"""The Schedules page: each periodic handler, its schedule in words, its slots, "Run now".

``ScheduleAdmin`` serves the page in place of a change list; the rest of the
module shapes its rows. Reads through ``stats.schedule_stats`` (two queries whatever the table
size). "Run now" enqueues one extra WorkItem of the handler (payload
``{"slot": <now>, "manual": true}``, no unique key) and never touches the
schedule row: the next slot comes when it is due, as before.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.contrib import messages
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from django_dbworker.admin import display
from django_dbworker.admin.base import may
from django_dbworker.admin.page import PageAdmin
from django_dbworker.enqueuing import enqueue
from django_dbworker.models import WorkItem
from django_dbworker.periodic.handler import PeriodicHandler
from django_dbworker.periodic.schedules import slot_key
from django_dbworker.registry import registry
from django_dbworker.stats import schedule_stats


def schedules_context() -> dict[str, Any]:
    rows = []
    for entry in schedule_stats():
        now = entry["now"]
        last: str
        if entry["last_status"] is not None:
            last = display.badge(entry["last_status"])
        elif entry["last_item_id"] is not None:
            last = "pruned"
        else:
            last = "never run"
        rows.append(
            {
                **entry,
                "next_display": _next(entry["next_slot"], now),
                "last_slot_display": _when(entry["last_slot"], now),
                "last_display": last,
                "last_finished_display": display.age(entry["last_finished_at"], now)
                if entry["last_finished_at"]
                else "",
            }
        )
    return {"rows": rows}


def _when(value: datetime | None, now: datetime) -> str:
    if value is None:
        return "-"
    return f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC ({display.age(value, now)})"


def _next(value: datetime | None, now: datetime) -> str:
    if value is not None and value <= now:
        # Due, and no worker that runs the handler has taken it yet.
        return f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC (due now)"
    return _when(value, now)


def run_now(name: str) -> WorkItem:
    """Enqueue an extra run of periodic handler ``name``; the schedule is left as it is.

    Its ``run()`` gets the time of the request as its slot; the payload
    says ``manual`` so that the admin and the handler can tell it apart.
    """
    cls = registry.get(name)
    if cls is None or not issubclass(cls, PeriodicHandler):
        raise LookupError(f"{name!r} is not a periodic handler registered here")
    return enqueue(cls, {"slot": slot_key(timezone.now()), "manual": True})


class ScheduleAdmin(PageAdmin):
    """One page: each periodic handler, its schedule in words, next and last slot, "Run now".

    Permissions are the work item pages': view (or change) work items to see
    it, change work items for "Run now", which creates a work item as the
    Retry action does. Schedule rows are the scheduler's: no add, edit or
    delete here.
    """

    template = "admin/django_dbworker/schedules.html"
    title = "Schedules"
    has_form = True

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return may(request, "view") or may(request, "change")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and may(request, "change")

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        return {**schedules_context(), "can_run": self.has_change_permission(request)}

    def post(self, request: HttpRequest) -> None:
        name = request.POST.get("run_now", "")
        try:
            item = run_now(name)
        except LookupError as exc:
            self.message_user(request, f"Nothing enqueued: {exc}.", messages.ERROR)
        else:
            self.message_user(
                request,
                format_html(
                    'Enqueued an extra run of {} (<a href="{}">work item {}</a>); '
                    "the schedule is unchanged.",
                    name,
                    reverse("admin:django_dbworker_workitem_change", args=[item.pk]),
                    item.pk,
                ),
                messages.SUCCESS,
            )
