"""Batches and ``after=`` dependencies (SPEC "Batches and dependencies").

In-process, on every database of the run: the callback is enqueued exactly
once when the last item ends, with the counts; a rolled-back block leaves
nothing; an empty batch completes at once; a dependent waits for its
parents, runs after them, and is cancelled (transitively, without running)
when one fails; the sweep settles what a deleted row left open; an operator's
retry, cancel, delete and prune keep those promises. The races between endings
are in test_batch_races.py.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings
from prometheus_client import REGISTRY

from django_dbworker import EnqueueError, batch, transitions
from django_dbworker.batches.completion import sweep
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.models import Status, WorkItem
from django_dbworker.tasks import task as dbtask
from django_dbworker.testing import run_until_empty
from tests.factories import claim
from tests.integration.interleave import Racer
from tests.testapp.models import Execution
from tests.testapp.workers import AlwaysFail, BatchDone, Noop, NoRetry, Record

pytestmark = pytest.mark.django_db(transaction=True)


def _callbacks(batch_id: int) -> list[WorkItem]:
    return list(WorkItem.objects.filter(handler="batch_done", payload__batch=batch_id))


def _counts(batch_id: int) -> dict[str, Any]:
    (callback,) = _callbacks(batch_id)
    return {k: callback.payload[k] for k in ("succeeded", "failed", "cancelled")}


def _succeed(item: WorkItem) -> set[Any]:
    assert item.claim_token is not None
    return transitions.succeed(
        [(item.pk, item.claim_token, None)], linked=transitions.linked_rows([item])
    )


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
    run_until_empty(include_scheduled=True)
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


def test_run_now_leaves_waiting_rows_waiting() -> None:
    parent = Record.enqueue({"key": "p"})
    child = Record.enqueue({"key": "c"}, after=[parent])
    assert WorkItem.objects.filter(pk__in=[parent.pk, child.pk]).run_now() == 1
    assert WorkItem.objects.get(pk=child.pk).waiting


def test_retrying_a_cancelled_item_of_a_completed_batch_enqueues_no_second_callback() -> None:
    from django_dbworker.testing import run_until_empty

    with batch(on_complete=BatchDone) as b:
        dropped = Record.enqueue({"key": "a"}, after=[])  # an empty after= is no condition
        Noop.enqueue({})
    WorkItem.objects.filter(pk=dropped.pk).cancel()
    run_until_empty([Noop])
    assert _counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}
    assert WorkItem.objects.filter(pk=dropped.pk).retry() == 1
    run_until_empty([Record])
    assert WorkItem.objects.get(pk=dropped.pk).status == Status.SUCCEEDED
    assert len(_callbacks(b.id)) == 1
    assert _counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}  # as it completed


def test_a_failed_parent_and_its_cancelled_children_in_one_batch_complete_it_once() -> None:
    from tests.testapp.workers import NoRetry

    with batch(on_complete=BatchDone) as b:
        parent = NoRetry.enqueue({"key": "p"})
        Record.enqueue({"key": "c"}, after=[parent])
        Record.enqueue({"key": "d"}, after=(x for x in [parent, parent.pk]))
    from django_dbworker.testing import run_until_empty

    run_until_empty([NoRetry, Record])
    assert _counts(b.id) == {"succeeded": 0, "failed": 1, "cancelled": 2}


def test_pruning_a_succeeded_parent_lets_its_waiting_child_run() -> None:
    from datetime import timedelta

    from django.db.models.functions import Now

    from django_dbworker.retention import prune

    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    a, b = sorted(claim(limit=2, handlers=["record"]), key=lambda i: i.pk)
    _succeed(a)
    WorkItem.objects.filter(pk=p1.pk).update(finished_at=Now() - timedelta(days=30))
    assert prune(older_than=timedelta(days=7), statuses=[Status.SUCCEEDED]) == 1
    _succeed(b)
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False)


def test_retrying_a_cancelled_waiting_child_does_not_run_it_before_its_parent() -> None:
    """An operator cancels a waiting child, then retries it, while its parent is still
    pending: the retried child waits again ("not claimed until every listed item has
    succeeded"), only the parent is claimed.
    """
    parent = Record.enqueue({"key": "parent"})
    child = Record.enqueue({"key": "child"}, after=[parent])
    assert WorkItem.objects.get(pk=child.pk).waiting
    child.cancel()
    assert WorkItem.objects.filter(pk=child.pk).retry() == 1
    claimed = {item.pk for item in claim(handlers=["record"])}
    assert child.pk not in claimed, "the child was claimed before its parent succeeded"
    assert claimed == {parent.pk}


def test_retrying_a_cancelled_chain_runs_the_links_in_order() -> None:
    """A chain a -> b -> c whose head failed (b and c cancelled without running); the operator
    retries every failed and cancelled row: b and c wait for their parents again, and the
    first claim takes a only.
    """
    a = AlwaysFail.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    c = Record.enqueue({"key": "c"}, after=[b])
    run_until_empty(include_scheduled=True)
    assert set(WorkItem.objects.filter(pk__in=[b.pk, c.pk]).values_list("status", flat=True)) == {
        Status.CANCELLED
    }
    assert Dependency.objects.filter(child_id__in=[b.pk, c.pk]).count() == 2
    assert WorkItem.objects.filter(status__in=[Status.FAILED, Status.CANCELLED]).retry() == 3
    claimed = {item.pk for item in claim(handlers=["always_fail", "record"])}
    assert claimed == {a.pk}, (
        f"claimed {sorted(claimed)}: b (#{b.pk}) and c (#{c.pk}) were claimed beside "
        f"their parent a (#{a.pk})"
    )


@pytest.mark.parametrize("pk", [2**63, -(2**63) - 1, 2**70])
def test_an_id_out_of_the_databases_range_is_an_enqueue_error(pk: int) -> None:
    """``after=[id]`` with an id outside the id column's 64-bit range is the same "do not
    exist" ``EnqueueError`` as any other missing parent (SQLite's driver would raise
    ``OverflowError``).
    """
    with pytest.raises(EnqueueError, match="do not exist"):
        Record.enqueue({}, after=[pk])
    assert not WorkItem.objects.exists()


def test_after_stops_reading_at_the_limit_of_parents() -> None:
    """``after=`` given a long iterable of distinct ids stops reading at the first id past
    ``MAX_PARENTS`` (no quadratic walk of the whole iterable before the error).
    """
    from django_dbworker.batches.dependencies import MAX_PARENTS

    drawn = 0

    def ids() -> Iterator[int]:
        nonlocal drawn
        for pk in range(1, 5 * MAX_PARENTS + 1):
            drawn += 1
            yield pk

    with pytest.raises(EnqueueError, match="at most"):
        Record.enqueue({}, after=ids())
    assert drawn <= MAX_PARENTS + 1, f"read {drawn} ids to refuse more than {MAX_PARENTS}"


def test_deleting_a_succeeded_parent_does_not_cancel_its_waiting_child() -> None:
    """A child waits for p1 (succeeded) and p2; an operator deletes p1's row, then p2
    succeeds. A parent that succeeded is no condition any more: the child runs, as it
    does when p1 is pruned instead of deleted.
    """
    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    (a,) = claim(limit=1, handlers=["record"])
    assert a.pk == p1.pk
    _succeed(a)
    WorkItem.objects.filter(pk=p1.pk).delete()
    (b,) = claim(limit=1, handlers=["record"])
    assert b.pk == p2.pk
    _succeed(b)
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False), (
        f"the child ended {row.status}: {row.last_error}"
    )


def test_a_unique_key_enqueue_in_a_batch_is_refused() -> None:
    """In a ``batch()`` block, ``enqueue(unique_key=k)`` could return a live row of that key,
    not in the batch (the batch would complete at once): the combination is an
    ``EnqueueError`` and nothing is written.
    """
    existing = Noop.enqueue({}, unique_key="k")
    with (
        pytest.raises(EnqueueError, match="unique_key cannot be used inside a batch"),
        batch(on_complete=BatchDone),
    ):
        Noop.enqueue({}, unique_key="k")
    assert list(WorkItem.objects.values_list("pk", flat=True)) == [existing.pk]
    assert not Batch.objects.exists()


def test_an_after_enqueue_that_finds_a_live_unique_key_does_not_hand_back_a_due_row() -> None:
    """``enqueue(unique_key="k", after=[t])`` while a due row of key "k" is live must not hand
    back that row, which would run before t: it is refused (``EnqueueError``) or the
    returned row is not claimed beside t.
    """
    from django_dbworker import EnqueueError

    t = Record.enqueue({"key": "t"})
    live = Record.enqueue({"key": "report"}, unique_key="k")
    try:
        item = Record.enqueue({"key": "report"}, unique_key="k", after=[t])
    except EnqueueError:
        assert sorted(WorkItem.objects.values_list("pk", flat=True)) == [t.pk, live.pk]
        return
    claimed = {row.pk for row in claim(handlers=["record"])}
    assert item.pk not in claimed, (
        f"enqueue(after=[#{t.pk}]) returned #{item.pk} (the live key's row, #{live.pk}), "
        f"claimed beside its parent #{t.pk}: {sorted(claimed)}"
    )


def test_a_callback_completed_where_its_handler_is_not_registered_keeps_its_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The callback handler has its own queue; the last item ends in a process where that
    handler is not registered. The callback still goes to its handler's queue with its
    ``max_attempts`` (stored on the batch at ``batch()``), where its workers claim it.
    """
    from django_dbworker.registry import registry
    from tests.testapp.workers import Echo

    with batch(on_complete=Echo, payload={"x": 1}) as b:
        item = Noop.enqueue({})
    # This process forgets the handler (monkeypatch restores it after the test).
    monkeypatch.setattr(registry, "_handlers", {k: v for k, v in registry.items() if k != "echo"})
    WorkItem.objects.filter(pk=item.pk).cancel()
    (callback,) = WorkItem.objects.filter(handler="echo", payload__batch=b.id)
    assert (callback.queue, callback.max_attempts) == (Echo.queue, Echo.get_max_attempts())


