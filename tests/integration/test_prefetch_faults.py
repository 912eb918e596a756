"""Prefetched (buffered) rows under faults: heartbeats held up, a give-back refused,
a ``max_items`` stop, the cap on abandoned threads.

Every test states what it proves. They run a real database and real worker
threads; waits are bounded (``wait_until``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from django_dbworker import transitions
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import GATE, Gate, Slow

pytestmark = pytest.mark.django_db(transaction=True)

StartWorker = Callable[..., Worker]


def _prefetch_behind_a_gated_item(background_worker: StartWorker, **kwargs: object) -> Worker:
    """One thread: a few fast items size the buffer, then a gated item holds the
    thread while ``later-N`` rows wait claimed in the buffer."""
    Gate.enqueue_many([{"key": f"fast-{n}"} for n in range(20)], priority=10)
    Gate.enqueue({"key": "gated", "wait": True}, priority=5)
    Gate.enqueue_many([{"key": f"later-{n}"} for n in range(10)])
    worker = background_worker(["gate"], concurrency=1, **kwargs)
    wait_until(lambda: Execution.objects.filter(key="gated").exists(), what="the gated item")
    wait_until(
        lambda: WorkItem.objects.filter(payload__key="later-0", status=Status.CLAIMED).exists(),
        what="later-0 to be prefetched",
    )
    return worker


REFUSE_HEARTBEATS = """
CREATE OR REPLACE FUNCTION dbworker_test_refuse_heartbeats() RETURNS trigger AS $$
BEGIN
    IF NEW.status = 'claimed' AND OLD.status = 'claimed'
       AND NEW.heartbeat_at IS DISTINCT FROM OLD.heartbeat_at THEN
        RAISE EXCEPTION 'heartbeats held up' USING ERRCODE = '57014';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER dbworker_test_refuse_heartbeats BEFORE UPDATE ON django_dbworker_workitem
    FOR EACH ROW EXECUTE FUNCTION dbworker_test_refuse_heartbeats();
"""
ALLOW_HEARTBEATS = """
DROP TRIGGER IF EXISTS dbworker_test_refuse_heartbeats ON django_dbworker_workitem;
DROP FUNCTION IF EXISTS dbworker_test_refuse_heartbeats();
"""


@pytest.mark.postgres_only
def test_a_buffered_row_recovered_before_the_heartbeat_notices_is_not_run(
    background_worker: StartWorker, gate: None
) -> None:
    """A buffered row whose claim was recovered as stale must not start.

    Heartbeats are held up (a trigger refuses them, as a lock or a slow
    disk would) for longer than STALE_AFTER, so the rows are recovered as
    stale (by the worker's own overdue pass or another's); when the thread
    gets to them, the heartbeat may not have told the worker yet. They must
    not start.
    (First found with a claim stolen while heartbeats landed, which no
    worker can tell from its own clock; that stays like a running row's
    false stale detection: fenced.)
    """
    # A horizon long enough that the buffer is not given back (after two
    # horizons) before the rows go stale.
    worker = _prefetch_behind_a_gated_item(
        background_worker, heartbeat_interval=0.2, stale_after=2.0, prefetch_horizon=3.0
    )
    # Attempts used up: recovery fails the rows instead of requeueing them, so
    # this worker does not claim them again (a claim would mark the old
    # attempts lost by itself).
    WorkItem.objects.filter(payload__key__startswith="later-").update(max_attempts=1)
    with connection.cursor() as cursor:
        cursor.execute(REFUSE_HEARTBEATS)
    try:
        wait_until(
            lambda: WorkItem.objects.filter(
                payload__key="later-0", heartbeat_at__lt=Now() - timedelta(seconds=2.5)
            ).exists(),
            what="later-0 to be stale",
        )
        recovered = transitions.recover_stale(stale_after=2.0)  # another worker's pass
        assert (
            recovered.total >= 1
            or not WorkItem.objects.filter(payload__key="later-0", status=Status.CLAIMED).exists()
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute(ALLOW_HEARTBEATS)
    GATE.set()
    wait_until(lambda: not worker.in_flight(), timeout=30, what="the worker to finish")
    assert WorkItem.objects.filter(payload__key__startswith="later-", status=Status.FAILED).count()
    ran = sorted(Execution.objects.filter(key__startswith="later-").values_list("key", flat=True))
    assert ran == [], f"recovered rows ran from the buffer: {ran}"


REFUSE_RELEASE = """
CREATE OR REPLACE FUNCTION dbworker_test_refuse_release() RETURNS trigger AS $$
BEGIN
    IF OLD.status = 'claimed' AND NEW.status = 'pending' THEN
        RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction'
            USING ERRCODE = '25006';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER dbworker_test_refuse_release BEFORE UPDATE ON django_dbworker_workitem
    FOR EACH ROW EXECUTE FUNCTION dbworker_test_refuse_release();
