"""The Failed work items page: rows that used up their attempts, their error, Retry."""

from __future__ import annotations

from django.db.models import QuerySet
from django.http import HttpRequest

from django_dbworker.admin import actions
from django_dbworker.admin.base import _OneStatusAdmin
from django_dbworker.models import Status, WorkItem


class FailedWorkItemAdmin(_OneStatusAdmin):
    # The error, this page's key column, right after the row's name and
    # given the width the others leave (admin.css): on screen at 1,280 px.
    list_display = [
        "id",
        "handler_and_queue",
        "error_summary",
        "attempts_display",
        "finished",
    ]

    actions = [actions.retry]

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).filter(status=Status.FAILED)
