"""What every work item page shares: the light change list and ``BaseWorkItemAdmin``.

``BaseWorkItemAdmin`` holds the configuration of the list pages (filters,
exact indexed search, estimating paginator, no facet counts), the read-only
change page and the permission rules; the columns it can show live in
``columns``. The pages themselves (``workitems``, ``claimed``, ``failed``,
``queue_summary``) subclass it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Q, QuerySet
from django.db.models.functions import Left, Now
from django.http import HttpRequest, HttpResponse

from django_dbworker.admin import actions
from django_dbworker.admin.columns import WorkItemColumns
from django_dbworker.admin.filters import HandlerFilter, QueueFilter
from django_dbworker.admin.pagination import EstimatedCountPaginator
from django_dbworker.models import WorkItem, handler_match

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


class BaseWorkItemAdmin(WorkItemColumns, _ModelAdmin):
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

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        title = str(self.model._meta.verbose_name_plural).capitalize()
        return super().changelist_view(request, {"title": title, **(extra_context or {})})


class _OneStatusAdmin(BaseWorkItemAdmin):
    """A page fixed to one status: no status filter."""

    def get_list_filter(self, request: HttpRequest) -> Any:
        return (QueueFilter, HandlerFilter)


def may(request: HttpRequest, action: str) -> bool:
    """Whether the user holds the ``WorkItem`` permission ``action`` (view, change, ...)."""
    opts = WorkItem._meta
    return bool(request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}"))
