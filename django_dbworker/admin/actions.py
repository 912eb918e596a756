"""Admin actions: each one filtered UPDATE through ``transitions``.

The selected rows are narrowed to eligible states inside the same UPDATE
that changes them, so an action cannot race a worker claiming the row at
that moment, and rows in other states are reported as skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.http import HttpRequest

from django_dbworker import transitions
from django_dbworker.models import WorkItem, WorkItemQuerySet

Action = Callable[[Any, HttpRequest, QuerySet[Any]], None]


def _make(
    name: str, label: str, transition: Callable[[WorkItemQuerySet], int], done: str
) -> Action:
    @admin.action(description=label, permissions=["change"])
    def action(modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        selected = queryset.count()
        rows = WorkItem.objects.using(queryset.db).filter(pk__in=queryset.values("pk"))
        try:
            with transaction.atomic(using=queryset.db):
                changed = transition(rows)
        except IntegrityError:
            modeladmin.message_user(
                request,
                "Nothing changed: some selected rows share a unique key, and only one row "
                "per key may be pending at a time. Select one of them.",
                messages.ERROR,
            )
            return
        skipped = selected - changed
        text = f"{changed} work item(s) {done}."
        if skipped > 0:
            text += f" {skipped} skipped: not in a state this action applies to."
        level = messages.SUCCESS if changed else messages.WARNING
        modeladmin.message_user(request, text, level)

    action.__name__ = name
    return action


retry = _make(
    "retry",
    "Retry selected (failed/cancelled → pending)",
    transitions.retry,
    "set to pending for a new run",
)
cancel = _make("cancel", "Cancel selected (pending → cancelled)", transitions.cancel, "cancelled")
run_now = _make(
    "run_now", "Run selected now (pending: due now)", transitions.run_now, "made due now"
)
