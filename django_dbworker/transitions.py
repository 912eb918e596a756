"""The worker's state changes of a ``WorkItem``, each one filtered UPDATE.

This module owns the worker's side of the life cycle of SPEC.md. Writes
after a claim are fenced: they match ``status='claimed' AND claim_token=<the
claim's token>`` and report whether the row was still theirs, so a late
finisher can never overwrite a newer attempt. The operator's verbs are
queryset methods in ``models.py``; the claim and the success write are
vendor SQL in ``django_dbworker.db``.

All times come from the database clock (``Now()``), never the worker host's.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple
from uuid import UUID

from django.db.models import Case, CharField, F, Q, TextField, Value, When
from django.db.models.functions import Concat, JSONObject, Now

from django_dbworker import completion
from django_dbworker.conf import dbworker_settings
from django_dbworker.db import operations
from django_dbworker.db.expressions import AppendCapped
from django_dbworker.errors import MAX_SNOOZES
from django_dbworker.models import (
    ERROR_HISTORY_LIMIT,
    Status,
    WorkItem,
    WorkItemQuerySet,
)

logger = logging.getLogger("django_dbworker.transitions")

#: An attempt: a row id and the claim token of one claim of it.
AttemptKey = tuple[int, UUID]

#: Rows per UPDATE of the stale-recovery pass.
RECOVERY_BATCH = 500
#: ``error_history``'s class path for an attempt whose worker stopped heartbeating.
WORKER_LOST = "django_dbworker.errors.WorkerLost"
#: A claim's attempt handed back (a release, a snooze): the claim counted it.
_ATTEMPT_HANDED_BACK = Case(When(attempts__gt=0, then=F("attempts") - 1), default=Value(0))


def _fenced(item: WorkItem) -> WorkItemQuerySet:
    """The row only if it is still claimed under this claim's token."""
    return WorkItem.objects.using(item._state.db).filter(
        pk=item.pk, status=Status.CLAIMED, claim_token=item.claim_token
    )


def _with_history(error: Any, class_path: Any) -> AppendCapped:
    """``error_history`` with the attempt that just ended appended (DB values, DB clock)."""
    entry = JSONObject(
        attempt=F("attempts"),
        worker=F("claimed_by"),
        started_at=F("claimed_at"),
        finished_at=Now(),
        exception_class_path=class_path,
        error=error,
    )
    return AppendCapped(F("error_history"), entry, limit=ERROR_HISTORY_LIMIT)


# -- worker transitions (fenced) ----------------------------------------------------


class Beat(NamedTuple):
    """What one heartbeat found: the attempts still held, and those asked to stop."""

    held: set[AttemptKey]
    #: Held attempts whose row has ``cancel_requested_at`` set.
    cancel_requested: set[AttemptKey]


def beat(claims: Collection[AttemptKey], using: str | None = None) -> Beat:
    """Refresh ``heartbeat_at`` of the attempts ``(id, claim_token)`` still held, in one
    statement for a process (``VendorOperations.heartbeat``) that also says which have a
    cancel request; an older attempt of a row (another token) is neither held nor asked.
    """
    if not claims:
        return Beat(set(), set())
    wanted = set(claims)
    held: set[AttemptKey] = set()
    asked: set[AttemptKey] = set()
    for pk, token, requested in operations(using).heartbeat(wanted):
        key = (pk, token)
        if key in wanted:
            held.add(key)
            if requested:
                asked.add(key)
    return Beat(held, asked)


def heartbeat(claims: Collection[AttemptKey], using: str | None = None) -> set[AttemptKey]:
    """``beat(claims).held``: the attempts still held, their heartbeats refreshed."""
    return beat(claims, using).held


def succeed(
    outcomes: Sequence[tuple[int, UUID, str | None]],
    using: str | None = None,
    *,
    linked: Mapping[int, int | None] | None = None,
) -> set[AttemptKey]:
    """claimed -> succeeded for every attempt still held; returns those recorded.

    ``outcomes`` holds ``(id, claim_token, result as JSON text or None)``.
    The one way a success is written (the success writer's batches, an atomic
    handler's row in its transaction): one fenced statement; a re-claimed row's
    attempt is not in the answer.

    ``linked`` (``linked_rows``: row id -> batch id, from the claim): their write and
    what it sets off (dependents, batch) are one transaction. A row that gained
    dependents after its claim is settled right after (the sweep covers a crash).
    """
    ops = operations(using)
    if not linked:
        rows = ops.succeed_rows(outcomes)
        late = [pk for pk, _, has_dependents in rows if has_dependents]
        if late:
            with ops.ending_transaction():
                completion.settle(ops.using, ended=late)
        return {(pk, token) for pk, token, _ in rows}
    nested = ops.connection.in_atomic_block  # an atomic handler's: its isolation level
    with ops.ending_transaction():
        rows = ops.succeed_rows(outcomes)
        ended = [pk for pk, _, has_dependents in rows if has_dependents]
        batches = [linked.get(pk) for pk, _, _ in rows]
        # Nested, no probe: at a caller's REPEATABLE READ it is a serialization failure.
        completion.settle(ops.using, ended=ended, batches=batches, quick=not nested)
    if nested and rows:
        completion.settle_after_commit(ops.using, ended=ended, batches=batches)
    return {(pk, token) for pk, token, _ in rows}


