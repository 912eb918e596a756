"""The Work items page: every row, whatever its status."""

from __future__ import annotations

from django_dbworker.admin.base import BaseWorkItemAdmin


class WorkItemAdmin(BaseWorkItemAdmin):
    # The columns that matter first, narrow enough for 1,280 px beside the
    # filters; the error sits under the handler name.
    # Priority and creation time give way below 1,440 px (admin.css).
    list_display = [
        "id",
        "status_badge",
        "handler_and_error",
        "progress",
        "queue",
        "attempts_display",
        "priority",
        "created",
    ]
