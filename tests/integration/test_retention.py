"""The retention run deletes old finished rows by status, and nothing else."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db.models.functions import Now
from django.test import override_settings

from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import PruneFinished
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
