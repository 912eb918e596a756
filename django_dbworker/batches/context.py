"""Which batch block the current thread is in: what ``enqueuing`` asks of every enqueue.

A context variable set by ``batch()`` (``block.py``) for its block. An enqueue in the
block's thread joins its batch; one in another thread that copied the context
(``asyncio.to_thread``, ``sync_to_async``) does not, its writes are not the block's;
and a batch's callback, enqueued when the batch completes, joins no batch
(``outside``), whatever block the completing thread is in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from django_dbworker.batches.models import Batch
from django_dbworker.errors import EnqueueError


@dataclass(frozen=True)
class Open:
    batch: Batch
    using: str
    #: The block's thread: a context copied into another thread (asyncio.to_thread,
    #: sync_to_async) would enqueue on that thread's connection, outside the block.
    thread: int


current: ContextVar[Open | None] = ContextVar("dbworker_batch", default=None)


def current_batch_id(using: str) -> int | None:
    """The id of the batch block this thread is in (None outside one, and in another
    thread that copied the block's context: its writes are not the block's).

    Raises ``EnqueueError`` for an enqueue to another database than the batch's.
    """
    open_ = current.get()
    if open_ is None or open_.thread != threading.get_ident():
        return None
    if using != open_.using:
        raise EnqueueError(
            f"This enqueue writes to database {using!r}, its batch #{open_.batch.pk} "
            f"lives on {open_.using!r}: a batch's items share its database."
        )
    return open_.batch.pk


@contextmanager
def outside() -> Iterator[None]:
    """Enqueues in the block join no batch (a batch's callback, enqueued on completion)."""
    token = current.set(None)
    try:
        yield
    finally:
        current.reset(token)
