"""``dbworker_stats`` and ``batch_stats``: open batches, their progress, rows waiting."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_dbworker import batch
from django_dbworker.batches.models import Batch
from django_dbworker.batches.stats import OLDEST_OPEN, batch_progress, open_batches, waiting_count
from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from tests.factories import claim
from tests.testapp.workers import BatchDone, Echo, Noop, NoRetry, Record

pytestmark = pytest.mark.django_db


def _open_batch(noops: int, echoes: int) -> Batch:
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}] * noops)
        Echo.enqueue_many([{}] * echoes)
    return b


def test_progress_counts_open_batches_from_their_items_and_completed_ones_as_stored() -> None:
    with batch(on_complete=BatchDone) as done:
        Noop.enqueue_many([{}, {}])
        NoRetry.enqueue({})
    opened = _open_batch(2, 3)
    run_until_empty([Noop, NoRetry])
    claim(limit=1, handlers=["echo"])
    rows = list(Batch.objects.order_by("pk"))
    with CaptureQueriesContext(connection) as ctx:
        progress = batch_progress(rows)
    assert len(ctx.captured_queries) == 1
    p = progress[done.pk]
    assert p.completed and (p.total, p.succeeded, p.failed, p.cancelled) == (3, 2, 1, 0)
    assert (p.pending, p.retried, p.gone) == (0, 0, 0)
    p = progress[opened.pk]
    assert not p.completed
    assert (p.total, p.succeeded, p.pending, p.claimed, p.done) == (5, 2, 3, 1, 2)
    # A deleted item of an open batch is "gone"; a retried item of a completed one "retried".
    gone = WorkItem.objects.filter(batch_id=opened.pk, status=Status.PENDING).order_by("pk")[0]
    WorkItem.objects.filter(pk=gone.pk).delete()
    WorkItem.objects.filter(batch_id=done.pk, status=Status.FAILED).retry()
    progress = batch_progress(Batch.objects.order_by("pk"))
    assert progress[opened.pk].gone == 1
    assert progress[done.pk].retried == 1 and progress[done.pk].failed == 1


def test_open_batches_lists_the_oldest_few() -> None:
    made = [_open_batch(1, 1) for _ in range(OLDEST_OPEN + 2)]
    run_until_empty([Noop])
    with batch(on_complete=BatchDone):  # complete at once: not open
        pass
    found = open_batches()
    assert found.count == OLDEST_OPEN + 2
    assert [b.pk for b, _ in found.oldest] == [b.pk for b in made[:OLDEST_OPEN]]
    assert all((p.done, p.total) == (1, 2) for _, p in found.oldest)


def test_stats_show_open_batches_and_waiting_rows() -> None:
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "Open batches" not in out.getvalue() and "waiting" not in out.getvalue()
    opened = _open_batch(2, 1)
    run_until_empty([Noop])
    parent = Record.enqueue({"key": "p"})
    Record.enqueue({"key": "c"}, after=[parent])
    Record.enqueue({"key": "d"}, after=[parent])
    assert waiting_count() == 2
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    text = out.getvalue()
    lines = text.splitlines()
    start = lines.index("Open batches: 1 (times in UTC):")
    assert lines[start + 1].split() == [
        "batch",
        "callback",
        "created",
        "ended/total",
        "succeeded",
        "failed",
        "cancelled",
        "pending",
    ]
    row = lines[start + 2].split()
    assert row[:2] == [f"#{opened.pk}", "batch_done"]
    assert row[-5:] == ["2/3", "2", "0", "0", "1"]
    assert "Items waiting for their parents (after=): 2." in text


def test_stats_say_how_many_open_batches_are_not_listed() -> None:
    for _ in range(OLDEST_OPEN + 1):
        _open_batch(0, 1)
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert f"Open batches: {OLDEST_OPEN + 1}, the {OLDEST_OPEN} oldest (times in UTC):" in (
        out.getvalue()
    )
