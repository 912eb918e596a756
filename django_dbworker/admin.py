"""Django admin for work items: read-only rows, state-changing actions.

Actions go through ``transitions`` (one filtered UPDATE each, narrowed to
eligible states), so they never race a worker that claims at the same
moment. Every action needs the change permission; view-only staff see the
pages without actions. List pages never load payload, result or traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince

from django_dbworker import transitions
from django_dbworker.models import ClaimedWorkItem, FailedWorkItem, Status, WorkItem
from django_dbworker.registry import registry

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[WorkItem]
else:  # ModelAdmin is only generic in django-stubs
    _ModelAdmin = admin.ModelAdmin

STATUS_COLOURS = {
    Status.PENDING: "#2f6fad",
    Status.CLAIMED: "#b7791f",
    Status.SUCCEEDED: "#2f855a",
    Status.FAILED: "#c53030",
    Status.CANCELLED: "#718096",
}


def _age(value: datetime | None) -> str:
    if value is None:
        return "-"
    return timesince(value, timezone.now()) + " ago"


def _is_sensitive(item: WorkItem) -> bool:
    cls = registry.get(item.handler)
    return bool(getattr(cls, "sensitive", False))


def _pretty(value: Any) -> str:
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True, default=str))


def _action(
    label: str, transition: Callable[[Any], int], verb: str
) -> Callable[[admin.ModelAdmin[WorkItem], HttpRequest, QuerySet[WorkItem]], None]:
    @admin.action(description=label, permissions=["change"])
    def action(
        modeladmin: admin.ModelAdmin[WorkItem], request: HttpRequest, queryset: QuerySet[WorkItem]
    ) -> None:
        selected = queryset.count()
        changed = transition(WorkItem.objects.filter(pk__in=queryset.values("pk")))
        skipped = selected - changed
        text = f"{changed} work item(s) {verb}."
        if skipped:
            text += f" {skipped} skipped (not in an eligible state)."
        modeladmin.message_user(request, text, messages.SUCCESS if changed else messages.WARNING)

    action.__name__ = f"{verb.replace(' ', '_')}_items"
    return action


retry_action = _action("Retry (failed/cancelled → pending)", transitions.retry, "retried")
cancel_action = _action("Cancel (pending → cancelled)", transitions.cancel, "cancelled")
run_now_action = _action("Run now (pending: due now)", transitions.run_now, "made due now")


class _LightChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        qs = super().get_queryset(request, exclude_parameters)
        return qs.defer(*getattr(self.model_admin, "list_defer", ()))


class BaseWorkItemAdmin(_ModelAdmin):
    list_filter = ["status", "queue", "handler"]
    search_fields = ("=id", "handler", "=unique_key")
    ordering = ("-id",)
    list_per_page = 50
    show_full_result_count = False
    actions = [retry_action, cancel_action, run_now_action]
    readonly_fields = (
        "id",
        "handler",
        "queue",
        "status",
        "priority",
        "run_after",
        "attempts",
        "max_attempts",
        "claimed_at",
        "heartbeat_at",
        "claimed_by",
        "claim_token",
        "finished_at",
        "payload_pretty",
        "result_pretty",
        "error_pre",
        "unique_key",
        "trace_context",
        "created_at",
        "updated_at",
    )
    fieldsets = (
        (None, {"fields": ("id", "handler", "queue", "status", "priority", "unique_key")}),
        (
            "Schedule",
            {
                "fields": (
                    "run_after",
                    "attempts",
                    "max_attempts",
                    "created_at",
                    "updated_at",
                    "finished_at",
                )
            },
        ),
        ("Claim", {"fields": ("claimed_by", "claimed_at", "heartbeat_at", "claim_token")}),
        ("Data", {"fields": ("payload_pretty", "result_pretty", "error_pre", "trace_context")}),
    )

    #: Columns the list page never loads (they can be megabytes per row).
    list_defer: tuple[str, ...] = ("payload", "result", "last_error", "trace_context")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _LightChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: WorkItem) -> str:
        colour = STATUS_COLOURS.get(Status(obj.status), "#444")
        return format_html(
            '<span style="color:#fff;background:{};padding:1px 6px;border-radius:8px">{}</span>',
            colour,
            obj.status,
        )

    @admin.display(description="attempts")
    def attempts_display(self, obj: WorkItem) -> str:
        return f"{obj.attempts}/{obj.max_attempts}"

    @admin.display(description="heartbeat", ordering="heartbeat_at")
    def heartbeat_age(self, obj: WorkItem) -> str:
        return _age(obj.heartbeat_at) if obj.status == Status.CLAIMED else "-"

    @admin.display(description="payload")
    def payload_pretty(self, obj: WorkItem) -> str:
        if _is_sensitive(obj):
            return "(redacted: sensitive handler)"
        return _pretty(obj.payload)

    @admin.display(description="result")
    def result_pretty(self, obj: WorkItem) -> str:
        return _pretty(obj.result)

    @admin.display(description="last error")
    def error_pre(self, obj: WorkItem) -> str:
        return format_html("<pre>{}</pre>", obj.last_error) if obj.last_error else "-"


@admin.register(WorkItem)
class WorkItemAdmin(BaseWorkItemAdmin):
    list_display = (
        "id",
        "handler",
        "queue",
        "status_badge",
        "priority",
        "attempts_display",
        "run_after",
        "claimed_by",
        "heartbeat_age",
        "created_at",
    )


@admin.register(ClaimedWorkItem)
class ClaimedWorkItemAdmin(BaseWorkItemAdmin):
    list_display = (
        "id",
        "handler",
        "queue",
        "claimed_by",
        "claimed_at",
        "heartbeat_age",
        "attempts_display",
    )
    list_filter = ["queue", "handler"]
    ordering = ("heartbeat_at",)
    actions = []

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).filter(status=Status.CLAIMED)


@admin.register(FailedWorkItem)
class FailedWorkItemAdmin(BaseWorkItemAdmin):
    list_display = ("id", "handler", "queue", "attempts_display", "finished_at", "error_summary")
    list_filter = ["queue", "handler"]
    actions = [retry_action]

    # The error's first line needs last_error; only this page pays for it.
    list_defer = ("payload", "result", "trace_context")

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).filter(status=Status.FAILED)

    @admin.display(description="error")
    def error_summary(self, obj: WorkItem) -> str:
        return (obj.last_error or "").split("\n", 1)[0][:200]
