"""Attack s7b: on PostgreSQL, does every bulk writer of claimed rows lock them in id order?

2bea049 made the success write and the heartbeat lock their rows in id order (a
LockRows over a sort). Their comment (and ``stale.py``) say every bulk writer locks
that way; but ``locked_in_id_order`` is a no-op on PostgreSQL, so the ORM's bulk
UPDATEs of claimed rows (the admin's Cancel on claimed rows: ``request_cancel``)
lock in the plan's order: the heap's, for a seq or bitmap scan. When a row with a
lower id sits later in the heap (it was updated after the higher one, e.g. by a
heartbeat of one row), such an UPDATE takes the higher row first, the heartbeat
the lower one first: a real deadlock, run here with real transactions, no race.

With 2bea049 reverted (``git show 2bea049 -- django_dbworker/db/postgresql_sql.py |
git apply -R``) the four heartbeat cases pass (its plan met the rows in the heap's
order too) and the four success-write cases fail: the heartbeat's deadlocks with
the admin's Cancel, QuerySet.cancel, stale recovery and release are new in 2bea049.
"""

from __future__ import annotations

import threading
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
