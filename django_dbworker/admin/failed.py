"""The Failed work items page: rows that used up their attempts, their error, Retry."""

from __future__ import annotations

from django.db.models import QuerySet
from django.http import HttpRequest

from django_dbworker.admin import actions
from django_dbworker.admin.base import _OneStatusAdmin
from django_dbworker.models import Status, WorkItem


class FailedWorkItemAdmin(_OneStatusAdmin):
    list_display = [
        "id",
        "handler",
        "queue",
        "attempts_display",
        "finished",
        "error_summary",
    ]

    actions = [actions.retry]

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).filter(status=Status.FAILED)
