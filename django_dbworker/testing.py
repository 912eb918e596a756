"""Helpers for users' own test suites: run enqueued work in-process, inspect it.

``run_until_empty`` runs the real ``Worker`` (burst mode, inline): the same
claim loop, execution and success writer as ``run_workers``, in the calling
thread, so it works inside the test transaction of Django's ``TestCase``.
Handlers' ``timeout`` values are not enforced here (enforcing them needs a second
thread, which would not see the test transaction's rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

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
) -> dict[str, int]:
    """Run every claimable item, one at a time; return counts by outcome.

    Drives the real ``Worker`` in burst mode, inline: the same claim loop,
    dispatch, execution and success writer as ``run_workers``, in the
    calling thread and its transaction. Stops when no pending row is due
    (retries scheduled in the future are left pending). ``max_items`` guards
    against handlers that enqueue themselves forever.
    """
    names = _names(handlers)
    using = work_db_for_write(using)
    config = WorkerConfig(
        burst=True,
        inline=True,
        # Tuning knobs of the threaded worker mean nothing inline.
        concurrency=1,
        batch_size=1,
        max_abandoned_threads=None,
        queues=list(queues) if queues is not None else None,
        using=using,
        max_items=max_items,
    )
    worker = Worker([registry[name] for name in names], config)
    worker.run()
    if worker.claimed >= max_items and _claimable(names, config.queues, using):
        raise RuntimeError(f"run_until_empty ran {max_items} items and work remains.")
    return {str(outcome): count for outcome, count in worker.outcomes.items()}


def _claimable(names: list[str], queues: Sequence[str] | None, using: str) -> bool:
    rows = WorkItem.objects.using(using).ready().filter(handler__in=names)
    if queues is not None:
        rows = rows.filter(queue__in=queues)
    return rows.exists()


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
