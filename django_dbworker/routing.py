"""Which database alias holds the work: one rule for every caller.

Django's routers decide, as for any model: writes, and everything a worker
does (claims are writes, and its reads must see its own writes), go to
``router.db_for_write(WorkItem)``; read-only views (stats, the Prometheus
collector, ``testing.enqueued``) go to ``router.db_for_read(WorkItem)``.
Without routers both are ``"default"``. An explicit ``using=`` (or
``--database``) wins wherever an API offers one. Model methods pass the row
as the routers' ``instance`` hint (``router.db_for_write(WorkItem,
instance=self)``, spelled out in models.py), so a row loaded from an alias
is written back there unless a router says otherwise, as ``Model.save()``
does.

Also here: ``QueueRouter``, a ready router for a queue database of its own
(``DATABASE_ROUTERS = ["django_dbworker.routing.QueueRouter"]``), and what an
enqueue says when it cannot be part of the caller's transaction
(``warn_if_outside_transaction``; system check ``W006`` says it at start).

Declarations and one look at the connections Django already holds: nothing
here opens a connection.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import django
from django.conf import settings
from django.db import connections, router

from django_dbworker.models import WorkItem

#: The app whose tables ``QueueRouter`` routes: the work table, batches,
#: dependencies, queue states, schedules.
APP_LABEL = "django_dbworker"

#: The system check that says enqueue is not atomic with a transaction on
#: another database; silencing it silences the enqueue-time warning too.
NOT_ATOMIC_CHECK = "django_dbworker.W006"

#: Frames of this package and of Django's (``Task.enqueue``) are not the enqueuing line.
#: Folders with a separator ("django_myapp/" is not Django's), as imported and resolved.
_LIBRARIES = tuple(
    {
        str(folder) + os.sep
        for module in (__file__, django.__file__)
        for folder in (Path(module).absolute().parent, Path(module).resolve().parent)
    }
)


def work_db_for_write(using: str | None = None) -> str:
    """The alias to write the work table on: ``using`` if given, else the routers' choice."""
    return using or router.db_for_write(WorkItem)


def work_db_for_read(using: str | None = None) -> str:
    """The alias to read the work table from: ``using`` if given, else the routers' choice."""
    return using or router.db_for_read(WorkItem)


class QueueRouter:
    """Keeps django-dbworker's tables on the database alias ``database``, and only them.

    Reads, writes and migrations of the ``django_dbworker`` app go to
    ``database`` (``"queue"``); no other app's tables are migrated there; any
    other model is left to the next router (``default`` without one). For
    another alias name, subclass and set ``database``.
    """

    database = "queue"

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return self.database if model._meta.app_label == APP_LABEL else None

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return self.database if model._meta.app_label == APP_LABEL else None

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        ours = [obj._meta.app_label == APP_LABEL for obj in (obj1, obj2)]
        if all(ours):
            # Rows loaded from two databases (a queue database and default, where
            # ids name other rows): not ours to allow; a replica's router may.
            dbs = {obj._state.db for obj in (obj1, obj2)} - {None}
            return True if len(dbs) <= 1 else None
        # A foreign key between the work tables and a model of another
        # database cannot hold (no database checks it).
        return False if any(ours) else None

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: Any
    ) -> bool | None:
        if app_label == APP_LABEL:
            return db == self.database
        return False if db == self.database else None


def warn_if_outside_transaction(db: str) -> None:
    """Warn when an enqueue on ``db`` commits at once inside a transaction on another alias.

    The caller is in ``atomic()`` on another database (``default``, or a
    request with ``ATOMIC_REQUESTS``) and none is open on ``db``: the row
    commits now, whether or not the caller's transaction does. A
    ``RuntimeWarning`` (as Django's for a naive datetime), shown once per
    calling line; none once ``NOT_ATOMIC_CHECK`` is in
    ``SILENCED_SYSTEM_CHECKS``, the project's word that it means it.
    Looks only at connections this thread already has.
    """
    if len(connections.settings) == 1:  # one database (most projects): nothing to warn of
        return
    conn = connections[db]
    if conn.in_atomic_block or conn.settings_dict.get("AUTOCOMMIT") is False:
        return
    others = sorted(
        other.alias
        for other in connections.all(initialized_only=True)
        if other.alias != db and other.in_atomic_block
    )
    if not others or NOT_ATOMIC_CHECK in getattr(settings, "SILENCED_SYSTEM_CHECKS", ()):
        return
    names = ", ".join(repr(alias) for alias in others)
    warnings.warn(
        f"This enqueue writes to database {db!r}, where no transaction is open: it commits "
        f"at once, whatever becomes of the transaction open on {names}. To enqueue only "
        f"if that transaction commits, enqueue in transaction.on_commit(..., "
        f"using={others[0]!r}); to group enqueues, open transaction.atomic(using={db!r}). "
        f"Add {NOT_ATOMIC_CHECK!r} to SILENCED_SYSTEM_CHECKS if this is what you want.",
        RuntimeWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package and Django: the enqueuing line."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
