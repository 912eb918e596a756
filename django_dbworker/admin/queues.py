"""The Queues page: every known queue, its live rows, paused or not (who, when), Pause/Resume.

``QueueAdmin`` serves the page in place of a change list for ``QueueState``;
the figures come from ``queues.queue_list`` (the queue names by a loose
index scan, one grouped count of the pending and claimed rows, the few
QueueState rows), whatever the table's size. Pause and Resume go through
``queues.pause_queue`` / ``resume_queue``, as the command does, and need
the change permission on queues (``django_dbworker.change_queuestate``);
each is recorded in the admin's log. Seeing the page needs the view (or
change) permission on queues or the view permission on work items.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

from django.contrib import messages
from django.http import HttpRequest

from django_dbworker.admin.base import may
from django_dbworker.admin.page import PageAdmin
from django_dbworker.flow.models import QueueState
from django_dbworker.flow.queues import UnknownQueue, pause_queue, queue_list, resume_queue
from django_dbworker.stats import busiest_fair_keys


def queues_context() -> dict[str, Any]:
    rows = [
        {
            "name": q.name,
            "paused": q.paused,
            "paused_at": (
                f"{q.paused_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC" if q.paused_at else ""
            ),
            "paused_by": q.paused_by,
            "pending": q.pending,
            "claimed": q.claimed,
        }
        for q in queue_list()
    ]
    return {
        "rows": rows,
        "paused_count": sum(r["paused"] for r in rows),
        "fair_keys": busiest_fair_keys(),
    }


class QueueAdmin(PageAdmin):
    """One page: the queues, their pending and claimed rows, and Pause/Resume."""

    template = "admin/django_dbworker/queues.html"
    title = "Queues"
    has_form = True

    def _may(self, request: HttpRequest, action: str) -> bool:
        opts = QueueState._meta
        return bool(request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}"))

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._may(request, "view") or self._may(request, "change") or may(request, "view")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._may(request, "change")

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        return {**queues_context(), "can_change": self.has_change_permission(request)}

    def post(self, request: HttpRequest) -> None:
        self._pause_or_resume(request)

    def _pause_or_resume(self, request: HttpRequest) -> None:
        action, name = request.POST.get("action", ""), request.POST.get("queue", "")
        if action not in ("pause", "resume"):
            self.message_user(request, "Nothing done: unknown action.", messages.ERROR)
            return
        user = request.user.get_username()
        try:
            change = pause_queue if action == "pause" else resume_queue
            state = change(name, by=user)
        except (UnknownQueue, ValueError) as exc:
            self.message_user(request, f"Nothing done: {exc}", messages.ERROR)
            return
        if state.pk is not None and QueueState.objects.filter(pk=state.pk).exists():
            self.log_change(request, state, f"{action.capitalize()}d queue {name}")
        if action == "pause":
            text = f"Paused queue {name!r}: no worker claims its items until it is resumed."
        else:
            text = f"Resumed queue {name!r}: workers claim its items again."
        self.message_user(request, text, messages.SUCCESS)
