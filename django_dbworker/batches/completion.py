"""What a row's final state sets off: its waiting dependents, and its batch's callback.

SPEC "Batches and dependencies". ``propagate`` runs inside the transaction
that wrote the final states (the success writer's, a failure's, stale
recovery's, an operator's cancel), so a dependent is released or
cancelled, and a batch's callback enqueued, exactly when that ending
commits, and never if it rolls back.

Nothing here counts up or down. Two finishers of one batch or of one
dependent's parents can commit at the same moment, each seeing the
other's row as still claimed; so the last step takes a lock first (the
batch row; the dependent's row) and reads the rows' states after it. At
READ COMMITTED (forced on MySQL by ``ending_transaction``) that read sees
what the lock's previous holder committed, so of any set of concurrent
finishers the last to take the lock sees every ending. The callback is
inserted by the conditional ``completed_at IS NULL`` update, exactly once.

``sweep`` is the safety net, run by every worker's stale-recovery pass: a
batch whose items were deleted, a dependent whose parent was pruned, or
one whose parent an operator cancelled in a transaction that raced its
enqueue, are propagated there from the rows' states alone.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, OuterRef, Q
from django.db.models.functions import Now

from django_dbworker import metrics
from django_dbworker.batches.context import outside
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.db import operations
from django_dbworker.db.batch_probe import holds_a_pending_item
from django_dbworker.enqueue_options import EnqueueOptions
from django_dbworker.errors import EnqueueError
from django_dbworker.handlers import WorkItemHandler, insert
from django_dbworker.models import ACTIVE_STATUSES, Status, WorkItem
from django_dbworker.registry import registry

logger = logging.getLogger("django_dbworker.batches.completion")

#: Rows and batches one sweep propagates at most.
SWEEP_LIMIT = 500


def _chunks(ids: Iterable[int], size: int = 1000) -> Iterator[list[int]]:
    """``ids`` sorted, ``size`` at a time: a statement's parameters stay far below every
    database's limit (SQLite's 32,766 by default; PostgreSQL's 65,535)."""
    ordered = sorted(set(ids))
    for start in range(0, len(ordered), size):
        yield ordered[start : start + size]


def waiting_run_after() -> datetime:
    """The ``run_after`` of a waiting row: after every real time, so no claim sees it."""
    never = datetime(9999, 12, 30)
    return never.replace(tzinfo=UTC) if settings.USE_TZ else never


def propagate(
    using: str,
    *,
    ended: Collection[int] = (),
    batches: Iterable[int | None] = (),
    quick: bool = False,
) -> None:
    """Release or cancel the dependents of the rows ``ended`` (those that have any), then
    complete the ``batches`` (and those of the dependents cancelled) whose items all ended.

    Call it in the transaction that ended the rows (``ending_transaction``), after
    its writes. Idempotent: it reads every decision from the rows' states.
    ``quick``: see ``complete_batches``.
    """
    touched = {b for b in batches if b is not None}
    if ended:
        touched |= _follow(set(ended), using)
    if touched:
        complete_batches(touched, using, quick=quick)


def propagate_after_commit(
    using: str, *, ended: Collection[int] = (), batches: Iterable[int | None] = ()
) -> None:
    """``propagate`` again once the caller's transaction commits, in one of its own at READ
    COMMITTED: a caller's transaction at a stricter level (an atomic handler's, in a
    project configured so) read the other finishers' rows in its first snapshot."""
    batches = list(batches)

    def again() -> None:
        with operations(using).ending_transaction():
            propagate(using, ended=ended, batches=batches)

    transaction.on_commit(again, using=using, robust=True)


def propagate_rows_after_commit(ids: Collection[int], using: str) -> None:
    """``propagate_rows`` again once the caller's transaction commits, at READ COMMITTED."""
    ids = list(ids)

    def again() -> None:
        with operations(using).ending_transaction():
            propagate_rows(ids, using)

    transaction.on_commit(again, using=using, robust=True)


def propagate_rows(ids: Collection[int], using: str) -> None:
    """``propagate`` for rows whose batch and dependents the caller does not know."""
    rows: list[tuple[int, bool, int | None]] = []
    for chunk in _chunks(ids):
        rows += (
            WorkItem.objects.using(using)
            .filter(pk__in=chunk)
            .filter(Q(has_dependents=True) | Q(batch__isnull=False))
            .values_list("pk", "has_dependents", "batch_id")
        )
    if rows:
        propagate(
            using,
            ended=[pk for pk, has, _ in rows if has],
            batches=[batch for _, _, batch in rows],
        )


