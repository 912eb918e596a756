"""Queues as operators see them: pause and resume, which queues exist, what they hold.

A pause is a ``QueueState`` row with ``paused``; the claim statements of
every vendor skip such queues (``db/*``), so a pause holds on every worker
from its commit, and across restarts. Running items finish; a worker gives
its buffered, not yet started rows of a paused queue back to pending within
a poll interval (``worker/claim_loop.py``). Resuming wakes idle workers (a
NOTIFY on PostgreSQL), so they claim at once.

A queue is *known* when a work item names it (any status), when it has a
``QueueState`` row, when a registered WorkItem handler has it as its
default ``queue``, or when it is ``"default"``. Pausing a queue nobody has
heard of is almost always a typo, and is refused (``UnknownQueue``) rather
than stored for ever. This module only reads and writes ``QueueState``
rows and counts live rows; it never touches a claimed row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Count
from django.db.models.functions import Now

from django_dbworker import validation
from django_dbworker.db import operations
from django_dbworker.flow.models import QueueState
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.routing import work_db_for_read, work_db_for_write

__all__ = [
    "DEFAULT_QUEUE",
    "QueueInfo",
    "UnknownQueue",
    "known_queues",
    "pause_queue",
    "paused_queues",
    "queue_list",
    "resume_queue",
]

#: The queue of handlers that name none; always known.
DEFAULT_QUEUE = "default"


class UnknownQueue(LookupError):
    """``pause_queue`` / ``resume_queue`` of a name no work item, handler or pause knows."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"Unknown queue {name!r}: no work item, registered handler or earlier pause names "
            "it (dbworker_queue list shows the known queues)."
        )
        self.name = name


@dataclass(frozen=True)
class QueueInfo:
    """One queue's line in ``dbworker_queue list`` and the admin's Queues page."""

    name: str
    paused: bool
    paused_at: datetime | None
    paused_by: str
    #: Rows waiting (due or not) and rows a worker holds, counted exactly.
    pending: int
    claimed: int


def _checked_name(name: object) -> str:
    try:
        return validation.queue_name(name)
    except validation.InvalidValue as exc:
        raise ValueError(f"The queue name {exc}.") from None


def handler_queues() -> set[str]:
    """The default queues of the WorkItem handlers registered in this process."""
    return {
        cls.queue
        for cls in registry.values()
        if isinstance(cls, type) and issubclass(cls, WorkItemHandler)
    }


def known_queues(using: str | None = None) -> set[str]:
    """Every queue name this process can vouch for (see the module's docstring)."""
    db = work_db_for_read(using)
    names = set(operations(db).distinct_queues())
    names |= set(QueueState.objects.using(db).values_list("name", flat=True))
    return names | handler_queues() | {DEFAULT_QUEUE}


def _is_known(name: str, db: str) -> bool:
    # Cheap checks first: the registry, then index probes.
    return (
        name == DEFAULT_QUEUE
        or name in handler_queues()
        or QueueState.objects.using(db).filter(name=name).exists()
        or WorkItem.objects.using(db).filter(queue=name).exists()
    )


def pause_queue(
    name: str, *, by: str = "", using: str | None = None, new: bool = False
) -> QueueState:
    """Pause queue ``name`` on every worker, until ``resume_queue``; returns its state.

    No worker claims its rows from the moment this commits (inside a
    transaction: when that commits). Pausing a paused queue changes nothing
    (the first pause's time and author stay). ``by`` says who paused it
    (the command's ``--by``, the admin user). Raises ``UnknownQueue`` for a
    queue nothing knows, unless ``new`` says the caller means it (a queue the
    next deploy adds, paused before its first item; the command's ``--new``),
    ``ValueError`` for a name no queue could have.
    """
    name = _checked_name(name)
    db = work_db_for_write(using)
    with transaction.atomic(using=db):
        state = QueueState.objects.using(db).select_for_update().filter(name=name).first()
        if state is None:
            if not new and not _is_known(name, db):
                raise UnknownQueue(name)
            # Insert-or-ignore, then lock: two first pauses of one queue at once.
            QueueState.objects.using(db).bulk_create(
                [QueueState(name=name, paused=False)], ignore_conflicts=True
            )
            state = QueueState.objects.using(db).select_for_update().get(name=name)
        if not state.paused:
            QueueState.objects.using(db).filter(name=name).update(
                paused=True, paused_at=Now(), paused_by=by[:255], updated_at=Now()
            )
            state.refresh_from_db(using=db)
    return state


def resume_queue(name: str, *, by: str = "", using: str | None = None) -> QueueState:
    """Let workers claim queue ``name`` again; wakes idle workers when it commits.

    Resuming a running queue changes nothing. ``by`` is accepted for
    symmetry with ``pause_queue`` (a resume keeps no author: ``updated_at``
    says when). Raises ``UnknownQueue`` / ``ValueError`` as ``pause_queue``.
    """
    name = _checked_name(name)
    db = work_db_for_write(using)
    with transaction.atomic(using=db):
        state = QueueState.objects.using(db).select_for_update().filter(name=name).first()
        if state is None:
            if not _is_known(name, db):
                raise UnknownQueue(name)
            return QueueState(name=name, paused=False)
        if state.paused:
            QueueState.objects.using(db).filter(name=name).update(
                paused=False, paused_at=None, paused_by="", updated_at=Now()
            )
            state.refresh_from_db(using=db)
            # Idle workers claim at once instead of at their next poll.
            operations(db).notify([name])
    return state


def paused_queues(using: str | None = None) -> list[str]:
    """The names of the paused queues, sorted (one read of the few QueueState rows)."""
    db = work_db_for_read(using)
    return sorted(QueueState.objects.using(db).filter(paused=True).values_list("name", flat=True))


def queue_list(using: str | None = None) -> list[QueueInfo]:
    """Every known queue with its pause and its pending and claimed rows, by name.

    Three bounded reads: the queue names (a loose index scan), the
    QueueState rows, and one count of the live rows grouped by queue and
    status (the status index reads the pending and claimed rows only,
    never the finished ones).
    """
    db = work_db_for_read(using)
    states = {s.name: s for s in QueueState.objects.using(db).all()}
    counts: dict[tuple[str, str], int] = {}
    live = (
        WorkItem.objects.using(db)
        .filter(status__in=[Status.PENDING, Status.CLAIMED])
        .order_by()
        .values("queue", "status")
        .annotate(n=Count("id"))
    )
    for row in live:
        counts[row["queue"], row["status"]] = row["n"]
    names = known_queues(db) | set(states)
    found = []
    for name in sorted(names):
        state = states.get(name)
        found.append(
            QueueInfo(
                name=name,
                paused=bool(state and state.paused),
                paused_at=state.paused_at if state and state.paused else None,
                paused_by=state.paused_by if state and state.paused else "",
                pending=counts.get((name, Status.PENDING), 0),
                claimed=counts.get((name, Status.CLAIMED), 0),
            )
        )
    return found
