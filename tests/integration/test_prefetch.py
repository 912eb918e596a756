"""Prefetch: claims run ahead of the threads for short jobs, never hoard long ones.

Rows held in the buffer are attempts like the running ones: heartbeated,
fenced, released at shutdown, dropped if recovered meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db.models import F

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from django_dbworker.worker.prefetch import MAX_PREFETCH
from tests.conftest import wait_until
from tests.factories import steal_claim
from tests.testapp.models import Execution
from tests.testapp.workers import GATE, Gate, Noop, Pace, Sleep

pytestmark = pytest.mark.django_db(transaction=True)

StartWorker = Callable[..., Worker]


def test_short_jobs_are_claimed_in_large_batches(background_worker: StartWorker) -> None:
    """One thread runs 2,000 no-op items with a few dozen claims, not 2,000."""
    Noop.enqueue_many([None] * 2000)
    worker = background_worker(["noop"], concurrency=1, burst=True)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 2000,
        timeout=60,
        what="2,000 items to succeed",
    )
    # The worker counts outcomes after their commit: wait for the count too.
    wait_until(lambda: worker.outcomes == {"succeeded": 2000}, what="the worker's count")
    assert worker.claims <= 100


def test_without_a_horizon_only_free_threads_are_claimed(background_worker: StartWorker) -> None:
    Noop.enqueue_many([None] * 40)
    worker = background_worker(["noop"], concurrency=1, burst=True, prefetch_horizon=0)
    wait_until(lambda: not WorkItem.objects.exclude(status=Status.SUCCEEDED).exists())
    assert worker.claims == 40


def test_long_jobs_are_not_prefetched(background_worker: StartWorker) -> None:
    """Jobs longer than the horizon: the worker claims no more rows than its threads."""
    Pace.enqueue_many([{"key": str(n), "seconds": 0.4} for n in range(6)])
    worker = background_worker(["pace"], concurrency=2, prefetch_horizon=0.2)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 6,
        timeout=30,
        what="6 paced items",
    )
    # No claim took more rows than there were threads to start them.
    assert worker.claims >= 3, "a claim took more rows than there were threads"


def test_long_jobs_are_not_prefetched_into_the_event_loops_slots(
    background_worker: StartWorker,
) -> None:
    """The same beside an async handler: the event loop's free slots are no room for
    sync rows (an idle worker claimed one for each, to wait for its two threads)."""
    Pace.enqueue_many([{"key": str(n), "seconds": 0.4} for n in range(6)])
    worker = background_worker(
        ["pace", "async_sleep"], concurrency=2, async_concurrency=4, prefetch_horizon=0.2
    )
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 6,
        timeout=30,
        what="6 paced items",
    )
    assert worker.claims >= 3, "a claim took more sync rows than there were threads"


def test_buffered_rows_go_back_when_jobs_turn_long(background_worker: StartWorker) -> None:
    """Fast jobs size the buffer; slow ones behind them are given back, not hoarded."""
    Noop.enqueue_many([None] * 300, priority=5)
    Sleep.enqueue_many([{"key": str(n), "seconds": 0.5} for n in range(6)])
    first = background_worker(["noop", "sleep"], concurrency=1)
    wait_until(lambda: Execution.objects.filter(kind="start").exists(), what="a slow item to start")
    second = background_worker(["noop", "sleep"], concurrency=1)
    wait_until(
        lambda: WorkItem.objects.filter(handler="sleep", status=Status.SUCCEEDED).count() == 6,
        timeout=30,
        what="the slow items",
    )
    # Both counts follow their commits: wait for them as for the rows.
    wait_until(lambda: first.given_back >= 1, what="the first worker to give rows back")
    wait_until(
        lambda: second.outcomes["succeeded"] >= 1,
        what="the second worker to run a slow item",
    )
    # Given back, never run twice.
    starts = list(Execution.objects.filter(kind="start").values_list("key", flat=True))
    assert sorted(starts) == [str(n) for n in range(6)]


def test_a_stop_releases_buffered_rows_at_once(background_worker: StartWorker, gate: None) -> None:
    """SIGTERM-like stop: the running item may finish; the buffered ones go back now."""
    Gate.enqueue_many([{"key": f"fast-{n}"} for n in range(5)], priority=10)
    Gate.enqueue_many([{"key": f"gated-{n}", "wait": True} for n in range(30)])
    # A horizon long enough that the buffer is not given back as the gated
    # item runs on (that is test_buffered_rows_go_back_when_jobs_turn_long).
    worker = background_worker(
        ["gate"], concurrency=1, heartbeat_interval=0.1, prefetch_horizon=5.0
    )
    wait_until(
        lambda: Execution.objects.filter(key__startswith="gated", kind="start").exists(),
        what="a gated item to start",
    )
    buffered = WorkItem.objects.filter(status=Status.CLAIMED).exclude(
        pk__in=WorkItem.objects.filter(payload__key="gated-0").values("pk")
    )
    wait_until(lambda: buffered.count() >= 10, what="rows prefetched behind the running item")
    # Buffered rows are heartbeated like running ones.
    wait_until(
        lambda: not buffered.filter(heartbeat_at__lte=F("claimed_at")).exists(),
        what="heartbeats of the buffered rows",
    )
    assert worker.given_back == 0
    worker.stop()
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.CLAIMED).count() == 1,
        timeout=5,
        what="the buffered rows to be released while the gated item runs",
    )
    # The worker counts the release after its commit: wait for the count too.
    wait_until(lambda: worker.released == 29, timeout=5, what="the worker to count the release")
    GATE.set()
    wait_until(lambda: not WorkItem.objects.filter(status=Status.CLAIMED).exists())
    assert Execution.objects.filter(key__startswith="gated").count() == 1
    released = WorkItem.objects.filter(status=Status.PENDING)
    assert released.count() == 29
    assert not released.exclude(attempts=0).exists(), "a release must give the attempt back"


def test_a_buffered_row_recovered_meanwhile_is_not_run(
    background_worker: StartWorker, gate: None
) -> None:
    Gate.enqueue_many([{"key": f"fast-{n}"} for n in range(5)], priority=10)
    Gate.enqueue({"key": "gated", "wait": True}, priority=5)
    Gate.enqueue_many([{"key": f"later-{n}"} for n in range(10)])
    worker = background_worker(
        ["gate"], concurrency=1, heartbeat_interval=0.1, prefetch_horizon=5.0
    )
    wait_until(lambda: Execution.objects.filter(key="gated").exists(), what="the gated item")
    wait_until(
        lambda: WorkItem.objects.filter(payload__key="later-0", status=Status.CLAIMED).exists(),
        what="later-0 to be prefetched",
    )
    victim = WorkItem.objects.get(payload__key="later-0")
    steal_claim(victim.pk)
    wait_until(
        lambda: any(a.lost for a in worker.ledger.attempts()),
        what="the heartbeat to notice the lost claim",
    )
    GATE.set()
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 16,
        what="every item",
    )
    assert Execution.objects.filter(key="later-0").count() == 1
    assert WorkItem.objects.get(pk=victim.pk).attempts == 2


def test_a_higher_priority_row_waits_at_most_one_buffer(background_worker: StartWorker) -> None:
    """Priorities hold across the buffer: a later urgent row overtakes the pending backlog.

    The backlog's jobs take about 5 ms: a buffer of about 100 rows at the
    default horizon (0.5 s), so most of the 400 rows are still pending when
    the urgent one is enqueued, and it must not wait for them.
    """
    Pace.enqueue_many([{"key": "backlog", "seconds": 0.005}] * 400)
    background_worker(["pace"], concurrency=1)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() >= 30,
        what="the backlog to be under way",
    )
    urgent = Pace.enqueue({"key": "urgent"}, priority=10)
    wait_until(lambda: WorkItem.objects.get(pk=urgent.pk).status == Status.SUCCEEDED)
    urgent.refresh_from_db()
    assert urgent.finished_at is not None
    backlog = WorkItem.objects.exclude(pk=urgent.pk)
    ran_in_between = backlog.filter(
        finished_at__gt=urgent.created_at, finished_at__lt=urgent.finished_at
    ).count()
    assert ran_in_between <= 1 + MAX_PREFETCH
    assert (
        backlog.exclude(status=Status.SUCCEEDED).filter(created_at__lt=urgent.created_at).count()
        >= 100
    ), "the urgent row waited for the backlog"
