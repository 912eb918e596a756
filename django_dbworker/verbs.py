"""The operator verbs: cancel, retry, run now; one implementation for every caller.

The admin's actions and row buttons, the model's methods (``item.cancel()``,
``WorkItem.objects.filter(...).retry()``) and the commands all come here. Each verb
is a few UPDATEs narrowed to the eligible states, in one transaction with what the
change sets off (``batches/completion.py``: dependents cancelled, a batch completed;
``batches/dependencies.py``: a retried row waits for its parents again). Rows that
a worker may be writing are locked first in ascending id order, as heartbeats and
outcome writes lock them (``VendorOperations.locked_in_id_order``).

``models.py`` sits below this module (everything here imports it), so its verb
methods import this one when called: the one upward import of the package, named
in the import contracts (pyproject.toml).
"""

from __future__ import annotations

from django.db import IntegrityError, connections, router, transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now

from django_dbworker.batches import completion, dependencies
from django_dbworker.db import operations
from django_dbworker.models import ACTIVE_STATUSES, Status, WorkItem, WorkItemQuerySet


def _write_alias(rows: WorkItemQuerySet) -> str:
    """The alias the verb writes to: the queryset's own, else the routers' for writes."""
    return getattr(rows, "_db", None) or router.db_for_write(WorkItem)


def cancel(rows: WorkItemQuerySet) -> tuple[int, int]:
    """Cancel: pending rows end ``cancelled``, claimed rows are asked to stop.

    Returns (rows cancelled now, claimed rows asked to stop). One transaction on the
    write alias, the rows that may change locked first in ascending id order: a row
    that its own attempt wrote back to pending between the two halves (a retry) would
    otherwise be missed by both, and its cancel lost. Locked, it is either claimed
    (asked) or pending (cancelled), and the attempt's write waits for this one.
    """
    db = _write_alias(rows)
    rows = rows.using(db)
    nested = connections[db].in_atomic_block
    with operations(db).ending_transaction():
        _lock_cancellable(rows, db)
        cancelled, linked = _cancel_pending_rows(rows, db)
        asked = request_cancel(rows)
        # Last: batch rows after every item row, the order endings lock them in.
        _propagate_ended(db, linked, nested)
    return cancelled, asked


def cancel_pending(rows: WorkItemQuerySet) -> int:
    """pending -> cancelled (waiting rows too). Rows in other states are left alone.

    In one transaction with what the endings set off: dependents cancelled, batches
    completed. The ids are read first and the rows' links read back after the UPDATE,
    which waits for a racing ``after=`` enqueue's lock: so a child enqueued meanwhile
    is found too.
    """
    db = _write_alias(rows)
    nested = connections[db].in_atomic_block
    with operations(db).ending_transaction():
        cancelled, linked = _cancel_pending_rows(rows, db)
        _propagate_ended(db, linked, nested)
    return cancelled


def request_cancel(rows: WorkItemQuerySet) -> int:
    """Claimed rows not asked yet get ``cancel_requested_at`` (DB clock); they stay claimed.

    The worker running one learns it with its next heartbeat and sets the handler's
    ``cancel_requested`` for that attempt; the row ends ``cancelled`` if the handler
    then raises (SPEC "Flow control").
    """
    db = _write_alias(rows)
    asked = rows.using(db).filter(status=Status.CLAIMED, cancel_requested_at__isnull=True)
    ids = sorted(asked.values_list("pk", flat=True))
    if not ids:
        return 0
    with operations(db).locked_in_id_order(ids):
        return (
            WorkItem.objects.using(db)
            .filter(pk__in=ids, status=Status.CLAIMED, cancel_requested_at__isnull=True)
            .update(cancel_requested_at=Now(), updated_at=Now())
        )


