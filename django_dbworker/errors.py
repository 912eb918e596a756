"""Exceptions that are part of the public API."""

from __future__ import annotations

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
    """An operator cancelled the row before it ran.

    Never raised: the class a cancelled Django task's ``TaskResult.errors``
    names, since Django's task statuses have no "cancelled".
    """
