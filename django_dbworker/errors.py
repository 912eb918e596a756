"""Exceptions that are part of the public API."""

from __future__ import annotations

import math
from datetime import timedelta

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError


class EnqueueError(ValueError):
    """Raised by enqueue when its input is invalid; nothing has been written."""


class DatabaseNotReady(ImproperlyConfigured, DatabaseError):
    """The work table cannot be used yet: not migrated, or a SQLite file that cannot be.

    Raised from the database's own error (chained), with a message that
    says the fix (``run manage.py migrate``, the missing folder). A
    ``DatabaseError`` too, so code that already catches those still does;
    never transient: retrying does not create a table.
    """


class NoTask(Exception):
    """Raised by ``Handler.claim`` when there is nothing to work on."""


class WorkerLost(Exception):
    """An attempt's worker stopped heartbeating (it crashed, or lost the database).

    Never raised: the class that stale recovery names in ``error_history``
    (and so in a Django task's ``TaskResult.errors``) for such an attempt.
    """


class Cancelled(Exception):
    """The row was cancelled: raise it in ``handle`` to end the item ``cancelled``.

    A handler that sees ``self.cancel_requested`` (an operator called
    ``item.cancel()`` on the running item) raises it to stop; any exception
    raised after a cancel request ends the item ``cancelled`` as well. A
    handler may also raise it unasked, to cancel its own item. Either way
    the item is not retried, whatever ``retry_on`` says, and ``last_error``
    says it was cancelled. Only ``WorkItemHandler``s: an own-table
    ``Handler[T]`` records its own outcomes.

    It is also the class a cancelled Django task's ``TaskResult.errors``
    names, since Django's task statuses have no "cancelled".
    """


#: Snoozes of one item before the next one fails it (``Snooze``).
MAX_SNOOZES = 100
#: The longest snooze, in seconds (ten years): longer ones are cut to it, so
#: that the database's datetime arithmetic stays in range on every vendor.
MAX_SNOOZE_SECONDS = 10 * 365 * 86400.0


class Snooze(Exception):
    """Raise in ``handle`` to run the item again ``seconds`` from now, without using an attempt.

    ``raise Snooze(600)`` or ``raise Snooze(timedelta(minutes=10))``: the
    item goes back to ``pending``, due that long from now by the database's
    clock; ``attempts`` stays as it was before this run (the snooze does not
    count as an attempt), ``snoozes`` grows by one, ``last_error`` and
    ``error_history`` are left alone (a snooze is not an error). The
    ``MAX_SNOOZES + 1``-th snooze (the 101st) fails the item instead.
    ``seconds`` is a number or a ``timedelta``, at least 0; more than
    ``MAX_SNOOZE_SECONDS`` (ten years) is cut to that. An atomic handler's
    transaction is rolled back first, as for a failure. If a cancel was
    requested meanwhile, the item ends ``cancelled`` instead. Only
    ``WorkItemHandler``s: an own-table ``Handler[T]`` records its own outcomes.
    """

    def __init__(self, seconds: float | timedelta) -> None:
        self.seconds = snooze_seconds(seconds)
        super().__init__(self.seconds)

    def __str__(self) -> str:
        return f"snoozed for {self.seconds:g}s"


def snooze_seconds(value: object) -> float:
    """``Snooze``'s delay in seconds; TypeError or ValueError for anything else."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"Snooze(seconds): seconds must be a number or a timedelta, not {type(value).__name__}"
        )
    elif isinstance(value, int):
        # Compared as an int: one too big for a float is cut (or refused), not an OverflowError.
        seconds = float(max(-1, min(value, int(MAX_SNOOZE_SECONDS))))
    else:
        seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"Snooze(seconds): seconds must be 0 or more, not {value!r}")
    return min(seconds, MAX_SNOOZE_SECONDS)
