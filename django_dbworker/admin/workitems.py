"""The Work items page: every row, whatever its status."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from django_dbworker.admin.base import BaseWorkItemAdmin
from django_dbworker.admin.filters import BatchFilter, FairKeyFilter, WaitingFilter


class WorkItemAdmin(BaseWorkItemAdmin):
    # The columns that matter first, narrow enough for 1,280 px beside
    # Django's navigation sidebar and the filters; the queue and the error
    # sit under the handler name. Priority and creation time give way below
    # 1,440 px (admin.css).
    list_display = [
        "id",
        "status_badge",
        "handler_and_error",
        "progress",
        "attempts_display",
        "priority",
        "created",
    ]

    # A batch's items (linked from the Batches page) and the rows waiting for parents.
    def get_list_filter(self, request: HttpRequest) -> Any:
        return (*self.list_filter, WaitingFilter, BatchFilter, FairKeyFilter)
