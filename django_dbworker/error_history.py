"""An ending attempt's entry in ``error_history``, written by the ending's own UPDATE.

Shared by the worker's fenced endings (``transitions.py``) and stale
recovery (``stale.py``): one expression, database values, database clock.
"""

from __future__ import annotations

from typing import Any

from django.db.models import F
from django.db.models.functions import JSONObject, Now

from django_dbworker.db.expressions import AppendCapped
from django_dbworker.models import ERROR_HISTORY_LIMIT

#: ``error_history``'s class path for an attempt whose worker stopped heartbeating.
WORKER_LOST = "django_dbworker.errors.WorkerLost"


def with_history(error: Any, class_path: Any) -> AppendCapped:
    """``error_history`` with the attempt that just ended appended (DB values, DB clock)."""
    entry = JSONObject(
        attempt=F("attempts"),
        worker=F("claimed_by"),
        started_at=F("claimed_at"),
        finished_at=Now(),
        exception_class_path=class_path,
        error=error,
    )
    return AppendCapped(F("error_history"), entry, limit=ERROR_HISTORY_LIMIT)
