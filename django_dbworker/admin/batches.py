"""The Batches page: each ``batch()`` block, its progress, its callback's work item.

Read-only, like every page here: batches are written by ``batch()`` and by
the endings that complete them, never by a form. Seeing the page needs the
view (or change) permission on batches or on work items (whoever may see a
batch's items may see the batch).

The list costs a fixed number of queries, whatever the page holds: the
rows, their progress (``batch_stats.batch_progress``: one grouped query
over the page's batches' items) and the states of their callbacks' items
(one query by primary key). Bar and counts are ``progress``'s, which a
work item's page uses too (``relations``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_dbworker.admin import display
from django_dbworker.admin.base import may
from django_dbworker.admin.pagination import EstimatedCountPaginator
from django_dbworker.admin.progress import items_url, progress_bar
from django_dbworker.batches.models import Batch
from django_dbworker.batches.stats import batch_progress
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry

if TYPE_CHECKING:
    _BatchModelAdmin = admin.ModelAdmin[Batch]
else:  # ModelAdmin is generic only in django-stubs
    _BatchModelAdmin = admin.ModelAdmin

#: The state badge's colours: those of the rows' states that mean the same.
STATE_COLOURS = {
    "open": display.STATUS_COLOURS[Status.PENDING.value],
    "completed": display.STATUS_COLOURS[Status.SUCCEEDED.value],
}


def callback_handler_redaction(batch: Batch) -> str | None:
    """Why the callback's payload must not be shown (as ``display.redaction`` for items)."""
    cls = registry.get(batch.on_complete)
    if cls is None:
        return (
            f"(redacted: handler {batch.on_complete} is not registered in this process, "
            "so it cannot be told whether its payload is sensitive)"
        )
    if getattr(cls, "sensitive", False):
        return "(redacted: this handler is marked sensitive)"
    return None


class BatchStateFilter(admin.SimpleListFilter):
    """Open (not completed yet: the partial index ``dbworker_open_batch_idx``) or completed."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("open", "Open"), ("completed", "Completed")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "open":
            return queryset.filter(completed_at__isnull=True)
        if self.value() == "completed":
            return queryset.filter(completed_at__isnull=False)
        return queryset


class _BatchChangeList(ChangeList):
    """Reads the page's progress and callbacks once, for every row of the page."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        return super().get_queryset(request, exclude_parameters).defer("payload")

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        rows = list(self.result_list)
        self.model_admin.load_page(rows)  # type: ignore[attr-defined]
        self.result_list = rows


