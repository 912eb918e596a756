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
from django_dbworker.admin.filters import (
    CancelRequestedFilter,
    HandlerFilter,
    QueueFilter,
    WorkerFilter,
)
from django_dbworker.conf import dbworker_settings
from django_dbworker.models import Status, WorkItem


class ClaimedWorkItemAdmin(_OneStatusAdmin):
    # Whether the claim is alive first (heartbeat age, stale or ok under
    # it): at 1,280 px beside Django's navigation sidebar only the worker's
    # name is cut (admin.css), the handler and queue wrap.
    list_display = [
        "id",
        "status_badge",
        "heartbeat_and_stale",
        "handler_and_queue",
        "worker_and_claimed",
        "attempts_display",
    ]

    ordering = ["heartbeat_at"]
    # Cancel asks running rows to stop (the change permission, as on every page).
    actions = [actions.cancel]

    def get_list_filter(self, request: HttpRequest) -> Any:
        return (QueueFilter, HandlerFilter, CancelRequestedFilter, WorkerFilter)

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).filter(status=Status.CLAIMED)

    @admin.display(description="heartbeat", ordering="heartbeat_at")
    def heartbeat_and_stale(self, obj: WorkItem) -> SafeString | str:
        """The heartbeat's age, and under it whether the claim is stale (one column, not two)."""
        now = display.db_now(obj)
        if obj.heartbeat_at is None or now is None:
            return "-"
        stale = display.is_stale(obj.heartbeat_at, now, float(dbworker_settings.STALE_AFTER))
        return format_html(
            '{}<br><span class="dbw-stale-marker">{}</span>',
            display.age(obj.heartbeat_at, now),
            format_html('<span class="dbw-stale">{}</span>', "stale") if stale else "ok",
        )
