"""Admin actions: the queryset verbs of ``models``, each a filtered UPDATE.

The one place for what an action does and what it reports, whichever way
it is asked for: the list's action on the selected rows, the same action
on every row matching the list's filter ("Select all", in batches), and a
row's button on its change page (``row_buttons``). Each changes rows only
through ``change_rows`` and reports through ``report``.

The selected rows are narrowed to eligible states inside the UPDATE
that changes them, so an action cannot race a worker claiming the row at
that moment, and rows in other states are reported as skipped. The UPDATE
goes to the routers' write alias (``routing.py``), whichever alias the
change list was read from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from django_dbworker import verbs
from django_dbworker.admin import confirm
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem, WorkItemQuerySet
from django_dbworker.routing import work_db_for_write

Action = Callable[[Any, HttpRequest, QuerySet[Any]], HttpResponse | None]


def cancel_rows(queryset: WorkItemQuerySet) -> int:
    """What Cancel does to rows: the list action, select-across and the row button all call this.

    Pending rows end cancelled at once (the count returned); claimed rows
    are asked to stop (``cancel_requested_at``; SPEC "Flow control"), and
    end cancelled if their handler then stops; ``report`` counts those
    apart. Rows in other states are left alone.
    """
    return verbs.cancel(queryset)[0]


#: The states Cancel applies to: its row button shows on rows in them, and
#: select-across reads only them (``cancel_rows`` still decides in its UPDATE).
CANCELLABLE: tuple[str, ...] = (Status.PENDING, Status.CLAIMED)


@dataclass(frozen=True)
class Verb:
    """One operator action: its names, its transition, what it says, the states it applies to."""

    name: str
    #: The row button's text.
    button: str
    #: The list's action menu entry.
    label: str
    transition: Callable[[WorkItemQuerySet], int]
    #: The report's participle: "3 work item(s) cancelled."
    done: str
    statuses: tuple[str, ...]


RETRY = Verb(
    "retry",
    "Retry",
    "Retry selected (failed/cancelled → pending)",
    verbs.retry,
    "set to pending for a new run",
    (Status.FAILED, Status.CANCELLED),
)
CANCEL = Verb(
    "cancel",
    "Cancel",
    "Cancel selected (pending → cancelled; running: asked to stop)",
    cancel_rows,
    "cancelled",
    CANCELLABLE,
)
RUN_NOW = Verb(
    "run_now",
    "Run now",
    "Run selected now (pending: due now)",
    verbs.run_now,
    "made due now",
    (Status.PENDING,),
)
VERBS: dict[str, Verb] = {verb.name: verb for verb in (RETRY, CANCEL, RUN_NOW)}

#: Rows changed per transaction when an action applies to every row that
#: matches the list's filter: each batch holds its row locks briefly, so
#: workers claiming and finishing meanwhile wait at most one batch.
BATCH_SIZE = 1_000
#: Such an action stops after the batch that passes this many seconds and
#: offers to go on from there (a page, not a request that a proxy cuts off).
ACROSS_SECONDS = 20.0

UNIQUE_KEY_CONFLICT = (
    "Nothing changed: some selected rows share a unique key, and only one row "
    "per key may be pending at a time. Select one of them."
)


def change_rows(verb: Verb, ids: Collection[int], db: str) -> int:
    """Apply ``verb`` to the rows ``ids`` in one transaction on ``db``; how many changed.

    The rows are locked in ascending id order first where the database's
    plan would not (MySQL: then a claim or a batch of successes cannot
    deadlock with the action), and the whole is tried again if a lock
    conflict ended it.
    """
    ordered = sorted(ids)
    ops = operations(db)

    def apply() -> int:
        with transaction.atomic(using=db), ops.locked_in_id_order(ordered):
            return verb.transition(WorkItem.objects.using(db).filter(pk__in=ordered))

    return ops.retrying(apply, f"the admin action {verb.name!r}")


def report(
    modeladmin: Any,
    request: HttpRequest,
    verb: Verb,
    changed: int,
    read: int,
    *,
    asked: int = 0,
) -> None:
    """Tell the user how many of the ``read`` rows ``verb`` changed and how many it skipped.

    ``asked``: for Cancel, the skipped rows that are running and now asked
    to stop (they end cancelled if their handler stops).
    """
    skipped = read - changed
    text = f"{changed} work item(s) {verb.done}."
    if skipped > 0 and verb is CANCEL:
        text += f" {skipped} skipped: not pending"
        if asked:
            text += (
                f"; {asked} of them running, asked to stop (each ends cancelled if its "
                "handler stops)"
            )
        text += "."
    elif skipped > 0:
        text += f" {skipped} skipped: not in a state this action applies to."
    level = messages.SUCCESS if changed or asked else messages.WARNING
    modeladmin.message_user(request, text, level)


def asked_to_stop(ids: Collection[int], db: str) -> int:
    """Of ``ids``, the running rows asked to stop (what Cancel's report counts apart)."""
    return (
        WorkItem.objects.using(db)
        .filter(pk__in=list(ids), status=Status.CLAIMED, cancel_requested_at__isnull=False)
        .count()
    )


def run_selected(
    modeladmin: Any, request: HttpRequest, verb: Verb, queryset: QuerySet[Any]
) -> None:
    """``verb`` on the rows of ``queryset`` (a selection, or one row), reported."""
    db = work_db_for_write()
    # The selection re-read on the write alias.
    ids = sorted(queryset.using(db).values_list("pk", flat=True))
    try:
        changed = change_rows(verb, ids, db)
    except IntegrityError:
        modeladmin.message_user(request, UNIQUE_KEY_CONFLICT, messages.ERROR)
        return
    asked = asked_to_stop(ids, db) if verb is CANCEL else 0
    report(modeladmin, request, verb, changed, len(ids), asked=asked)


@dataclass(frozen=True)
class BatchRun:
    changed: int
    #: Rows read in eligible states (changed + skipped).
    read: int
    #: Where to go on from (ids below this one), when the time ran out first.
    before: int | None


def run_in_batches(
    verb: Verb, queryset: QuerySet[Any], before: int | None = None, seconds: float | None = None
) -> BatchRun:
    """``verb`` on every row of ``queryset`` in an eligible state, ``BATCH_SIZE`` at a time.

    Every matching row, not only the first ``pagination.CAP`` that the list
    counts: the operator asked for all of them, and the confirmation page
    said "at least". Rows go newest first (descending id, as the lists
    show them, and as ``retry`` prefers the newest row of a unique key),
    each batch through ``change_rows`` in its own transaction. The id
    cursor moves past each batch, so a row that still matches after the
    change (Run now) is not taken twice, and rows that start to match
    behind the cursor are left for another run. A batch that a unique key
    refuses is done again row by row, the refused rows counted as skipped.
    """
    db = work_db_for_write()
    limit = ACROSS_SECONDS if seconds is None else seconds
    deadline = time.monotonic() + limit
    rows = queryset.using(db).filter(status__in=verb.statuses).order_by("-pk")
    changed = read = 0
    while True:
        page = rows if before is None else rows.filter(pk__lt=before)
        ids = list(page.values_list("pk", flat=True)[:BATCH_SIZE])
        if not ids:
            return BatchRun(changed, read, None)
        try:
            changed += change_rows(verb, ids, db)
        except IntegrityError:
            # A unique key of the batch is live (again): row by row, the
            # rows that conflict skipped.
            for pk in ids:
                with contextlib.suppress(IntegrityError):
                    changed += change_rows(verb, [pk], db)
        read += len(ids)
        before = min(ids)
        if len(ids) < BATCH_SIZE:
            return BatchRun(changed, read, None)
        if time.monotonic() >= deadline:
            return BatchRun(changed, read, before)


def _select_across(request: HttpRequest) -> bool:
    """Whether the user chose "Select all" (Django's hidden ``select_across`` field)."""
    # A call from code (a request-less call of the action) selects no more than given.
    post = getattr(request, "POST", None) or {}
    return bool(forms.BooleanField(required=False).clean(post.get("select_across")))


def _make(verb: Verb) -> Action:
    @admin.action(description=verb.label, permissions=["change"])
    def action(
        modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]
    ) -> HttpResponse | None:
        if not _select_across(request):
            run_selected(modeladmin, request, verb, queryset)
            return None
        # Every row matching the filter: first a page that says how many,
        # then, confirmed, the batches.
        if request.POST.get("post") != "yes":
            return confirm.confirmation_page(modeladmin, request, verb, queryset)
        # A run that stopped for time goes on below its cursor, its counts carried.
        before, changed, read = confirm.progress(request)
        result = run_in_batches(verb, queryset, before)
        done = BatchRun(changed + result.changed, read + result.read, result.before)
        if done.before is not None:
            return confirm.confirmation_page(modeladmin, request, verb, queryset, done=done)
        report(modeladmin, request, verb, done.changed, done.read)
        return None

    action.__name__ = verb.name
    return action


retry = _make(RETRY)
cancel = _make(CANCEL)
run_now = _make(RUN_NOW)
