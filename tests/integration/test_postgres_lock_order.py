"""PostgreSQL: a worker's success writes and heartbeats lock their rows in id order.

The success writer and the heartbeat thread of one worker update the same
claimed rows from two connections. Each locked them in the order its plan
met them (the success write in the order of its arrays, which is the order
the attempts ended; the heartbeat in the table's physical order), so one
could hold row 2 and wait for row 1 while the other held row 1 and waited
for row 2: a deadlock, broken by the server after ``deadlock_timeout`` (one
second by default) with an error, seen once in 12 drains of 50,000 items
(bench/scale_processes.py). Both now lock in id order, so one waits for the
other and neither fails.

Shown without a race: a third connection holds the lowest row; the
statement under test, given the rows in reverse order, must wait for it
before it locks any higher row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from django_dbworker.db import operations
from tests.conftest import wait_until
from tests.factories import claim, make_item

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

TABLE = "django_dbworker_workitem"


def _connect() -> psycopg.Connection[Any]:
    return psycopg.connect(**connection.get_connection_params(), autocommit=False)


def _locked_by_another(pk: int) -> bool:
    """Whether a row lock on ``pk`` is held elsewhere (NOWAIT from a fresh session)."""
    with _connect() as probe:
        try:
            probe.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE NOWAIT", [pk])
        except psycopg.errors.LockNotAvailable:
            return True
        finally:
            probe.rollback()
    return False


def _waits_for_the_lowest_row_first(run: Callable[[list[Any]], object]) -> None:
    items = [make_item("noop") for _ in range(3)]
    claimed = sorted(claim(limit=3, handlers=["noop"]), key=lambda i: i.pk)
    assert [i.pk for i in claimed] == sorted(i.pk for i in items)
    lowest, *higher = claimed
    holder = _connect()
    holder.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", [lowest.pk])
    errors: list[BaseException] = []

    def statement() -> None:
        try:
            run(list(reversed(claimed)))
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=statement)
    thread.start()
    # Its own autocommit session: inside a transaction pg_stat_activity is one snapshot.
    watcher = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    try:
        wait_until(
            lambda: (
                watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                ).fetchone()
                == (1,)
            ),
            timeout=10,
            what="the statement to wait for the held row",
        )
        locked = [pk for pk in (i.pk for i in higher) if _locked_by_another(pk)]
    finally:
        watcher.close()
        holder.rollback()
        holder.close()
        thread.join(10)
    assert not errors, errors
    assert not locked, (
        f"while waiting for row {lowest.pk} the statement already held rows {locked}: "
        "a statement locking in another order can deadlock with it"
    )


def test_a_success_write_locks_its_rows_in_id_order() -> None:
    _waits_for_the_lowest_row_first(
        lambda rows: operations().succeed_rows([(i.pk, i.claim_token, None) for i in rows])
    )


def test_a_heartbeat_locks_its_rows_in_id_order() -> None:
    _waits_for_the_lowest_row_first(
        lambda rows: operations().heartbeat([(i.pk, i.claim_token) for i in rows])
    )
