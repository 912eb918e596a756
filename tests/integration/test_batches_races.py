"""Races on batches and ``after=`` that the core change survives (issue 22).

The attack of ``test_batches_attack.py`` tried these interleavings and they
held; kept as regression tests. Each forces the race deterministically: one
ending's transaction is held open after its write (``interleave.Held``),
the other runs into the lock it holds (``interleave.Racer``), and only when
the database says it waits is the first committed. SPEC "Batches and
dependencies": one callback with the right counts, a dependent released
exactly once and never stuck, never run before its parents succeeded.
"""

from __future__ import annotations

from typing import Any

import pytest

from django_dbworker import batch, transitions
from django_dbworker.batches.models import Batch
from django_dbworker.models import Status, WorkItem
from tests.factories import age_heartbeat, claim
from tests.integration.interleave import Held, Racer, wait_for_lock_waiters
from tests.testapp.workers import BatchDone, Noop, Record

pytestmark = pytest.mark.django_db(transaction=True)
server_db = pytest.mark.server_db


def callbacks(batch_id: int) -> list[WorkItem]:
    return list(WorkItem.objects.filter(handler="batch_done", payload__batch=batch_id))


def counts(batch_id: int) -> dict[str, Any]:
    (callback,) = callbacks(batch_id)
    return {k: callback.payload[k] for k in ("succeeded", "failed", "cancelled")}


def claimed_batch(n: int, handler: str = "noop") -> tuple[int, list[WorkItem]]:
    """A sealed batch of ``n`` items, all claimed (as a worker holds them)."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}] * n)
    items = sorted(claim(limit=n, handlers=[handler]), key=lambda i: i.pk)
    assert len(items) == n
    return b.id, items


def succeed(item: WorkItem) -> set[Any]:
    """The success writer's write of one attempt."""
    assert item.claim_token is not None
    return transitions.succeed(
        [(item.pk, item.claim_token, None)],
        using="default",
        linked=transitions.linked_rows([item]),
    )


@server_db
def test_two_finishers_of_the_last_two_items_fire_one_callback() -> None:
    batch_id, (a, b) = claimed_batch(2)
    first = Held(lambda: succeed(a))
    second = Racer(lambda: succeed(b))
    wait_for_lock_waiters(1, second)
    assert callbacks(batch_id) == []
    first.release()
    second.outcome()
    assert counts(batch_id) == {"succeeded": 2, "failed": 0, "cancelled": 0}
    assert Batch.objects.get(pk=batch_id).completed_at is not None


@server_db
def test_operator_cancel_of_the_last_item_while_a_worker_finishes_another() -> None:
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        last = Noop.enqueue({})
    (a,) = claim(limit=1, handlers=["noop"])
    finisher = Held(lambda: succeed(a))
    operator = Racer(lambda: WorkItem.objects.filter(pk=last.pk).cancel())
    wait_for_lock_waiters(1, operator)
    finisher.release()
    assert operator.outcome() == 1
    assert counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}


@server_db
def test_a_worker_finishing_while_an_operator_cancel_of_the_last_item_is_uncommitted() -> None:
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        last = Noop.enqueue({})
    (a,) = claim(limit=1, handlers=["noop"])
    operator = Held(lambda: WorkItem.objects.filter(pk=last.pk).cancel())
    finisher = Racer(lambda: succeed(a))
    wait_for_lock_waiters(1, finisher)
    operator.release()
    finisher.outcome()
    assert counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}


@server_db
def test_stale_recovery_failing_the_last_item_while_another_finishes() -> None:
    batch_id, (a, b) = claimed_batch(2)
    WorkItem.objects.filter(pk=b.pk).update(max_attempts=1)
    age_heartbeat(b, 3600)
    finisher = Held(lambda: succeed(a))
    recovery = Racer(lambda: transitions.recover_stale(stale_after=60))
    wait_for_lock_waiters(1, recovery)
    finisher.release()
    assert recovery.outcome().failed == 1
    assert counts(batch_id) == {"succeeded": 1, "failed": 1, "cancelled": 0}


@server_db
def test_a_fan_in_child_is_released_once_when_its_parents_succeed_together() -> None:
    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    a, b = sorted(claim(limit=2, handlers=["record"]), key=lambda i: i.pk)
    assert (a.pk, b.pk) == (p1.pk, p2.pk) and a.has_dependents and b.has_dependents
    first = Held(lambda: succeed(a))
    second = Racer(lambda: succeed(b))
    wait_for_lock_waiters(1, second)
    first.release()
    second.outcome()
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False)
    assert [i.pk for i in claim(handlers=["record"])] == [child.pk]


@server_db
def test_a_child_enqueued_while_its_parents_success_is_uncommitted_is_due_at_once() -> None:
    parent = Record.enqueue({"key": "p"})
    (running,) = claim(handlers=["record"])
    finisher = Held(lambda: succeed(running))
    enqueuer = Racer(lambda: Record.enqueue({"key": "c"}, after=[parent]))
    wait_for_lock_waiters(1, enqueuer)
    finisher.release()
    child = WorkItem.objects.get(pk=enqueuer.outcome().pk)
    assert (child.status, child.waiting) == (Status.PENDING, False)


