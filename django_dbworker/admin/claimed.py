"""The Claimed work items page: what runs right now, who runs it, and whether it is stale."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_dbworker.admin import actions, display
from django_dbworker.admin.base import _OneStatusAdmin
from django_dbworker.admin.filters import CancelRequestedFilter, HandlerFilter, QueueFilter
from django_dbworker.conf import dbworker_settings
from django_dbworker.models import Status, WorkItem


class ClaimedWorkItemAdmin(_OneStatusAdmin):
    list_display = [
        "id",
        "handler_display",
        "queue",
        "worker_display",
        "claimed",
        "heartbeat_age",
        "stale_marker",
        "status_badge",
        "attempts_display",
    ]

    ordering = ["heartbeat_at"]
    # Cancel asks running rows to stop (the change permission, as on every page).
    actions = [actions.cancel]

    def get_list_filter(self, request: HttpRequest) -> Any:
        return (QueueFilter, HandlerFilter, CancelRequestedFilter)

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).filter(status=Status.CLAIMED)

    @admin.display(description="stale?")
    def stale_marker(self, obj: WorkItem) -> SafeString | str:
        now = display.db_now(obj)
        if obj.heartbeat_at is None or now is None:
            return "-"
        if (now - obj.heartbeat_at).total_seconds() > float(dbworker_settings.STALE_AFTER):
            return format_html('<strong style="color:#c53030">{}</strong>', "stale")
        return "ok"
