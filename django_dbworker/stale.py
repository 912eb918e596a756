"""Stale recovery: rows of crashed workers back to the queue, or failed.

A row whose heartbeat is older than ``STALE_AFTER`` (database clock) was
claimed by a worker that died or froze; the pass returns it to
``pending`` (the lost run counts as an attempt), fails it when its
attempts are used up, and cancels it when an operator had asked it to
stop. Every UPDATE repeats the staleness condition, so many processes can
run passes at once; what the rows' endings set off (dependents, batches)
is propagated in the pass's transaction, after all its writes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import F, Value
from django.db.models.functions import Concat, Now

from django_dbworker.batches import completion
from django_dbworker.conf import dbworker_settings
from django_dbworker.db import operations
from django_dbworker.error_history import WORKER_LOST, with_history
from django_dbworker.models import Status, WorkItem, WorkItemQuerySet
from django_dbworker.routing import work_db_for_write

logger = logging.getLogger("django_dbworker.transitions")

#: Rows per UPDATE of the stale-recovery pass.
RECOVERY_BATCH = 500


@dataclass
class Recovered:
    """What one stale-recovery pass did."""

    requeued: int = 0
    failed: int = 0
    #: Rows whose cancellation was requested: ended ``cancelled`` instead.
    cancelled: int = 0
    by_handler: dict[str, int] = field(default_factory=dict)
    #: (id, handler) of the rows this pass failed (attempts used up).
    failed_rows: list[tuple[int, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.requeued + self.failed + self.cancelled

    def log(self) -> None:
        if self.total:
            logger.warning(
                "Recovered %d stale work item(s): %d back to pending, %d failed%s.",
                self.total,
                self.requeued,
                self.failed,
                f", {self.cancelled} cancelled (by request)" if self.cancelled else "",
            )


def recover_stale(
    *,
    handlers: Sequence[str] | None = None,
    stale_after: float | None = None,
    using: str | None = None,
    batch_size: int = RECOVERY_BATCH,
    log: bool = True,
) -> Recovered:
    """Return rows of crashed workers to ``pending``, or ``failed`` if attempts are used up.

    Idempotent and safe from many processes at once: each UPDATE repeats the
    staleness condition, so a row recovered by another process (or heartbeated
    meanwhile) is not touched again. The lost run counts as an attempt.
    """
    # One alias for the rows, their settling and the transaction: without
    # one, the routers' write alias (the pass writes).
    using = work_db_for_write(using)
    seconds = float(dbworker_settings.STALE_AFTER if stale_after is None else stale_after)
    base = WorkItem.objects.using(using).stale(timedelta(seconds=seconds))
    if handlers is not None:
        base = base.filter(handler__in=list(handlers))
    message = f"Recovered as stale: no heartbeat for more than {seconds:g}s from worker "
    result = Recovered()
    ops = operations(using)
    # The chunks and their settling in one transaction (the worker's pass is one
    # already): batch rows locked after all the item rows, as endings lock them.
    with ops.ending_transaction():
        ended = _recover_chunks(base, message, using, batch_size, result)
        completion.propagate_rows(ended, ops.using)
    completion.sweep(ops.using)
    if log:
        result.log()
    return result


def _recover_chunks(
    base: WorkItemQuerySet, message: str, using: str | None, batch_size: int, result: Recovered
) -> list[int]:
    """The pass's chunks in ascending id order, each locked whole before it is written
    (``locked_in_id_order``), as every bulk writer locks; the ids of the rows ended."""
    ops = operations(using)
    after = 0
    ended: list[int] = []
    while True:
        batch = list(
            base.filter(pk__gt=after)
            .order_by("pk")
            .values_list("pk", "handler", "attempts", "max_attempts", "cancel_requested_at")[
                :batch_size
            ]
        )
        if not batch:
            break
        after = batch[-1][0]
        by_handler: dict[str, list[int]] = {}
        last: list[tuple[int, str]] = []
        for pk, handler, attempts, max_attempts, requested in batch:
            if requested is not None:
                continue
            by_handler.setdefault(handler, []).append(pk)
            if attempts >= max_attempts:
                last.append((pk, handler))
        with ops.locked_in_id_order([pk for pk, *_ in batch]):
            # The writes skip rows asked to stop, and then every row of the batch asked
            # by now ends cancelled: a request that came after the read above is not
            # lost to a pending row that would run again.
            ended += _recover_batch(base, last, by_handler, message, using, result)
            asked = [(pk, handler) for pk, handler, *_ in batch]
            ended += _cancel_asked(base, asked, message, result)
        if len(batch) < batch_size:
            break
    return ended


def _cancel_asked(
    base: WorkItemQuerySet, asked: list[tuple[int, str]], message: str, result: Recovered
) -> list[int]:
    """Stale rows asked to stop end ``cancelled``: running them again would run work an
    operator cancelled. One read of ``asked`` (the batch), an UPDATE only when any is."""
    lost = Concat(Value(message), F("claimed_by"), Value("; cancelled by request."))
    handlers = dict(asked)
    rows = base.filter(pk__in=list(handlers), cancel_requested_at__isnull=False)
    ids = list(rows.values_list("pk", flat=True))
    if not ids:
        return []
    cancelled = rows.filter(pk__in=ids).update(
        status=Status.CANCELLED,
        finished_at=Now(),
        claim_token=None,
        updated_at=Now(),
        last_error=lost,
        error_history=with_history(lost, Value(WORKER_LOST)),
    )
    result.cancelled += cancelled
    if cancelled:
        for pk in ids:
            handler = handlers[pk]
            result.by_handler[handler] = result.by_handler.get(handler, 0) + 1
    return ids if cancelled else []


def _recover_batch(
    base: WorkItemQuerySet,
    last: list[tuple[int, str]],
    by_handler: dict[str, list[int]],
    message: str,
    using: str | None,
    result: Recovered,
) -> list[int]:
    """One batch of stale rows: those out of attempts failed (their ids returned), the
    others back to pending."""
    ended: list[int] = []
    # Rows whose attempts are used up end failed, in one UPDATE that marks
    # them with a token of this pass (claim tokens are unique), so that
    # exactly the rows this pass failed, and no other recoverer's, are read
    # back for the handlers' attempt_recorded; then the mark goes. Two more
    # statements, only when such rows exist.
    if last:
        lost_failed = Concat(Value(message), F("claimed_by"), Value("; attempts used up."))
        marker = uuid.uuid4()
        candidates = [pk for pk, _ in last]
        failed = (
            base.filter(pk__in=candidates, cancel_requested_at__isnull=True)
            .filter(attempts__gte=F("max_attempts"))
            .update(
                status=Status.FAILED,
                finished_at=Now(),
                claim_token=marker,
                updated_at=Now(),
                last_error=lost_failed,
                error_history=with_history(lost_failed, Value(WORKER_LOST)),
            )
        )
        if failed:
            marked = WorkItem.objects.using(using).filter(pk__in=candidates, claim_token=marker)
            rows = list(marked.values_list("pk", "handler"))
            marked.update(claim_token=None)
            result.failed += len(rows)
            result.failed_rows.extend(rows)
            ended = [pk for pk, _ in rows]
            for _, handler in rows:
                result.by_handler[handler] = result.by_handler.get(handler, 0) + 1
    # The rest go back to pending: one UPDATE per handler (usually one or
    # two), exact counts per handler for the metrics, bounded by the batch.
    lost = Concat(Value(message), F("claimed_by"), Value("."))
    for handler, ids in by_handler.items():
        requeued = (
            base.filter(pk__in=ids, cancel_requested_at__isnull=True)
            .exclude(attempts__gte=F("max_attempts"))
            .update(
                status=Status.PENDING,
                run_after=Now(),
                claim_token=None,
                updated_at=Now(),
                last_error=lost,
                error_history=with_history(lost, Value(WORKER_LOST)),
            )
        )
        result.requeued += requeued
        if requeued:
            result.by_handler[handler] = result.by_handler.get(handler, 0) + requeued
    return ended