def _follow(parents: set[int], using: str) -> set[int]:
    """Propagate to the dependents of ``parents``, transitively; the batches of those cancelled."""
    touched: set[int] = set()
    while parents:
        children: set[int] = set()
        for chunk in _chunks(parents):
            children.update(
                Dependency.objects.using(using)
                .filter(parent_id__in=chunk)
                .values_list("child_id", flat=True)
            )
        cancelled: dict[int, int | None] = {}
        for chunk in _chunks(children):
            cancelled |= _resolve(chunk, using)
        touched |= {batch for batch in cancelled.values() if batch is not None}
        parents = set(cancelled)
    return touched


def _resolve(children: Collection[int], using: str) -> dict[int, int | None]:
    """Lock the waiting ``children`` in id order; release those whose parents all
    succeeded (or are gone), cancel those with a parent that failed or was cancelled.

    Returns the cancelled ones (id -> batch id): their own dependents follow.
    """
    locked = list(
        WorkItem.objects.using(using)
        .select_for_update()
        .filter(pk__in=list(children), status=Status.PENDING, waiting=True)
        .order_by("pk")
        .values_list("pk", "batch_id", "queue", "priority")
    )
    if not locked:
        return {}
    ids = [row[0] for row in locked]
    links = sorted(
        Dependency.objects.using(using)
        .filter(child_id__in=ids)
        .values_list("child_id", "parent_id")
    )
    states = dict(
        WorkItem.objects.using(using)
        .filter(pk__in={parent for _, parent in links})
        .values_list("pk", "status")
    )
    blamed: dict[int, tuple[int, str]] = {}
    unfinished: set[int] = set()
    for child, parent in links:
        state = states.get(parent)
        if state is None or state == Status.SUCCEEDED:
            continue  # gone: no condition (Dependency's docstring says why)
        if state in ACTIVE_STATUSES:
            unfinished.add(child)
        else:
            blamed.setdefault(child, (parent, state))
    rows = WorkItem.objects.using(using).filter(status=Status.PENDING, waiting=True)
    released = [row for row in locked if row[0] not in blamed and row[0] not in unfinished]
    if released:
        rows.filter(pk__in=[row[0] for row in released]).update(
            waiting=False, run_after=Now(), updated_at=Now()
        )
        ops = operations(using)
        for queue in sorted({row[2] for row in released}):
            ops.notify([queue], max(row[3] for row in released if row[2] == queue))
    by_parent: dict[tuple[int, str], list[int]] = {}
    for child, blame in blamed.items():
        by_parent.setdefault(blame, []).append(child)
    for (parent, state), group in sorted(by_parent.items()):
        rows.filter(pk__in=group).update(
            status=Status.CANCELLED,
            waiting=False,
            finished_at=Now(),
            updated_at=Now(),
            last_error=(
                f"Cancelled without running: it runs after work item #{parent}, which ended "
                f"{state}."
            ),
        )
    batch_of = {row[0]: row[1] for row in locked}
    return {child: batch_of[child] for child in blamed}


def complete_batches(batch_ids: Collection[int], using: str, *, quick: bool = False) -> list[int]:
    """Complete the sealed, open batches of ``batch_ids`` none of whose items is pending or
    claimed: lock them in id order, read after the lock, enqueue each callback once.

    ``quick``: first skip the batches with a pending item that this transaction can
    share-lock (``db/batch_probe.py``: not the last ending, and cheap). Only for a
    transaction that ended items and nothing else, after its writes. Returns the ids
    of the batches completed here.
    """
    maybe_last = [
        batch_id
        for batch_id in sorted(set(batch_ids))
        if not (quick and holds_a_pending_item(batch_id, using))
    ]
    if not maybe_last:
        return []
    candidates = list(
        Batch.objects.using(using)
        .select_for_update()
        .filter(pk__in=maybe_last, completed_at__isnull=True, sealed_at__isnull=False)
        .order_by("pk")
    )
    done = []
    for batch in candidates:
        unfinished = WorkItem.objects.using(using).filter(
            batch_id=batch.pk, status__in=ACTIVE_STATUSES
        )
        if not unfinished.exists() and _complete(batch, using):
            done.append(batch.pk)
    return done


