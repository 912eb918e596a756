"""Wake-ups that do not serialise commits: WAKEUP_WINDOW and WAKEUPS on PostgreSQL.

With a window, an enqueue sends its NOTIFY after its commit, at most once per
queue per window per process unless a more urgent row comes; a worker claims
once more a window after each wake-up, so a row whose wake-up was skipped is
still claimed long before POLL_INTERVAL. With WAKEUPS off nothing is sent and
workers poll. The notifications are counted on a LISTEN connection of the
test's own; workers are real ``run_workers`` subprocesses with a 30 s poll
interval, so only a wake-up (or the trailing claim) explains a prompt start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, connections, transaction

from django_dbworker.db.wake_window import WINDOW
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until, wake_turns
from tests.testapp.models import Execution
from tests.testapp.workers import Record, Sleep

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

#: Far beyond every bounded wait below: a start within them is a wake-up's.
POLL = "30"


class Notifications:
    """A LISTEN connection of the test's own, collecting every wake-up payload."""

    def __init__(self) -> None:
        self.conn = psycopg.connect(**connection.get_connection_params(), autocommit=True)
        self.conn.execute("LISTEN django_dbworker")
        self.payloads: list[str] = []

    def collect(self, seconds: float) -> list[str]:
        """Every payload received so far, waiting ``seconds`` for more."""
        self.payloads += [n.payload for n in self.conn.notifies(timeout=seconds)]
        return self.payloads

    @property
    def pid(self) -> int:
        return int(self.conn.info.backend_pid)


@pytest.fixture
def notifications() -> Iterator[Notifications]:
    listener = Notifications()
    yield listener
    listener.conn.close()


@pytest.fixture
def window(settings: Any) -> Callable[..., None]:
    """Set this process's DBWORKER wake-up settings (and forget the wake-ups sent so far)."""

    def set_window(seconds: float, *, wakeups: bool = True) -> None:
        settings.DBWORKER = {**settings.DBWORKER, "WAKEUP_WINDOW": seconds, "WAKEUPS": wakeups}
        WINDOW.clear()

    return set_window


def _listening_backends(besides: int) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE btrim(query, E' \\n') = 'LISTEN django_dbworker'"
            " AND pid <> %s AND datname = current_database()",
            [besides],
        )
        return int(cursor.fetchone()[0])


def _ran(key: str) -> bool:
    return Execution.objects.filter(key=key).exists()


