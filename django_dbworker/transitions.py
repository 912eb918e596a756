"""The worker's state changes of a ``WorkItem``, each one filtered UPDATE.

This module owns the worker's side of the life cycle of SPEC.md. Writes
after a claim are fenced: they match ``status='claimed' AND claim_token=<the
claim's token>`` and report whether the row was still theirs, so a late
finisher can never overwrite a newer attempt. The operator's verbs are
queryset methods in ``models.py``; the claim and the success write are
vendor SQL in ``django_dbworker.db``; stale recovery is ``stale.py``
(its names are importable from here too).

All times come from the database clock (``Now()``), never the worker host's.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple
from uuid import UUID

from django.db.models import Case, CharField, F, Q, TextField, Value, When
from django.db.models.functions import Least, Now

from django_dbworker.batches import completion
from django_dbworker.db import operations
from django_dbworker.error_history import WORKER_LOST as WORKER_LOST
from django_dbworker.error_history import with_history
from django_dbworker.errors import MAX_SNOOZES
from django_dbworker.models import (
    Status,
    WorkItem,
    WorkItemQuerySet,
)
from django_dbworker.stale import RECOVERY_BATCH as RECOVERY_BATCH
from django_dbworker.stale import Recovered as Recovered
from django_dbworker.stale import recover_stale as recover_stale

logger = logging.getLogger("django_dbworker.transitions")

#: An attempt: a row id and the claim token of one claim of it.
AttemptKey = tuple[int, UUID]

#: A claim's attempt handed back (a release, a snooze): the claim counted it.
_ATTEMPT_HANDED_BACK = Case(When(attempts__gt=0, then=F("attempts") - 1), default=Value(0))


def _fenced(item: WorkItem) -> WorkItemQuerySet:
    """The row only if it is still claimed under this claim's token."""
    return WorkItem.objects.using(item._state.db).filter(
        pk=item.pk, status=Status.CLAIMED, claim_token=item.claim_token
    )


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
    dependents after its claim is propagated right after (the sweep covers a crash).
    """
    ops = operations(using)
    if not linked:
        rows = ops.succeed_rows(outcomes)
        late = [pk for pk, _, has_dependents in rows if has_dependents]
        if late:
            with ops.ending_transaction():
                completion.propagate(ops.using, ended=late)
        return {(pk, token) for pk, token, _ in rows}
    nested = ops.connection.in_atomic_block  # an atomic handler's: its isolation level
    with ops.ending_transaction():
        rows = ops.succeed_rows(outcomes)
        ended = [pk for pk, _, has_dependents in rows if has_dependents]
        batches = [linked.get(pk) for pk, _, _ in rows]
        # Nested, no probe: at a caller's REPEATABLE READ it is a serialization failure.
        completion.propagate(ops.using, ended=ended, batches=batches, quick=not nested)
    if nested and rows:
        completion.propagate_after_commit(ops.using, ended=ended, batches=batches)
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
            completion.propagate_rows([item.pk], ops.using)
    return ended


def already_succeeded(
    attempts: Collection[AttemptKey], using: str | None = None
) -> set[AttemptKey]:
    """Those of ``attempts`` whose success is recorded already.

    When a success write's connection dies after the commit but before the
    answer, the write is retried and no longer matches ``claimed``;
    ``succeeded`` under the attempt's own token tells it from a fenced one.
    What those endings set off is propagated here (again: it is idempotent),
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
            completion.propagate_rows(sorted(pk for pk, _ in confirmed), ops.using)
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
        error_history=with_history(Value(error), Value(error_class)),
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
        changes["error_history"] = with_history(Value(error), Value(error_class))
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
        error_history=with_history(Value(error), Value(error_class)),
        updated_at=Now(),
    )


def release(items: Iterable[WorkItem], using: str | None = None) -> int:
    """claimed -> pending for rows a stopping worker gives back unfinished.

    The attempt the claim counted is handed back: a release is not a failure.
    A row whose cancellation was requested ends ``cancelled`` instead (in
    the same UPDATE): given back, it would run work an operator cancelled.
    Rows back in pending wake idle workers as an enqueue does: the one that
    holds the wake-up turn may have heard of them only by this worker, which
    claimed them (a stopping worker's buffer, rows shed or given back).
    """
    items = list(items)
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
                # Its place in the claim order kept: a row given back (a paused queue, a
                # full rate window, a stop) goes before the rows that waited behind it.
                run_after=Least(F("run_after"), Now()),
                claim_token=None,
                updated_at=Now(),
            )
        )
        completion.propagate_rows(list(claims), ops.using)  # those that ended cancelled
        if released:
            ops.notify(sorted({item.queue for item in items}), max(item.priority for item in items))
    return released