def linked_rows(items: Iterable[WorkItem]) -> dict[int, int | None]:
    """``succeed``'s ``linked`` for claimed ``items``: those in a batch or with dependents."""
    return {
        item.pk: item.batch_id
        for item in items
        if item.batch_id is not None or item.__dict__.get("has_dependents")
    }


def _ending(item: WorkItem, rows: WorkItemQuerySet, **changes: Any) -> bool:
    """``rows`` (the fenced row of ``item``) updated to a final state with ``changes``,
    and what that ending sets off (``completion``), in one transaction."""
    ops = operations(item._state.db)
    with ops.ending_transaction():
        ended = rows.update(**changes) == 1
        if ended:
            completion.settle_rows([item.pk], ops.using)
    return ended


def already_succeeded(
    attempts: Collection[AttemptKey], using: str | None = None
) -> set[AttemptKey]:
    """Those of ``attempts`` whose success is recorded already.

    When a success write's connection dies after the commit but before the
    answer, the write is retried and no longer matches ``claimed``;
    ``succeeded`` under the attempt's own token tells it from a fenced one.
    What those endings set off is settled here (again: it is idempotent),
    since the lost answer may have hidden dependents found after the claim.
    """
    if not attempts:
        return set()
    rows = WorkItem.objects.using(using).filter(
        pk__in={pk for pk, _ in attempts},
        claim_token__in={token for _, token in attempts},
        status=Status.SUCCEEDED,
    )
    confirmed = set(attempts) & set(rows.values_list("pk", "claim_token"))
    if confirmed:
        ops = operations(using)
        with ops.ending_transaction():
            completion.settle_rows(sorted(pk for pk, _ in confirmed), ops.using)
    return confirmed


def _back_to_pending(rows: WorkItemQuerySet, *, delay: float, **changes: Any) -> bool:
    """The fenced ``rows`` -> pending, due ``delay`` s from now (DB clock), claim cleared:
    a retry's and a snooze's write. Never a row asked to stop (``cancel_running``'s)."""
    return (
        rows.filter(cancel_requested_at__isnull=True).update(
            status=Status.PENDING,
            run_after=Now() + timedelta(seconds=max(0.0, delay)),
            claim_token=None,
            updated_at=Now(),
            **changes,
        )
        == 1
    )


def retry_later(
    item: WorkItem, *, delay: float, error: str, error_class: str = "builtins.Exception"
) -> bool:
    """claimed -> pending, due ``delay`` seconds from now (DB clock). False if fenced out.

    The attempt joins ``error_history`` (``error_class``: the exception's
    class path) in the same UPDATE. False too for a row asked to stop.
    """
    return _back_to_pending(
        _fenced(item),
        delay=delay,
        last_error=error,
        error_history=_with_history(Value(error), Value(error_class)),
    )


def snooze(item: WorkItem, *, delay: float, limit: int = MAX_SNOOZES) -> bool:
    """claimed -> pending, due ``delay`` s from now, ``attempts`` as before the claim,
    ``snoozes`` + 1, no error recorded. False if fenced out, asked to stop, or if the row
    snoozed ``limit`` times already (the caller then fails it).
    """
    return _back_to_pending(
        _fenced(item).filter(snoozes__lt=limit),
        delay=delay,
        attempts=_ATTEMPT_HANDED_BACK,
        snoozes=F("snoozes") + 1,
    )


def fail(
    item: WorkItem,
    *,
    error: str,
    error_class: str = "builtins.Exception",
    history: bool = True,
    unless_cancel_requested: bool = False,
) -> bool:
    """claimed -> failed, the attempt joining ``error_history``. False if fenced out.

    ``history=False`` leaves ``error_history`` alone: the last-resort
    failure record, written when the database refused the full one.
    ``unless_cancel_requested``: not a row asked to stop (False then too).
    """
    changes: dict[str, Any] = {"last_error": error}
    if history:
        changes["error_history"] = _with_history(Value(error), Value(error_class))
    rows = _fenced(item)
    if unless_cancel_requested:
        rows = rows.filter(cancel_requested_at__isnull=True)
    return _ending(
        item,
        rows,
        status=Status.FAILED,
        finished_at=Now(),
        claim_token=None,
        updated_at=Now(),
        **changes,
    )