def test_concurrent_enqueues_send_at_most_one_notify_per_window(
    window: Callable[..., None], notifications: Notifications
) -> None:
    window(0.2)
    errors: list[BaseException] = []

    def enqueue(thread: int) -> None:
        try:
            for n in range(thread, 50, 8):  # 50 items over 8 threads, spread over ~1 s
                Record.enqueue({"key": f"burst-{n}"})
                time.sleep(0.15)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    started = time.monotonic()
    threads = [threading.Thread(target=enqueue, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    elapsed = time.monotonic() - started
    assert not errors, errors
    assert WorkItem.objects.filter(payload__key__startswith="burst-").count() == 50
    payloads = notifications.collect(0.5)
    assert set(payloads) == {"default"}, payloads
    # One per started window, and the first; never one per enqueue.
    assert 1 <= len(payloads) <= elapsed / 0.2 + 3, (len(payloads), elapsed)


def test_an_idle_worker_wakes_for_an_enqueue_and_claims_a_skipped_one_after_the_window(
    window: Callable[..., None], notifications: Notifications, start_worker: Callable[..., Any]
) -> None:
    window(1.0)
    worker = start_worker(
        "record", env={"DBWORKER_POLL_INTERVAL": POLL, "DBWORKER_WAKEUP_WINDOW": "1.0"}
    )
    wait_until(
        lambda: _listening_backends(besides=notifications.pid) == 1,
        timeout=30,
        what="the worker to LISTEN",
    )
    # (b) The first enqueue notifies (after its commit): the idle worker runs it at once.
    Record.enqueue({"key": "first"})
    wait_until(lambda: _ran("first"), timeout=10, what="the woken worker to run the item")
    # (c) Within the window of that notify: no notify of its own, and the
    # worker's claim for the first item is over. Its trailing claim, a
    # window after the wake-up, finds it; its 30 s poll would be far too late.
    Record.enqueue({"key": "skipped"})
    assert notifications.collect(0.05) == ["default"], "the second enqueue sent a notify"
    wait_until(lambda: _ran("skipped"), timeout=10, what="the trailing claim to run the item")
    assert notifications.collect(0) == ["default"], worker.log()


def test_a_more_urgent_row_inside_the_window_still_notifies(
    window: Callable[..., None], notifications: Notifications
) -> None:
    window(5.0)
    Record.enqueue({"key": "bulk"})
    Record.enqueue({"key": "urgent"}, priority=10)
    Record.enqueue({"key": "urgent again"}, priority=10)
    Record.enqueue({"key": "bulk again"})
    Record.enqueue_many([{"key": "many"}, {"key": "many"}], priority=20)
    assert notifications.collect(0.5) == ["default", "default 10", "default 20"]


def test_a_rolled_back_enqueue_sends_nothing_and_does_not_use_up_the_window(
    window: Callable[..., None], notifications: Notifications
) -> None:
    window(5.0)
    with transaction.atomic():
        Record.enqueue({"key": "rolled back"})
        Record.enqueue_many([{"key": "rolled back"}] * 2)
        transaction.set_rollback(True)
    assert notifications.collect(0.3) == []
    with transaction.atomic():
        Record.enqueue({"key": "committed"})
        # Not before the commit: a worker would find nothing yet.
        assert notifications.collect(0.2) == []
    assert notifications.collect(0.5) == ["default"]


def test_an_enqueue_inside_a_transaction_notifies_once_after_its_commit(
    window: Callable[..., None], notifications: Notifications
) -> None:
    window(5.0)
    with transaction.atomic():
        for n in range(5):
            Record.enqueue({"key": f"in-{n}"})
        Record.enqueue_many([{"key": "batch"}] * 150)  # by COPY
        Record.enqueue({"key": "unique"}, unique_key="k")  # the ORM's path
    assert notifications.collect(0.5) == ["default"]


def test_without_wakeups_nothing_is_sent_and_a_worker_polls(
    window: Callable[..., None], notifications: Notifications, start_worker: Callable[..., Any]
) -> None:
    window(0, wakeups=False)
    Record.enqueue({"key": "one"})
    Record.enqueue_many([{"key": "many"}] * 3)
    Record.enqueue_many([{"key": "copied"}] * 150)
    Record.enqueue({"key": "unique"}, unique_key="u")
    with transaction.atomic():
        Record.enqueue({"key": "in a transaction"})
    assert notifications.collect(0.3) == []
    worker = start_worker("record", env={"DBWORKER_POLL_INTERVAL": "0.5", "DBWORKER_WAKEUPS": "0"})
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 156,
        timeout=30,
        what="the polling worker to run every item",
    )
    Record.enqueue({"key": "later"})
    wait_until(lambda: _ran("later"), timeout=10, what="the polling worker to run the item")
    assert _listening_backends(besides=notifications.pid) == 0, worker.log()
    assert notifications.collect(0) == []


def test_a_window_of_zero_notifies_inside_every_enqueue_as_before(
    window: Callable[..., None], notifications: Notifications
) -> None:
    window(0)
    with transaction.atomic():
        Record.enqueue({"key": "a"})
        Record.enqueue({"key": "b"}, priority=3)
    Record.enqueue({"key": "c"})
    Record.enqueue({"key": "d"})
    # PostgreSQL folds identical payloads of one transaction; separate
    # transactions each notify.
    assert notifications.collect(0.5) == ["default", "default 3", "default", "default"]


def test_a_failed_notify_after_the_commit_is_logged_not_raised(
    window: Callable[..., None], notifications: Notifications, caplog: pytest.LogCaptureFixture
) -> None:
    window(5.0)
    pid = connection.cursor().connection.info.backend_pid

    def kill_the_session() -> None:
        # Runs before the wake-up's callback (registered first): its NOTIFY
        # then meets a connection the server has closed.
        with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", [pid])
            wait_until(
                lambda: (
                    not other.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]
                    ).fetchone()
                ),
                timeout=10,
                what="the session to end",
            )

    with transaction.atomic():
        transaction.on_commit(kill_the_session)
        item = Record.enqueue({"key": "committed"})  # raises nothing
    assert "Could not send a wake-up for queue 'default'" in caplog.text
    connection.close()
    assert WorkItem.objects.filter(pk=item.pk).exists()
    assert notifications.collect(0.3) == []
    # Not counted as sent: the next enqueue notifies.
    Record.enqueue({"key": "next"})
    assert notifications.collect(0.5) == ["default"]


def test_a_worker_that_passed_its_turn_makes_its_trailing_claim_before_it_waits_again(
    window: Callable[..., None], notifications: Notifications, start_worker: Callable[..., Any]
) -> None:
    """Only the worker a wake-up reached knows of the trailing claim it owes: it makes
    it before waiting for its turn again (not listening), else a row whose wake-up
    the window skipped waits for a poll, whoever holds the turn."""
    window(5.0)
    env = {"DBWORKER_POLL_INTERVAL": POLL, "DBWORKER_WAKEUP_WINDOW": "5.0"}
    for _ in range(2):
        start_worker("sleep", "--concurrency", "1", env=env)
    wait_until(lambda: wake_turns() == (1, 1), timeout=60, what="one turn held, one waiting")
    # The holder takes it, has no room left and passes the turn on; once the item has
    # run (a claim that came back short), it would wait for the turn again.
    Sleep.enqueue({"key": "first", "seconds": 0.2})
    wait_until(
        lambda: Execution.objects.filter(key="first", kind="end").exists(),
        timeout=10,
        what="the first item to run",
    )
    Sleep.enqueue({"key": "skipped", "seconds": 0})
    assert notifications.collect(0.05) == ["default"], "the second enqueue sent a notify"
    wait_until(lambda: _ran("skipped"), timeout=15, what="the trailing claim to run the item")
