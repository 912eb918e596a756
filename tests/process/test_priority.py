"""Urgent work first, even behind a backlog: a real ``run_workers`` and its buffer.

A worker busy with a backlog of low-priority items holds some of them
claimed (its prefetch buffer). A higher-priority item enqueued meanwhile
must start before every low-priority item claimed after it was enqueued,
and soon: a wake-up that says its priority (PostgreSQL's LISTEN) or, where
none does, the worker's own look for outranking rows (URGENT_PEEK) has it
claimed ahead of the buffer. Order comes from the handlers' own start
records; no timing is asserted.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.db.models import Min

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker.config import URGENT_PEEK
from tests.conftest import wait_until, wake_turns
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


def _overtaking_bulk(start_worker, threads: int, *, ready=None, verbose: bool = False) -> int:
    """Bulk items that started after an urgent item was enqueued behind a buffer, before it.

    A buffer of 2 s of work (about 400 of these items) and a 2 s poll: a worker that
    learns of the urgent item only at its next refill starts 91 items first (measured;
    24 with the tests' 0.2 s poll).
    """
    Sleep.enqueue_many([{"key": f"bulk-{n}", "seconds": 0.02} for n in range(3 * BULK)])
    worker = start_worker(
        "sleep",
        "--concurrency",
        str(threads),
        *(["-v", "2"] if verbose else []),
        env={"DBWORKER_PREFETCH_HORIZON": "2", "DBWORKER_POLL_INTERVAL": "2"},
    )
    wait_until(lambda: _started("bulk-") >= 50, timeout=30, what="a buffer to fill")
    if ready is not None:
        wait_until(lambda: ready(worker), timeout=30, what="the worker to be ready")
    before = set(
        Execution.objects.filter(kind="start", key__startswith="bulk-").values_list(
            "key", flat=True
        )
    )
    Sleep.enqueue({"key": "urgent", "seconds": 0.0}, priority=10)
    wait_until(lambda: _started("urgent") == 1, timeout=30, what="the urgent item to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log()
    urgent_at = Execution.objects.get(kind="start", key="urgent").pk
    return len(
        [
            key
            for key in Execution.objects.filter(
                kind="start", key__startswith="bulk-", pk__lt=urgent_at
            ).values_list("key", flat=True)
            if key not in before
        ]
    )


@pytest.mark.pgbouncer
def test_an_urgent_item_waits_for_the_running_items_not_for_the_buffer(start_worker) -> None:
    """Wherever the wake-up carries no priority (SQLite, MySQL/MariaDB, a pooler without a
    wake-up database), the worker looks for outranking rows while it holds a buffer
    (URGENT_PEEK): an urgent item starts after the running items and the few that start
    within that look, not after the whole buffer."""
    threads = 4
    overtaking = _overtaking_bulk(start_worker, threads)
    # The documented bound: the running items, then the buffered work that starts before
    # the next look (URGENT_PEEK: 50 ms, ten of these 20 ms items on four threads), and
    # one more per thread while the look and its claim run. The whole buffer is about 100.
    bound = threads + round(URGENT_PEEK / 0.02 * threads) + threads
    assert overtaking <= bound, f"{overtaking} bulk items started first"


@pytest.mark.postgres_only
def test_an_urgent_wake_up_reaches_a_worker_that_passed_the_wake_up_turn(start_worker) -> None:
    """A worker busy with a backlog passes the wake-up turn on (worker/wakeup.py) and no
    longer looks for outranking rows itself (its wake-ups say their priority): it still
    hears the urgent ones."""
    if os.environ.get("DBWORKER_DIRECT_URL"):
        pytest.skip("DATABASE_URL goes through PgBouncer in this leg")
    threads = 4

    def aside(worker) -> bool:
        # Its probe came back, and it neither holds the turn nor waits for it.
        return "Wake-ups reach the listener" in worker.log() and wake_turns() == (0, 0)

    overtaking = _overtaking_bulk(start_worker, threads, ready=aside, verbose=True)
    # The running items, and one more per thread while the wake-up's claim runs.
    assert overtaking <= 2 * threads + round(URGENT_PEEK / 0.02 * threads), overtaking
