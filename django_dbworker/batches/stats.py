"""What an operator reads of batches and dependencies: progress, open batches, waiting rows.

Shared by the admin's Batches page (and a work item's page) and
``manage.py dbworker_stats``. Nothing here writes, and every read is
bounded by the rows asked about, never by the size of the work table:

- ``batch_progress``: the progress of a page of batches, in ONE grouped
  query over their items (the partial index ``dbworker_batch_idx`` on
  ``(batch, status)``). An open batch is counted from its items; a
  completed one shows the counts stored when it completed (those its
  callback got), and only its items that are pending or claimed again (an
  operator retried them after it completed) are read.
- ``open_batches``: how many batches are open, and the oldest few with
  their progress (the partial index ``dbworker_open_batch_idx``).
- ``waiting_count``: rows waiting for their parents (``dbworker_waiting_idx``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q

from django_dbworker.batches.models import Batch
from django_dbworker.models import ACTIVE_STATUSES, Status, WorkItem
from django_dbworker.routing import work_db_for_read

#: Open batches listed by ``open_batches`` (the oldest first).
OLDEST_OPEN = 5


@dataclass(frozen=True)
class Progress:
    """Where a batch stands: its items by state.

    ``pending`` holds the items pending (waiting ones included) or claimed;
    ``claimed`` is the part of them running now. For a completed batch the
    three final counts are the stored ones, and ``pending`` / ``claimed``
    count the items that run again since (``retried``).
    """

    total: int
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    pending: int = 0
    claimed: int = 0
    #: True when the batch completed: the final counts are the callback's.
    completed: bool = False

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.cancelled

    @property
    def retried(self) -> int:
        """Items of a completed batch pending or claimed again (retried by an operator)."""
        return self.pending if self.completed else 0

    @property
    def gone(self) -> int:
        """Items of an open batch no longer in the table (deleted by hand or pruned)."""
        if self.completed:
            return 0
        return max(0, self.total - self.done - self.pending)


def batch_progress(batches: Iterable[Batch], using: str | None = None) -> dict[int, Progress]:
    """``{batch id: Progress}`` of ``batches``, in one grouped query over their items."""
    rows = list(batches)
    open_ids = [b.pk for b in rows if b.completed_at is None]
    done_ids = [b.pk for b in rows if b.completed_at is not None]
    counts: dict[int, dict[str, int]] = {b.pk: {} for b in rows}
    if rows:
        match = Q(batch_id__in=open_ids) if open_ids else Q()
        if done_ids:
            again = Q(batch_id__in=done_ids, status__in=ACTIVE_STATUSES)
            match = (match | again) if open_ids else again
        grouped: Any = (
            WorkItem.objects.using(work_db_for_read(using))
            .filter(match)
            .order_by()
            .values("batch_id", "status")
            .annotate(n=Count("pk"))
        )
        for row in grouped:
            counts[row["batch_id"]][row["status"]] = row["n"]
    return {b.pk: _progress(b, counts[b.pk]) for b in rows}


def _progress(batch: Batch, counts: dict[str, int]) -> Progress:
    pending = counts.get(Status.PENDING, 0) + counts.get(Status.CLAIMED, 0)
    claimed = counts.get(Status.CLAIMED, 0)
    if batch.completed_at is not None:
        return Progress(
            total=batch.total,
            succeeded=batch.succeeded,
            failed=batch.failed,
            cancelled=batch.cancelled,
            pending=pending,
            claimed=claimed,
            completed=True,
        )
    succeeded = counts.get(Status.SUCCEEDED, 0)
    failed = counts.get(Status.FAILED, 0)
    cancelled = counts.get(Status.CANCELLED, 0)
    # Sealed: ``total`` is what the block enqueued. Unsealed (only seen from
    # inside the block's own transaction): what is there so far.
    total = batch.total if batch.sealed_at is not None else sum(counts.values())
    return Progress(
        total=total,
        succeeded=succeeded,
        failed=failed,
        cancelled=cancelled,
        pending=pending,
        claimed=claimed,
    )


@dataclass(frozen=True)
class OpenBatches:
    #: Batches not completed yet.
    count: int
    #: The oldest of them (at most ``OLDEST_OPEN``), with their progress.
    oldest: list[tuple[Batch, Progress]]


def open_batches(using: str | None = None, limit: int = OLDEST_OPEN) -> OpenBatches:
    """How many batches are open, and the oldest ``limit`` of them with their progress."""
    db = work_db_for_read(using)
    opened = Batch.objects.using(db).filter(completed_at__isnull=True)
    count = opened.count()
    if not count:
        return OpenBatches(0, [])
    oldest = list(opened.defer("payload").order_by("pk")[:limit])
    progress = batch_progress(oldest, using=db)
    return OpenBatches(count, [(b, progress[b.pk]) for b in oldest])


def waiting_count(using: str | None = None) -> int:
    """Rows pending but waiting for their parents (``after=``)."""
    rows = WorkItem.objects.using(work_db_for_read(using))
    return rows.filter(waiting=True, status=Status.PENDING).count()