class BatchAdmin(_BatchModelAdmin):
    """The Batches page and a batch's page: progress, state, the callback's item."""

    list_display = [
        "id",
        "on_complete_display",
        "progress_bar",
        "state",
        "created",
        "callback_link",
    ]
    list_display_links = ["id"]
    list_filter = (BatchStateFilter,)
    search_fields = ["=id"]
    search_help_text = "Exact batch id."
    ordering = ["-id"]
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    actions = None

    class Media:
        css = {"all": ("django_dbworker/admin.css",)}

    fields = (
        "id",
        "on_complete_display",
        "state",
        "created_exact",
        "sealed",
        "completed",
        "progress_bar",
        "items_link",
        "callback_link",
        "payload_pretty",
    )
    readonly_fields = fields

    # -- access: read-only, the batch's or the work items' permissions ----------

    def _may(self, request: HttpRequest, action: str) -> bool:
        opts = Batch._meta
        return bool(request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}"))

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return (
            self._may(request, "view")
            or self._may(request, "change")
            or may(request, "view")
            or may(request, "change")
        )

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        """Only the state filter's parameter (see ``BaseWorkItemAdmin.lookup_allowed``)."""
        return lookup == BatchStateFilter.parameter_name

    # -- the list ----------------------------------------------------------------

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _BatchChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Batch], search_term: str
    ) -> tuple[QuerySet[Batch], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        if term.isascii() and term.isdigit() and len(term) < 19:
            return queryset.filter(pk=int(term)), False
        return queryset.none(), False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        return super().changelist_view(request, {"title": "Batches", **(extra_context or {})})

    def load_page(self, rows: list[Batch]) -> None:
        """Attach the progress and the callback's state to each batch of ``rows``: two queries."""
        db = rows[0]._state.db if rows else None
        progress = batch_progress(rows, using=db)
        callback_ids = [b.callback_id for b in rows if b.callback_id is not None]
        states = dict(
            WorkItem.objects.using(db).filter(pk__in=callback_ids).values_list("pk", "status")
            if callback_ids
            else []
        )
        for b in rows:
            b.dbw_progress = progress[b.pk]  # type: ignore[attr-defined]
            status = states.get(b.callback_id) if b.callback_id is not None else None
            b.dbw_callback_status = status  # type: ignore[attr-defined]

    def _loaded(self, obj: Batch) -> Batch:
        """``obj`` with its progress and callback state (read here for a change page)."""
        if not hasattr(obj, "dbw_progress"):
            self.load_page([obj])
        return obj

    # -- the columns and fields -----------------------------------------------------

    @admin.display(description="on complete", ordering="on_complete")
    def on_complete_display(self, obj: Batch) -> SafeString:
        return format_html('<span title="{}">{}</span>', obj.on_complete, obj.on_complete)

    @admin.display(description="progress")
    def progress_bar(self, obj: Batch) -> SafeString:
        progress = self._loaded(obj).dbw_progress  # type: ignore[attr-defined]
        return progress_bar(progress, items=items_url(obj.pk))

    @admin.display(description="state", ordering="completed_at")
    def state(self, obj: Batch) -> SafeString:
        """Completed (and when), open, or still enqueuing (seen from its block's own view)."""
        if obj.completed_at is not None:
            label, colour, when = "completed", STATE_COLOURS["completed"], obj.completed_at
        elif obj.sealed_at is not None:
            label, colour, when = "open", STATE_COLOURS["open"], None
        else:  # seen only from inside the block's transaction
            label, colour, when = "enqueuing", STATE_COLOURS["open"], None
        return format_html(
            '<span class="dbw-status dbw-batch-{}" style="color:#fff;background:{};'
            'padding:1px 7px;border-radius:8px;white-space:nowrap">{}</span>'
            '<br><small class="dbw-quiet">{}</small>',
            label,
            colour,
            label,
            display.short_timestamp(when) if when is not None else "",
        )

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Batch) -> SafeString | str:
        return display.short_timestamp(obj.created_at)

    @admin.display(description="created")
    def created_exact(self, obj: Batch) -> SafeString | str:
        return display.timestamp(obj.created_at)

    @admin.display(description="completed")
    def completed(self, obj: Batch) -> SafeString | str:
        return display.timestamp(obj.completed_at)

    @admin.display(description="sealed")
    def sealed(self, obj: Batch) -> SafeString | str:
        """When the block exited (its items all enqueued); it completes only after."""
        return display.timestamp(obj.sealed_at)

    @admin.display(description="callback")
    def callback_link(self, obj: Batch) -> SafeString | str:
        """The callback's work item and its state: "-" before completion, "—" once pruned."""
        if obj.callback_id is None:
            return "-"
        status = self._loaded(obj).dbw_callback_status  # type: ignore[attr-defined]
        if status is None:
            return format_html(
                '<span title="Work item #{} (the callback) was pruned.">—</span>', obj.callback_id
            )
        url = reverse("admin:django_dbworker_workitem_change", args=[obj.callback_id])
        colour = display.STATUS_COLOURS.get(status, display.UNKNOWN_STATUS_COLOUR)
        return format_html(
            '<a href="{}">#{}</a><br><small class="dbw-status dbw-{}" style="color:{}">{}</small>',
            url,
            obj.callback_id,
            status,
            colour,
            status,
        )

    @admin.display(description="items")
    def items_link(self, obj: Batch) -> SafeString:
        return format_html(
            '<a href="{}">The work items of batch #{}</a>', items_url(obj.pk), obj.pk
        )

    @admin.display(description="callback payload")
    def payload_pretty(self, obj: Batch) -> SafeString | str:
        """What the callback gets, before the batch id and counts are added."""
        hidden = callback_handler_redaction(obj)
        if hidden is not None:
            return hidden
        return display.pretty_json(obj.payload)