@server_db
def test_a_parents_success_racing_an_uncommitted_child_enqueue_releases_the_child() -> None:
    parent = Record.enqueue({"key": "p"})
    (running,) = claim(handlers=["record"])
    assert not running.has_dependents  # the claim did not know: the "late" path
    enqueuer = Held(lambda: Record.enqueue({"key": "c"}, after=[parent]))
    finisher = Racer(lambda: succeed(running))
    wait_for_lock_waiters(1, finisher)
    child = enqueuer.release()
    assert finisher.outcome() == {(running.pk, running.claim_token)}
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False)


@server_db
def test_a_parents_failure_racing_an_uncommitted_child_enqueue_cancels_the_child() -> None:
    parent = Record.enqueue({"key": "p"})
    (running,) = claim(handlers=["record"])
    enqueuer = Held(lambda: Record.enqueue({"key": "c"}, after=[parent]))
    finisher = Racer(lambda: transitions.fail(running, error="boom"))
    wait_for_lock_waiters(1, finisher)
    child = enqueuer.release()
    assert finisher.outcome() is True
    row = WorkItem.objects.get(pk=child.pk)
    assert row.status == Status.CANCELLED and f"#{parent.pk}" in row.last_error


# -- operator paths and odd values that held (every database) -----------------------


def test_held_run_now_leaves_waiting_rows_waiting() -> None:
    parent = Record.enqueue({"key": "p"})
    child = Record.enqueue({"key": "c"}, after=[parent])
    assert WorkItem.objects.filter(pk__in=[parent.pk, child.pk]).run_now() == 1
    assert WorkItem.objects.get(pk=child.pk).waiting


def test_held_retrying_an_item_of_a_completed_batch_enqueues_no_second_callback() -> None:
    from django_dbworker.testing import run_until_empty

    with batch(on_complete=BatchDone) as b:
        dropped = Record.enqueue({"key": "a"}, after=[])  # an empty after= is no condition
        Noop.enqueue({})
    WorkItem.objects.filter(pk=dropped.pk).cancel()
    run_until_empty([Noop])
    assert counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}
    assert WorkItem.objects.filter(pk=dropped.pk).retry() == 1
    run_until_empty([Record])
    assert WorkItem.objects.get(pk=dropped.pk).status == Status.SUCCEEDED
    assert len(callbacks(b.id)) == 1
    assert counts(b.id) == {"succeeded": 1, "failed": 0, "cancelled": 1}  # as it completed


def test_held_a_failed_parent_and_its_cancelled_child_in_one_batch_complete_it_once() -> None:
    from tests.testapp.workers import NoRetry

    with batch(on_complete=BatchDone) as b:
        parent = NoRetry.enqueue({"key": "p"})
        Record.enqueue({"key": "c"}, after=[parent])
        Record.enqueue({"key": "d"}, after=(x for x in [parent, parent.pk]))
    from django_dbworker.testing import run_until_empty

    run_until_empty([NoRetry, Record])
    assert counts(b.id) == {"succeeded": 0, "failed": 1, "cancelled": 2}


def test_held_pruning_a_succeeded_parent_lets_its_waiting_child_run() -> None:
    from datetime import timedelta

    from django.db.models.functions import Now

    from django_dbworker.retention import prune

    p1 = Record.enqueue({"key": "p1"})
    p2 = Record.enqueue({"key": "p2"})
    child = Record.enqueue({"key": "child"}, after=[p1, p2])
    a, b = sorted(claim(limit=2, handlers=["record"]), key=lambda i: i.pk)
    succeed(a)
    WorkItem.objects.filter(pk=p1.pk).update(finished_at=Now() - timedelta(days=30))
    assert prune(older_than=timedelta(days=7), statuses=[Status.SUCCEEDED]) == 1
    succeed(b)
    row = WorkItem.objects.get(pk=child.pk)
    assert (row.status, row.waiting) == (Status.PENDING, False)


@pytest.mark.postgres_only
def test_held_a_callback_insert_that_fails_leaves_nothing_half_done() -> None:
    """A trigger refuses the callback's row: the last item's success rolls back with it."""
    from django.db import DatabaseError, connection

    batch_id, (a,) = claimed_batch(1)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION refuse_callback() RETURNS trigger AS $$ BEGIN "
            "IF NEW.handler = 'batch_done' THEN RAISE EXCEPTION 'no callbacks today'; END IF; "
            "RETURN NEW; END $$ LANGUAGE plpgsql"
        )
        cursor.execute(
            "CREATE TRIGGER refuse_callback BEFORE INSERT ON django_dbworker_workitem "
            "FOR EACH ROW EXECUTE FUNCTION refuse_callback()"
        )
    try:
        with pytest.raises(DatabaseError, match="no callbacks today"):
            succeed(a)
        row = WorkItem.objects.get(pk=a.pk)
        assert (row.status, row.claim_token) == (Status.CLAIMED, a.claim_token)
        assert Batch.objects.get(pk=batch_id).completed_at is None
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_callback ON django_dbworker_workitem")
            cursor.execute("DROP FUNCTION refuse_callback()")
    assert succeed(a) == {(a.pk, a.claim_token)}
    assert counts(batch_id) == {"succeeded": 1, "failed": 0, "cancelled": 0}
