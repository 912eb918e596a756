"""Wake-ups without NOTIFY (MySQL/MariaDB, SQLite): adaptive polling and in-process wakes.

On PostgreSQL, NOTIFY wakes every worker (tests/integration/test_postgres.py);
elsewhere a worker polls, and an enqueue committed in its own process wakes
it at once, and only once committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from django.db import connection, transaction

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.testapp.workers import Record

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _without_notify() -> None:
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL wakes workers by NOTIFY (tests/integration/test_postgres.py)")


def test_an_enqueue_in_the_workers_process_wakes_it_only_when_committed(
    background_worker: Callable[..., Worker],
) -> None:
    # A poll interval far longer than the waits below: only the wake can explain a start.
    worker = background_worker(["record"], poll_interval=30.0)
    wait_until(lambda: worker.idle.is_set(), what="the worker to go idle")
    with transaction.atomic():
        item = Record.enqueue({"key": "rolled back"})
        assert WorkItem.objects.filter(pk=item.pk).exists()
        transaction.set_rollback(True)
    started = time.monotonic()
    item = Record.enqueue({"key": "committed"})
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED,
        timeout=10,
        what="the woken worker to run the item",
    )
    assert time.monotonic() - started < 5.0
    assert not WorkItem.objects.filter(payload__key="rolled back").exists()
    assert worker.claims == 1
