"""The side table the chaos workload writes its effects to."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class Effect(models.Model):
    """One row per committed run of an atomic handler.

    Deliberately without a unique constraint: a duplicate must be visible
    (and counted by the checks), not refused by the database.
    """

    item_no = models.IntegerField()
    handler = models.CharField(max_length=100)
    pid = models.IntegerField()
    created_at = models.DateTimeField(db_default=Now())
