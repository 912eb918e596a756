"""A batch's callback is enqueued whatever the enqueue checks say by then, once the batch
was accepted.

``batch(payload=...)`` checks the payload at the block with room for the four keys the batch
adds (``batch``, ``succeeded``, ``failed``, ``cancelled``). The callback goes through the
enqueue path when the batch completes, inside the transaction that records the batch's
last ending; if its checks refuse it then (MAX_PAYLOAD_BYTES lowered since the block), it
is inserted as it is: that ending must not be lost, and nothing may loop on it.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_dbworker import batch
from django_dbworker.batches.models import Batch
from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from tests.testapp.workers import BatchDone, Noop

pytestmark = pytest.mark.django_db(transaction=True)

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