def _complete(batch: Batch, using: str) -> bool:
    """Mark ``batch`` complete with its items' counts and insert its callback."""
    counts: dict[str, int] = dict(
        WorkItem.objects.using(using)
        .filter(batch_id=batch.pk)
        .order_by()
        .values_list("status")
        .annotate(n=Count("pk"))
        .values_list("status", "n")
    )
    succeeded = counts.get(Status.SUCCEEDED, 0)
    failed = counts.get(Status.FAILED, 0)
    cancelled = counts.get(Status.CANCELLED, 0)
    won = (
        Batch.objects.using(using)
        .filter(pk=batch.pk, completed_at__isnull=True)
        .update(completed_at=Now(), succeeded=succeeded, failed=failed, cancelled=cancelled)
    )
    if won != 1:
        return False
    payload: dict[str, Any] = {
        **(batch.payload if isinstance(batch.payload, dict) else {}),
        "batch": batch.pk,
        "succeeded": succeeded,
        "failed": failed,
        "cancelled": cancelled,
    }
    callback = _enqueue_callback(batch, payload, using)
    Batch.objects.using(using).filter(pk=batch.pk).update(callback_id=callback.pk)

    def told() -> None:
        # Once committed: a completion that rolls back (and is done again) is not one.
        metrics.default_metrics().batch_completed(batch.on_complete)
        logger.info(
            "Batch #%d complete (%d succeeded, %d failed, %d cancelled): enqueued %s as "
            "work item #%d.",
            batch.pk,
            succeeded,
            failed,
            cancelled,
            batch.on_complete,
            callback.pk,
        )

    transaction.on_commit(told, using=using, robust=True)
    return True


def _enqueue_callback(batch: Batch, payload: dict[str, Any], using: str) -> WorkItem:
    """Insert ``batch``'s callback through the one insert path (validation, span, wake-up),
    in no batch, whatever block this thread is in.

    Nothing here may refuse it: that would roll back the ending that completed the batch
    (a success write, a stale recovery pass, an operator's cancel) and every later try of
    it. So a handler this process has not registered (a ``@task`` callback that a worker of
    other tasks never imported), and a payload the enqueue checks refuse now (the block
    checked it with room for the counts; a lower MAX_PAYLOAD_BYTES since), are inserted as
    they are, by name, with a warning.
    """
    cls = registry.get(batch.on_complete)
    if cls is not None and issubclass(cls, WorkItemHandler):
        options = EnqueueOptions(queue=batch.queue, max_attempts=batch.max_attempts, using=using)
        try:
            with outside():
                return insert(cls, payload, options)[0]
        except EnqueueError as exc:
            why = f"the enqueue checks refuse it ({exc})"
    else:
        why = "it is not a handler of this process"
    logger.warning(
        "Batch #%d: its callback %r: %s; enqueued as it is.", batch.pk, batch.on_complete, why
    )
    item = WorkItem.objects.using(using).create(
        handler=batch.on_complete,
        queue=batch.queue,
        payload=payload,
        max_attempts=batch.max_attempts,
    )
    operations(using).notify([batch.queue], 0)
    return item


def sweep(using: str, *, limit: int = SWEEP_LIMIT) -> None:
    """Propagate, from the rows' states alone, what no ending propagated (see the module doc)."""
    live = WorkItem.objects.using(using).filter(status__in=ACTIVE_STATUSES)
    batches = list(
        Batch.objects.using(using)
        .filter(completed_at__isnull=True, sealed_at__isnull=False)
        .exclude(Exists(live.filter(batch_id=OuterRef("pk"))))
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )
    waiting = list(
        WorkItem.objects.using(using)
        .filter(status=Status.PENDING, waiting=True)
        .exclude(
            Exists(
                Dependency.objects.using(using).filter(
                    child_id=OuterRef("pk"), parent__status__in=ACTIVE_STATUSES
                )
            )
        )
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )
    if not batches and not waiting:
        return
    with operations(using).ending_transaction():
        touched = set(batches)
        cancelled = _resolve(waiting, using) if waiting else {}
        touched |= {batch for batch in cancelled.values() if batch is not None}
        if cancelled:
            touched |= _follow(set(cancelled), using)
        if touched:
            complete_batches(touched, using)
