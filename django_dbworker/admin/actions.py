"""Admin actions: the queryset verbs of ``models``, each a filtered UPDATE.

The selected rows are narrowed to eligible states inside the UPDATE
that changes them, so an action cannot race a worker claiming the row at
that moment, and rows in other states are reported as skipped. The UPDATE
goes to the routers' write alias (``routing.py``), whichever alias the
change list was read from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.http import HttpRequest

from django_dbworker.db import operations
from django_dbworker.models import WorkItem, WorkItemQuerySet
from django_dbworker.routing import work_db_for_write

Action = Callable[[Any, HttpRequest, QuerySet[Any]], None]


def _make(
    name: str, label: str, transition: Callable[[WorkItemQuerySet], int], done: str
) -> Action:
    @admin.action(description=label, permissions=["change"])
    def action(modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        db = work_db_for_write()
        # The selection re-read on the write alias, its rows locked in
        # ascending id order first where the database's plan would not (MySQL:
        # then a claim or a batch of successes cannot deadlock with the
        # action), and the whole tried again if a lock conflict ended it.
        ids = sorted(queryset.using(db).values_list("pk", flat=True))
        selected = len(ids)
        ops = operations(db)

        def apply() -> int:
            with transaction.atomic(using=db), ops.locked_in_id_order(ids):
                return transition(WorkItem.objects.using(db).filter(pk__in=ids))

        try:
            changed = ops.retrying(apply, f"the admin action {name!r}")
        except IntegrityError:
            modeladmin.message_user(
                request,
                "Nothing changed: some selected rows share a unique key, and only one row "
                "per key may be pending at a time. Select one of them.",
                messages.ERROR,
            )
            return
        skipped = selected - changed
        text = f"{changed} work item(s) {done}."
        if skipped > 0:
            text += f" {skipped} skipped: not in a state this action applies to."
        level = messages.SUCCESS if changed else messages.WARNING
        modeladmin.message_user(request, text, level)

    action.__name__ = name
    return action


retry = _make(
    "retry",
    "Retry selected (failed/cancelled → pending)",
    WorkItemQuerySet.retry,
    "set to pending for a new run",
)
cancel = _make(
    "cancel", "Cancel selected (pending → cancelled)", WorkItemQuerySet.cancel, "cancelled"
)
run_now = _make(
    "run_now", "Run selected now (pending: due now)", WorkItemQuerySet.run_now, "made due now"
)
