"""What every work item page shares: the light change list and ``BaseWorkItemAdmin``.

``BaseWorkItemAdmin`` holds the configuration of the list pages (filters,
exact indexed search and the payload search of ``search``, estimating
paginator, no facet counts), the read-only change page, the raw JSON
download of payload and result, and the rules of access; the columns it
can show live in ``columns``. The pages themselves (``workitems``,
``claimed``, ``failed``, ``queue_summary``) subclass it.

Access, on every page: the permissions of ``WorkItem`` decide, never those
of the proxy model a page is registered for (``view`` or ``change`` to see,
``change`` for the actions). A list accepts only the lookups of its own
filters: any other (``?payload__password__startswith=h``) is refused with
400, so no list tells whether a value the user may not read matches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast, Left, Now
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse

from django_dbworker.admin import actions, display, search
from django_dbworker.admin.columns import WorkItemColumns
from django_dbworker.admin.filters import CancelRequestedFilter, HandlerFilter, QueueFilter
from django_dbworker.admin.pagination import EstimatedCountPaginator
from django_dbworker.admin.relations import RELATIONS_FIELDSET, Relations
from django_dbworker.admin.row_buttons import RowButtons
from django_dbworker.db import operations
from django_dbworker.models import WorkItem, handler_match, key_match

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


class BaseWorkItemAdmin(Relations, RowButtons, WorkItemColumns, _ModelAdmin):
    list_filter = ("status", QueueFilter, HandlerFilter, CancelRequestedFilter)
    # Exact matches, each served by an index (pk, handler, unique_key,
    # concurrency_key); payload searches only in their own form (``search``).
    search_fields = ["=id", "=handler", "=unique_key", "=concurrency_key"]
    search_help_text = (
        "Exact id, handler name, unique key or concurrency key. Payloads: "
        'payload.user.id=5 or {"user": {"id": 5}} (exact values; not of sensitive handlers).'
    )
    ordering = ["-id"]
    list_per_page = 50
    show_full_result_count = False
    # Facet counts would run one COUNT per filter choice over the whole table.
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator

    class Media:
        # Lists that fit 1,280 px; the change page's row buttons.
        css = {"all": ("django_dbworker/admin.css",)}

    actions = [actions.retry, actions.cancel, actions.run_now]
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "handler",
                    "queue",
                    "status_badge",
                    "priority",
                    "unique_key",
                    "concurrency_key",
                    "concurrency_limit",
                )
            },
        ),
        # Only the fields the row has (``relations``); none, no fieldset.
        (
            RELATIONS_FIELDSET,
            {"fields": ("batch_link", "parents_display", "dependents_display")},
        ),
        (
            "Schedule",
            {
                "fields": (
                    "run_after_exact",
                    "attempts_display",
                    "snoozes_display",
                    "created_at_exact",
                    "updated_at_exact",
                    "finished_at_exact",
                )
            },
        ),
        (
            "Claim",
            {
                "fields": (
                    "claimed_by",
                    "claimed_at_exact",
                    "heartbeat_at_exact",
                    "claim_token",
                    "cancel_requested_at_exact",
                )
            },
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
        "concurrency_key",
        "concurrency_limit",
        "batch_link",
        "parents_display",
        "dependents_display",
        "run_after_exact",
        "attempts_display",
        "snoozes_display",
        "created_at_exact",
        "updated_at_exact",
        "finished_at_exact",
        "claimed_by",
        "claimed_at_exact",
        "heartbeat_at_exact",
        "claim_token",
        "cancel_requested_at_exact",
        "payload_pretty",
        "result_pretty",
        "error_pre",
        "history_table",
        "trace_id",
    )

    #: The values the raw JSON download serves (with the change page's redaction).
    raw_values = ("payload", "result")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _LightChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkItem]:
        return super().get_queryset(request).annotate(db_now=Now())

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[WorkItem], search_term: str
    ) -> tuple[QuerySet[WorkItem], bool]:
        """Exact matches that each use an index, or a payload search (``search``).

        Django's "=field" search is ``iexact`` (``UPPER(col) = UPPER(term)``),
        which no plain index serves; on millions of rows that is a scan. A
        payload search only runs for a term in its form, and only over the
        rows of handlers whose payloads the change page shows: a sensitive
        or unregistered handler's row never matches, so no search answers
        yes or no about a value the admin redacts.
        """
        term = search_term.strip()
        if not term:
            return queryset, False
        # Any string is a valid unique or concurrency key ('{tenant-1}/daily',
        # 'payload.export'): the exact matches hold for a term in a payload form too.
        match = handler_match(term) | Q(unique_key=term) | key_match(term)
        # isdigit() alone accepts "²", which int() refuses; ids are ASCII digits.
        if term.isascii() and term.isdigit() and len(term) < 19:
            match |= Q(pk=int(term))
        try:
            leaves = search.payload_leaves(term)
        except search.SearchTermError as exc:
            self.message_user(request, f"Payloads not searched: {exc}", messages.WARNING)
            leaves = None
        if leaves is not None:
            shown = Q(handler__in=display.handlers_with_shown_payloads())
            match |= shown & operations(queryset.db).payload_matches(leaves)
        return queryset.filter(match), False

    # Rows are written by workers and actions only: no add, no delete, no edit
    # form. Change permission still gates the actions (obj is None there).
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and may(request, "change")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return may(request, "view") or may(request, "change")

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        """Only the parameters of this page's list filters (and Django's own, such as ``q``).

        Django allows any lookup on a local field by default, and a list
        whose rows appear or not for ``?last_error__startswith=...`` reads
        out values the user may not see, one character at a time.
        """
        return lookup in self.filter_parameters(request)

    def filter_parameters(self, request: HttpRequest | None) -> set[str]:
        """The query parameters that the list filters of this page read."""
        filters = self.get_list_filter(request) if request is not None else self.list_filter
        names: set[str] = set()
        for item in filters:
            if isinstance(item, type) and issubclass(item, admin.SimpleListFilter):
                names.add(str(item.parameter_name))
            else:  # a field, or (field, filter class): Django's field filters
                field = item[0] if isinstance(item, list | tuple) else item
                names |= {f"{field}__exact", f"{field}__isnull"}
        return names

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        title = str(self.model._meta.verbose_name_plural).capitalize()
        return super().changelist_view(request, {"title": title, **(extra_context or {})})

    # -- the raw JSON of payload and result -------------------------------------

    def get_urls(self) -> list[URLPattern]:
        opts = self.model._meta
        raw = path(
            "<path:object_id>/raw/<str:value>/",
            self.admin_site.admin_view(self.raw_view),
            name=f"{opts.app_label}_{opts.model_name}_raw",
        )
        return [raw, *super().get_urls()]

    def raw_url(self, obj: WorkItem, value: str) -> str | None:
        opts = self.model._meta
        name = f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_raw"
        return reverse(name, args=[quote(obj.pk), value])

    def raw_view(self, request: HttpRequest, object_id: str, value: str) -> HttpResponse:
        """The stored JSON of a row's payload or result, as a download.

        The change page's rules: the user may view work items, the row is
        one of this page's, and the value is not redacted (sensitive or
        unregistered handler). The text is the database's, not re-encoded,
        so a value of any size or depth downloads whole.
        """
        if not self.has_view_permission(request):
            raise PermissionDenied
        if value not in self.raw_values:
            raise Http404(f"No raw download of {value!r}.")
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404("No such work item on this page.")
        if not self.has_view_permission(request, obj) or display.redaction(obj, value):
            raise PermissionDenied
        raw = (
            self.get_queryset(request)
            .filter(pk=obj.pk)
            .annotate(raw=Cast(value, TextField()))
            .values_list("raw", flat=True)
            .first()
        )
        response = HttpResponse(
            "null" if raw is None else raw, content_type="application/json; charset=utf-8"
        )
        response["Content-Disposition"] = f'attachment; filename="work-item-{obj.pk}-{value}.json"'
        response["X-Content-Type-Options"] = "nosniff"
        return response


class _OneStatusAdmin(BaseWorkItemAdmin):
    """A page fixed to one status: no status filter."""

    def get_list_filter(self, request: HttpRequest) -> Any:
        return (QueueFilter, HandlerFilter)


def refuse_parameters(request: HttpRequest) -> None:
    """For pages that take no query parameters: refuse any, as a list refuses unknown lookups."""
    for key in request.GET:
        raise DisallowedModelAdminLookup(f"Filtering by {key} not allowed")


def may(request: HttpRequest, action: str) -> bool:
    """Whether the user holds the ``WorkItem`` permission ``action`` (view, change, ...)."""
    opts = WorkItem._meta
    return bool(request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}"))