# -- what belongs to a batch, what a rolled-back ending leaves --


def _completed() -> float:
    sample = REGISTRY.get_sample_value(
        "dbworker_batches_completed_total", {"worker": BatchDone.name}
    )
    return sample or 0.0


def _cancel_the_last_item_then_roll_back() -> None:
    with batch(on_complete=BatchDone) as b:
        item = Noop.enqueue({})
    with transaction.atomic():
        WorkItem.objects.filter(pk=item.pk).cancel()
        raise RuntimeError(f"the caller's transaction rolls back {b.id}")


def _seal_an_empty_batch_then_roll_back() -> None:
    with transaction.atomic():
        with batch(on_complete=BatchDone):
            pass
        raise RuntimeError("the caller's transaction rolls back")


@pytest.mark.parametrize(
    "ending",
    [_cancel_the_last_item_then_roll_back, _seal_an_empty_batch_then_roll_back],
    ids=["cancel", "empty_seal"],
)
def test_a_rolled_back_completion_is_not_counted_or_logged_as_completed(
    ending: Callable[[], None], caplog: pytest.LogCaptureFixture
) -> None:
    """``dbworker_batches_completed_total`` and the "Batch #N complete" line count batches
    completed: a completion whose transaction rolls back (an operator's cancel of the last
    item in a block that raises, an empty batch sealed in one) leaves the batch open (or
    absent), no callback, and counts and logs nothing."""
    before = _completed()
    caplog.set_level("INFO", logger="django_dbworker")
    with pytest.raises(RuntimeError, match="rolls back"):
        ending()
    assert not Batch.objects.filter(completed_at__isnull=False).exists()
    assert not WorkItem.objects.filter(handler=BatchDone.name).exists()
    lines = [r.getMessage() for r in caplog.records if "complete" in r.getMessage()]
    assert (_completed() - before, lines) == (0, [])


