"""Pause and rate limits across real ``run_workers`` processes, on every database.

A pause is in the database: it stops claims on every worker, holds across
a restart, and a resume lets them claim again. A rate limit is
cluster-wide: two workers together start at most N items in any window of
one period, by the handlers' own start records.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from django_dbworker import pause_queue, resume_queue
from django_dbworker.models import Status, WorkItem
from tests.conftest import WorkerProcess, wait_until
from tests.factories import most_in_a_window
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed, Paused, Rated, Sleep

pytestmark = pytest.mark.django_db(transaction=True)


def _both_claim_other_work(batch: str, pids: set[int]) -> None:
    """Sleep items, one thread per worker: both workers take some (their claims ran)."""
    Sleep.enqueue_many([{"key": f"{batch}{i}", "seconds": 0.4} for i in range(6)])
    wait_until(
        lambda: Execution.objects.filter(kind="end", key__startswith=batch).count() == 6,
        timeout=60,
        what=f"the {batch} sleep items to finish",
    )
    ran_on = set(
        Execution.objects.filter(kind="start", key__startswith=batch).values_list("pid", flat=True)
    )
    assert ran_on == pids, (ran_on, pids)


def test_a_pause_stops_every_worker_survives_a_restart_and_resume_restarts_them(
    start_worker,
) -> None:
    def start_two() -> list:
        workers = [start_worker("pausable", "sleep", "--concurrency", "1") for _ in range(2)]
        for worker in workers:
            worker.wait_for_log("Starting worker", timeout=60)
        return workers

    workers = start_two()
    pause_queue("pausable", by="test")
    Paused.enqueue_many([{"key": f"p{i}"} for i in range(10)])
    # Both workers claim after the pause (their other work runs on each), and
    # neither takes a row of the paused queue.
    _both_claim_other_work("a", {w.pid for w in workers})
    assert WorkItem.objects.filter(handler="pausable", status=Status.PENDING, attempts=0).count()
    assert not Execution.objects.filter(kind="pausable").exists()

    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(60) == 0
    workers = start_two()
    _both_claim_other_work("b", {w.pid for w in workers})
    assert WorkItem.objects.filter(handler="pausable", status=Status.PENDING).count() == 10
    assert not Execution.objects.filter(kind="pausable").exists()

    resume_queue("pausable")
    wait_until(
        lambda: WorkItem.objects.filter(handler="pausable", status=Status.SUCCEEDED).count() == 10,
        timeout=60,
        what="the paused items to run after the resume",
    )
    assert Execution.objects.filter(kind="pausable").count() == 10


def test_a_rate_limit_holds_across_two_workers(start_worker) -> None:
    n, items, threads = 20, 70, 4
    # No prefetch: each worker claims for its free threads only, so both take part
    # (with a buffer, the first to wake could claim all 70 and prove nothing shared).
    workers = [
        start_worker("rated", "--concurrency", str(threads), env={"DBWORKER_PREFETCH_HORIZON": "0"})
        for _ in range(2)
    ]
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    Rated.enqueue_many([{"key": str(i)} for i in range(items)])
    rows = WorkItem.objects.filter(handler="rated")
    # Succeeded, not only run: the start is read from the result, which the
    # success writer records a moment after the handler's own record (later
    # still through a pooler: the PgBouncer leg saw a result still None).
    wait_until(
        lambda: (
            Execution.objects.filter(kind="rated").count() == items
            and rows.filter(status=Status.SUCCEEDED).count() == items
        ),
        timeout=60,
        what=f"all {items} rated items to run and succeed",
    )
    # The handlers' own records of their starts. The limit counts starts as they are taken,
    # just before each runs: a thread the machine keeps waiting after its take starts its
    # handler later than its count (documented: "the starts of a window can then bunch by
    # that much"; a loaded CI run saw 21 in a second). Each thread holds at most one taken,
    # not yet started start, so a second of records holds at most the limit plus the threads.
    starts = [datetime.fromtimestamp(float(t), UTC) for t in rows.values_list("result", flat=True)]
    assert most_in_a_window(starts, 1.0) <= n + threads * len(workers)
    # 70 items at 20 a second: three windows were waited for (3.06 s less a late first
    # start); one limit per process, 40 a second, would take half of that.
    assert (max(starts) - min(starts)).total_seconds() >= 2.5
    # Both workers started some: the limit is shared, not per process.
    assert len(set(Execution.objects.filter(kind="rated").values_list("pid", flat=True))) == 2
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}


# -- burst workers leave paused queues alone ---------------------------------------------
#
# ``--burst``: "process until nothing is claimable ... then exit 0". A paused queue's
# rows are claimed by no worker, so they are not claimable: a burst run leaves them
# pending and exits, whether or not the handler has a ``concurrency_limit``.


def test_burst_exits_with_a_paused_queue_with_or_without_concurrency_keys(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    Paused.enqueue({"key": "plain"})
    pause_queue("pausable", by="test")
    plain = start_worker("pausable", "--burst", "--interval", "0.2")
    assert plain.wait(60) == 0

    Keyed.enqueue({"key": "k"}, concurrency_key="k", queue="pausable")
    keyed = start_worker("keyed", "--burst", "--interval", "0.2")
    # Killed and failed after 30 s if it is still running.
    assert keyed.wait(30) == 0
    assert WorkItem.objects.filter(status=Status.PENDING, attempts=0).count() == 2


def test_a_rate_limited_handler_keeps_its_pace_beside_a_backlog(start_worker) -> None:
    """A worker that serves a backlog of other work (its buffer always full) starts a
    rate-limited handler's rows, older than the backlog, as its window allows: in claim
    order, not only when a thread happens to be idle."""
    Rated.enqueue_many([{"key": f"r{n}"} for n in range(20)])
    Sleep.enqueue_many([{"key": f"bulk-{n}", "seconds": 0.02} for n in range(1500)])
    worker = start_worker("sleep", "rated", "--concurrency", "4")
    wait_until(
        lambda: Execution.objects.filter(kind="rated").count() == 20,
        timeout=60,
        what="the 20 rated items to run beside the backlog",
    )
    bulk_left = WorkItem.objects.filter(handler="sleep", status=Status.PENDING).count()
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.log()
    # "20/s": they all ran within about a second or two, while most of the backlog waited.
    assert bulk_left > 500, bulk_left


@pytest.mark.postgres_only
@pytest.mark.parametrize("level", ["read committed", "repeatable read"])
def test_a_rate_limit_holds_behind_a_slow_taker_at_any_isolation_level(
    level: str, start_worker
) -> None:
    """The database's default isolation is REPEATABLE READ (a server or database default;
    OPTIONS["isolation_level"] the same): three workers wait for the rate lock while a slow
    taker holds it and uses the whole window; none of them counts without its starts."""
    import psycopg
    from django.db import connection

    from django_dbworker.flow.models import FlowLock

    n, items = 20, 60
    name = connection.settings_dict["NAME"]
    s = connection.settings_dict
    dsn = f"host={s['HOST']} port={s['PORT']} dbname={name} user={s['USER']}" + (
        f" password={s['PASSWORD']}" if s.get("PASSWORD") else ""
    )

    def waiting() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE '%%flowlock%%'"
            )
            return int(cursor.fetchone()[0])

    with connection.cursor() as cursor:
        cursor.execute(f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = '{level}'")
    try:
        Rated.enqueue_many([{"key": str(i)} for i in range(items)])
        FlowLock.objects.create(name="rate:rated")
        slow = psycopg.connect(dsn)
        slow.execute(
            "SELECT name FROM django_dbworker_flowlock WHERE name = 'rate:rated' FOR UPDATE"
        )
        workers = [start_worker("rated", "--concurrency", "4") for _ in range(3)]
        wait_until(lambda: waiting() >= 3, timeout=60, what="three workers at the rate lock")
        full_at = slow.execute(
            "INSERT INTO django_dbworker_ratestart (handler, started_at, count) "
            "VALUES ('rated', statement_timestamp(), %s) RETURNING started_at",
            [n],
        ).fetchone()[0]
        slow.commit()
        slow.close()
        rows = WorkItem.objects.filter(handler="rated")
        wait_until(
            lambda: rows.filter(status=Status.SUCCEEDED).count() == items,
            timeout=120,
            what="every rated item to succeed",
        )
        for worker in workers:
            worker.signal(signal.SIGTERM)
        for worker in workers:
            assert worker.wait(timeout=60) == 0, worker.log()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_isolation')
    starts = [datetime.fromtimestamp(float(t), UTC) for t in rows.values_list("result", flat=True)]
    early = [t for t in starts if t < full_at + timedelta(seconds=1)]
    assert early == [], f"{len(early)} starts within the second of a full window"
