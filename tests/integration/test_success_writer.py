"""The batching success writer: group commit, per-row fencing, stragglers."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker.success_writer import SuccessWriter
from tests.conftest import wait_until
from tests.factories import claim, make_item

pytestmark = pytest.mark.django_db(transaction=True)


def test_successes_arriving_during_a_write_share_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for _ in range(20):
        make_item()
    first, *rest = claim(limit=20)
    ops = operations()
    writer = SuccessWriter()
    batches: list[list[int]] = []
    in_flight = threading.Event()
    release = threading.Event()
    real = ops.succeed_rows

    def observed(rows: Any) -> Any:
        batches.append([pk for pk, _token, _result in rows])
        if len(batches) == 1:
            # Hold the first write open until the test has queued the others.
            in_flight.set()
            release.wait(20)
        return real(rows)

    # operations() is shared per alias: monkeypatch puts the method back afterwards.
    monkeypatch.setattr(ops, "succeed_rows", observed)
    writer.start()
    results: dict[int, bool] = {}

    def record(item: WorkItem) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.__setitem__(item.pk, writer.record(item, f"{item.pk}"))
        )
        thread.start()
        return thread

    # One success alone, so the first write holds exactly it; the other 19
    # are handed over only once that write is in flight.
    threads = [record(first)]
    try:
        wait_until(in_flight.is_set, what="the first write to start")
        threads += [record(item) for item in rest]
        wait_until(lambda: writer._queue.qsize() == len(rest), what="19 queued successes")
    finally:
        release.set()
    for t in threads:
        t.join(10)
    writer.close()
    writer.join(10)
    # Two writes: the lone first success, then all 19 that arrived meanwhile.
    assert [sorted(batch) for batch in batches] == [[first.pk], sorted(i.pk for i in rest)]
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
    writer = SuccessWriter()
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
    writer = SuccessWriter()
    writer.start()
    # The same write again (as after a lost answer): recognised as ours.
    assert writer.record(item, None) is True
    writer.close()
    writer.join(10)


def test_records_after_close_are_written_directly() -> None:
    make_item()
    (item,) = claim(limit=1)
    writer = SuccessWriter()
    writer.start()
    writer.close()
    writer.join(10)
    assert not writer.is_alive()
    assert writer.record(item, '"straggler"') is True
    assert WorkItem.objects.get(pk=item.pk).result == "straggler"