def cancel_running(
    item: WorkItem, *, error: str, error_class: str, requested: bool = False
) -> bool:
    """claimed -> cancelled (not retried), the attempt joining ``error_history``. False if
    fenced out; ``requested``: only a row asked to stop (a refused retry's fallback).
    """
    rows = _fenced(item)
    if requested:
        rows = rows.filter(cancel_requested_at__isnull=False)
    return _ending(
        item,
        rows,
        status=Status.CANCELLED,
        finished_at=Now(),
        claim_token=None,
        last_error=error,
        error_history=_with_history(Value(error), Value(error_class)),
        updated_at=Now(),
    )


def release(items: Iterable[WorkItem], using: str | None = None) -> int:
    """claimed -> pending for rows a stopping worker gives back unfinished.

    The attempt the claim counted is handed back: a release is not a failure.
    A row whose cancellation was requested ends ``cancelled`` instead (in
    the same UPDATE): given back, it would run work an operator cancelled.
    """
    claims = {item.pk: item.claim_token for item in items}
    if not claims:
        return 0
    asked = Q(cancel_requested_at__isnull=False)
    ops = operations(using)
    with ops.ending_transaction(), ops.locked_in_id_order(claims):
        released = (
            WorkItem.objects.using(using)
            .filter(
                pk__in=list(claims), claim_token__in=list(claims.values()), status=Status.CLAIMED
            )
            .update(
                status=Case(
                    When(asked, then=Value(Status.CANCELLED)),
                    default=Value(Status.PENDING),
                    output_field=CharField(),
                ),
                finished_at=Case(When(asked, then=Now()), default=None),
                last_error=Case(
                    When(asked, then=Value("cancelled by request: released by a stopping worker")),
                    default=F("last_error"),
                    output_field=TextField(),
                ),
                attempts=_ATTEMPT_HANDED_BACK,
                run_after=Now(),
                claim_token=None,
                updated_at=Now(),
            )
        )
        completion.settle_rows(list(claims), ops.using)  # those that ended cancelled
    return released


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
    seconds = float(dbworker_settings.STALE_AFTER if stale_after is None else stale_after)
    base = WorkItem.objects.using(using).stale(timedelta(seconds=seconds))
    if handlers is not None:
        base = base.filter(handler__in=list(handlers))
    message = f"Recovered as stale: no heartbeat for more than {seconds:g}s from worker "
    result = Recovered()
    ops = operations(using)
    after = 0
    ended: list[int] = []
    # Batches in ascending id order, each locked whole before it is written
    # (locked_in_id_order): a pass's locks, one transaction, are taken in one
    # ascending order, as every bulk writer takes them: no deadlock with them.
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
        asked: list[tuple[int, str]] = []
        for pk, handler, attempts, max_attempts, requested in batch:
            if requested is not None:
                asked.append((pk, handler))
                continue
            by_handler.setdefault(handler, []).append(pk)
            if attempts >= max_attempts:
                last.append((pk, handler))
        with ops.locked_in_id_order([pk for pk, *_ in batch]):
            ended += _cancel_asked(base, asked, message, result) if asked else []
            ended += _recover_batch(base, last, by_handler, message, using, result)
        if len(batch) < batch_size:
            break
    # Once, after every chunk: batch rows locked after all the item rows, as endings do.
    with ops.ending_transaction():
        completion.settle_rows(ended, ops.using)
    completion.sweep(ops.using)
    if log:
        result.log()
    return result


def _cancel_asked(
    base: WorkItemQuerySet, asked: list[tuple[int, str]], message: str, result: Recovered
) -> list[int]:
    """Stale rows asked to stop end ``cancelled``: running them again would run work an
    operator cancelled. Only when such rows exist."""
    lost = Concat(Value(message), F("claimed_by"), Value("; cancelled by request."))
    handlers = dict(asked)
    rows = base.filter(pk__in=list(handlers), cancel_requested_at__isnull=False)
    ids = list(rows.values_list("pk", flat=True))
    cancelled = rows.filter(pk__in=ids).update(
        status=Status.CANCELLED,
        finished_at=Now(),
        claim_token=None,
        updated_at=Now(),
        last_error=lost,
        error_history=_with_history(lost, Value(WORKER_LOST)),
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
            base.filter(pk__in=candidates)
            .filter(attempts__gte=F("max_attempts"))
            .update(
                status=Status.FAILED,
                finished_at=Now(),
                claim_token=marker,
                updated_at=Now(),
                last_error=lost_failed,
                error_history=_with_history(lost_failed, Value(WORKER_LOST)),
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
            base.filter(pk__in=ids)
            .exclude(attempts__gte=F("max_attempts"))
            .update(
                status=Status.PENDING,
                run_after=Now(),
                claim_token=None,
                updated_at=Now(),
                last_error=lost,
                error_history=_with_history(lost, Value(WORKER_LOST)),
            )
        )
        result.requeued += requeued
        if requeued:
            result.by_handler[handler] = result.by_handler.get(handler, 0) + requeued
    return ended
