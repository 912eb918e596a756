"""Attack s7b: ``tidy_all`` (ed2d974) and a caller's transactions on other aliases.

Since ed2d974 a worker thread tidies every connection it opened after each job,
leaving alone those ``in_atomic_block`` ("it may be a caller's"). But Django's
manual transaction mode (``transaction.set_autocommit(False, using=...)``, or
``AUTOCOMMIT: False`` in DATABASES) has a caller's transaction open with
``in_atomic_block`` False: ``run_until_empty`` (the calling thread, the
caller's connections) then rolls back the caller's uncommitted writes on the
other alias and turns its autocommit back on. SPEC: run_until_empty runs "in
the calling thread"; the library supports manual transaction mode
(tests/integration/test_enqueue_manual_transactions.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connections, transaction

from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from tests.routers import WORK_ALIAS
from tests.testapp.workers import Noop

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS])


@pytest.fixture
def manual_on_other_alias() -> Iterator[None]:
    transaction.set_autocommit(False, using=WORK_ALIAS)
    try:
        yield
    finally:
        if not connections[WORK_ALIAS].get_autocommit():
            transaction.rollback(using=WORK_ALIAS)
            transaction.set_autocommit(True, using=WORK_ALIAS)


def test_run_until_empty_keeps_a_manual_transaction_on_another_alias(
    manual_on_other_alias: None,
) -> None:
    # The caller's uncommitted write on the other alias (any table will do).
    mine = WorkItem.objects.using(WORK_ALIAS).create(
        handler="noop", payload={"mine": True}, max_attempts=1, status=Status.SUCCEEDED
    )
    Noop.enqueue({"n": 1})  # the work: on default
    counts = run_until_empty()
    assert counts.get("succeeded") == 1, counts
    still_manual = not connections[WORK_ALIAS].get_autocommit()
    transaction.commit(using=WORK_ALIAS)
    kept = WorkItem.objects.using(WORK_ALIAS).filter(pk=mine.pk).exists()
    assert still_manual and kept, (
        f"run_until_empty on default tidied the caller's manual transaction on "
        f"{WORK_ALIAS!r}: autocommit turned back on: {not still_manual}; its "
        f"uncommitted row #{mine.pk} kept: {kept}"
    )


# The enqueue on default inside work's atomic block is meant: the warning says so.
@pytest.mark.filterwarnings("ignore:This enqueue writes to database:RuntimeWarning")
def test_run_until_empty_keeps_an_atomic_block_on_another_alias() -> None:
    """Control (holds): the caller's ``atomic()`` on the other alias is left alone."""
    with transaction.atomic(using=WORK_ALIAS):
        mine = WorkItem.objects.using(WORK_ALIAS).create(
            handler="noop", payload={"mine": True}, max_attempts=1, status=Status.SUCCEEDED
        )
        Noop.enqueue({"n": 1})
        assert run_until_empty().get("succeeded") == 1
    assert WorkItem.objects.using(WORK_ALIAS).filter(pk=mine.pk).exists()


@pytest.mark.django_db(transaction=False, databases="__all__")
def test_run_until_empty_in_a_testcase_on_every_alias_keeps_its_writes() -> None:
    """Control (holds): a TestCase's transactions on every alias are left alone."""
    mine = WorkItem.objects.using(WORK_ALIAS).create(
        handler="noop", payload={"mine": True}, max_attempts=1, status=Status.SUCCEEDED
    )
    Noop.enqueue({"n": 1})
    assert run_until_empty().get("succeeded") == 1
    assert connections[WORK_ALIAS].in_atomic_block
    assert WorkItem.objects.using(WORK_ALIAS).filter(pk=mine.pk).exists()
