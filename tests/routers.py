"""Routers that put the work tables on the ``work`` alias (tests/settings.py).

Active only where a test turns it on with ``override_settings(DATABASE_ROUTERS=...)``.
"""

from __future__ import annotations

from typing import Any

from django_dbworker.routing import QueueRouter

WORK_ALIAS = "work"


class WorkOnSecondAlias:
    def _route(self, model: Any, **hints: Any) -> str | None:
        return WORK_ALIAS if model._meta.app_label == "django_dbworker" else None

    db_for_read = _route
    db_for_write = _route


class QueueOnWork(QueueRouter):
    """The shipped router (django_dbworker.routing.QueueRouter), on the ``work`` alias."""

    database = WORK_ALIAS
