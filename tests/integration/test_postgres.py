"""PostgreSQL-only behaviour: SKIP LOCKED claims and LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
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


# -- fencing of the locking CTE under READ COMMITTED -------------------------------------
#
# SUCCEED_MANY and HEARTBEAT lock ``id = ANY(ids) AND claim_token = ANY(tokens) AND
# status = 'claimed'`` first. A row locked by another transaction when the statement
# reaches it is re-checked on its newest version once the lock is granted
# (EvalPlanQual): a row recovered, or recovered and claimed again with a new token,
# meanwhile is neither refreshed nor written nor returned. Also: a pair whose token is
# another row's (the ANY over both arrays), duplicate ids, empty arrays.


TABLE = "django_dbworker_workitem"


def _waiting(watcher: psycopg.Connection[Any]) -> bool:
    row = watcher.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
    ).fetchone()
    return row == (1,)


def _while_changed(statement: Any, change: str, pk: int) -> Any:
    """``statement()`` waiting for row ``pk``, which another transaction changes meanwhile."""
    holder = psycopg.connect(**connection.get_connection_params(), autocommit=False)
    watcher = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = statement()
        except BaseException as exc:  # reported by the test
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    try:
        holder.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", [pk])
        thread.start()
        wait_until(lambda: _waiting(watcher), timeout=10, what="the statement to wait")
        holder.execute(change, [pk])
        holder.commit()
    finally:
        holder.close()
        thread.join(20)
        watcher.close()
    assert "error" not in box, box["error"]
    return box["result"]


RECOVERED = f"UPDATE {TABLE} SET status = 'pending', claim_token = NULL WHERE id = %s"


RECLAIMED = (
    f"UPDATE {TABLE} SET claim_token = gen_random_uuid(), heartbeat_at = now() - interval '1 h',"
    " attempts = attempts + 1 WHERE id = %s"
)


@pytest.mark.parametrize("change", [RECOVERED, RECLAIMED], ids=["recovered", "reclaimed"])
def test_a_heartbeat_waiting_for_a_row_changed_meanwhile_leaves_it(change: str) -> None:
    make_item("noop")
    make_item("noop")
    a, b = sorted(claim(limit=2, handlers=["noop"]), key=lambda i: i.pk)
    before = WorkItem.objects.get(pk=a.pk).heartbeat_at
    rows = _while_changed(
        lambda: operations().heartbeat([(a.pk, a.claim_token), (b.pk, b.claim_token)]),
        change,
        a.pk,
    )
    assert [pk for pk, _, _ in rows] == [b.pk], rows
    after = WorkItem.objects.get(pk=a.pk).heartbeat_at
    if change == RECLAIMED:
        assert after is not None and before is not None and after < before


@pytest.mark.parametrize("change", [RECOVERED, RECLAIMED], ids=["recovered", "reclaimed"])
def test_a_success_waiting_for_a_row_changed_meanwhile_is_not_written(change: str) -> None:
    make_item("noop")
    make_item("noop")
    a, b = sorted(claim(limit=2, handlers=["noop"]), key=lambda i: i.pk)
    rows = _while_changed(
        lambda: operations().succeed_rows([(b.pk, b.claim_token, "1"), (a.pk, a.claim_token, "2")]),
        change,
        a.pk,
    )
    assert [pk for pk, _, _ in rows] == [b.pk], rows
    row = WorkItem.objects.get(pk=a.pk)
    assert row.status == (Status.PENDING if change == RECOVERED else Status.CLAIMED)
    assert row.result is None


def test_crossed_pairs_duplicates_and_empty_arrays() -> None:
    make_item("noop")
    make_item("noop")
    a, b = sorted(claim(limit=2, handlers=["noop"]), key=lambda i: i.pk)
    ops = operations()
    # Each id with the other's token: both tokens are in the array, no pair matches.
    crossed = [(a.pk, b.claim_token), (b.pk, a.claim_token)]
    assert ops.succeed_rows([(pk, t, None) for pk, t in crossed]) == []
    assert ops.heartbeat([]) == []
    assert ops.succeed_rows([]) == []
    # The same attempt twice, and an attempt with an unknown token: written once.
    rows = ops.succeed_rows(
        [(a.pk, a.claim_token, "1"), (a.pk, a.claim_token, "1"), (a.pk, uuid.uuid4(), "3")]
    )
    assert [(pk, token) for pk, token, _ in rows] == [(a.pk, a.claim_token)]
    assert WorkItem.objects.get(pk=b.pk).status == Status.CLAIMED


def test_the_kept_statement_cursor_follows_reconnects_and_errors() -> None:
    """The enqueue statement's cursor is kept per connection: a reconnected
    connection and a statement that failed each get a fresh one, and query
    logging still sees every enqueue."""
    from django.test.utils import CaptureQueriesContext

    first = Record.enqueue({"n": 1})
    connection.close()  # a new raw connection: the kept cursor is not reused
    second = Record.enqueue({"n": 2})
    assert second.pk > first.pk
    with CaptureQueriesContext(connection) as captured:
        Record.enqueue({"n": 3})
    sqls = [q["sql"] for q in captured.captured_queries]
    assert any("INSERT INTO django_dbworker_workitem" in sql for sql in sqls)
    with pytest.raises(Exception, match="dbworker_priority_range"):
        # Past the options' own check: the database's CHECK constraint refuses it.
        operations(connection.alias).insert_item(
            WorkItem(handler=Record.name, queue="default", priority=1000, max_attempts=1),
            run_after=None,
            payload_json=None,
        )
    Record.enqueue({"n": 4})
    assert WorkItem.objects.filter(handler=Record.name).count() == 4
