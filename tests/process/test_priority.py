"""Urgent work first, even behind a backlog: a real ``run_workers`` and its buffer.

A worker busy with a backlog of low-priority items holds some of them
claimed (its prefetch buffer). A higher-priority item enqueued meanwhile
must start before every low-priority item claimed after it was enqueued,
and, on the databases that poll, a buffer of low-priority rows is given
back when a full claim shows that rows outranking them are pending. Order
comes from the handlers' own start records; no timing is asserted.
"""

from __future__ import annotations

import signal
import time

from django.db import connection
from django.db.models import Min

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import Sleep

BULK = 300


def _started(prefix: str) -> int:
    return Execution.objects.filter(kind="start", key__startswith=prefix).count()


def test_urgent_items_start_before_bulk_claimed_after_them_and_outranked_rows_go_back(
    start_worker,
) -> None:
    Sleep.enqueue_many([{"key": f"bulk-{n}", "seconds": 0.02} for n in range(BULK)], priority=0)
    # One thread: starts are then in the order the worker chose them.
    worker = start_worker("sleep", "--concurrency", "1", "-v", "2")
    wait_until(lambda: _started("bulk-") >= 20, timeout=30, what="the backlog to be draining")
    urgent = []
    for n in range(5):
        urgent.append(Sleep.enqueue({"key": f"urgent-{n}", "seconds": 0.0}, priority=10))
        time.sleep(0.05)  # each its own moment in the backlog
    # More outranking rows than one refill takes: a full claim of them.
    Sleep.enqueue_many([{"key": f"wave-{n}", "seconds": 0.0} for n in range(150)], priority=10)
    wait_until(
        lambda: WorkItem.objects.filter(priority=10, status=Status.SUCCEEDED).count() == 155,
        timeout=60,
        what="the urgent items",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log()

    starts = dict(Execution.objects.filter(kind="start").values_list("key", "created_at"))
    for item in urgent:
        item.refresh_from_db()
        key = item.payload["key"]
        assert item.claimed_at is not None
        # Started next once claimed: at most the bulk item a thread took
        # while the claim that took this one was still being dispatched.
        overtaking = [
            k
            for k, at in starts.items()
            if k.startswith("bulk-") and item.claimed_at < at < starts[key]
        ]
        assert len(overtaking) <= 1, f"{key} waited behind buffered bulk work: {overtaking}"
    # The wave: once its first rows were claimed, no bulk work started before them.
    wave = WorkItem.objects.filter(payload__key__startswith="wave-")
    first_claim = wave.aggregate(first=Min("claimed_at"))["first"]
    first_start = min(at for k, at in starts.items() if k.startswith("wave-"))
    overtaking = [
        k for k, at in starts.items() if k.startswith("bulk-") and first_claim < at < first_start
    ]
    assert len(overtaking) <= 1, f"the wave waited behind buffered bulk work: {overtaking}"
    if connection.vendor != "postgresql":
        # Polled: a full refill of outranking rows gave back the bulk rows
        # the buffer held. (PostgreSQL's wake-up says the priority: the
        # worker claims the wave ahead of its buffer instead.)
        assert "of lower priority than 10: such rows are pending" in worker.log(), worker.log()[
            -3000:
        ]