@pytest.mark.server_db
def test_an_enqueue_in_another_thread_does_not_join_the_batch() -> None:
    """Only enqueues in the block's thread belong to it (docs/topics/batches.md, "What
    belongs to a batch"). A thread that runs a copy of the block's context
    (``asyncio.to_thread``, ``sync_to_async``, ``copy_context().run``) sees the open batch's
    context variable, but its enqueue commits on its own connection: it names no batch,
    and survives the block's rollback as a row of its own."""

    def block() -> None:
        with batch(on_complete=BatchDone):
            context = contextvars.copy_context()
            Racer(lambda: context.run(Noop.enqueue, {})).outcome()
            raise RuntimeError("the block rolls back")

    with pytest.raises(RuntimeError, match="rolls back"):
        block()
    assert not Batch.objects.exists()
    assert list(WorkItem.objects.values_list("batch_id", flat=True)) == [None]


# -- operator verbs in a caller's transaction ---------------------------------------


@pytest.fixture
def manual_transaction() -> Iterator[None]:
    """Autocommit off, as ``AUTOCOMMIT: False`` in DATABASES leaves every connection
    (supported: test_enqueue_manual_transactions.py).
    """
    transaction.set_autocommit(False)
    try:
        yield
    finally:
        transaction.rollback()
        connection.needs_rollback = False
        transaction.set_autocommit(True)


