"""The rows of flow control (SPEC "Flow control"): paused queues, key and rate locks.

Kept beside ``models.py``, which imports them so Django registers them
with the app; the claim statements of ``db/`` read and lock them.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models.functions import Now

from django_dbworker import validation


def fair_weight_validator(value: object) -> None:
    """A fair key's weight, as ``set_fair_weight`` takes it (the admin's form)."""
    try:
        validation.fair_weight(value)
    except validation.InvalidValue as exc:
        raise ValidationError(f"The weight {exc}.") from None


class QueueState(models.Model):
    """One row per queue an operator paused (or paused and resumed): the durable pause.

    The claim statements skip the queues whose row says ``paused``, so a
    pause holds on every worker from the moment it commits, and across
    restarts. A queue without a row is running.
    """

    name = models.CharField(max_length=100, primary_key=True)
    paused = models.BooleanField(default=False)
    paused_at = models.DateTimeField(null=True, blank=True)
    #: Who paused it: the admin user, or the command's / caller's ``by``.
    paused_by = models.CharField(max_length=255, blank=True, default="")
    updated_at = models.DateTimeField(db_default=Now())

    objects: models.Manager[QueueState] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "queue"
        verbose_name_plural = "queues"

    def __str__(self) -> str:
        return self.name


class FlowLock(models.Model):
    """A row per concurrency key or rate-limited handler, locked inside a claim.

    Claims that would take a key's last slot, or a rate-limited handler's
    next start, lock this row (``SELECT ... FOR UPDATE``) first, so two
    workers decide one after the other and never both take it. It holds
    no count: a slot is a claimed row of the key, and a start is a
    ``RateStart`` row, so nothing is ever "released" here and a late or
    zombie finisher has nothing to release. Inserted on first use
    (insert-or-ignore); rows are a few bytes and one per key ever used.
    """

    name = models.CharField(max_length=255, primary_key=True)

    objects: models.Manager[FlowLock] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "flow lock"
        verbose_name_plural = "flow locks"

    def __str__(self) -> str:
        return self.name


class RateStart(models.Model):
    """The starts of a rate-limited handler within its latest window, a bucket a row.

    ``started_at`` is the bucket's start (a hundredth of the period wide) and ``count`` the
    starts in it (``flow/rates.py``): a start counts the buckets of the last period (DB
    clock) under the handler's ``FlowLock``, adds itself and deletes the buckets older than
    the period: a sliding window, never exceeded in any window of one period, cluster-wide.
    """

    id = models.BigAutoField(primary_key=True)
    handler = models.CharField(max_length=200)
    started_at = models.DateTimeField(db_default=Now())
    count = models.PositiveIntegerField(default=1, db_default=1)

    objects: models.Manager[RateStart] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "rate-limited start"
        verbose_name_plural = "rate-limited starts"
        indexes = [models.Index(fields=["handler", "started_at"], name="dbworker_rate_start_idx")]

    def __str__(self) -> str:
        return f"{self.handler} at {self.started_at}"


class FairKey(models.Model):
    """A fair key's place in the rotation (``flow/fair.py``) and its weight.

    ``served`` is the key's pass: virtual time that advances by 1/weight per row
    claimed for it; a turn goes to the key with ready work whose pass is lowest.
    ``started`` is the pass its last turn reached (of its last row, as dealt): the
    rotation's clock is the highest of them among the keys with ready work for a claim,
    and a key that comes back after idling starts from that clock, not from the pass it
    left with. Inserted on first turn (or by
    ``set_fair_weight``); the row ``""`` is the rows without a key, which take turns as one
    key.
    """

    key = models.CharField(max_length=200, primary_key=True, blank=True)
    weight = models.FloatField(default=1.0, validators=[fair_weight_validator])
    served = models.FloatField(default=0.0, editable=False)
    started = models.FloatField(default=0.0, editable=False)

    objects: models.Manager[FairKey] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "fair key"
        verbose_name_plural = "fair keys"

    def __str__(self) -> str:
        return self.key or "(no key)"
