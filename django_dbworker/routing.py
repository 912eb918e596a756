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

A declaration: reads the routers, never opens a connection.
"""

from __future__ import annotations

from django.db import router

from django_dbworker.models import WorkItem


def work_db_for_write(using: str | None = None) -> str:
    """The alias to write the work table on: ``using`` if given, else the routers' choice."""
    return using or router.db_for_write(WorkItem)


def work_db_for_read(using: str | None = None) -> str:
    """The alias to read the work table from: ``using`` if given, else the routers' choice."""
    return using or router.db_for_read(WorkItem)