@pytest.mark.parametrize("read_first", [False, True])
def test_an_operator_cancel_in_a_manual_transaction_cancels_and_returns(
    manual_transaction: None, read_first: bool
) -> None:
    """Django's manual transaction mode: a script cancels the last pending item of a batch
    (with or without a read first), then commits. The cancel keeps the caller's
    transaction and level (psycopg refuses a new ``isolation_level`` inside one): it returns
    True and commits with the caller's ``commit()``, the callback with it.
    """
    with batch(on_complete=BatchDone) as b:
        last = Noop.enqueue({})
    transaction.commit()
    item = WorkItem.objects.get(pk=last.pk) if read_first else last
    assert item.cancel()
    transaction.commit()
    assert WorkItem.objects.get(pk=last.pk).status == Status.CANCELLED
    assert len(_callbacks(b.id)) == 1


def test_an_operator_retry_in_a_manual_transaction_returns(manual_transaction: None) -> None:
    """Manual transaction mode: ``QuerySet.retry`` of a failed parent and its cancelled child
    returns 2, the child waiting for its parent again.
    """
    a = Record.enqueue({"key": "a"})
    b = Record.enqueue({"key": "b"}, after=[a])
    transaction.commit()
    (running,) = claim(limit=1, handlers=["record"])
    transaction.commit()
    assert transitions.fail(running, error="boom")
    transaction.commit()
    assert WorkItem.objects.filter(pk__in=[a.pk, b.pk]).retry() == 2
    transaction.commit()
    row = WorkItem.objects.get(pk=b.pk)
    assert (row.status, row.waiting) == (Status.PENDING, True)


@pytest.mark.mysql_only
def test_an_operator_cancel_in_a_manual_transaction_at_repeatable_read_returns() -> None:
    """MariaDB at REPEATABLE READ in manual transaction mode: a cancel inside the caller's open
    transaction sends no ``SET TRANSACTION ISOLATION LEVEL`` (error 1568 there): it works at
    the caller's level, as inside ``atomic()``.
    """
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    connection.isolation_level = "repeatable read"  # what Django records at connect
    with batch(on_complete=BatchDone) as b:
        last = Noop.enqueue({})
    transaction.set_autocommit(False)
    try:
        assert WorkItem.objects.get(pk=last.pk).cancel()
        transaction.commit()
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
        connection.close()
    assert WorkItem.objects.get(pk=last.pk).status == Status.CANCELLED
    assert len(_callbacks(b.id)) == 1


@pytest.mark.postgres_only
def test_a_transaction_opened_on_commit_of_an_ending_runs_at_the_projects_level() -> None:
    """PostgreSQL at SERIALIZABLE: an operator's cancel ends a batch, and on-commit work of
    the callback's row opens a transaction of its own. The ending's READ COMMITTED is
    restored before the commit hooks run: that transaction runs at the project's level.
    """
    import psycopg
    from django.db.models.signals import post_init

    connection.ensure_connection()
    connection.connection.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    with batch(on_complete=BatchDone) as b:
        last = Noop.enqueue({})
    seen: list[str] = []

    def audit() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            seen.append(cursor.fetchone()[0])

    def receiver(sender: Any, instance: WorkItem, **kwargs: Any) -> None:
        if instance.pk is None and instance.handler == BatchDone.name:
            transaction.on_commit(audit)

    post_init.connect(receiver, sender=WorkItem)
    try:
        assert last.cancel()
    finally:
        post_init.disconnect(receiver, sender=WorkItem)
        connection.close()  # the next test's connection gets the default level again
    assert len(_callbacks(b.id)) == 1
    assert seen == ["serializable"]