"""
ALLOW_RELEASE = """
DROP TRIGGER IF EXISTS dbworker_test_refuse_release ON django_dbworker_workitem;
DROP FUNCTION IF EXISTS dbworker_test_refuse_release();
"""


@pytest.fixture
def refuse_release() -> Iterator[Callable[[], None]]:
    """Releases (claimed -> pending) fail as in a read-only window, until allowed."""
    with connection.cursor() as cursor:
        cursor.execute(REFUSE_RELEASE)

    def allow() -> None:
        with connection.cursor() as cursor:
            cursor.execute(ALLOW_RELEASE)

    yield allow
    allow()


@pytest.mark.postgres_only
def test_a_give_back_that_fails_keeps_the_buffered_rows(
    background_worker: StartWorker,
    gate: None,
    refuse_release: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Was: when giving back buffered rows fails, they are lost to this worker
    yet stay claimed, unheartbeated; stale recovery then charges them an
    attempt they never ran, and with max_attempts=1 they end ``failed``
    without their handler ever running.

    ``_shed_hoard`` marks the rows withdrawn (no thread will start them) and,
    when ``transitions.release`` fails (a read-only window longer than the 5 s
    ``persist`` allows), still retired them: nobody heartbeats, runs or
    releases them. (``Shutdown.release_buffered`` handles the same failure by keeping
    them in flight.)
    """
    Gate.enqueue_many([{"key": f"fast-{n}"} for n in range(20)], priority=10)
    Gate.enqueue({"key": "gated", "wait": True}, priority=5)
    later = Gate.enqueue_many([{"key": f"later-{n}"} for n in range(10)])
    WorkItem.objects.filter(pk__in=[i.pk for i in later]).update(max_attempts=1)
    worker = background_worker(["gate"], concurrency=1, heartbeat_interval=0.2, stale_after=2.0)
    wait_until(lambda: Execution.objects.filter(key="gated").exists(), what="the gated item")
    wait_until(
        lambda: WorkItem.objects.filter(payload__key="later-0", status=Status.CLAIMED).exists(),
        what="later rows to be prefetched",
    )
    # The gated job turned long: after 1 s the worker tries to give the buffer
    # back; the release fails (for 5 s of retries). The rows must stay its own.
    wait_until(
        lambda: "Could not give back" in caplog.text,
        timeout=15,
        what="the give-back to fail",
    )
    assert len(worker.in_flight()) == 11, "buffered rows were dropped"
    refuse_release()  # the database accepts writes again
    GATE.set()
    wait_until(
        lambda: not WorkItem.objects.filter(status__in=[Status.CLAIMED, Status.PENDING]).exists(),
        timeout=30,
        what="every item to end",
    )
    never_ran = [
        k
        for k in WorkItem.objects.filter(status=Status.FAILED).values_list(
            "payload__key", flat=True
        )
        if not Execution.objects.filter(key=k).exists()
    ]
    assert never_ran == [], f"failed without ever running: {never_ran}"


def test_a_row_released_at_a_max_items_stop_is_not_started_afterwards(
    background_worker: StartWorker, gate: None
) -> None:
    """A worker that stopped at ``max_items`` releases its buffered rows after
    SHUTDOWN_TIMEOUT, and its pool never starts them: a row ``pending`` again is
    anyone's to claim, and this worker, having claimed its ``max_items``, claims
    nothing more. (Was: ``_drain``'s final release left the rows' tasks queued on
    the pool, and a pool thread started them afterwards, without a claim.)

    The stop must come while the gated item holds the thread, or the worker is
    not stopped: rows given back earlier by the horizon's give-back are then
    claimed again, legitimately (a fresh claim each, within ``max_items``). A
    long horizon keeps the whole buffer until the stop, and the test waits for it.
    """
    worker = _prefetch_behind_a_gated_item(
        background_worker, max_items=31, shutdown_timeout=0.5, prefetch_horizon=3.0
    )
    wait_until(
        lambda: worker.stopping.is_set(),
        timeout=15,
        what="the max_items stop while the gated item runs (its 31 rows claimed)",
    )
    later = WorkItem.objects.filter(payload__key__startswith="later-")
    wait_until(
        lambda: later.filter(status=Status.PENDING).count() == 10,
        timeout=10,
        what="the buffered rows to be released",
    )
    GATE.set()  # the running item ends; its thread takes the next queued task
    wait_until(
        lambda: (
            not [t for t in threading.enumerate() if t.name.startswith("dbworker")]
            or Execution.objects.filter(key__startswith="later-").exists()
        ),
        timeout=15,
        what="the pool threads to end or a released row to start",
    )
    started = sorted(
        Execution.objects.filter(key__startswith="later-").values_list("key", flat=True)
    )
    assert started == [], f"released (pending) rows were started by the stopped worker: {started}"


def test_buffered_rows_keep_starting_past_the_abandoned_threads_cap(
    background_worker: StartWorker,
) -> None:
    """PROVES: the watchdog's cap on abandoned (timed-out, still running) handler
    threads no longer holds: once it is reached, pool threads go on starting
    buffered rows, each of which overruns and is abandoned too, until the
    claim loop happens to wake (up to POLL_INTERVAL later).

    ``_check_health`` runs only in the claim loop (``run_once``); before
    prefetch no row started without a claim after the check, now ``_start``
    takes buffered rows without looking at the cap (or ``unhealthy``).
    """
    Slow.enqueue_many([{"key": f"fast-{n}", "seconds": 0} for n in range(30)], priority=10)
    Slow.enqueue_many([{"key": f"hang-{n}", "seconds": 3} for n in range(150)])
    worker = background_worker(["slow"], concurrency=1, max_abandoned_threads=1, poll_interval=1.0)
    wait_until(lambda: worker.unhealthy is not None, timeout=20, what="the watchdog to stop it")
    wait_until(lambda: worker.abandoned.count == 0, timeout=30, what="abandoned threads to end")
    hung = Execution.objects.filter(kind="start", key__startswith="hang-").count()
    assert hung <= 1, f"{hung} overrunning handlers started with a cap of 1 abandoned thread"
