"""The rows of flow control (SPEC "Flow control"): paused queues, key and rate locks.

Kept beside ``models.py``, which imports them so Django registers them
with the app; the claim statements of ``db/`` read and lock them.
"""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


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
    """One row per start of a rate-limited handler within its latest window.

    The claim counts the rows of the last period (DB clock) under the
    handler's ``FlowLock``, claims at most what is left, inserts one row
    per start and deletes the rows older than the period: a sliding
    window, exact in any window of one period, cluster-wide.
    """

    id = models.BigAutoField(primary_key=True)
    handler = models.CharField(max_length=200)
    started_at = models.DateTimeField(db_default=Now())

    objects: models.Manager[RateStart] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "rate-limited start"
        verbose_name_plural = "rate-limited starts"
        indexes = [models.Index(fields=["handler", "started_at"], name="dbworker_rate_start_idx")]

    def __str__(self) -> str:
        return f"{self.handler} at {self.started_at}"


class WorkerProcess(models.Model):
    """One row per live ``run_workers`` process: the register of who serves which queues.

    Written at the worker's start, refreshed by it every ``HEARTBEAT_INTERVAL`` and deleted
    when it stops claiming; a row not refreshed for three intervals is of a process that
    died (any worker deletes it after ``STALE_AFTER``). The workers of one ``pool`` (the
    same queues and handlers) count each other here to split the keys of limited handlers
    between them in proportion to their threads (``worker/peers.py``): balance only, never
    correctness, which the claim statements keep by themselves, so a missing or stale row
    costs at most an uneven split.
    """

    #: ``host:pid:token``: ``host:pid`` as in the ``claimed_by`` of the process's rows, and
    #: a random token (containers on the host's network share its name and pid 1).
    name = models.CharField(max_length=255, primary_key=True)
    #: A digest of the queues it serves (sorted; ``*`` for every queue).
    pool = models.CharField(max_length=64)
    #: The queues it serves; null for every queue.
    queues = models.JSONField(null=True, blank=True)
    #: Its threads (``--concurrency``): the pool's keys are shared in proportion.
    threads = models.PositiveIntegerField(default=1)
    started_at = models.DateTimeField(db_default=Now())
    seen_at = models.DateTimeField(db_default=Now())

    objects: models.Manager[WorkerProcess] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "worker process"
        verbose_name_plural = "worker processes"

    def __str__(self) -> str:
        return self.name
