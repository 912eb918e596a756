"""The rows of batches and dependencies (SPEC "Batches and dependencies").

Kept beside ``models.py`` (which imports them, so Django registers them
with the app) because they are their own subject: what a ``batch()`` block
and an ``after=`` enqueue leave in the database. The logic that reads and
writes them is ``batches.py`` (the block), ``dependencies.py`` (``after=``
at enqueue) and ``completion.py`` (what a row's final state sets off).

Neither table holds a count that finishers move up or down. A batch is
complete when none of its items is pending or claimed, which the
finisher that ends one of them checks under the batch row's lock; a
dependent is released when all its parents succeeded, checked under the
dependent's lock. So a zombie, a late finisher, an operator's retry or a
crash can never make a count wrong: the rows themselves are the truth,
and the conditional ``completed_at IS NULL`` update fires the callback
exactly once.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class Batch(models.Model):
    """One ``with batch(on_complete=...)`` block: its items, its callback, its progress.

    ``sealed_at`` is set when the block exits: a batch never completes
    before that, so items enqueued one by one (each its own commit) cannot
    make it look finished early. ``completed_at`` and the three counts are
    set once, in the transaction that finds the last item ended; that
    transaction also inserts the callback (``callback_id``; a plain
    number, like ``PeriodicSchedule.last_item_id``, so pruning the
    callback's row leaves the batch readable).
    """

    id = models.BigAutoField(primary_key=True)
    #: The registered name of the ``on_complete`` handler, and its queue and
    #: attempts when the block opened: the callback is inserted by whichever
    #: process ends the last item, which need not have the handler registered.
    on_complete = models.CharField(max_length=200)
    queue = models.CharField(max_length=100, default="default")
    max_attempts = models.PositiveIntegerField(default=1)
    #: The callback's payload, before the batch id and the counts are added.
    payload = models.JSONField(default=dict, blank=True)
    #: Items enqueued in the block (set when it exits).
    total = models.PositiveIntegerField(default=0)
    sealed_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    #: The items' final states when the batch completed (the callback's counts).
    succeeded = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    cancelled = models.PositiveIntegerField(default=0)
    callback_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())

    objects: models.Manager[Batch] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "batch"
        verbose_name_plural = "batches"
        indexes = [
            # The sweep and the admin's "open" filter: batches not completed yet.
            models.Index(
                fields=["completed_at"],
                condition=Q(completed_at__isnull=True),
                name="dbworker_open_batch_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"batch #{self.pk} -> {self.on_complete}"


class Dependency(models.Model):
    """``child`` is not claimed until ``parent`` succeeded (``after=`` at enqueue).

    Only links to parents that were unfinished when the child was enqueued
    are stored: a parent that had succeeded already is no condition, one
    that had failed cancelled the child at once. A parent row that no
    longer exists is no condition either: pruning deletes finished rows
    only, and a parent that failed had cancelled its waiting children when
    it ended, so a pruned parent had succeeded; an operator who deletes a
    parent row removes it as a condition. Pruning deletes the links of the
    rows it deletes, in the same transaction.
    """

    id = models.BigAutoField(primary_key=True)
    child = models.ForeignKey(
        "django_dbworker.WorkItem",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="parent_links",
    )
    parent = models.ForeignKey(
        "django_dbworker.WorkItem",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="child_links",
    )

    objects: models.Manager[Dependency] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "dependency"
        verbose_name_plural = "dependencies"
        constraints = [
            models.UniqueConstraint(fields=["child", "parent"], name="dbworker_dependency_unique")
        ]

    def __str__(self) -> str:
        return f"#{self.child_id} after #{self.parent_id}"