def retry(rows: WorkItemQuerySet) -> int:
    """failed | cancelled -> pending, attempts and snoozes reset to 0, due now.

    A row whose ``unique_key`` is live again (another row of its handler with that
    key is pending or claimed) is skipped: retrying it would break the unique-work
    guarantee (and the unique index would refuse it). Of several dead rows with one
    key, only the newest is retried, for the same reason. The eligible ids are read
    first, then updated by primary key: MySQL refuses an UPDATE whose subquery reads
    the table it updates (error 1093). A key that came alive between the two (a
    racing enqueue) skips its row instead of failing the others.
    """
    live_twin = WorkItem.objects.filter(
        handler=OuterRef("handler"),
        unique_key=OuterRef("unique_key"),
        status__in=ACTIVE_STATUSES,
    )
    # The write alias for the read as for the update (read-your-writes).
    db = _write_alias(rows)
    dead = (Status.FAILED, Status.CANCELLED)
    eligible = (
        rows.using(db)
        .filter(status__in=dead)
        .exclude(Q(unique_key__isnull=False) & Exists(live_twin))
    )
    ids: set[int] = set()
    newest: dict[tuple[str, str], int] = {}
    for pk, handler, key in eligible.values_list("pk", "handler", "unique_key"):
        if key is None:
            ids.add(pk)
        else:
            newest[(handler, key)] = max(pk, newest.get((handler, key), pk))
    ids.update(newest.values())
    if not ids:
        return 0
    candidates = WorkItem.objects.using(db).filter(status__in=dead)
    changes = {
        "status": Status.PENDING,
        "attempts": 0,
        "run_after": Now(),
        "finished_at": None,
        "claim_token": None,
        # A fresh start: no cancel request, no snoozes counted.
        "cancel_requested_at": None,
        "snoozes": 0,
        "updated_at": Now(),
    }
    # A retried row with parents (after=) waits for them again, in the same
    # transaction: retried with them, it runs after them again. The parents are
    # locked first, as endings lock a parent before its children.
    with operations(db).ending_transaction():
        dependencies.lock_parents_of(sorted(ids), db)
        try:
            with transaction.atomic(using=db):
                changed = candidates.filter(pk__in=sorted(ids)).update(**changes)
        except IntegrityError:
            changed = 0
            for pk in sorted(ids):
                try:
                    with transaction.atomic(using=db):
                        changed += candidates.filter(pk=pk).update(**changes)
                except IntegrityError:
                    continue  # its key is live again: skipped
        dependencies.wait_again(sorted(ids), db)
    return changed


def run_now(rows: WorkItemQuerySet) -> int:
    """pending: make due now (DB clock); not rows waiting for their parents."""
    return rows.pending().filter(waiting=False).update(run_after=Now(), updated_at=Now())


def _lock_cancellable(rows: WorkItemQuerySet, db: str) -> None:
    """Lock the queryset's pending and claimed rows, in ascending id order."""
    live = rows.using(db).filter(status__in=(Status.PENDING, Status.CLAIMED))
    ids = sorted(live.values_list("pk", flat=True))
    for start in range(0, len(ids), 1000):
        chunk = WorkItem.objects.using(db).filter(pk__in=ids[start : start + 1000])
        list(chunk.order_by("pk").select_for_update().values_list("pk", flat=True))


def _cancel_pending_rows(rows: WorkItemQuerySet, db: str) -> tuple[int, list[int]]:
    """``cancel_pending``'s writes: how many, and those in a batch or with dependents."""
    ids = sorted(rows.using(db).pending().values_list("pk", flat=True))
    cancelled = 0
    linked: list[int] = []
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        chosen = WorkItem.objects.using(db).filter(pk__in=chunk)
        cancelled += chosen.filter(status=Status.PENDING).update(
            status=Status.CANCELLED, waiting=False, finished_at=Now(), updated_at=Now()
        )
        linked += (
            chosen.filter(status=Status.CANCELLED)
            .filter(Q(has_dependents=True) | Q(batch__isnull=False))
            .values_list("pk", flat=True)
        )
    return cancelled, linked


def _propagate_ended(db: str, linked: list[int], nested: bool) -> None:
    """What the rows a verb ended set off; once more after the commit of a caller's
    transaction (``nested``), whose isolation level may be stricter."""
    if linked:
        completion.propagate_rows(linked, db)
        if nested:
            completion.propagate_rows_after_commit(linked, db)
