"""Wake-ups that do not serialise commits: at most one per queue per window, after the commit.

PostgreSQL takes a database-wide lock at commit for every transaction that
issued NOTIFY (to keep its notification queue in commit order), so a
NOTIFY inside every enqueue serialises concurrent enqueuers.
With ``WAKEUP_WINDOW`` above 0 an enqueue runs without its NOTIFY; once it
has committed (``transaction.on_commit``; in autocommit at once) this
process sends ``pg_notify`` as a statement of its own, unless it already
sent one for that queue, of a priority at least as high, within the
window. A worker claims once more ``WAKEUP_WINDOW`` seconds after each
wake-up it receives (``worker/wakeup.py``), so a row whose wake-up was
skipped (committed within the window after one that was sent) is claimed
by that trailing claim, and a busy worker finds it when it next claims.

``WAKEUPS`` False sends nothing (workers poll). Holds no SQL: the vendor's
operations pass the statement that sends (``send``). A failed send costs
latency only: the caller's data is committed, and workers still poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import transaction

from django_dbworker.conf import dbworker_settings

logger = logging.getLogger("django_dbworker.db")

#: How an enqueue sends its wake-up (``mode()``).
IN_TRANSACTION = "in transaction"  # WAKEUP_WINDOW 0: inside the enqueue, as always
AFTER_COMMIT = "after commit"  # WAKEUP_WINDOW > 0: after the commit, at most one per window
OFF = "off"  # WAKEUPS False: none (only this process's own workers are woken)


def mode() -> str:
    """How enqueues wake workers of other processes now (the settings are read each time)."""
    if not dbworker_settings.WAKEUPS:
        return OFF
    return AFTER_COMMIT if dbworker_settings.WAKEUP_WINDOW > 0 else IN_TRANSACTION


class WakeWindow:
    """What this process sent last per (alias, queue): when, and of which priority."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._sent: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()
        #: A failed send was logged as a warning (later ones go to debug).
        self.warned = threading.Event()

    def due(self, using: str, queue: str, priority: int, window: float) -> bool:
        """Whether to send a wake-up for a row of ``priority`` now; if so, it counts as sent.

        Skipped only when one was sent within ``window`` seconds with a
        priority at least as high: an urgent row always wakes workers at once.
        """
        now = self.clock()
        key = (using, queue)
        with self._lock:
            last = self._sent.get(key)
            if last is not None and now - last[0] < window and last[1] >= priority:
                return False
            self._sent[key] = (now, priority)
            return True

    def clear(self) -> None:
        """Forget every wake-up sent, and the warning (a test's fresh start)."""
        with self._lock:
            self._sent.clear()
        self.warned.clear()

    def forget(self, using: str, queue: str) -> None:
        """The wake-up counted by ``due`` was not sent: the next enqueue sends one."""
        with self._lock:
            self._sent.pop((using, queue), None)


#: This process's window (the one every alias's enqueues share).
WINDOW = WakeWindow()


def wake_after_commit(
    connection: Any, using: str, queue: str, priority: int, send: Callable[[], None]
) -> None:
    """Send ``queue``'s wake-up (``send``) once the current transaction commits, if due.

    In autocommit the enqueue has committed already: sent now. With
    AUTOCOMMIT off outside ``atomic()`` Django has no commit hooks: ``send``
    runs now, inside the transaction, and is delivered at its commit, as
    with ``WAKEUP_WINDOW`` 0 (and not counted: that commit may never come).
    A rolled-back transaction sends nothing.
    """
    if connection.in_atomic_block:
        transaction.on_commit(lambda: _send(using, queue, priority, send), using=using)
    elif connection.get_autocommit():
        _send(using, queue, priority, send)
    else:
        send()


def _send(using: str, queue: str, priority: int, send: Callable[[], None]) -> None:
    """``send`` if due; an error is logged (a warning once, then at debug), never raised."""
    if not WINDOW.due(using, queue, priority, float(dbworker_settings.WAKEUP_WINDOW)):
        return
    try:
        send()
    except Exception as exc:
        WINDOW.forget(using, queue)
        if WINDOW.warned.is_set():
            logger.debug("Could not send a wake-up for queue %r.", queue, exc_info=True)
        else:
            WINDOW.warned.set()
            logger.warning(
                "Could not send a wake-up for queue %r after its enqueue committed (%s); "
                "workers find the rows when they next poll or claim.",
                queue,
                exc,
            )
