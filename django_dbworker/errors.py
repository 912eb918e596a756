"""Exceptions that are part of the public API."""

from __future__ import annotations


class EnqueueError(ValueError):
    """Raised by enqueue when its input is invalid; nothing has been written."""


class NoTask(Exception):
    """Raised by ``Handler.claim`` when there is nothing to work on."""


class WorkerLost(Exception):
    """An attempt's worker stopped heartbeating (it crashed, or lost the database).

    Never raised: the class that stale recovery names in ``error_history``
    (and so in a Django task's ``TaskResult.errors``) for such an attempt.
    """


class Cancelled(Exception):
    """An operator cancelled the row before it ran.

    Never raised: the class a cancelled Django task's ``TaskResult.errors``
    names, since Django's task statuses have no "cancelled".
    """
