"""What the batches guide promises of an ending, found wanting while it was written.

A completion that rolls back is neither counted nor logged; an enqueue in
another thread that copied the block's context does not join the batch;
the last of two concurrent finishers completes the batch at any isolation
level the project configures (docs/topics/batches.md). Each failed before
its fix.
"""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, connections, transaction
from prometheus_client import REGISTRY

from django_dbworker import batch, transitions
from django_dbworker.batches.models import Batch
from django_dbworker.models import WorkItem
from tests.conftest import lock_waiters, wait_until
from tests.factories import claim
from tests.testapp.workers import BatchDone, Noop

pytestmark = pytest.mark.django_db(transaction=True)


def _completed() -> float:
    sample = REGISTRY.get_sample_value(
        "dbworker_batches_completed_total", {"worker": BatchDone.name}
    )
    return sample or 0.0


def _cancel_then_roll_back(pk: int) -> None:
    with transaction.atomic():
        WorkItem.objects.filter(pk=pk).cancel()
        raise RuntimeError("the caller's transaction rolls back")


def test_a_completion_that_rolls_back_is_not_counted_as_a_completed_batch() -> None:
    """The guide: ``dbworker_batches_completed_total`` counts batches completed.

    The counter is moved inside the completing transaction, before it
    commits (``completion._complete``); when that transaction rolls back
    (here an operator's cancel in a caller's block that raises; in a
    worker, a success write that fails and is retried or split) the batch
    is still open and no callback exists, but the counter (and the log
    line "Batch #N complete") says one
    completed, and counts it again when the batch completes for real.
    Counting on commit (``transaction.on_commit``) would make it true.
    """
    with batch(on_complete=BatchDone) as b:
        item = Noop.enqueue({})
    before = _completed()
    with pytest.raises(RuntimeError, match="rolls back"):
        _cancel_then_roll_back(item.pk)
    assert Batch.objects.get(pk=b.id).completed_at is None
    assert not WorkItem.objects.filter(handler=BatchDone.name).exists()
    assert _completed() == before


def _enqueue_in_a_thread_with_the_callers_context() -> int:
    """``asyncio.to_thread`` and asgiref's ``sync_to_async`` copy the context like this."""
    context = contextvars.copy_context()

    def enqueue() -> int:
        try:
            return Noop.enqueue({}).pk
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(context.run, enqueue).result(timeout=30)


def _batch_that_raises(enqueued: list[int]) -> None:
    with batch(on_complete=BatchDone):
        enqueued.append(_enqueue_in_a_thread_with_the_callers_context())
        raise RuntimeError("the block raises")


@pytest.mark.server_db
def test_an_enqueue_in_another_thread_does_not_join_the_batch() -> None:
    """The guide (and ``batches.py``): only enqueues in the block's thread belong to it.

    The open batch is a context variable, which a thread started with a copy
    of the caller's context (``asyncio.to_thread``, ``sync_to_async``, a pool
    fed through ``contextvars.copy_context().run``) sees too. Its enqueue
    then writes on its own connection, outside the block's transaction, a
    row carrying the id of a batch not committed yet: it commits on its
    own, is not in the batch's ``total``, and survives a rollback of the
    block with a ``batch_id`` that names no batch. Keeping the thread's id
    with the open batch (and ignoring it in other threads) would keep the
    promise.
    """
    enqueued: list[int] = []
    with pytest.raises(RuntimeError, match="block raises"):
        _batch_that_raises(enqueued)
    (pk,) = enqueued
    assert not Batch.objects.exists()
    assert WorkItem.objects.get(pk=pk).batch_id is None


@pytest.mark.postgres_only
@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_the_last_of_two_concurrent_finishers_completes_the_batch_at_any_isolation_level(
    isolation: str,
) -> None:
    """The guide: the read after the batch row's lock sees what the previous holder
    committed, "at READ COMMITTED, PostgreSQL's default".

    ``OPTIONS["isolation_level"]`` may make the connections REPEATABLE READ
    (the keyed claim, which reads after a lock too, sets READ COMMITTED for
    its transaction and refuses a stricter caller's). An ending's
    transaction does not (``ending_transaction`` is a plain ``atomic`` on
    PostgreSQL): its snapshot is taken by the success UPDATE, before the
    lock, so two finishers of a batch's last two items that wait for the
    batch row together each see the other's item as still claimed, and
    neither completes the batch. The callback comes only with some
    worker's next sweep (up to ``STALE_AFTER / 4`` later), not "when the
    last item ends".
    """
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        Noop.enqueue({})
    claimed = claim(handlers=["noop"])
    assert len(claimed) == 2
    hold, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def finish(item: WorkItem) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {isolation}"
                )
            assert item.claim_token is not None
            transitions.succeed([(item.pk, item.claim_token, None)], linked={item.pk: b.id})
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    def holder() -> None:
        try:
            with transaction.atomic():
                list(Batch.objects.select_for_update().filter(pk=b.id))
                hold.set()
                release.wait(timeout=30)
        finally:
            connections.close_all()

    lock = threading.Thread(target=holder)
    lock.start()
    hold.wait(timeout=20)
    finishers = [threading.Thread(target=finish, args=(item,)) for item in claimed]
    for thread in finishers:
        thread.start()
    # Polled from this thread's connection: a transaction sees pg_stat_activity
    # as it was when it first read it.
    wait_until(lambda: lock_waiters() >= 2, timeout=20, what="both finishers at the lock")
    release.set()
    lock.join(timeout=30)
    for thread in finishers:
        thread.join(timeout=30)
    assert not errors, errors
    assert set(WorkItem.objects.filter(batch_id=b.id).values_list("status", flat=True)) == {
        "succeeded"
    }
    assert Batch.objects.get(pk=b.id).completed_at is not None
    assert WorkItem.objects.filter(handler=BatchDone.name).count() == 1
