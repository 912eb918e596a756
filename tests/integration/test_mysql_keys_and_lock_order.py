"""MySQL/MariaDB: unique keys compared byte for byte, row locks in an order that cannot deadlock.

Keys that differ only by trailing spaces, concurrent enqueues of one key,
``retry()``'s SQL, and the lock order of stale recovery, success writes,
claims and the admin's Cancel against each other.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.db.models.functions import Now

from django_dbworker import EnqueueError, enqueue, transitions
from django_dbworker.db import mysql
from django_dbworker.enqueuing import insert as enqueue_or_get
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import age_heartbeat, claim, make_item

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]

TABLE = "django_dbworker_workitem"


# -- unique_key and PAD SPACE ----------------------------------------------------------
#
# A PAD SPACE collation (utf8mb4_bin among them, on MariaDB and MySQL 8) makes 'k' = 'k '
# in every comparison, while the unique index is on a VARBINARY column, where they
# differ: the database would keep 'k' and 'k ' live side by side (as PostgreSQL does) but
# every lookup by key (enqueue's "return the live row", retry()'s live-twin test) would
# confuse them. The initial migration gives unique_key a NO PAD binary collation.


def test_enqueue_again_returns_the_row_of_its_own_key_not_one_with_a_trailing_space() -> None:
    spaced, added = enqueue_or_get("noop", {}, unique_key="k ")
    assert added
    plain, added = enqueue_or_get("noop", {}, unique_key="k")
    assert added and plain.pk != spaced.pk  # distinct keys, as on PostgreSQL
    again, added = enqueue_or_get("noop", {}, unique_key="k")
    assert not added
    assert again.unique_key == "k", (
        f"enqueue(unique_key='k') returned the row of key {again.unique_key!r}"
    )
    assert again.pk == plain.pk


def test_retry_is_not_blocked_by_a_live_row_whose_key_only_differs_by_trailing_space() -> None:
    failed = make_item(unique_key="k", status=Status.FAILED)
    make_item(unique_key="k  ")  # pending, a different key
    assert WorkItem.objects.filter(pk=failed.pk).retry() == 1, (
        "retry() skipped a failed row: it took 'k  ' for a live twin of 'k'"
    )


# -- lock order inside the worker's recovery transaction --------------------------------


def _second_connection() -> Any:
    conn = connection.get_new_connection(connection.get_connection_params())
    conn.autocommit(False)
    conn.cursor().execute("SET SESSION innodb_lock_wait_timeout = 5")
    return conn


def _lock_waits() -> int:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
        )
        return int(cursor.fetchone()[0])


def test_stale_recovery_and_a_success_write_of_the_same_rows_cannot_deadlock() -> None:
    # The worker runs recover_stale in ONE transaction (Recovery.maybe_recover:
    # transaction.atomic around it). Inside it, each UPDATE's rows are locked
    # in id order (locked_in_id_order), but one after the other: first the
    # rows whose attempts are used up, then each handler's requeued rows, then
    # the next batch. Over the whole transaction the rows are NOT taken in
    # ascending id order, so a success writer (a late finisher's batch, which
    # locks a, b ascending) deadlocks with it. Here: a (attempts left) < b
    # (attempts used up), both stale. The success writer has locked a and is
    # about to lock b (its SELECT ... ORDER BY id FOR UPDATE takes a, then b).
    # Recovery fails b first (locks b), then requeues a (waits for a).
    # Taken in ascending order, recovery would wait for a before touching b.
    for _ in range(3):
        make_item()
    a, b = sorted(claim(limit=2), key=lambda i: i.pk)
    WorkItem.objects.filter(pk=b.pk).update(max_attempts=1)
    WorkItem.objects.filter(pk=a.pk).update(max_attempts=5)
    age_heartbeat(a, 3600)
    age_heartbeat(b, 3600)

    errors: list[BaseException] = []
    recovered: list[Any] = []

    def recover() -> None:
        try:
            with transaction.atomic():  # as Recovery.maybe_recover runs it
                recovered.append(transitions.recover_stale(stale_after=60, log=False))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    writer = _second_connection()
    try:
        cursor = writer.cursor()
        cursor.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", (a.pk,))
        thread = threading.Thread(target=recover)
        thread.start()
        wait_until(
            lambda: _lock_waits() == 1 or errors or recovered,
            interval=0.2,
            what="the recovery to wait for row a",
        )
        deadlock: BaseException | None = None
        try:
            # The success writer's next row.
            cursor.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", (b.pk,))
        except Exception as exc:
            deadlock = exc
        writer.rollback()
        thread.join(30)
    finally:
        writer.close()
    assert deadlock is None and not errors, (
        "recovery took row b before row a in its transaction and deadlocked with a "
        f"success writer taking a, b in id order: writer={deadlock!r}, recovery={errors!r}"
    )


# -- concurrent enqueues of one unique_key ----------------------------------------------


def test_concurrent_enqueues_of_one_unique_key_all_return_the_same_row() -> None:
    results: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def enqueuer() -> None:
        try:
            connection.ensure_connection()
            barrier.wait()
            for _ in range(20):
                item, _ = enqueue_or_get("noop", {}, unique_key="same")
                results.append(item.pk)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=enqueuer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(set(results)) == 1
    assert WorkItem.objects.filter(unique_key="same").count() == 1


# -- unique_key against its holder's end ---------------------------------------------


@pytest.mark.mysql_only
def test_enqueues_of_a_live_key_racing_the_end_of_its_holder_do_not_deadlock() -> None:
    """A second enqueue of a live key returns the holder or inserts; it never fails.

    When the holder's row leaves pending/claimed (its success), the INSERTs
    waiting on its entry of ``dbworker_my_active_key_uniq`` all get a shared
    lock, then all want to insert: InnoDB kills all but one of them with
    error 1213. ``insert()`` retries an IntegrityError, not a deadlock, so
    the enqueue raises OperationalError. (The spec: "a second enqueue
    returns the existing row instead of inserting (race-free)".)
    """
    errors: list[BaseException] = []
    stop = threading.Event()

    def enqueuer() -> None:
        try:
            for n in range(150):
                if stop.is_set():
                    return
                # "The key kept changing hands; try again" is allowed.
                with contextlib.suppress(EnqueueError):
                    enqueue("noop", {"n": n}, unique_key="hot")
        except DatabaseError as exc:
            errors.append(exc)
            stop.set()
        finally:
            connections.close_all()

    def finisher() -> None:
        # A worker's success: the live row by its id, pending/claimed -> succeeded.
        try:
            while not stop.is_set():
                live = WorkItem.objects.filter(unique_key="hot", status="pending")
                pk = live.values_list("pk", flat=True).first()
                if pk is not None:
                    WorkItem.objects.filter(pk=pk, status="pending").update(
                        status="succeeded", finished_at=Now()
                    )
        finally:
            connections.close_all()

    threads = [threading.Thread(target=enqueuer) for _ in range(6)]
    ender = threading.Thread(target=finisher)
    ender.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    stop.set()
    ender.join(30)
    assert not any(t.is_alive() for t in [*threads, ender]), "a thread did not finish"
    assert not errors, errors[:3]
    assert WorkItem.objects.filter(unique_key="hot", status="pending").count() <= 1


# -- retry() on MySQL 8: error 1093 ----------------------------------------------------


def test_retry_update_does_not_select_from_its_own_target_table() -> None:
    # MySQL 8 refuses "UPDATE t ... WHERE ... EXISTS (SELECT ... FROM t ...)"
    # with error 1093 (ER_UPDATE_TABLE_USED: You can't specify target table
    # 't' for update in FROM clause); MariaDB 10.3+ accepts it, so this
    # server cannot show the error: the SQL does. retry() (the admin's Retry
    # action, WorkItem.retry()) excludes rows with a live twin by a
    # correlated EXISTS on the same table, in the UPDATE itself.
    from django.test.utils import CaptureQueriesContext

    failed = make_item(unique_key="k", status=Status.FAILED)
    with CaptureQueriesContext(connection) as ctx:
        assert WorkItem.objects.filter(pk=failed.pk).retry() == 1
    updates = [
        q["sql"] for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")
    ]
    assert updates, ctx.captured_queries
    for sql in updates:
        assert f"FROM `{TABLE}` U0" not in sql, (
            f"MySQL 8 refuses this UPDATE with error 1093 (subquery on the target table): {sql}"
        )


def test_retry_of_two_dead_rows_with_one_key_revives_one_and_does_not_raise() -> None:
    # Two failed attempts at the same unique work (a key enqueued again after
    # the first failed, failed again). The admin selects both and clicks
    # Retry: NOT EXISTS is evaluated before either row is updated, both
    # qualify, and the second UPDATEd row collides with the first in
    # dbworker_my_active_key_uniq: the action raises IntegrityError (a 500
    # in the admin) instead of retrying one and skipping the other.
    first = make_item(unique_key="k", status=Status.FAILED)
    second = make_item(unique_key="k", status=Status.FAILED)
    revived = WorkItem.objects.filter(pk__in=[first.pk, second.pk]).retry()
    assert revived == 1
    assert WorkItem.objects.filter(unique_key="k", status=Status.PENDING).count() == 1


# -- admin actions against a claim in progress ------------------------------------------


def test_cancel_of_pending_rows_does_not_deadlock_with_a_claim_in_progress() -> None:
    # A claim has locked its rows (SELECT ... FOR UPDATE SKIP LOCKED) and is
    # about to mark them claimed; the admin's Cancel (WorkItem.objects
    # .cancel(): an ORM UPDATE ... WHERE status = 'pending', not locked in id
    # order by primary key first) arrives meanwhile. The cancel takes a
    # secondary-index entry of status and waits for the claim's row; the
    # claim's UPDATE changes status, must change that entry, and waits for
    # the cancel: a deadlock. InnoDB rolls back the lighter transaction,
    # the cancel, whose 1213 reaches the admin (nothing retries it).
    # A queue table as it usually is: mostly finished rows, a small backlog.
    WorkItem.objects.bulk_create(
        WorkItem(handler="noop", payload={}, max_attempts=3, status=Status.SUCCEEDED)
        for _ in range(300)
    )
    pending = [make_item() for _ in range(10)]
    claimer = _second_connection()
    errors: list[BaseException] = []
    cancelled: list[int] = []

    def cancel() -> None:
        # The admin's action itself (what an operator runs), as the admin calls it.
        from django.test import RequestFactory

        from django_dbworker.admin import actions

        class Admin:
            def message_user(self, request: object, text: str, level: int) -> None:
                cancelled.append(level)

        try:
            actions.cancel(Admin(), RequestFactory().post("/"), WorkItem.objects.all())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    deadlock: BaseException | None = None
    try:
        cursor = claimer.cursor()
        # The claim's own statements: the next 2 of 10 ready rows.
        select = mysql.claim_select_sql(1, 0)
        cursor.execute(select, {"limit": 2, "handler_0": "noop"})
        ids = sorted(pk for (pk,) in cursor.fetchall())
        assert ids == [i.pk for i in pending[:2]]
        thread = threading.Thread(target=cancel)
        thread.start()
        wait_until(
            lambda: _lock_waits() == 1 or errors or cancelled,
            interval=0.2,
            what="the cancel to wait for a claimed row",
        )
        try:
            cursor.execute(
                mysql.claim_update_sql(len(ids)),
                {"worker": "w", **mysql.numbered_params("id", ids)},
            )
        except Exception as exc:
            deadlock = exc
        claimer.commit()
        thread.join(30)
    finally:
        claimer.close()
    assert deadlock is None and not errors, (
        f"the claim and the admin's cancel deadlocked: claim={deadlock!r}, cancel={errors!r}"
    )
