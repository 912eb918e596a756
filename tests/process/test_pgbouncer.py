"""Wake-ups through PgBouncer in transaction mode: WAKEUP_DATABASE, or a warning.

The PgBouncer leg of ``scripts/test`` runs the tests marked ``pgbouncer``
with DATABASE_URL going through a real PgBouncer 1.18 in transaction mode
(``scripts/pgbouncer.py``) and the alias ``direct`` reaching the same
database without it (``tests/settings.py``, DBWORKER_DIRECT_URL). There a
LISTEN succeeds and lasts one transaction: notifications are silently
lost, and an enqueued item waits a whole POLL_INTERVAL. With POLL_INTERVAL
at 30 s, these tests tell a wake-up from a poll: a wake-up starts the item
within a second or so, a poll would take up to 30.

``test_a_direct_connection_passes_the_probe`` runs in the PostgreSQL leg:
the probe that finds the pooler must not warn on a direct connection.
"""

from __future__ import annotations

import os

import pytest

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until, wake_turns
from tests.testapp.workers import Record

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

#: Long enough that a poll cannot pass for a wake-up.
SLOW_POLL = {"DBWORKER_POLL_INTERVAL": "30"}
#: A wake-up starts an item within this (measured: tens of milliseconds).
WAKE_UP_BOUND = 5.0
WARNING = "Wake-ups cannot reach this worker"
REACHED = "Wake-ups reach the listener on database"

behind_pgbouncer = pytest.mark.skipif(
    not os.environ.get("DBWORKER_DIRECT_URL"),
    reason="needs DATABASE_URL through PgBouncer and DBWORKER_DIRECT_URL "
    "(the PgBouncer leg of scripts/test)",
)


def pickup_seconds(pk: int) -> float:
    """Seconds from the row's insert to its claim, both on the database's clock."""
    row = WorkItem.objects.get(pk=pk)
    assert row.claimed_at is not None
    return (row.claimed_at - row.created_at).total_seconds()


def enqueue_and_time(n: int) -> list[float]:
    """Enqueue ``n`` items one after the other; each one's pick-up latency."""
    latencies = []
    for i in range(n):
        item = Record.enqueue({"key": f"w{i}"})
        wait_until(
            lambda pk=item.pk: WorkItem.objects.get(pk=pk).status == Status.SUCCEEDED,
            timeout=40,
            interval=0.01,
            what=f"item {i} to succeed",
        )
        latencies.append(pickup_seconds(item.pk))
    return latencies


@pytest.mark.pgbouncer
@behind_pgbouncer
def test_listen_through_pgbouncer_is_a_warning_at_start(start_worker) -> None:
    worker = start_worker("record", env=SLOW_POLL)
    worker.wait_for_log(WARNING, timeout=30)
    log = worker.log()
    assert "WAKEUP_DATABASE is not set" in log
    assert "polls every POLL_INTERVAL (30s)" in log
    assert "DBWORKER['WAKEUP_DATABASE']" in log
    # No wake-up turn through the pooler: its lock would stay on a server session.
    assert wake_turns() == (0, 0)
    # The worker works all the same: it polls.
    worker.signal(15)
    assert worker.wait() == 0


@pytest.mark.pgbouncer
@behind_pgbouncer
def test_wakeup_database_brings_wake_ups_past_pgbouncer(start_worker) -> None:
    env = {**SLOW_POLL, "DBWORKER_WAKEUP_DATABASE": "direct"}
    workers = [start_worker("record", "-v", "2", env=env) for _ in range(2)]
    for worker in workers:
        worker.wait_for_log(f"{REACHED} 'direct'", timeout=30)
    # The two take turns on the direct connections (one holds, one waits)...
    wait_until(lambda: wake_turns() == (1, 1), timeout=30, what="the wake-up turn")
    latencies = enqueue_and_time(5)
    # ...and each wake-up reaches the holder.
    assert max(latencies) < WAKE_UP_BOUND, latencies
    print(f"pick-up through PgBouncer with WAKEUP_DATABASE: {latencies}")
    for worker in workers:
        assert WARNING not in worker.log()
        worker.signal(15)
    assert [worker.wait() for worker in workers] == [0, 0]


def test_a_direct_connection_passes_the_probe(start_worker) -> None:
    if os.environ.get("DBWORKER_DIRECT_URL"):
        pytest.skip("DATABASE_URL goes through PgBouncer in this leg")
    worker = start_worker("record", "-v", "2", env=SLOW_POLL)
    worker.wait_for_log(f"{REACHED} 'default'", timeout=30)
    latencies = enqueue_and_time(2)
    assert max(latencies) < WAKE_UP_BOUND, latencies
    assert WARNING not in worker.log()
    worker.signal(15)
    assert worker.wait() == 0
