"""Cancel of running work and Snooze through ``manage.py run_workers`` subprocesses."""

from __future__ import annotations

import signal

import pytest

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import SnoozeOnce, StopWhenCancelled

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_running_item_cancelled_from_outside_ends_cancelled_after_one_attempt(
    start_worker,
) -> None:
    item = StopWhenCancelled.enqueue({"key": "export"})
    worker = start_worker("stop_when_cancelled", "--concurrency", "2")
    wait_until(
        lambda: Execution.objects.filter(key="export", kind="run").exists(),
        timeout=60,
        what="the handler to start",
    )
    assert WorkItem.objects.get(pk=item.pk).cancel() is True
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.CANCELLED,
        timeout=30,
        what="the item to end cancelled",
    )
    row = WorkItem.objects.get(pk=item.pk)
    assert row.attempts == 1
    assert row.claim_token is None
    assert "cancelled by request" in row.last_error
    assert "RuntimeError: stopped: cancel requested" in row.last_error
    # It saw the request, and ran once: not retried although attempts remain.
    assert Execution.objects.filter(key="export", kind="saw-cancel").count() == 1
    assert Execution.objects.filter(key="export", kind="run").count() == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert "1 cancelled" in worker.log()
    assert Execution.objects.filter(key="export", kind="run").count() == 1
    assert WorkItem.objects.get(pk=item.pk).status == Status.CANCELLED


def test_a_snoozing_item_runs_again_without_using_an_attempt(start_worker) -> None:
    """``max_attempts = 1``: a snooze counted as an attempt would leave none for the rerun."""
    item = SnoozeOnce.enqueue({"key": "later", "seconds": 1.5})
    worker = start_worker("snooze_once")
    wait_until(
        lambda: WorkItem.objects.filter(pk=item.pk, status=Status.PENDING, snoozes=1).exists(),
        timeout=60,
        what="the snooze",
    )
    snoozed = WorkItem.objects.get(pk=item.pk)
    assert snoozed.attempts == 0
    assert snoozed.last_error == ""
    # Due 1.5 s after the snooze was written, by the database clock (one statement).
    assert snoozed.updated_at is not None
    assert 1.4 <= (snoozed.run_after - snoozed.updated_at).total_seconds() <= 1.6
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED,
        timeout=30,
        what="the run after the snooze",
    )
    done = WorkItem.objects.get(pk=item.pk)
    assert (done.attempts, done.snoozes, done.result) == (1, 1, 2)
    assert Execution.objects.filter(key="later", kind="run").count() == 2
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert "1 succeeded, 0 failed, 0 retried, 0 released, 1 snoozed" in worker.log()


def test_a_cancelled_attempt_that_overruns_ends_cancelled_and_its_late_success_is_discarded(
    start_worker,
) -> None:
    from tests.testapp.workers import OverrunAfterCancel

    item = OverrunAfterCancel.enqueue({"key": "slow-export"})
    worker = start_worker("overrun_after_cancel")
    wait_until(
        lambda: Execution.objects.filter(key="slow-export", kind="run").exists(),
        timeout=60,
        what="the handler to start",
    )
    WorkItem.objects.get(pk=item.pk).cancel()
    wait_until(
        lambda: Execution.objects.filter(key="slow-export", kind="late").exists(),
        timeout=30,
        what="the abandoned run to end",
    )
    worker.wait_for_log("Discarded the outcome of work item", timeout=20)
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.CANCELLED
    assert row.result is None
    assert row.attempts == 1
    assert "cancelled by request" in row.last_error and "TimeoutError" in row.last_error
    assert Execution.objects.filter(key="slow-export", kind="saw-cancel").count() == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert Execution.objects.filter(key="slow-export", kind="run").count() == 1
