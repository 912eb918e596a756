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
from typing import Any

from django.db.models import Count
from django.db.models.functions import Now

from django_dbworker import verbs
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
    nothing due is left, the rows of the earliest ``run_after`` are made due
    now by the operators' "run now" verb (``verbs.run_now``: the claim and
    its order stay ``run_workers``'), run, and so on in the order their
    times would come, until no pending row of ``handlers``/``queues`` is
    left that a worker could ever claim. Left pending, as ``run_workers``
    would leave them: rows waiting for their parents (``after=``; they run
    here once their parents succeed) and rows of paused queues (resume the
    queue to run them; their ``run_after`` is not changed). Only ``run_after`` is
    brought forward, not the clock: a rate limit's window still passes in real time,
    so rows it holds back stay pending too.

    ``max_items`` (claims, snoozes and retries included) guards against
    handlers that enqueue themselves, snooze or retry forever: past it, a
    ``RuntimeError`` names the handlers whose rows remain.
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
    while True:
        worker = _burst_worker(names, queue_names, using, max_items - ran)
        worker.run()
        ran += worker.claimed
        outcomes.update({str(outcome): count for outcome, count in worker.outcomes.items()})
        if ran >= max_items:
            break
        if not include_scheduled or not _make_next_due(names, queue_names, using):
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


def _make_next_due(names: list[str], queues: Sequence[str] | None, using: str) -> int:
    """Make the runnable rows of the earliest future ``run_after`` due now; how many.

    The earliest instant is found in Python, on the values as read: an equality on a
    datetime sent back would miss on SQLite, which stores ``Now()`` with milliseconds
    and a parameter with microseconds (text that compares unequal).
    """
    later = _runnable(names, queues, using).filter(run_after__gt=Now()).order_by("run_after", "pk")
    ids: list[int] = []
    first = None
    # A slice: more rows of one instant than that are made due over several rounds.
    for pk, run_after in later.values_list("pk", "run_after")[:1000]:
        if first is None:
            first = run_after
        elif run_after != first:
            break
        ids.append(pk)
    if not ids:
        return 0
    return verbs.run_now(WorkItem.objects.using(using).filter(pk__in=ids))


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
