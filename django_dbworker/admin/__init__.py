"""Django admin for work items: what is stuck, what failed, why, and fix it.

Pages: all work items, claimed ones, failed ones, a queue summary, and the
schedules of periodic handlers.
Detail pages are read-only (a form save would race the workers); state
changes happen only through the actions, which need the change permission.
List pages defer payload, result and traceback columns, count with an
estimating paginator and filter on indexed columns, so they stay fast on
tables with millions of rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Q, QuerySet
from django.db.models.functions import Left, Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_dbworker.admin import actions, display
from django_dbworker.admin.filters import HandlerFilter, QueueFilter
from django_dbworker.admin.pagination import EstimatedCountPaginator
from django_dbworker.conf import dbworker_settings
from django_dbworker.models import (
    ClaimedWorkItem,
    FailedWorkItem,
    PeriodicSchedule,
    QueueSummary,
    Status,
    WorkItem,
    handler_match,
)
from django_dbworker.registry import registry

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[WorkItem]
else:  # ModelAdmin is generic only in django-stubs
    _ModelAdmin = admin.ModelAdmin


class _LightChangeList(ChangeList):
    """Loads only what the list shows: no payload, result, traceback or context."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        qs: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        light = qs.defer("payload", "result", "last_error", "error_history", "trace_context")
        return cast(
            "QuerySet[Any]", light.annotate(db_now=Now(), error_head=Left("last_error", 300))
        )


