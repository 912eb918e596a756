"""Enqueue in Django's manual transaction mode: unique keys, wake-ups, failed batches.

Django's "manual transaction" mode (``DATABASES[...]["AUTOCOMMIT"] = False``,
or ``transaction.set_autocommit(False)``) has a transaction open while
``connection.in_atomic_block`` is False: ``atomic()`` then makes a
savepoint, exactly as it does inside the caller's ``atomic()`` block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction

from django_dbworker import enqueue, enqueue_many
from django_dbworker.db.base import add_local_waker, remove_local_waker
from django_dbworker.models import WorkItem

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = "django_dbworker_workitem"


@pytest.fixture
def manual_transaction() -> Iterator[None]:
    """Autocommit off, as ``AUTOCOMMIT: False`` in DATABASES leaves every connection."""
    transaction.set_autocommit(False)
    try:
        yield
    finally:
        transaction.rollback()
        connection.needs_rollback = False
        transaction.set_autocommit(True)


# -- enqueue in manual transaction mode ------------------------------------------------


def test_a_live_unique_key_in_a_manual_transaction_returns_the_holder(
    manual_transaction: None,
) -> None:
    """The second enqueue of a live key returns the first row; the transaction goes on.

    On PostgreSQL the conflicting INSERT now runs without a savepoint
    (``in_atomic_block`` is False here), so it aborts the caller's
    transaction: the holder's read fails with "current transaction is
    aborted", and so does everything the caller does next.
    """
    first = enqueue("noop", {"n": 1}, unique_key="k")
    again = enqueue("noop", {"n": 2}, unique_key="k")
    assert again.pk == first.pk
    enqueue("noop", {"n": 3})  # the caller's transaction is still usable
    transaction.commit()
    assert sorted(WorkItem.objects.values_list("payload__n", flat=True)) == [1, 3]


def test_an_enqueue_in_a_manual_transaction_with_a_worker_in_process_does_not_raise(
    manual_transaction: None,
) -> None:
    """With a worker in the process (a local waker), enqueue must not raise after inserting.

    The wake-up goes through ``transaction.on_commit``, which Django refuses
    in manual transaction mode outside ``atomic()``: the row is inserted and
    then ``enqueue`` raises TransactionManagementError.
    """
    woken: list[Any] = []
    add_local_waker(woken.append)
    try:
        item = enqueue("noop", {"n": 1}, unique_key="k")
        plain = enqueue("noop", {"n": 2})
    finally:
        remove_local_waker(woken.append)
    transaction.commit()
    assert WorkItem.objects.filter(pk__in=[item.pk, plain.pk]).count() == 2


@pytest.mark.mysql_only
def test_a_failed_batch_in_a_manual_transaction_leaves_no_rows_to_commit(
    manual_transaction: None,
) -> None:
    """MariaDB: a batch whose last statement fails leaves none of its rows behind.

    ``atomic(savepoint=False)`` in manual mode neither rolls back nor makes
    a savepoint: the first 2,000 rows stay in the caller's transaction, and
    a caller that goes on to commit its other work commits them too.
    """
    enqueue("noop", {"n": "mine"})
    payloads: list[Any] = [{"n": n} for n in range(2500)] + ["refuse me"]
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TRIGGER dbworker_test_refuse_payload BEFORE INSERT ON {TABLE} FOR EACH ROW "
            "IF NEW.payload = '\"refuse me\"' THEN "
            "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused'; END IF"
        )
    try:
        with pytest.raises(DatabaseError, match="refused"):
            enqueue_many("noop", payloads)
        transaction.commit()
    finally:
        connection.needs_rollback = False
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS dbworker_test_refuse_payload")
        transaction.commit()
    assert list(WorkItem.objects.values_list("payload__n", flat=True)) == ["mine"]


def test_a_batch_and_its_endings_in_a_manual_transaction(manual_transaction: None) -> None:
    """``batch()``, ``after=`` and an operator's cancel with autocommit off: the endings'
    READ COMMITTED transaction (PostgreSQL: set on psycopg's BEGIN) cannot be set
    while the caller's is open; they run in the caller's, as a savepoint."""
    from django_dbworker import batch
    from tests.testapp.workers import BatchDone, Noop

    with batch(on_complete=BatchDone) as b:
        item = Noop.enqueue({})
    child = Noop.enqueue({}, after=[item])
    item.cancel()
    transaction.commit()
    child.refresh_from_db()
    assert child.status == "cancelled"
    assert WorkItem.objects.filter(handler="batch_done", payload__batch=b.id).count() == 1
