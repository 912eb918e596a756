"""PostgreSQL: every bulk writer of claimed rows locks them in id order.

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
before it locks any higher row. The other bulk writers of claimed rows (the
admin's Cancel, ``QuerySet.cancel``, stale recovery, release) run beside a
heartbeat or a success write of the same rows, the lower row placed later in
the heap (a seq or bitmap scan meets the rows in the heap's order): they must
not deadlock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection, connections

from django_dbworker.admin.actions import cancel_rows
from django_dbworker.db import operations
from django_dbworker.models import WorkItem
from django_dbworker.stale import recover_stale
from django_dbworker.transitions import release
from tests.conftest import wait_until
from tests.factories import claim, make_item

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

TABLE = "django_dbworker_workitem"


def _connect(autocommit: bool = False) -> psycopg.Connection[Any]:
    return psycopg.connect(**connection.get_connection_params(), autocommit=autocommit)


def _ctid(watcher: psycopg.Connection[Any], pk: int) -> tuple[int, int]:
    row = watcher.execute(f"SELECT ctid::text FROM {TABLE} WHERE id = %s", [pk]).fetchone()
    assert row is not None
    page, offset = row[0].strip("()").split(",")
    return int(page), int(offset)


def _lock_waiters(watcher: psycopg.Connection[Any]) -> int:
    row = watcher.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _in_thread(run: Any, errors: list[BaseException]) -> threading.Thread:
    def body() -> None:
        try:
            run()
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def _admin_cancel(pks: list[int], items: list[WorkItem]) -> object:
    return cancel_rows(WorkItem.objects.filter(pk__in=pks))


def _queryset_cancel(pks: list[int], items: list[WorkItem]) -> object:
    return WorkItem.objects.filter(pk__in=pks).cancel()


def _stale_recovery(pks: list[int], items: list[WorkItem]) -> object:
    return recover_stale(stale_after=0, log=False)


def _release(pks: list[int], items: list[WorkItem]) -> object:
    return release(items)


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
    thread = _in_thread(lambda: run(list(reversed(claimed))), errors)
    # Its own autocommit session: inside a transaction pg_stat_activity is one snapshot.
    watcher = _connect(autocommit=True)
    try:
        wait_until(
            lambda: _lock_waiters(watcher) == 1,
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


@pytest.mark.parametrize(
    "writer",
    [_admin_cancel, _queryset_cancel, _stale_recovery, _release],
    ids=["admin-cancel", "queryset-cancel", "stale-recovery", "release"],
)
@pytest.mark.parametrize("ordered", ["heartbeat", "succeed_rows"])
def test_a_bulk_writer_of_claimed_rows_and_a_heartbeat_do_not_deadlock(
    writer: Any, ordered: str
) -> None:
    for _ in range(2):
        make_item("noop")
    lo, hi = sorted(claim(limit=2, handlers=["noop"]), key=lambda i: i.pk)
    # A heartbeat of the lower row alone: its new version goes after the higher row's.
    assert operations().heartbeat([(lo.pk, lo.claim_token)])
    watcher = _connect(autocommit=True)
    holder = _connect()
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []
    try:
        assert _ctid(watcher, hi.pk) < _ctid(watcher, lo.pk), "precondition: heap order"
        holder.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", [hi.pk])
        # The bulk writer of the two claimed rows (plan order): waits on the higher one.
        threads.append(_in_thread(lambda: writer([lo.pk, hi.pk], [lo, hi]), errors))
        wait_until(lambda: _lock_waiters(watcher) == 1, timeout=10, what="the writer to wait")
        # The worker's heartbeat (or success write) of both: locks the lower row, then
        # waits for the higher.
        threads.append(
            _in_thread(
                lambda: (
                    operations().heartbeat([(lo.pk, lo.claim_token), (hi.pk, hi.claim_token)])
                    if ordered == "heartbeat"
                    else operations().succeed_rows(
                        [(hi.pk, hi.claim_token, None), (lo.pk, lo.claim_token, None)]
                    )
                ),
                errors,
            )
        )
        wait_until(lambda: _lock_waiters(watcher) == 2, timeout=10, what="heartbeat to wait")
    finally:
        holder.rollback()
        holder.close()
        for thread in threads:
            thread.join(20)
        watcher.close()
    assert not errors, (
        f"{writer.__name__} (plan order: the heap's) and {ordered} (id order) "
        f"deadlocked: {errors!r}"
    )
