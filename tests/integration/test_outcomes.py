"""The batching success writer: group commit, per-row fencing, stragglers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker.outcomes import SuccessWriter
from tests.factories import claim, make_item

pytestmark = pytest.mark.django_db(transaction=True)


def test_successes_arriving_during_a_write_share_the_next_one() -> None:
    for _ in range(20):
        make_item()
    items = claim(limit=20)
    ops = operations()
    writer = SuccessWriter(ops)
    batches: list[int] = []
    real = ops.succeed_many

    def observed(rows: Any) -> Any:
        if not batches:
            # Hold the first write until the other 19 successes are queued.
            deadline = time.monotonic() + 10
            while writer._queue.qsize() < 19 and time.monotonic() < deadline:
                time.sleep(0.005)
        batches.append(len(rows))
        return real(rows)

    ops.succeed_many = observed  # type: ignore[method-assign]
    writer.start()
    results: dict[int, bool] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i.pk, writer.record(i, f"{i.pk}")))
        for i in items
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    writer.close()
    writer.join(10)
    assert batches == [1, 19]
    assert all(results.values()) and len(results) == 20
    rows = WorkItem.objects.all()
    assert {r.status for r in rows} == {Status.SUCCEEDED}
    assert all(r.result == r.pk for r in rows)


def test_fenced_rows_in_a_batch_are_reported_per_row() -> None:
    make_item()
    make_item()
    mine, lost = claim(limit=2)
    WorkItem.objects.filter(pk=lost.pk).update(status=Status.PENDING)
    claim(limit=1)  # re-claimed by someone else
    writer = SuccessWriter(operations())
    writer.start()
    assert writer.record(mine, None) is True
    assert writer.record(lost, '"late"') is False
    writer.close()
    writer.join(10)
    assert WorkItem.objects.get(pk=lost.pk).status == Status.CLAIMED


def test_a_write_already_committed_is_not_mistaken_for_fencing() -> None:
    make_item()
    (item,) = claim(limit=1)
    ops = operations()
    assert ops.succeed_many([(item.pk, item.claim_token, None)]) == {(item.pk, item.claim_token)}
    writer = SuccessWriter(ops)
    writer.start()
    # The same write again (as after a lost answer): recognised as ours.
    assert writer.record(item, None) is True
    writer.close()
    writer.join(10)


def test_records_after_close_are_written_directly() -> None:
    make_item()
    (item,) = claim(limit=1)
    writer = SuccessWriter(operations())
    writer.start()
    writer.close()
    writer.join(10)
    assert not writer.is_alive()
    assert writer.record(item, '"straggler"') is True
    assert WorkItem.objects.get(pk=item.pk).result == "straggler"