class BaseWorkItemAdmin(_ModelAdmin):
    list_filter = ("status", QueueFilter, HandlerFilter)
    # Exact matches only: each is served by an index (pk, handler, unique_key).
    search_fields = ["=id", "=handler", "=unique_key"]
    search_help_text = "Exact id, handler name or unique key."
    ordering = ["-id"]
    list_per_page = 50
    show_full_result_count = False
    # Facet counts would run one COUNT per filter choice over the whole table.
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    actions = [actions.retry, actions.cancel, actions.run_now]
    fieldsets = (
        (None, {"fields": ("id", "handler", "queue", "status_badge", "priority", "unique_key")}),
        (
            "Schedule",
            {
                "fields": (
                    "run_after_exact",
                    "attempts_display",
                    "created_at_exact",
                    "updated_at_exact",
                    "finished_at_exact",
                )
            },
        ),
        (
            "Claim",
            {"fields": ("claimed_by", "claimed_at_exact", "heartbeat_at_exact", "claim_token")},
        ),
        (
            "Data",
            {
                "fields": (
                    "payload_pretty",
                    "result_pretty",
                    "error_pre",
                    "history_table",
                    "trace_id",
                )
            },
        ),
    )
    readonly_fields = (
        "id",
        "handler",
        "queue",
        "status_badge",
        "priority",
        "unique_key",
        "run_after_exact",
        "attempts_display",
        "created_at_exact",
        "updated_at_exact",
        "finished_at_exact",
        "claimed_by",
        "claimed_at_exact",
        "heartbeat_at_exact",
        "claim_token",
        "payload_pretty",
        "result_pretty",
        "error_pre",
        "history_table",
        "trace_id",
    )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _LightChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).annotate(db_now=Now())

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[WorkItem], search_term: str
    ) -> tuple[QuerySet[WorkItem], bool]:
        """Exact matches that each use an index.

        Django's "=field" search is ``iexact`` (``UPPER(col) = UPPER(term)``),
        which no plain index serves; on millions of rows that is a scan.
        """
        term = search_term.strip()
        if not term:
            return queryset, False
        match = handler_match(term) | Q(unique_key=term)
        # isdigit() alone accepts "²", which int() refuses; ids are ASCII digits.
        if term.isascii() and term.isdigit() and len(term) < 19:
            match |= Q(pk=int(term))
        return queryset.filter(match), False

    # Rows are written by workers and actions only: no add, no delete, no edit
    # form. Change permission still gates the actions (obj is None there).
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None:
            return False
        return super().has_change_permission(request, obj)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        opts = WorkItem._meta
        return bool(
            request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")
            or request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")
        )

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    # -- columns ----------------------------------------------------------------

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: WorkItem) -> SafeString:
        return display.badge(obj.status)

    @admin.display(description="handler", ordering="handler")
    def handler_display(self, obj: WorkItem) -> SafeString | str:
        """The handler name, marked when no loaded module registers it (it would never run)."""
        if obj.handler in registry or obj.status not in (Status.PENDING, Status.CLAIMED):
            return obj.handler
        return format_html(
            '{} <strong style="color:#c53030" title="No loaded module registers this handler, '
            "so no worker runs it: is it defined in a workers.py module of an installed app?"
            '">(not registered)</strong>',
            obj.handler,
        )

    @admin.display(description="claimed by", ordering="claimed_by")
    def worker_display(self, obj: WorkItem) -> SafeString | str:
        return display.worker(obj.claimed_by)

    @admin.display(description="handler / last error", ordering="handler")
    def handler_and_error(self, obj: WorkItem) -> SafeString | str:
        """The handler, and under it the first line of the last error (whole on hover).

        One column instead of two keeps the list readable at 1,280 px:
        the error was the widest column and the last, so off-screen.
        """
        head = getattr(obj, "error_head", None)
        line = display.first_line(head if head is not None else obj.last_error)
        if not line:
            return self.handler_display(obj)
        return format_html(
            '{}<br><small style="color:var(--body-quiet-color)">{}</small>',
            self.handler_display(obj),
            display.one_line(line, width="20em"),
        )

    @admin.display(description="progress")
    def progress(self, obj: WorkItem) -> SafeString | str:
        """Where the row stands: when it runs, who runs it (heartbeat age), or when it ended."""
        if obj.status == Status.PENDING:
            return self.next_run(obj)
        if obj.status == Status.CLAIMED:
            return format_html(
                "{}, heartbeat {}", display.worker(obj.claimed_by), self.heartbeat_age(obj)
            )
        if obj.finished_at is not None:
            return format_html("ended {}", display.timestamp(obj.finished_at))
        return "-"

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.created_at)

    @admin.display(description="claimed", ordering="claimed_at")
    def claimed(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.claimed_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.finished_at)

    @admin.display(description="attempts")
    def attempts_display(self, obj: WorkItem) -> str:
        return f"{obj.attempts}/{obj.max_attempts}"

    @admin.display(description="heartbeat", ordering="heartbeat_at")
    def heartbeat_age(self, obj: WorkItem) -> str:
        if obj.status != Status.CLAIMED:
            return "-"
        return display.age(obj.heartbeat_at, display.db_now(obj))

    @admin.display(description="next run", ordering="run_after")
    def next_run(self, obj: WorkItem) -> str:
        if obj.status != Status.PENDING:
            return "-"
        now = display.db_now(obj)
        if now is not None and obj.run_after <= now:
            return "due"
        return display.age(obj.run_after, now)

    @admin.display(description="error")
    def error_summary(self, obj: WorkItem) -> SafeString | str:
        head = getattr(obj, "error_head", None)
        line = display.first_line(head if head is not None else obj.last_error)
        return display.one_line(line) if line else "-"

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        title = str(self.model._meta.verbose_name_plural).capitalize()
        return super().changelist_view(request, {"title": title, **(extra_context or {})})

    @admin.display(description="payload")
    def payload_pretty(self, obj: WorkItem) -> SafeString | str:
        redaction = display.payload_redaction(obj)
        if redaction is not None:
            return redaction
        return display.pretty_json(obj.payload)

    @admin.display(description="result")
    def result_pretty(self, obj: WorkItem) -> SafeString:
        return display.pretty_json(obj.result)

    @admin.display(description="last error")
    def error_pre(self, obj: WorkItem) -> SafeString | str:
        if not obj.last_error:
            return "-"
        return format_html('<pre style="white-space:pre-wrap">{}</pre>', obj.last_error)

    # Times to the second on the change page too (Django's default format
    # stops at minutes, or at "10 p.m."), the full value on hover.
    @admin.display(description="run after")
    def run_after_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.run_after)

    @admin.display(description="created at")
    def created_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.created_at)

    @admin.display(description="updated at")
    def updated_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.updated_at)

    @admin.display(description="finished at")
    def finished_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.finished_at)

    @admin.display(description="claimed at")
    def claimed_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.claimed_at)

    @admin.display(description="heartbeat at")
    def heartbeat_at_exact(self, obj: WorkItem) -> SafeString | str:
        return display.timestamp(obj.heartbeat_at)

    @admin.display(description="failed attempts")
    def history_table(self, obj: WorkItem) -> SafeString | str:
        return display.error_history(obj.error_history)

    @admin.display(description="trace id")
    def trace_id(self, obj: WorkItem) -> str:
        return display.trace_id(obj.trace_context) or "-"


