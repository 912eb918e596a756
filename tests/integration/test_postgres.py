"""PostgreSQL-only behaviour: SKIP LOCKED claims and LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection

from django_dbworker.models import WorkItem
from django_dbworker.worker import Worker
from django_dbworker.worker.runtime import WorkerConfig
from tests.conftest import wait_until
from tests.factories import claim, make_item
from tests.testapp.models import Execution
from tests.testapp.workers import Record

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def _second_connection() -> psycopg.Connection:
    params = connection.get_connection_params()
    return psycopg.connect(**params)


def test_claim_skips_a_row_locked_by_another_transaction() -> None:
    first = make_item()
    second = make_item()
    with _second_connection() as other:
        other.execute(
            f"SELECT id FROM {WorkItem._meta.db_table} WHERE id = %s FOR UPDATE", (first.pk,)
        )
        started = time.monotonic()
        items = claim(limit=2)
        assert time.monotonic() - started < 2.0, "the claim waited for the lock"
        assert [i.pk for i in items] == [second.pk]
        other.rollback()
    assert [i.pk for i in claim(limit=2)] == [first.pk]


def test_an_idle_worker_wakes_on_notify_not_on_its_poll() -> None:
    worker = Worker([Record], WorkerConfig(poll_interval=30.0, heartbeat_interval=1.0))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: worker.listener is not None and worker.listener.listening.is_set(),
            timeout=10,
            what="the listener to LISTEN",
        )
        # The listener wakes the loop once when it connects; wait until that
        # empty claim is done and the loop sleeps on its 30 s poll.
        worker.wake.set()
        wait_until(
            lambda: worker.idle.is_set() and not worker.wake.is_set(),
            timeout=10,
            what="the claim loop to go idle",
        )
        Record.enqueue({"key": "wake"})
        # Bounded far below the 30 s poll interval: only the NOTIFY can wake it in time.
        wait_until(
            lambda: Execution.objects.filter(key="wake").exists(),
            timeout=10,
            what="the notified worker to run the item",
        )
    finally:
        worker.stop(immediate=True)
        thread.join(10)
