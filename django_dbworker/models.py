"""The ``WorkItem`` table, its states, and the querysets that name its subsets.

The worker's state changes (claim, heartbeat, outcomes, stale recovery) are
fenced UPDATEs in ``transitions.py`` and ``db/``. The operator's (cancel,
retry, run now) are ``verbs.py``'s; the queryset and model methods of those
names call it when called (the one upward import: everything the verbs need
imports this module). Otherwise this module imports nothing from the package
but ``validation``'s constants. The rows of batches, flow control and the
register of live workers (``fleet``) are in their packages' ``models.py``
(registered by ``apps.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import models, router
from django.db.models import Q
from django.db.models.functions import Now

from django_dbworker.validation import PRIORITY_MAX, PRIORITY_MIN

if TYPE_CHECKING:
    from datetime import timedelta


class Status(models.TextChoices):
    PENDING = "pending", "Pending"
    CLAIMED = "claimed", "Claimed"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


#: States in which a row is still "live" for unique_key purposes.
ACTIVE_STATUSES = (Status.PENDING, Status.CLAIMED)
#: States a row never leaves by itself.
FINISHED_STATUSES = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

#: Failed or lost attempts kept in ``error_history`` per row (the newest).
ERROR_HISTORY_LIMIT = 25


def handler_match(name: str) -> Q:
    """``handler = name`` split so that PostgreSQL can OR two partial indexes."""
    return (Q(handler=name) & ~Q(status=Status.PENDING)) | Q(handler=name, status=Status.PENDING)


def key_match(key: str) -> Q:
    """``concurrency_key = key``, split as ``handler_match``: ``dbworker_concurrency_key_idx``
    serves the rows that are not pending, the keyed claim's index of pending rows the rest."""
    return (Q(concurrency_key=key) & ~Q(status=Status.PENDING)) | Q(
        concurrency_key=key, status=Status.PENDING
    )


def live_or_failed() -> Q:
    """Pending, claimed or failed rows, split the same way (claim index + status index)."""
    return Q(status=Status.PENDING) | Q(status__in=(Status.CLAIMED, Status.FAILED))


class WorkItemQuerySet(models.QuerySet["WorkItem"]):
    """Adjectives for subsets of rows; every time comparison uses the DB clock."""

    def pending(self) -> WorkItemQuerySet:
        return self.filter(status=Status.PENDING)

    def ready(self) -> WorkItemQuerySet:
        """Pending rows whose ``run_after`` has passed by the database's clock."""
        return self.filter(status=Status.PENDING, run_after__lte=Now())

    def stale(self, stale_after: timedelta) -> WorkItemQuerySet:
        """Claimed rows whose heartbeat is older than ``stale_after`` (DB clock)."""
        return self.filter(status=Status.CLAIMED, heartbeat_at__lt=Now() - stale_after)

    def in_order(self) -> WorkItemQuerySet:
        """The claim order: higher priority first, then oldest due, then FIFO."""
        return self.order_by("-priority", "run_after", "id")

    # -- operator transitions: one UPDATE each, narrowed to eligible states ------

    def cancel_requested(self) -> WorkItemQuerySet:
        """Claimed rows whose cancellation was requested (their handlers are told)."""
        return self.filter(status=Status.CLAIMED, cancel_requested_at__isnull=False)

    def cancel(self) -> int:
        """Cancel: pending rows end ``cancelled``, claimed rows are asked to stop; returns
        how many rows were cancelled now (``verbs.cancel``)."""
        from django_dbworker import verbs  # the verbs' module: above this one (STYLE)

        return verbs.cancel(self)[0]

    def cancel_pending(self) -> int:
        """pending -> cancelled, with what the endings set off (``verbs.cancel_pending``)."""
        from django_dbworker import verbs

        return verbs.cancel_pending(self)

    def request_cancel(self) -> int:
        """Claimed rows are asked to stop (``verbs.request_cancel``)."""
        from django_dbworker import verbs

        return verbs.request_cancel(self)

    def retry(self) -> int:
        """failed | cancelled -> pending, attempts reset, due now (``verbs.retry``)."""
        from django_dbworker import verbs

        return verbs.retry(self)

    def run_now(self) -> int:
        """pending: make due now (DB clock); not rows waiting for their parents."""
        from django_dbworker import verbs

        return verbs.run_now(self)