@pytest.mark.sqlite_only
def test_cancelling_a_big_batch_on_a_standard_sqlite_build() -> None:
    """SQLite with ``SQLITE_MAX_VARIABLE_NUMBER`` 32,766 (the default since 3.32): cancelling
    the 33,000 pending items of a batch settles them in chunks, not one ``pk__in`` of every
    id: all cancelled, one callback.
    """
    import sqlite3

    n = 33_000
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}] * n)
    connection.ensure_connection()
    connection.connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32_766)
    try:
        assert WorkItem.objects.filter(batch_id=b.id).cancel() == n
    finally:
        connection.close()
    assert len(_callbacks(b.id)) == 1


# -- the callback's payload ----------------------------------------------------------------
# A batch's callback is enqueued whatever the enqueue checks say by then, once the batch
# was accepted.
#
# ``batch(payload=...)`` checks the payload at the block with room for the four keys the batch
# adds (``batch``, ``succeeded``, ``failed``, ``cancelled``). The callback goes through the
# enqueue path when the batch completes, inside the transaction that records the batch's
# last ending; if its checks refuse it then (MAX_PAYLOAD_BYTES lowered since the block), it
# is inserted as it is: that ending must not be lost, and nothing may loop on it.

LIMIT = 300


def _payload_just_under_the_limit() -> dict[str, str]:
    # {"note": "xxx..."}: 12 bytes of JSON around the text.
    return {"note": "x" * (LIMIT - 12)}


def _lowered() -> Any:
    """MAX_PAYLOAD_BYTES lowered after the block (a deploy): the callback no longer fits."""
    return override_settings(DBWORKER={**settings.DBWORKER, "MAX_PAYLOAD_BYTES": LIMIT})


def test_a_batch_payload_without_room_for_the_counts_is_refused_at_the_block() -> None:
    from django_dbworker import EnqueueError

    payload = _payload_just_under_the_limit()
    refused = pytest.raises(EnqueueError, match="with the batch's id and counts")
    with _lowered(), refused, batch(on_complete=BatchDone, payload=payload):
        Noop.enqueue({})
    assert not Batch.objects.exists() and not WorkItem.objects.exists()


def test_a_batch_payload_accepted_at_the_block_still_gets_its_callback() -> None:
    with batch(on_complete=BatchDone, payload=_payload_just_under_the_limit()) as b:
        item = Noop.enqueue({})
    with _lowered():
        run_until_empty([Noop])
    item.refresh_from_db()
    row = Batch.objects.get(pk=b.id)
    # The item ran and its success is recorded; the batch completed with its callback.
    assert item.status == Status.SUCCEEDED, (item.status, item.last_error[:300])
    assert row.completed_at is not None
    assert WorkItem.objects.filter(handler="batch_done", payload__batch=b.id).count() == 1


def test_stale_recovery_of_such_a_batch_item_does_not_stop_every_other_recovery() -> None:
    """The item left claimed above is recovered as stale after its worker gave up on it; with
    its attempts used up it ends ``failed``, which completes the batch: the callback's
    refusal must not roll back the whole recovery pass (every other stale row with it)."""
    from tests.factories import age_heartbeat, claim, make_item

    with batch(on_complete=BatchDone, payload=_payload_just_under_the_limit()) as b:
        item = Noop.enqueue({})
    with _lowered():
        WorkItem.objects.filter(pk=item.pk).update(max_attempts=1)
        other = make_item("echo")
        taken = claim(limit=10, handlers=["noop", "echo"])
        assert {i.pk for i in taken} == {item.pk, other.pk}
        age_heartbeat(item, 3600)
        age_heartbeat(other, 3600)
        from django_dbworker import transitions

        try:
            transitions.recover_stale(stale_after=60)
        except Exception as exc:
            raised: Exception | None = exc
        else:
            raised = None
    other.refresh_from_db()
    item.refresh_from_db()
    assert raised is None, f"stale recovery raised {raised!r}"
    assert other.status == Status.PENDING
    assert item.status == Status.FAILED
    assert Batch.objects.get(pk=b.id).completed_at is not None


def test_an_operator_can_cancel_the_last_pending_item_of_such_a_batch() -> None:
    """``item.cancel()`` (and the admin's Cancel action) ends the batch's last item; the
    batch completes in the same transaction: the callback's refusal must not make the
    operator's cancel fail."""
    with batch(on_complete=BatchDone, payload=_payload_just_under_the_limit()) as b:
        item = Noop.enqueue({})
    with _lowered():
        item.cancel()
    item.refresh_from_db()
    assert item.status == Status.CANCELLED
    assert Batch.objects.get(pk=b.id).completed_at is not None
