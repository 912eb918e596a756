"""The database connections of one ``run_workers`` process, counted on PostgreSQL.

docs/topics/deployment.md ("Database connections") says what a worker
opens: one for the main thread, one per handler thread, one each for the
success writer, the heartbeat, the LISTEN connection and the periodic
scheduler, one for the orphan watch (its first look is 10 minutes after
start), and more only for handlers with a ``timeout`` or own-table loops.
This counts them in ``pg_stat_activity`` for a real worker with every
handler thread busy, by the ``application_name`` its environment gives it.
"""

from __future__ import annotations

import time

import pytest
from django.db import connection

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import make_item

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

APP = "dbworker-connection-count"
CONCURRENCY = 3
#: Main thread, success writer, heartbeat, listener, scheduler (dbworker.retention).
HELPERS = 5
#: The orphan watch's, once its first look has run.
LATER = 1


def worker_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [APP])
        return int(cursor.fetchone()[0])


def test_a_busy_worker_holds_concurrency_plus_its_helpers_connections(start_worker) -> None:
    make_item(handler="noop")  # a success: the writer's connection opens
    worker = start_worker(
        "dbworker.retention",
        "noop",
        "sleep",
        "--concurrency",
        str(CONCURRENCY),
        env={"PGAPPNAME": APP},
    )
    worker.wait_for_log("Starting worker")
    wait_until(
        lambda: WorkItem.objects.filter(handler="noop", status=Status.SUCCEEDED).exists(),
        timeout=20,
        what="the noop item to succeed",
    )
    for i in range(CONCURRENCY):
        make_item(handler="sleep", payload={"key": f"s{i}", "seconds": 12})
    expected = CONCURRENCY + HELPERS
    # Every handler thread runs a job, and the first heartbeat (5 s) has gone out.
    wait_until(
        lambda: worker_connections() == expected,
        timeout=15,
        what=f"{expected} connections of the worker (now {worker_connections()})",
    )
    seen = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        seen.append(worker_connections())
        time.sleep(0.2)
    assert max(seen) <= expected + LATER, seen
