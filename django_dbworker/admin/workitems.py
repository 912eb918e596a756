"""The Work items page: every row, whatever its status."""

from __future__ import annotations

from django_dbworker.admin.base import BaseWorkItemAdmin


class WorkItemAdmin(BaseWorkItemAdmin):
    # The columns that matter first, narrow enough for 1,280 px beside the
    # filters; the error sits under the handler name.
    list_display = [
        "id",
        "handler_and_error",
        "status_badge",
        "queue",
        "attempts_display",
        "progress",
        "priority",
        "created",
    ]
