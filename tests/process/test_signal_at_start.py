"""A stop signal in the moments after "Starting worker" is a clean stop, not a kill.

The start-up line is what supervisors and these tests wait for; the work
after it (the orphan warning's query, the metrics server) used to run
before the signal handlers were installed, so a SIGTERM then ended the
process by the default action (exit -15) instead of a graceful stop.
"""

from __future__ import annotations

import signal

import pytest
from django.db import connection, transaction

from tests.conftest import lock_waiters, wait_until

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def test_sigterm_right_after_the_start_up_line_stops_the_worker_cleanly(start_worker) -> None:
    # The orphan warning's query, right after the start-up line, waits for
    # this lock: the worker is held there while the signal arrives.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("LOCK TABLE django_dbworker_workitem IN ACCESS EXCLUSIVE MODE")
        worker = start_worker("noop")
        worker.wait_for_log("Starting worker", timeout=60)
        wait_until(lambda: lock_waiters() > 0, timeout=30, what="the worker to wait for the lock")
        worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
    assert "SIGTERM received" in worker.log()