class WorkItem(models.Model):
    Status = Status

    id = models.BigAutoField(primary_key=True)
    handler = models.CharField(max_length=200)
    queue = models.CharField(max_length=100, default="default")
    payload = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    priority = models.SmallIntegerField(default=0)
    run_after = models.DateTimeField(db_default=Now())
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField()
    claimed_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    claimed_by = models.CharField(max_length=255, blank=True, default="")
    claim_token = models.UUIDField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    #: The attempts that ended without success, oldest first, at most
    #: ``ERROR_HISTORY_LIMIT``: each ``{"attempt", "worker", "started_at",
    #: "finished_at", "exception_class_path", "error"}``. NULL until the first
    #: one, so that inserts and successes never write it.
    error_history = models.JSONField(null=True, blank=True, editable=False)
    result = models.JSONField(null=True, blank=True)
    # NULL (not "") means "no key", so the partial unique constraint ignores it.
    unique_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    trace_context = models.JSONField(default=dict, blank=True)
    #: Flow control (SPEC "Flow control"): at most the handler's current
    #: ``concurrency_limit`` rows of one (handler, concurrency_key) are claimed
    #: at once. ``concurrency_limit`` here is the limit at enqueue,
    #: informational: the claim reads the handler's declaration, not this.
    concurrency_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    concurrency_limit = models.PositiveIntegerField(null=True, blank=True)
    #: Fair share (SPEC "Fair share between tenants"): among ready rows of one priority,
    #: claims take turns across the keys with ready work (``flow/fair.py``).
    fair_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    #: Times the handler raised ``Snooze``: pending again without using an attempt.
    snoozes = models.PositiveIntegerField(default=0, db_default=0)
    #: Set by ``cancel()`` on a claimed row; the heartbeat tells the handler.
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    #: ``batches/models.py``: the batch of its block; ``waiting`` on parents (due
    #: never, so no claim sees it); ``has_dependents``: its ending moves others.
    batch = models.ForeignKey(
        "django_dbworker.Batch",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="items",
    )
    waiting = models.BooleanField(default=False, db_default=False)
    has_dependents = models.BooleanField(default=False, db_default=False)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    objects = WorkItemQuerySet.as_manager()

    class Meta:
        verbose_name = "work item"
        verbose_name_plural = "work items"
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN) & Q(priority__lte=PRIORITY_MAX),
                name="dbworker_priority_range",
            ),
            models.UniqueConstraint(
                fields=["handler", "unique_key"],
                condition=Q(status__in=["pending", "claimed"]) & Q(unique_key__isnull=False),
                name="dbworker_unique_active_key",
            ),
        ]
        indexes = [
            # The claim query: pending rows in claim order, optionally by queue.
            models.Index(
                models.F("priority").desc(),
                "run_after",
                "id",
                condition=Q(status="pending"),
                name="dbworker_claim_idx",
            ),
            models.Index(
                "queue",
                models.F("priority").desc(),
                "run_after",
                "id",
                condition=Q(status="pending"),
                name="dbworker_claim_queue_idx",
            ),
            # The stale scan: claimed rows by heartbeat age.
            models.Index(
                fields=["heartbeat_at"],
                condition=Q(status="claimed"),
                name="dbworker_stale_idx",
            ),
            # Admin lists, filters and search: newest first within a status,
            # queue or handler, and exact unique_key lookups. The status and
            # handler indexes leave pending rows out on purpose: the claim
            # query must only ever be able to use the claim indexes above,
            # even when planner statistics are stale (a queue table's pending
            # set changes faster than ANALYZE runs); pending rows are the
            # newest, which the primary key finds for the admin.
            models.Index(
                fields=["status", "-id"],
                condition=~Q(status="pending"),
                name="dbworker_status_idx",
            ),
            models.Index(fields=["queue", "-id"], name="dbworker_queue_idx"),
            models.Index(
                fields=["handler", "-id"],
                condition=~Q(status="pending"),
                name="dbworker_handler_idx",
            ),
            # The dashboard's last hour: finished rows by finish time (throughput
            # per minute, run times, recent failures), each a range scan of
            # ``finished_at >= now - 1 hour``. Partial: pending and claimed rows
            # (finished_at NULL, the churning part of the table) never enter it,
            # and any range comparison on finished_at implies the condition, on
            # PostgreSQL and SQLite alike.
            models.Index(
                fields=["finished_at"],
                condition=Q(finished_at__isnull=False),
                name="dbworker_finished_idx",
            ),
            models.Index(
                fields=["unique_key"],
                condition=Q(unique_key__isnull=False),
                name="dbworker_unique_key_idx",
            ),
            # The admin's exact search by concurrency key: rows that have one,
            # but not pending ones, like the status and handler indexes above
            # (a claim planned on it read a hot key's whole backlog); pending
            # keyed rows are in the claim's own index (``key_match``).
            models.Index(
                fields=["concurrency_key"],
                condition=Q(concurrency_key__isnull=False) & ~Q(status="pending"),
                name="dbworker_concurrency_key_idx",
            ),
            # The slots a key holds: its claimed rows, counted inside the claim.
            models.Index(
                fields=["handler", "concurrency_key", "status"],
                condition=Q(status="claimed") & Q(concurrency_key__isnull=False),
                name="dbworker_key_slots_idx",
            ),
            # A fair key's pending rows in claim order: a turn of the rotation claims
            # from it (``fair_key IS NULL`` too: the rows without a key take turns).
            # MySQL/MariaDB: (fair_key, status, priority DESC, run_after, id), by migration
            # 0004 (they build no partial index).
            models.Index(
                "fair_key",
                models.F("priority").desc(),
                "run_after",
                "id",
                condition=Q(status="pending"),
                name="dbworker_fair_idx",
            ),
            # A batch's unfinished items, probed when one of them ends.
            models.Index(
                fields=["batch", "status"],
                condition=Q(batch__isnull=False),
                name="dbworker_batch_idx",
            ),
            # The sweep's waiting rows (``completion.sweep``).
            models.Index(
                fields=["waiting"], condition=Q(waiting=True), name="dbworker_waiting_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.handler}#{self.pk} ({self.status})"

    def cancel(self) -> bool:
        """Pending -> cancelled; claimed: asked to stop. Returns whether this row changed.

        A claimed row stays claimed with ``cancel_requested_at`` set; its
        handler sees ``self.cancel_requested`` within about one heartbeat
        interval. Asking again changes nothing (False).
        """
        from django_dbworker import verbs

        return self._change(lambda rows: sum(verbs.cancel(rows)))

    def retry(self) -> bool:
        """Failed or cancelled -> pending with attempts reset. Returns whether it changed."""
        return self._change(WorkItemQuerySet.retry)

    def run_now(self) -> bool:
        """Pending: make it due now. Returns whether this row changed."""
        return self._change(WorkItemQuerySet.run_now)

    def _change(self, verb: Callable[[WorkItemQuerySet], int]) -> bool:
        # The database alias rule (routing.py): the routers' choice for writes,
        # with this row as the hint, as Model.save() does.
        using = router.db_for_write(type(self), instance=self)
        changed = verb(type(self).objects.using(using).filter(pk=self.pk)) == 1
        self.refresh_from_db(using=using)
        return changed


class ClaimedWorkItem(WorkItem):
    """Admin view of rows that a worker holds right now."""

    class Meta:
        proxy = True
        verbose_name = "claimed work item"
        verbose_name_plural = "claimed work items"


class FailedWorkItem(WorkItem):
    """Admin view of rows that used up their attempts."""

    class Meta:
        proxy = True
        verbose_name = "failed work item"
        verbose_name_plural = "failed work items"


class QueueSummary(WorkItem):
    """Admin entry for the queue summary page (counts, lag, stale workers)."""

    class Meta:
        proxy = True
        verbose_name = "queue summary"
        verbose_name_plural = "queue summary"


class PeriodicSchedule(models.Model):
    """One row per periodic handler: the durable "once per slot" marker.

    ``last_slot`` is the latest slot taken (enqueued or skipped). The
    scheduler advances it by compare-and-set (``last_slot < slot``) in the
    same transaction that inserts the slot's WorkItem, so a slot is taken
    once however many workers try, and never again after its WorkItem is
    finished or pruned: ``dbworker_prune`` deletes work items only, and
    ``last_item_id`` is a plain number, not a foreign key, for that reason.
    A row whose ``last_slot`` is NULL was just created: its first slot is
    the first one after ``created_at`` (a new schedule does not run at once
    for a slot that passed before it existed).
    """

    name = models.CharField(max_length=200, primary_key=True)
    last_slot = models.DateTimeField(null=True, blank=True)
    #: The WorkItem of the latest slot enqueued (it may have been pruned since).
    last_item_id = models.BigIntegerField(null=True, blank=True)
    #: Slots skipped because the previous run was still pending or running.
    skipped = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    objects: models.Manager[PeriodicSchedule] = models.Manager()

    class Meta:
        verbose_name = "schedule"
        verbose_name_plural = "schedules"

    def __str__(self) -> str:
        return self.name
