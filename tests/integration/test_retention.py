"""The retention run deletes old finished rows by status, and nothing else."""

from __future__ import annotations

import itertools
import re
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.db.models.functions import Now
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_dbworker.batches.models import Dependency
from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import PruneFinished, prune
from tests.conftest import wait_until
from tests.factories import make_item

pytestmark = pytest.mark.django_db


def finished(status: str, days: float, queue: str = "default") -> WorkItem:
    item = make_item(status=status, queue=queue)
    WorkItem.objects.filter(pk=item.pk).update(finished_at=Now() - timedelta(days=days))
    return item


def remaining() -> set[int]:
    return set(WorkItem.objects.values_list("pk", flat=True))


def test_run_deletes_by_each_status_age_and_never_live_rows() -> None:
    old_ok = finished(Status.SUCCEEDED, 8)
    new_ok = finished(Status.SUCCEEDED, 6)
    old_cancelled = finished(Status.CANCELLED, 8)
    month_failed = finished(Status.FAILED, 20)
    old_failed = finished(Status.FAILED, 31)
    # Live rows with an old finished_at (a retried row keeps none, but a
    # hand-edited one might): never deleted.
    pending = finished(Status.PENDING, 400)
    claimed = finished(Status.CLAIMED, 400)

    result = PruneFinished().run()

    assert result == {"deleted": {"succeeded": 1, "cancelled": 1, "failed": 1}}
    assert remaining() == {new_ok.pk, month_failed.pk, pending.pk, claimed.pk}
    assert old_ok.pk not in remaining() and old_cancelled.pk not in remaining()
    assert old_failed.pk not in remaining()


def test_a_status_set_to_none_is_kept() -> None:
    old_failed = finished(Status.FAILED, 400)
    old_ok = finished(Status.SUCCEEDED, 400)
    with override_settings(DBWORKER={"RETENTION": {"failed": None}}):
        result = PruneFinished().run()
    assert result == {"deleted": {"succeeded": 1, "cancelled": 0}}
    assert remaining() == {old_failed.pk}
    assert old_ok.pk not in remaining()


def test_prune_dry_run_counts_and_deletes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    finished(Status.SUCCEEDED, 10)
    finished(Status.SUCCEEDED, 10, queue="emails")
    before = remaining()
    call_command("dbworker_prune", "--older-than", "7d", "--dry-run")
    assert "Would delete 2 work item(s)" in capsys.readouterr().out
    assert remaining() == before


def test_prune_queue_narrows_it_to_that_queue(capsys: pytest.CaptureFixture[str]) -> None:
    default = finished(Status.SUCCEEDED, 10)
    finished(Status.SUCCEEDED, 10, queue="emails")
    call_command("dbworker_prune", "--older-than", "7d", "--queue", "emails")
    assert "Deleted 1 work item(s) (succeeded, failed, cancelled) in queue(s) emails" in (
        capsys.readouterr().out
    )
    assert remaining() == {default.pk}


def test_prune_refuses_a_bad_queue_name() -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--queue is not a valid queue name"):
        call_command("dbworker_prune", "--older-than", "7d", "--queue", "no spaces")


# -- prune and concurrent writers --------------------------------------------------------
#
# prune chooses a batch's ids (status and ``finished_at`` older than the cut-off), then
# deletes them with the age repeated: a row chosen while it was an old failure, then
# retried and failed again before the DELETE, is not deleted (its DELETE re-checks its
# WHERE on the new version). Concurrent prunes delete every row once, with its links.


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


# -- prune walks the table by keyset -----------------------------------------------------


def test_each_batch_is_chosen_after_the_last_id_of_the_one_before() -> None:
    WorkItem.objects.bulk_create(
        WorkItem(handler="noop", payload={}, max_attempts=3, status=Status.SUCCEEDED)
        for _ in range(7)
    )
    WorkItem.objects.update(finished_at=Now() - timedelta(days=2))
    ids = sorted(WorkItem.objects.values_list("pk", flat=True))
    with CaptureQueriesContext(connection) as queries:
        deleted = prune(older_than=timedelta(days=1), statuses=[Status.SUCCEEDED], batch_size=3)
    assert deleted == 7
    assert not WorkItem.objects.exists()
    choices = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith("SELECT") and "ORDER BY" in q["sql"] and "LIMIT 3" in q["sql"]
    ]
    assert len(choices) == 4, choices  # 3 + 3 + 1, then none left
    assert not re.search(r"[`\"]id[`\"] > ", choices[0]), choices[0]
    for choice, last in zip(choices[1:], (ids[2], ids[5], ids[6]), strict=True):
        assert re.search(rf'[`"]id[`"] > {last}\b', choice), (
            f"a batch chosen from the start of the table again, not after id {last}: {choice}"
        )
