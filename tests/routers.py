"""A router that puts the work table on the ``work`` alias (tests/settings.py).

Active only where a test turns it on with ``override_settings(DATABASE_ROUTERS=...)``.
"""

from __future__ import annotations

from typing import Any

WORK_ALIAS = "work"


class WorkOnSecondAlias:
    def _route(self, model: Any, **hints: Any) -> str | None:
        return WORK_ALIAS if model._meta.app_label == "django_dbworker" else None

    db_for_read = _route
    db_for_write = _route
