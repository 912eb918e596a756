"""What writing the batches guide found in the core (issue 22): failing tests, to fix.

Each test states what the guide (docs/topics/batches.md) says and fails
while the code does otherwise.
"""

from __future__ import annotations

import pytest
from django.db import transaction
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