@admin.register(WorkItem)
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


class _OneStatusAdmin(BaseWorkItemAdmin):
    """A page fixed to one status: no status filter."""

    def get_list_filter(self, request: HttpRequest) -> Any:
        return (QueueFilter, HandlerFilter)


@admin.register(ClaimedWorkItem)
class ClaimedWorkItemAdmin(_OneStatusAdmin):
    list_display = [
        "id",
        "handler_display",
        "queue",
        "worker_display",
        "claimed",
        "heartbeat_age",
        "stale_marker",
        "attempts_display",
    ]

    ordering = ["heartbeat_at"]
    actions = []

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


@admin.register(FailedWorkItem)
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


@admin.register(QueueSummary)
class QueueSummaryAdmin(BaseWorkItemAdmin):
    """One page: counts per queue and status, queue lag, rows of stale workers."""

    def changelist_view(  # the summary page replaces the list
        self, request: HttpRequest, extra_context: Any = None
    ) -> HttpResponse:
        from django_dbworker.admin.summary import summary_context

        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            **summary_context(),
            "title": "Queue summary",
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/django_dbworker/summary.html", context)


if TYPE_CHECKING:
    _ScheduleModelAdmin = admin.ModelAdmin[PeriodicSchedule]
else:
    _ScheduleModelAdmin = admin.ModelAdmin


@admin.register(PeriodicSchedule)
class ScheduleAdmin(_ScheduleModelAdmin):
    """One page: each periodic handler, its schedule in words, next and last slot, "Run now".

    Permissions are the work item pages': view (or change) work items to see
    it, change work items for "Run now", which creates a work item as the
    Retry action does. Schedule rows are the scheduler's: no add, edit or
    delete here.
    """

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _may(request, "view") or _may(request, "change")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and _may(request, "change")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def change_view(self, request: HttpRequest, object_id: str, *args: Any, **kwargs: Any) -> Any:
        from django.shortcuts import redirect

        return redirect("admin:django_dbworker_periodicschedule_changelist")

    def changelist_view(  # the schedules page replaces the list
        self, request: HttpRequest, extra_context: Any = None
    ) -> HttpResponse:
        from django.contrib import messages
        from django.core.exceptions import PermissionDenied
        from django.shortcuts import redirect

        from django_dbworker.admin.schedules import run_now, schedules_context

        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            name = request.POST.get("run_now", "")
            try:
                item = run_now(name)
            except LookupError as exc:
                self.message_user(request, f"Nothing enqueued: {exc}.", messages.ERROR)
            else:
                self.message_user(
                    request,
                    format_html(
                        'Enqueued an extra run of {} (<a href="{}">work item {}</a>); '
                        "the schedule is unchanged.",
                        name,
                        reverse("admin:django_dbworker_workitem_change", args=[item.pk]),
                        item.pk,
                    ),
                    messages.SUCCESS,
                )
            return redirect(request.path)
        context = {
            **self.admin_site.each_context(request),
            **schedules_context(),
            "title": "Schedules",
            "opts": self.model._meta,
            "can_run": self.has_change_permission(request),
        }
        return TemplateResponse(request, "admin/django_dbworker/schedules.html", context)


def _may(request: HttpRequest, action: str) -> bool:
    opts = WorkItem._meta
    return bool(request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}"))
