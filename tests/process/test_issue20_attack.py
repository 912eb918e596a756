"""Attacks on issue 20's start-up and claim-loop changes, as real ``run_workers`` processes.

The claim loop now claims first and recovers stale rows after the claim;
these hold the worker to what it did before: rows a dead worker left
behind are recovered and run by the next worker, burst mode included.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import claim
from tests.testapp.models import Execution
from tests.testapp.workers import Record

pytestmark = pytest.mark.django_db(transaction=True)


def _left_by_a_dead_worker(count: int) -> list[int]:
    """``count`` record rows claimed by a worker that died, heartbeats an hour old."""
    Record.enqueue_many([{"key": f"stale-{i}"} for i in range(count)])
    claimed = claim(limit=count, handlers=["record"], worker="dead:1:main")
    assert len(claimed) == count
    WorkItem.objects.filter(pk__in=[i.pk for i in claimed]).update(
        heartbeat_at=Now() - timedelta(hours=1)
    )
    return [i.pk for i in claimed]


def test_a_burst_worker_recovers_and_runs_a_dead_workers_rows(start_worker) -> None:
    """Stale rows and nothing else: a burst run recovers them and runs them before exiting.

    Before issue 20 the pass ran before the claim, which then took the
    requeued rows. Now the pass runs after a claim that found nothing, and
    burst mode exits on that empty claim: the rows are left pending, with
    no worker to run them.
    """
    pks = _left_by_a_dead_worker(3)
    worker = start_worker("record", "--burst", env={"DBWORKER_STALE_AFTER": "1.0"})
    assert worker.wait() == 0
    statuses = dict(WorkItem.objects.filter(pk__in=pks).values_list("pk", "status"))
    assert set(statuses.values()) == {Status.SUCCEEDED}, (statuses, worker.log())
    assert Execution.objects.filter(kind="run").count() == 3


def test_stale_rows_are_recovered_while_claims_keep_failing(start_worker) -> None:
    """A claim statement that fails every time (here: a table it reads is gone) skips no pass.

    The pass is best effort and independent of the claim ("claiming must go
    on", and the other way round): before issue 20 it ran before each claim,
    so a dead worker's rows went back to pending for the workers that can
    claim. Now it runs after the claim, and a claim that raises skips it.
    """
    pks = _left_by_a_dead_worker(2)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE django_dbworker_queuestate RENAME TO dbworker_attack_moved")
    try:
        worker = start_worker("record", env={"DBWORKER_STALE_AFTER": "1.0"})
        worker.wait_for_log("retrying in", timeout=30)  # the claim failed
        wait_until(
            lambda: (
                set(WorkItem.objects.filter(pk__in=pks).values_list("status", flat=True))
                == {Status.PENDING}
            ),
            timeout=20,
            what="the dead worker's rows back to pending",
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE dbworker_attack_moved RENAME TO django_dbworker_queuestate")
