"""Tables the test handlers write to, so tests can count real executions."""

from __future__ import annotations

from django.db import models


class Execution(models.Model):
    """One row per handler invocation: how tests prove "exactly once"."""

    key = models.CharField(max_length=100, db_index=True)
    kind = models.CharField(max_length=20, default="run")
    pid = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)


class Effect(models.Model):
    """Written by the atomic handler; must exist exactly once per job."""

    key = models.CharField(max_length=100)


class Invoice(models.Model):
    """An own table driven by a ``Handler[Invoice]``."""

    status = models.CharField(max_length=20, default="pending")
    sent_by = models.IntegerField(null=True)
    updated_at = models.DateTimeField(auto_now=True)
