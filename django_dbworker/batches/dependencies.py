"""``after=`` at enqueue: the parents an item waits for, checked and locked as it is written.

An item with unfinished parents is written ``pending`` but ``waiting``, due
at ``completion.waiting_run_after()`` (after every real time), so the claim
statements, their indexes and their plans do not change at all: a waiting
row is simply never due. ``completion.propagate`` makes it due when its last
parent succeeds, or cancels it when one fails or is cancelled.

The parents are locked (in id order) in the enqueue's transaction and
marked ``has_dependents``, so a parent that ends at the same moment either
ends before (the child then sees its final state here) or after the child
commits (its ending then finds the child and propagates to it): never neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import router
from django.db.models.functions import Now

from django_dbworker.batches.completion import propagate_rows, waiting_run_after
from django_dbworker.batches.models import Dependency
from django_dbworker.errors import EnqueueError
from django_dbworker.models import ACTIVE_STATUSES, Status, WorkItem

#: Most parents of one item.
MAX_PARENTS = 1000
#: Ids are BigAutoField values: anything from here on names no row (and would
#: overflow the driver's integer before the database could say so).
MAX_ID = 2**63


def parent_ids(after: Any, using: str | None = None) -> list[int]:
    """The ids ``after=`` names (work items or ids), in order, once each; checked only.

    A work item loaded from another database than ``using`` (the child's) is
    refused: ids are per database, so its id would name another row there.
    """
    if after is None:
        return []
    if isinstance(after, (str, bytes, dict, WorkItem)) or not isinstance(after, Iterable):
        raise EnqueueError(
            f"after= takes a list of work items or their ids, got {type(after).__name__}."
        )
    ids: dict[int, None] = {}  # in order, once each
    for parent in after:
        if isinstance(parent, WorkItem):
            pk = parent.pk
            if pk is None:
                raise EnqueueError("after= names an unsaved work item; enqueue it first.")
            if using is not None and not _same_rows(parent, using):
                raise EnqueueError(
                    f"after= names work item #{pk} of database {parent._state.db!r}; this "
                    f"item goes to {using!r}. An item and its parents share a database."
                )
        elif isinstance(parent, int) and not isinstance(parent, bool):
            pk = parent
        else:
            raise EnqueueError(
                f"after= takes work items or their ids, got {type(parent).__name__} "
                f"{str(parent)[:40]!r}."
            )
        if not 0 < pk < MAX_ID:
            raise EnqueueError(f"after= names work item(s) #{pk} that do not exist.")
        ids[pk] = None
        if len(ids) > MAX_PARENTS:
            raise EnqueueError(f"after= names more items than allowed: at most {MAX_PARENTS}.")
    return list(ids)


def _same_rows(parent: WorkItem, using: str) -> bool:
    """Whether ``parent``'s id names the same row on ``using``: loaded from it, or from a
    database the routers relate to it (a replica of it: ``allow_relation``)."""
    if parent._state.db in (None, using):
        return True
    child = WorkItem()
    child._state.db = using
    return bool(router.allow_relation(parent, child))


@dataclass(frozen=True)
class Parents:
    """What the locked parents said: those still unfinished, the first that ended badly."""

    unfinished: list[int]
    #: (id, status) of the first parent that failed or was cancelled, if any.
    blamed: tuple[int, str] | None


def lock_parents(ids: list[int], using: str) -> Parents:
    """Lock the parents ``ids`` in id order and read them; raises ``EnqueueError`` for an
    id that names no row. Marks the unfinished ones ``has_dependents``. Call it in the
    enqueue's transaction."""
    states = dict(
        WorkItem.objects.using(using)
        .select_for_update()
        .filter(pk__in=ids)
        .order_by("pk")
        .values_list("pk", "status")
    )
    missing = [pk for pk in ids if pk not in states]
    if missing:
        named = ", ".join(f"#{pk}" for pk in missing[:5])
        raise EnqueueError(
            f"after= names work item(s) {named} that do not exist (on database {using!r})."
        )
    blamed = next(
        ((pk, states[pk]) for pk in ids if states[pk] in (Status.FAILED, Status.CANCELLED)),
        None,
    )
    unfinished = [pk for pk in ids if states[pk] in ACTIVE_STATUSES]
    if unfinished and blamed is None:
        WorkItem.objects.using(using).filter(pk__in=unfinished, has_dependents=False).update(
            has_dependents=True
        )
    return Parents(unfinished, blamed)


def shape(item: WorkItem, parents: Parents) -> None:
    """Make the unsaved ``item`` what its parents make it: cancelled, waiting, or due."""
    if parents.blamed is not None:
        parent, state = parents.blamed
        item.status = Status.CANCELLED
        item.finished_at = Now()
        item.last_error = (
            f"Cancelled without running: it runs after work item #{parent}, which ended {state}."
        )
    elif parents.unfinished:
        item.waiting = True
        item.run_after = waiting_run_after()


def link(child: int, parents: Parents, using: str) -> None:
    """Store the links of a waiting ``child`` to its unfinished parents."""
    if parents.blamed is None and parents.unfinished:
        Dependency.objects.using(using).bulk_create(
            [Dependency(child_id=child, parent_id=parent) for parent in parents.unfinished]
        )


def lock_parents_of(ids: list[int], using: str) -> None:
    """Lock the parents of the rows ``ids`` in id order (a retry does, before its UPDATE)."""
    parents = sorted(
        set(
            Dependency.objects.using(using)
            .filter(child_id__in=ids)
            .values_list("parent_id", flat=True)
        )
    )
    if parents:
        list(
            WorkItem.objects.using(using)
            .select_for_update()
            .filter(pk__in=parents)
            .order_by("pk")
            .values_list("pk", flat=True)
        )


def wait_again(ids: list[int], using: str) -> None:
    """Retried rows ``ids`` that have parents wait for the unfinished ones again; a row
    with a parent that failed or was cancelled is cancelled again (retry that parent
    too). Call it in the retry's transaction, after its UPDATE."""
    links = sorted(
        Dependency.objects.using(using)
        .filter(child_id__in=ids)
        .values_list("child_id", "parent_id")
    )
    if not links:
        return
    states = dict(
        WorkItem.objects.using(using)
        .select_for_update()
        .filter(pk__in={parent for _, parent in links})
        .order_by("pk")
        .values_list("pk", "status")
    )
    waits: set[int] = set()
    unfinished: set[int] = set()
    blamed: dict[int, tuple[int, str]] = {}
    for child, parent in links:
        state = states.get(parent)
        if state in ACTIVE_STATUSES:
            waits.add(child)
            unfinished.add(parent)
        elif state in (Status.FAILED, Status.CANCELLED):
            blamed.setdefault(child, (parent, state))
    rows = WorkItem.objects.using(using).filter(status=Status.PENDING)
    rows.filter(pk__in=waits - set(blamed)).update(waiting=True, run_after=waiting_run_after())
    WorkItem.objects.using(using).filter(pk__in=unfinished, has_dependents=False).update(
        has_dependents=True
    )
    for child, (parent, state) in sorted(blamed.items()):
        rows.filter(pk=child).update(
            status=Status.CANCELLED,
            finished_at=Now(),
            updated_at=Now(),
            last_error=(
                f"Cancelled without running: it runs after work item #{parent}, which ended "
                f"{state}; retry that item too."
            ),
        )
    if blamed:
        propagate_rows(sorted(blamed), using)
