"""Wake-ups: this process's worker callbacks, and what a cross-process wake-up says.

``VendorOperations.notify`` (``base.py``) calls ``wake_local`` when an
enqueue commits, so a worker in the same process claims at once, also where
the database has no cross-process wake-ups (SQLite, MySQL). The worker's
wake-up code adds and removes its callback. Nothing here touches the
database; this module must not import anything of the package.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

#: Callbacks of this process's workers, given the queue names of each enqueue
#: committed in this process (``VendorOperations.notify``).
_local_wakers: set[Callable[[Sequence[str]], None]] = set()
_local_wakers_lock = threading.Lock()

logger = logging.getLogger("django_dbworker.db")


def add_local_waker(callback: Callable[[Sequence[str]], None]) -> None:
    """Call ``callback(queues)`` after each enqueue this process commits."""
    with _local_wakers_lock:
        _local_wakers.add(callback)


def remove_local_waker(callback: Callable[[Sequence[str]], None]) -> None:
    with _local_wakers_lock:
        _local_wakers.discard(callback)


def has_local_wakers() -> bool:
    """Whether any worker of this process is waiting to be woken (a lock-free peek)."""
    return bool(_local_wakers)


def wake_local(queues: Sequence[str]) -> None:
    """Wake this process's workers for ``queues``; a failing callback only costs latency."""
    with _local_wakers_lock:
        callbacks = list(_local_wakers)
    for callback in callbacks:
        try:
            callback(queues)
        except Exception:
            logger.debug("Ignoring an error in a local wake-up.", exc_info=True)


# What a cross-process wake-up says: the queue of the committed rows, and
# their priority. PostgreSQL's NOTIFY carries a text payload: the queue name
# alone for rows of priority 0 (what every earlier version sent), else
# "<queue> <priority>" (a queue name holds no space). Workers use the
# priority to claim an urgent row ahead of the bulk work they have
# buffered (worker/claim_loop.py).


def wake_payload(queue: str, priority: int = 0) -> str:
    return queue if priority == 0 else f"{queue} {priority}"


def parse_wake_payload(payload: str) -> tuple[str, int]:
    """``(queue, priority)``; a payload that names no valid priority announces 0."""
    queue, _, priority = payload.partition(" ")
    try:
        return queue, int(priority) if priority else 0
    except ValueError:
        return queue, 0
