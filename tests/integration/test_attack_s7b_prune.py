"""Attack s7b: prune deletes only rows older than the cut-off, even rows retried meanwhile.

prune chooses a batch's ids (status and ``finished_at`` older than the cut-off),
then deletes ``pk__in=ids, status__in=allowed``: the DELETE repeats the status but
not the age. A row chosen while it was an old failure, then retried and failed
again before the DELETE (here: its DELETE waits for the lock of the transaction
that does so, then re-checks its WHERE on the new version), is deleted though it
finished a moment ago: ``dbworker_prune --older-than 7d`` erases a failure the
operator has not seen yet.
"""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.db.models.functions import Now

from django_dbworker.batches.models import Dependency
from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import prune
from tests.conftest import wait_until
from tests.factories import make_item

TABLE = "django_dbworker_workitem"
NOW = {"postgresql": "now()", "mysql": "UTC_TIMESTAMP(6)"}


def _lock_waits(watcher: Any) -> int:
    with watcher.cursor() as cursor:
        if watcher.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        else:
            # INNODB_TRX does not always list the waiting DELETE's transaction yet
            # (seen on MariaDB 10.11): the statement in the process list counts too.
            cursor.execute(
                "SELECT count(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'"
            )
            waits = int(cursor.fetchone()[0])
            cursor.execute(
                "SELECT count(*) FROM information_schema.PROCESSLIST"
                f" WHERE info LIKE 'DELETE FROM `{TABLE}`%%'"
            )
            return max(waits, int(cursor.fetchone()[0]))
        return int(cursor.fetchone()[0])


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
def test_a_row_failed_again_while_the_prune_waits_is_not_deleted() -> None:
    item = make_item("noop")
    WorkItem.objects.filter(pk=item.pk).update(
        status=Status.FAILED, finished_at=Now() - timedelta(days=10)
    )
    holder = connections.create_connection("default")
    watcher = connections.create_connection("default")
    holder.set_autocommit(False)
    errors: list[BaseException] = []
    counts: list[int] = []

    def run() -> None:
        try:
            counts.append(
                prune(older_than=timedelta(days=7), statuses=[Status.FAILED], batch_size=10)
            )
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    def waiting() -> bool:
        return _lock_waits(watcher) == 1

    thread = threading.Thread(target=run)
    try:
        # Retried and failed again (one transaction here, the state is the same): the
        # row is a failure of a moment ago when the prune's DELETE gets its lock.
        with holder.cursor() as cursor:
            cursor.execute(
                f"UPDATE {TABLE} SET status = 'pending', finished_at = NULL WHERE id = %s",
                [item.pk],
            )
        thread.start()
        wait_until(waiting, timeout=10, what="the prune's DELETE to wait for the row")
        with holder.cursor() as cursor:
            cursor.execute(
                f"UPDATE {TABLE} SET status = 'failed', finished_at = {NOW[holder.vendor]}"
                " WHERE id = %s",
                [item.pk],
            )
        holder.commit()
    finally:
        holder.close()
        thread.join(20)
        watcher.close()
    assert not errors, errors
    assert WorkItem.objects.filter(pk=item.pk).exists(), (
        f"prune --older-than 7d deleted row {item.pk}, which failed a moment ago "
        f"(deleted {counts}): its DELETE re-checks the status, not finished_at"
    )


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
def test_concurrent_prunes_delete_every_row_once_with_their_links() -> None:
    """Holds: two prunes at once, each walking after its own last id, leave nothing."""
    WorkItem.objects.bulk_create(
        WorkItem(handler="noop", payload={}, max_attempts=3, status=Status.SUCCEEDED)
        for _ in range(1200)
    )
    ids = sorted(WorkItem.objects.values_list("pk", flat=True))
    WorkItem.objects.update(finished_at=Now() - timedelta(days=2))
    Dependency.objects.bulk_create(
        Dependency(parent_id=a, child_id=b) for a, b in itertools.pairwise(ids)
    )
    counts: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run() -> None:
        try:
            start.wait(10)
            counts.append(
                prune(older_than=timedelta(days=1), statuses=[Status.SUCCEEDED], batch_size=50)
            )
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert sum(counts) == 1200, counts
    assert not WorkItem.objects.exists()
    assert not Dependency.objects.exists()
