"""Retention in a real ``run_workers``: the worker deletes old finished rows by itself."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now

from django_dbworker.models import PeriodicSchedule, Status, WorkItem
from tests.conftest import wait_until
from tests.factories import make_item

pytestmark = pytest.mark.django_db(transaction=True)


def finished(status: str, days: float) -> WorkItem:
    item = make_item(status=status)
    WorkItem.objects.filter(pk=item.pk).update(finished_at=Now() - timedelta(days=days))
    return item


def test_a_worker_prunes_old_finished_rows_on_its_schedule(start_worker) -> None:
    old = [finished(Status.SUCCEEDED, 30) for _ in range(3)]
    kept = finished(Status.SUCCEEDED, 1)
    pending = finished(Status.PENDING, 30)
    # The schedule's last slot was two hours ago: the worker owes it a run now
    # (a new schedule would wait for its first slot, an hour from now).
    PeriodicSchedule.objects.create(name="dbworker.retention", last_slot=Now() - timedelta(hours=2))
    worker = start_worker("dbworker.retention", "noop")
    worker.wait_for_log("Schedule dbworker.retention: every hour")
    run = wait_until(
        lambda: WorkItem.objects.filter(
            handler="dbworker.retention", status=Status.SUCCEEDED
        ).first(),
        timeout=30,
        what="the retention run to succeed",
    )
    assert run.result == {"deleted": {"succeeded": 3, "cancelled": 0, "failed": 0}}
    left = set(WorkItem.objects.exclude(handler="dbworker.retention").values_list("pk", flat=True))
    assert left == {kept.pk, pending.pk}
    assert not {item.pk for item in old} & left
    worker.wait_for_log("Retention deleted 3 finished work item(s): 3 succeeded.")


def test_retention_keeps_the_finished_items_of_an_open_batch(start_worker) -> None:
    """A batch open longer than the retention ages (an item due later: a slow, rate-limited
    tail) keeps its finished items: its callback counts every item."""
    from django_dbworker import batch
    from django_dbworker.batches.models import Batch
    from tests.testapp.workers import BatchDone, Step

    with batch(on_complete=BatchDone, payload={"import": 1}) as b:
        Step.enqueue_many([{"key": "a"}, {"key": "b"}])
        late = Step.enqueue({"key": "c"}, run_after=timedelta(days=30))
    first = start_worker("step", "--burst")
    assert first.wait(timeout=60) == 0, first.log()
    done = WorkItem.objects.filter(batch_id=b.id, status=Status.SUCCEEDED)
    assert done.count() == 2
    # Eight days pass with the batch open; the hourly retention run is due (default ages:
    # succeeded rows a week).
    done.update(finished_at=Now() - timedelta(days=8))
    PeriodicSchedule.objects.create(name="dbworker.retention", last_slot=Now() - timedelta(hours=2))
    keeper = start_worker("dbworker.retention", "--burst")
    assert keeper.wait(timeout=60) == 0, keeper.log()
    assert WorkItem.objects.get(handler="dbworker.retention").status == Status.SUCCEEDED
    assert done.count() == 2, "retention deleted items of an open batch"
    # The last item runs; the batch completes with every item counted.
    WorkItem.objects.filter(pk=late.pk).update(run_after=Now())
    last = start_worker("step", "batch_done", "--burst")
    assert last.wait(timeout=60) == 0, last.log()
    row = Batch.objects.get(pk=b.id)
    callback = WorkItem.objects.get(handler="batch_done")
    assert (callback.payload["succeeded"], row.total) == (3, 3), callback.payload
