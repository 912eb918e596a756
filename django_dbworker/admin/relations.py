"""A work item's page: its batch, its parents and its dependents, as links with their states.

``Relations`` is mixed into ``BaseWorkItemAdmin``. The fieldset "Batch and
dependencies" shows only what the row has: its batch (and the batch's
progress), the items it runs after (``after=``: its ``parent_links``) and
those that run after it (``child_links``, read only when the row's
``has_dependents`` says there are any). Dependency rows have no foreign
key constraint, so a linked row may be gone (deleted by hand or pruned):
it shows as ``#id (gone)``.

Bounded, whatever the row's fan-in or fan-out: one query for the batch and
one for its progress, one for the parents and one for the dependents (each
the first ``SHOWN`` with their states, by correlated subqueries on the
primary key), and a count only when there are more than that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import OuterRef, Subquery
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from django_dbworker.admin import display
from django_dbworker.admin.progress import items_url, progress_bar
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.batches.stats import Progress, batch_progress
from django_dbworker.models import Status, WorkItem

if TYPE_CHECKING:
    _Base = admin.ModelAdmin[WorkItem]
else:
    _Base = object

#: The fieldset of the row's batch and dependencies, shown when the row has any.
RELATIONS_FIELDSET = "Batch and dependencies"
#: Parents and dependents listed on a row's page; past that, how many more.
SHOWN = 50


@dataclass
class Linked:
    """Rows linked to one row (its parents, or its dependents): the first ``SHOWN``, and more."""

    #: (id, handler, status); handler and status are None for a row that is gone.
    rows: list[tuple[int, str | None, str | None]] = field(default_factory=list)
    #: Linked rows beyond those in ``rows``.
    more: int = 0


@dataclass
class RowRelations:
    batch: Batch | None = None
    progress: Progress | None = None
    parents: Linked = field(default_factory=Linked)
    dependents: Linked = field(default_factory=Linked)


def _linked(links: Any, other: str) -> Linked:
    """The rows at the ``other`` end (``parent_id`` or ``child_id``) of ``links``."""
    rows = WorkItem.objects.using(links.db).filter(pk=OuterRef(other))
    found = list(
        links.order_by(other)
        .annotate(
            linked_handler=Subquery(rows.values("handler")[:1]),
            linked_status=Subquery(rows.values("status")[:1]),
        )
        .values_list(other, "linked_handler", "linked_status")[: SHOWN + 1]
    )
    more = links.count() - SHOWN if len(found) > SHOWN else 0
    return Linked(found[:SHOWN], more)


def row_relations(item: WorkItem) -> RowRelations:
    """``item``'s batch (with its progress), parents and dependents, read once."""
    db = item._state.db or WorkItem.objects.db
    found = RowRelations()
    if item.batch_id is not None:
        found.batch = Batch.objects.using(db).defer("payload").filter(pk=item.batch_id).first()
        if found.batch is not None:
            found.progress = batch_progress([found.batch], using=db)[found.batch.pk]
    found.parents = _linked(Dependency.objects.using(db).filter(child_id=item.pk), "parent_id")
    if item.has_dependents:
        found.dependents = _linked(
            Dependency.objects.using(db).filter(parent_id=item.pk), "child_id"
        )
    return found


class Relations(_Base):
    """The "Batch and dependencies" fieldset of a work item's page."""

    def relations(self, obj: WorkItem) -> RowRelations:
        cached: RowRelations | None = getattr(obj, "dbw_relations", None)
        if cached is None:
            cached = row_relations(obj)
            obj.dbw_relations = cached  # type: ignore[attr-defined]
        return cached

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None:
            return fieldsets
        found = self.relations(obj)
        shown = [
            name
            for name, present in (
                ("batch_link", obj.batch_id is not None),
                ("parents_display", bool(found.parents.rows)),
                ("dependents_display", bool(found.dependents.rows)),
            )
            if present
        ]
        return [
            (name, {**options, "fields": shown} if name == RELATIONS_FIELDSET else options)
            for name, options in fieldsets
            if name != RELATIONS_FIELDSET or shown
        ]

    def _row_link(self, pk: int, handler: str | None, status: str | None) -> SafeString:
        if status is None:
            return format_html(
                '<span title="{}">#{} (gone)</span>', "No such work item: pruned or deleted.", pk
            )
        url = reverse(f"{self.admin_site.name}:django_dbworker_workitem_change", args=[pk])
        return format_html('<a href="{}">#{}</a> {} {}', url, pk, handler, display.badge(status))

    def _linked_list(self, linked: Linked, lead: SafeString | str = "") -> SafeString:
        items = format_html_join(
            "", "<li>{}</li>", ((self._row_link(*row),) for row in linked.rows)
        )
        more = format_html("<li>… and {} more</li>", linked.more) if linked.more else ""
        return format_html(
            '{}<ul class="dbw-links" style="margin:0;padding-left:1.2em">{}{}</ul>',
            lead,
            items,
            more,
        )

    @admin.display(description="batch")
    def batch_link(self, obj: WorkItem) -> SafeString | str:
        """The row's batch: a link, its callback handler and its progress."""
        found = self.relations(obj)
        if found.batch is None or found.progress is None:
            return format_html(
                '<span title="{}">#{} (gone)</span>', "No such batch: pruned.", obj.batch_id
            )
        url = reverse(f"{self.admin_site.name}:django_dbworker_batch_change", args=[found.batch.pk])
        return format_html(
            '<a href="{}">batch #{}</a> (callback {}){}',
            url,
            found.batch.pk,
            found.batch.on_complete,
            progress_bar(found.progress, items=items_url(found.batch.pk)),
        )

    @admin.display(description="runs after")
    def parents_display(self, obj: WorkItem) -> SafeString:
        """The rows this one waits for (``after=``), with their states."""
        linked = self.relations(obj).parents
        lead: SafeString | str = ""
        if obj.status == Status.PENDING and obj.waiting:
            lead = format_html(
                "<p>{}</p>",
                "Waiting: it is claimed once every one of these has succeeded, and "
                "cancelled without running if one fails or is cancelled.",
            )
        return self._linked_list(linked, lead)

    @admin.display(description="runs before")
    def dependents_display(self, obj: WorkItem) -> SafeString:
        """The rows that wait for this one, with their states."""
        return self._linked_list(self.relations(obj).dependents)
