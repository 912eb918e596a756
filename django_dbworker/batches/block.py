"""``batch()``: a block whose items share one callback, enqueued once when the last ends.

The block is one transaction on the work table's alias (a savepoint inside
the caller's): the ``Batch`` row, every item enqueued in the block and the
seal commit together, or, if the block raises or the caller's transaction
rolls back, none of them. Items join the batch through a context variable
(``context.py``) that ``enqueuing`` reads, so any enqueue in the block's thread (a
handler's ``enqueue``, ``enqueue_many``, a Django ``@task``'s) belongs to
it; another thread's does not. An empty batch, or one whose items all ended
at enqueue, completes at the seal. Completion itself is ``completion.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from django_dbworker.batches.completion import complete_batches
from django_dbworker.batches.context import Open, current
from django_dbworker.batches.models import Batch
from django_dbworker.db import operations
from django_dbworker.errors import EnqueueError
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import WorkItem
from django_dbworker.payloads import encode_payload
from django_dbworker.registry import registry
from django_dbworker.routing import warn_if_outside_transaction, work_db_for_write

#: Keys of the callback's payload that the batch fills in.
RESERVED_KEYS = ("batch", "succeeded", "failed", "cancelled")


def _callback_handler(on_complete: Any) -> type[WorkItemHandler]:
    name = getattr(on_complete, "name", None) if isinstance(on_complete, type) else on_complete
    cls = registry.get(name) if isinstance(name, str) else None
    if cls is None or not issubclass(cls, WorkItemHandler):
        known = sorted(n for n, c in registry.items() if issubclass(c, WorkItemHandler))
        raise EnqueueError(
            f"batch(on_complete=...) takes a registered WorkItemHandler or its name, "
            f"got {str(on_complete)[:80]!r}. Registered WorkItemHandlers: "
            f"{', '.join(known) or 'none'}."
        )
    return cls


def _callback_payload(payload: Any, db: str) -> dict[str, Any]:
    """The callback's payload as given; refused unless it still fits once the batch adds
    its id and counts (the callback is enqueued, and validated, when the batch completes)."""
    if payload is None:
        return {}
    if not isinstance(payload, Mapping):
        raise EnqueueError(
            f"batch(payload=...) takes a dict (the callback's payload), got "
            f"{type(payload).__name__}."
        )
    taken = [key for key in RESERVED_KEYS if key in payload]
    if taken:
        raise EnqueueError(
            f"batch(payload=...) may not use the key(s) {', '.join(taken)}: the callback's "
            "payload gets the batch id and the counts under those names."
        )
    completed = {**payload, **dict.fromkeys(RESERVED_KEYS, 2**63 - 1)}
    try:
        encode_payload(completed, max_depth=operations(db).max_json_depth)
    except EnqueueError as exc:
        raise EnqueueError(f"batch(payload=...), with the batch's id and counts: {exc}") from None
    return dict(payload)


@contextmanager
def batch(
    on_complete: type[WorkItemHandler] | str, payload: Any = None, *, using: str | None = None
) -> Iterator[Batch]:
    """Every item enqueued in the block belongs to one batch; when the last of them has
    ended (succeeded, failed or cancelled), ``on_complete`` is enqueued once with
    ``payload`` plus ``batch``, ``succeeded``, ``failed`` and ``cancelled``.

    Yields the ``Batch`` row (``b.id``). ``using``: the database of the work
    table (default: the routers' write alias). Blocks do not nest.
    """
    handler = _callback_handler(on_complete)
    if current.get() is not None:
        raise EnqueueError("batch() blocks do not nest: close the open batch first.")
    db = work_db_for_write(using)
    data = _callback_payload(payload, db)
    warn_if_outside_transaction(db)
    with transaction.atomic(using=db):
        row = Batch.objects.using(db).create(
            on_complete=handler.name,
            payload=data,
            queue=handler.queue,
            max_attempts=handler.get_max_attempts(),
        )
        token = current.set(Open(row, db, threading.get_ident()))
        try:
            yield row
        finally:
            current.reset(token)
        total = WorkItem.objects.using(db).filter(batch_id=row.pk).count()
        Batch.objects.using(db).filter(pk=row.pk).update(sealed_at=Now(), total=total)
        row.total = total
        complete_batches([row.pk], db)
    row.refresh_from_db(using=db)
