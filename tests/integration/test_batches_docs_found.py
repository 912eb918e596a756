"""What writing the batches guide found in the core (issue 22): failing tests, to fix.

Each test states what the guide (docs/topics/batches.md) says and fails
while the code does otherwise.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections, transaction
from prometheus_client import REGISTRY

from django_dbworker import batch
from django_dbworker.models import Batch, WorkItem
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
