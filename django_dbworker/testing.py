"""Helpers for users' own test suites: run enqueued work in-process, inspect it.

``run_until_empty`` runs the real ``Worker`` (burst mode, inline): the same
claim loop, execution and success writer as ``run_workers``, in the calling
thread, so it works inside the test transaction of Django's ``TestCase``.
Handlers' ``timeout`` values are not enforced here (enforcing them needs a second
thread, which would not see the test transaction's rows).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from django.db.models import Count, F
from django.db.models.functions import Now

from django_dbworker.flow.queues import paused_queues
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import WorkItem, WorkItemQuerySet
from django_dbworker.registry import registry
from django_dbworker.routing import work_db_for_read, work_db_for_write
from django_dbworker.worker.runtime import Worker, WorkerConfig

__all__ = ["assert_enqueued", "enqueued", "run_until_empty"]


def _names(handlers: Iterable[str | type[WorkItemHandler]] | None) -> list[str]:
    if handlers is None:
        return [n for n, cls in registry.items() if issubclass(cls, WorkItemHandler)]
    names = []
    for h in handlers:
        name = h if isinstance(h, str) else h.name
        if name not in registry:
            raise ValueError(f"Unknown handler {name!r}. Registered: {', '.join(sorted(registry))}")
        if not issubclass(registry[name], WorkItemHandler):
            raise ValueError(
                f"{name!r} is an own-table Handler, not a WorkItemHandler: run_until_empty "
                "runs enqueued work items only."
            )
        names.append(name)
    return names


def run_until_empty(
    handlers: Iterable[str | type[WorkItemHandler]] | None = None,
    queues: Iterable[str] | None = None,
    *,
    using: str | None = None,
    max_items: int = 100_000,
    include_scheduled: bool = False,
) -> dict[str, int]:
    """Run every claimable item, one at a time; return counts by outcome.

    Drives the real ``Worker`` in burst mode, inline: the same claim loop,
    dispatch, execution and success writer as ``run_workers``, in the
    calling thread and its transaction. Stops when no pending row is due:
    retries after their backoff, snoozed rows and rows enqueued with a later
    ``run_after`` are left pending.

    ``include_scheduled=True`` runs those too, as if their time had come, so
    that a test can drive a failing handler through all its attempts: when
    nothing due is left, every later row of ``handlers``/``queues`` is moved
    back by the span to the earliest ``run_after`` (the rows' clock jumps
    forward; the claim and its order stay ``run_workers``'), the earliest
    run, and so on, in the order their times would come (a retry's backoff
    and a snooze counted from the jump), until no pending row is left that
    a worker could ever claim. Left pending, as ``run_workers`` would leave
    them: rows waiting for their parents (``after=``; they run here once
    their parents succeed), rows of paused queues (their ``run_after`` is
    not changed), and rows a rate limit holds back (the database's clock
    does not move, so a window passes in real time).

    ``max_items`` (attempts, snoozes included) guards against handlers that
    enqueue themselves, snooze or retry forever: past it, a ``RuntimeError``
    names the handlers whose rows remain. Starts a rate limit refused are
    not counted: those rows did not run.
    """
    if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
        raise ValueError(f"run_until_empty(max_items=...) takes an int >= 1, got {max_items!r}.")
    if not isinstance(include_scheduled, bool):
        raise TypeError(
            "run_until_empty(include_scheduled=...) takes True or False, "
            f"got {include_scheduled!r}."
        )
    names = _names(handlers)
    using = work_db_for_write(using)
    queue_names = list(queues) if queues is not None else None
    outcomes: Counter[str] = Counter()
    ran = 0
    made_due = False
    while True:
        limit = max_items - ran
        worker = _burst_worker(names, queue_names, using, limit)
        worker.run()
        # Attempts that ended, not claims: a start a rate limit refused went back
        # to pending without running, as run_workers leaves it.
        this_round = sum(worker.outcomes.values())
        ran += this_round
        outcomes.update({str(outcome): count for outcome, count in worker.outcomes.items()})
        if ran >= max_items or worker.claimed >= limit:
            break
        if made_due and not this_round:
            break  # what came due could not start (a full rate window): it stays pending
        made_due = include_scheduled and _advance_to_next(names, queue_names, using)
        if not made_due:
            break
    if ran >= max_items:
        left = _left(names, queue_names, using, include_scheduled=include_scheduled)
        if left:
            raise RuntimeError(
                f"run_until_empty ran {max_items} items and work remains: {left}. A handler "
                "that enqueues itself, snoozes or retries every time never empties the "
                "queue; raise max_items if the work ends."
            )
    return dict(outcomes)


def _burst_worker(names: list[str], queues: list[str] | None, using: str, limit: int) -> Worker:
    config = WorkerConfig(
        burst=True,
        inline=True,
        # Tuning knobs of the threaded worker mean nothing inline.
        concurrency=1,
        batch_size=1,
        max_abandoned_threads=None,
        queues=queues,
        using=using,
        max_items=limit,
    )
    return Worker([registry[name] for name in names], config)


def _runnable(names: list[str], queues: Sequence[str] | None, using: str) -> WorkItemQuerySet:
    """Pending rows of ``names`` (and ``queues``) that a claim takes once they are due: not
    waiting for parents, not in a paused queue."""
    rows = WorkItem.objects.using(using).pending().filter(handler__in=names, waiting=False)
    if queues is not None:
        rows = rows.filter(queue__in=queues)
    return rows.exclude(queue__in=paused_queues(using))


def _advance_to_next(names: list[str], queues: Sequence[str] | None, using: str) -> bool:
    """Make the earliest runnable row due, bringing the later rows' time forward; whether any.

    When none is due yet, every later row of ``names``/``queues`` (waiting ones
    too) moves back by the same span, so the earliest is due now and the
    others keep their distance to it, and to what a run now schedules (a
    retry's backoff, a snooze): the run order is the order their times would
    come. A row that came due by itself meanwhile (a short backoff) needs no
    move. Paused queues' rows stay as they are. The span is read from the
    database's clock, with a millisecond more, so that SQLite (which stores
    ``Now()`` in milliseconds) finds the earliest due.
    """
    first = (
        _runnable(names, queues, using)
        .order_by("run_after")
        .annotate(now=Now())
        .values_list("run_after", "now")
        .first()
    )
    if first is None:
        return False  # the work has ended
    run_after, now = first
    if run_after <= now:
        return True
    later = WorkItem.objects.using(using).pending().filter(handler__in=names)
    if queues is not None:
        later = later.filter(queue__in=queues)
    later = later.exclude(queue__in=paused_queues(using)).filter(run_after__gt=Now())
    span = run_after - now + timedelta(milliseconds=1)
    later.update(run_after=F("run_after") - span, updated_at=Now())
    return True


def _left(
    names: list[str], queues: Sequence[str] | None, using: str, *, include_scheduled: bool
) -> str:
    """The rows this run would still take, by handler ("" when none)."""
    rows = _runnable(names, queues, using)
    if not include_scheduled:
        rows = rows.filter(run_after__lte=Now())
    counts = rows.values_list("handler").annotate(n=Count("pk")).order_by("handler")
    return ", ".join(f"{n} pending {handler!r}" for handler, n in counts)


def enqueued(handler: str | type[WorkItemHandler], *, using: str | None = None) -> WorkItemQuerySet:
    """Pending rows of ``handler``, oldest first."""
    name = handler if isinstance(handler, str) else handler.name
    return (
        WorkItem.objects.using(work_db_for_read(using))
        .pending()
        .filter(handler=name)
        .order_by("id")
    )


def assert_enqueued(
    handler: str | type[WorkItemHandler],
    payload: Any = None,
    count: int | None = None,
    *,
    using: str | None = None,
) -> list[WorkItem]:
    """Assert pending rows of ``handler`` exist (with ``payload``, ``count`` of them)."""
    items = list(enqueued(handler, using=using))
    name = handler if isinstance(handler, str) else handler.name
    if payload is not None:
        matching = [i for i in items if i.payload == payload]
        if not matching:
            seen = [i.payload for i in items[:10]]
            raise AssertionError(
                f"No pending {name!r} item with payload {payload!r}; pending payloads: {seen}"
            )
        items = matching
    if count is not None and len(items) != count:
        raise AssertionError(f"Expected {count} pending {name!r} item(s), found {len(items)}.")
    if count is None and not items:
        raise AssertionError(f"No pending {name!r} item was enqueued.")
    return items
