"""Batches and ``after=`` dependencies (issue 22, SPEC "Batches and dependencies").

In-process, on every database of the run: the callback is enqueued exactly
once when the last item ends, with the counts; a rolled-back block leaves
nothing; an empty batch completes at once; a dependent waits for its
parents, runs after them, and is cancelled (transitively, without running)
when one fails; the sweep settles what a deleted row left open.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction

from django_dbworker import EnqueueError, batch, transitions
from django_dbworker.batches.completion import sweep
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.models import Status, WorkItem
from django_dbworker.tasks import task as dbtask
from django_dbworker.testing import run_until_empty
from tests.factories import claim, run_retries
from tests.testapp.models import Execution
from tests.testapp.workers import AlwaysFail, BatchDone, Noop, NoRetry, Record

pytestmark = pytest.mark.django_db(transaction=True)


def _callbacks(batch_id: int) -> list[WorkItem]:
    return list(WorkItem.objects.filter(handler="batch_done", payload__batch=batch_id))


def test_the_callback_is_enqueued_once_with_the_counts_when_the_last_item_ends() -> None:
    with batch(on_complete=BatchDone, payload={"import_id": 7}) as b:
        Noop.enqueue({})
        Noop.enqueue_many([{}, {}])
        NoRetry.enqueue({"key": "x"})
    assert b.total == 4
    assert _callbacks(b.id) == []
    run_until_empty([Noop, NoRetry])
    (callback,) = _callbacks(b.id)
    assert callback.payload == {
        "import_id": 7,
        "batch": b.id,
        "succeeded": 3,
        "failed": 1,
        "cancelled": 0,
    }
    row = Batch.objects.get(pk=b.id)
    assert row.completed_at is not None
    assert (row.succeeded, row.failed, row.cancelled, row.callback_id) == (3, 1, 0, callback.pk)
    run_until_empty([BatchDone])
    assert Execution.objects.filter(key=f"batch:{b.id}", kind="callback").count() == 1


def _enqueue_then_raise(outer: bool) -> None:
    if outer:
        with transaction.atomic():
            with batch(on_complete=BatchDone):
                Noop.enqueue({})
            raise RuntimeError("the caller's transaction rolls back")
    with batch(on_complete=BatchDone):
        Noop.enqueue({})
        raise RuntimeError("the block raises")


@pytest.mark.parametrize("outer", [False, True])
def test_a_rolled_back_block_leaves_no_batch_items_or_callback(outer: bool) -> None:
    with pytest.raises(RuntimeError, match="rolls back" if outer else "block raises"):
        _enqueue_then_raise(outer)
    assert not Batch.objects.exists()
    assert not WorkItem.objects.exists()


def test_an_empty_batch_enqueues_its_callback_at_once() -> None:
    with batch(on_complete="batch_done") as b:
        pass
    (callback,) = _callbacks(b.id)
    assert callback.payload == {"batch": b.id, "succeeded": 0, "failed": 0, "cancelled": 0}


def _open(on_complete: object, payload: object = None, *, nested: bool = False) -> None:
    with batch(on_complete=on_complete, payload=payload):  # type: ignore[arg-type]
        if nested:
            with batch(on_complete=BatchDone):
                pass


@pytest.mark.parametrize(
    ("on_complete", "payload", "nested", "message"),
    [
        ("no_such_handler", None, False, "registered WorkItemHandler"),
        (BatchDone, [1], False, "takes a dict"),
        (BatchDone, {"batch": 1}, False, "may not use the key"),
        (BatchDone, None, True, "do not nest"),
    ],
)
def test_bad_batches_are_clear_errors_and_write_nothing(
    on_complete: object, payload: object, nested: bool, message: str
) -> None:
    with pytest.raises(EnqueueError, match=message):
        _open(on_complete, payload, nested=nested)
    assert not Batch.objects.exists()


def test_a_dependent_waits_for_its_parents_then_runs() -> None:
    a = Record.enqueue({"key": "a"})
    other = Record.enqueue({"key": "o"})
    t = Record.enqueue({"key": "t"}, after=[a])
    load = Record.enqueue({"key": "l"}, after=[t, other.pk])
    t.refresh_from_db()
    assert (t.status, t.waiting) == (Status.PENDING, True)
    assert Dependency.objects.filter(child=load).count() == 2
    run_until_empty([Record])
    order = list(Execution.objects.order_by("pk").values_list("key", flat=True))
    assert set(order) == {"a", "o", "t", "l"}
    assert order.index("a") < order.index("t") < order.index("l")
    assert order.index("o") < order.index("l")
    assert set(WorkItem.objects.values_list("status", flat=True)) == {Status.SUCCEEDED}


def test_a_failed_parent_cancels_its_dependents_transitively_without_running_them() -> None:
    a = AlwaysFail.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    c = Record.enqueue({"key": "c"}, after=[b])
    run_retries()
    for row in (b, c):
        row.refresh_from_db()
        assert row.status == Status.CANCELLED
        assert row.waiting is False
    assert f"#{a.pk}" in b.last_error and "failed" in b.last_error
    assert f"#{b.pk}" in c.last_error and "cancelled" in c.last_error
    assert not Execution.objects.filter(key__in=["b", "c"]).exists()


def test_an_item_after_a_failed_parent_is_cancelled_at_enqueue() -> None:
    a = NoRetry.enqueue({"key": "a"})
    run_until_empty([NoRetry])
    b = Record.enqueue({"key": "b"}, after=[a])
    b.refresh_from_db()
    assert b.status == Status.CANCELLED and f"#{a.pk}" in b.last_error


def test_after_names_that_do_not_exist_or_are_not_items_are_errors() -> None:
    with pytest.raises(EnqueueError, match="do not exist"):
        Record.enqueue({}, after=[999_999])
    with pytest.raises(EnqueueError, match="work items or their ids"):
        Record.enqueue({}, after=["7"])
    with pytest.raises(EnqueueError, match="list of work items"):
        Record.enqueue({}, after=7)
    with pytest.raises(EnqueueError, match="cannot be combined"):
        Record.enqueue({}, after=[1], run_after=timedelta(seconds=1))
    assert not WorkItem.objects.exists()


def test_a_cancelled_batch_item_completes_the_batch() -> None:
    with batch(on_complete=BatchDone) as b:
        item = Noop.enqueue({})
    item.cancel()
    (callback,) = _callbacks(b.id)
    assert callback.payload["cancelled"] == 1


def test_the_sweep_settles_a_batch_whose_last_item_was_deleted() -> None:
    with batch(on_complete=BatchDone) as b:
        keep = Noop.enqueue({})
        gone = Noop.enqueue({})
    with pytest.raises(RuntimeError, match="work remains"):
        run_until_empty([Noop], max_items=1)
    assert WorkItem.objects.get(pk=keep.pk).status == Status.SUCCEEDED
    WorkItem.objects.filter(pk=gone.pk).delete()
    assert _callbacks(b.id) == []
    sweep("default")
    assert len(_callbacks(b.id)) == 1
    sweep("default")
    assert len(_callbacks(b.id)) == 1


def test_enqueue_after_a_running_parent_is_released_when_it_succeeds() -> None:
    """A child enqueued while its parent is claimed: the success write finds it."""
    a = Record.enqueue({"key": "a"})
    (claimed,) = claim(handlers=["record"])
    assert claimed.has_dependents is False
    b = Record.enqueue({"key": "b"}, after=[a])
    assert transitions.succeed([(claimed.pk, claimed.claim_token, None)]) == {
        (claimed.pk, claimed.claim_token)
    }
    b.refresh_from_db()
    assert (b.status, b.waiting) == (Status.PENDING, False)


@dbtask()
def batched_task(n: int) -> int:
    return n * 2


def test_django_task_enqueues_in_the_block_belong_to_the_batch() -> None:
    with batch(on_complete=BatchDone) as b:
        results = [batched_task.enqueue(n) for n in range(3)]
    assert b.total == 3
    ids = {int(result.id) for result in results}
    assert set(WorkItem.objects.filter(batch_id=b.id).values_list("pk", flat=True)) == ids
    run_until_empty([batched_task.module_path])
    (callback,) = _callbacks(b.id)
    assert callback.payload["succeeded"] == 3


def test_an_item_retried_after_its_batch_completed_runs_again_without_a_second_callback() -> None:
    """SPEC leaves it open; documented in docs/topics/batches.md: the batch stays
    completed with the counts it had, its callback does not fire again."""
    with batch(on_complete=BatchDone) as b:
        failing = NoRetry.enqueue({"key": "r"})
        Noop.enqueue({})
    run_until_empty([Noop, NoRetry])
    assert len(_callbacks(b.id)) == 1
    WorkItem.objects.filter(pk=failing.pk).update(handler="noop")
    assert failing.retry()
    run_until_empty([Noop])
    assert WorkItem.objects.get(pk=failing.pk).status == Status.SUCCEEDED
    assert len(_callbacks(b.id)) == 1
    row = Batch.objects.get(pk=b.id)
    assert (row.succeeded, row.failed) == (1, 1)


def test_an_item_retried_before_its_batch_completed_holds_the_batch_open() -> None:
    with batch(on_complete=BatchDone) as b:
        failing = NoRetry.enqueue({"key": "r"})
        slow = Noop.enqueue({})
    with pytest.raises(RuntimeError, match="work remains"):
        run_until_empty([NoRetry, Noop], max_items=1)
    assert WorkItem.objects.get(pk=failing.pk).status == Status.FAILED
    WorkItem.objects.filter(pk=failing.pk).update(handler="noop")
    assert failing.retry()
    run_until_empty([Noop])
    assert WorkItem.objects.get(pk=slow.pk).status == Status.SUCCEEDED
    (callback,) = _callbacks(b.id)
    assert (callback.payload["succeeded"], callback.payload["failed"]) == (2, 0)
