"""Admin actions: the queryset verbs of ``models``, each a filtered UPDATE.

The selected rows are narrowed to eligible states inside the UPDATE
that changes them, so an action cannot race a worker claiming the row at
that moment, and rows in other states are reported as skipped. Cancel
also asks the running (claimed) rows of the selection to stop, and says
how many. The UPDATE
goes to the routers' write alias (``routing.py``), whichever alias the
change list was read from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.contrib import admin, messages
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.http import HttpRequest

from django_dbworker.db import operations
from django_dbworker.models import WorkItem, WorkItemQuerySet
from django_dbworker.routing import work_db_for_write

Action = Callable[[Any, HttpRequest, QuerySet[Any]], None]
T = TypeVar("T")


def _apply(
    modeladmin: Any,
    request: HttpRequest,
    queryset: QuerySet[Any],
    name: str,
    transition: Callable[[WorkItemQuerySet], T],
) -> tuple[T, int] | None:
    """Run ``transition`` on the selection; its answer and how many rows were selected.

    None (after telling the user) when a unique key refused the change.
    """
    db = work_db_for_write()
    # The selection re-read on the write alias, its rows locked in
    # ascending id order first where the database's plan would not (MySQL:
    # then a claim or a batch of successes cannot deadlock with the
    # action), and the whole tried again if a lock conflict ended it.
    ids = sorted(queryset.using(db).values_list("pk", flat=True))
    ops = operations(db)

    def apply() -> T:
        with transaction.atomic(using=db), ops.locked_in_id_order(ids):
            return transition(WorkItem.objects.using(db).filter(pk__in=ids))

    try:
        return ops.retrying(apply, f"the admin action {name!r}"), len(ids)
    except IntegrityError:
        modeladmin.message_user(
            request,
            "Nothing changed: some selected rows share a unique key, and only one row "
            "per key may be pending at a time. Select one of them.",
            messages.ERROR,
        )
        return None


def _make(
    name: str, label: str, transition: Callable[[WorkItemQuerySet], int], done: str
) -> Action:
    @admin.action(description=label, permissions=["change"])
    def action(modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        applied = _apply(modeladmin, request, queryset, name, transition)
        if applied is None:
            return
        changed, selected = applied
        skipped = selected - changed
        text = f"{changed} work item(s) {done}."
        if skipped > 0:
            text += f" {skipped} skipped: not in a state this action applies to."
        level = messages.SUCCESS if changed else messages.WARNING
        modeladmin.message_user(request, text, level)

    action.__name__ = name
    return action


def _cancel_both(rows: WorkItemQuerySet) -> tuple[int, int]:
    return rows.cancel_pending(), rows.request_cancel()


@admin.action(
    description="Cancel selected (pending → cancelled; running: asked to stop)",
    permissions=["change"],
)
def cancel(modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]) -> None:
    """Pending rows end ``cancelled``; claimed ones are asked to stop (SPEC "Flow control").

    The message counts both: the rows cancelled now, and of the others
    (skipped: not pending) the running ones whose handlers are asked to
    stop; they end ``cancelled`` if the handler then raises.
    """
    applied = _apply(modeladmin, request, queryset, "cancel", _cancel_both)
    if applied is None:
        return
    (cancelled, asked), selected = applied
    skipped = selected - cancelled
    text = f"{cancelled} work item(s) cancelled."
    if skipped > 0:
        text += f" {skipped} skipped: not pending"
        if asked:
            text += (
                f"; {asked} of them running, asked to stop (each ends cancelled if its "
                "handler stops)"
            )
        text += "."
    level = messages.SUCCESS if cancelled or asked else messages.WARNING
    modeladmin.message_user(request, text, level)


retry = _make(
    "retry",
    "Retry selected (failed/cancelled → pending)",
    WorkItemQuerySet.retry,
    "set to pending for a new run",
)
run_now = _make(
    "run_now", "Run selected now (pending: due now)", WorkItemQuerySet.run_now, "made due now"
)
