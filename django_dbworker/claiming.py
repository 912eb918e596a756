"""``claim_next``: claim one row of a user's own table, race-free.

For ``Handler[T]`` implementations over users' tables. On databases with
row locks it is one short transaction with ``SELECT ... FOR UPDATE SKIP
LOCKED``; elsewhere (SQLite) an optimistic conditional UPDATE that repeats
the queryset's filters, retried when another worker won the row.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import models, transaction

from django_dbworker.db import skip_locked_options, supports_skip_locked

M = TypeVar("M", bound=models.Model)

#: Conditional-UPDATE claims retried this often when other workers win the race.
OPTIMISTIC_TRIES = 10


def claim_next(queryset: models.QuerySet[M], **updates: Any) -> M | None:
    """Claim the first row of ``queryset`` by applying ``updates`` to it.

    Returns the row with ``updates`` applied, or None when no row is
    available. ``queryset`` should be ordered; its filters must describe
    "claimable" (e.g. ``status="pending"``) and ``updates`` must make the row
    stop matching them (e.g. ``status="sending"``), or two workers could
    claim the same row.
    """
    if not updates:
        raise ValueError("claim_next needs at least one field update that marks the row claimed.")
    db = queryset.db
    model = queryset.model
    if supports_skip_locked(db):
        with transaction.atomic(using=db):
            row = queryset.select_for_update(**skip_locked_options(db)).first()
            if row is None:
                return None
            model._default_manager.using(db).filter(pk=row.pk).update(**updates)
        for name, value in updates.items():
            setattr(row, name, value)
        return row
    for _ in range(OPTIMISTIC_TRIES):
        row = queryset.first()
        if row is None:
            return None
        # The filters are repeated in the UPDATE: it only succeeds if the row
        # is still claimable, which makes the claim atomic without row locks.
        if queryset.filter(pk=row.pk).update(**updates) == 1:
            for name, value in updates.items():
                setattr(row, name, value)
            return row
    return None
