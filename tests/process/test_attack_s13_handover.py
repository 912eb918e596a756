"""Attacks (session 13) on the hand-over with real ``run_workers`` processes.

A SIGTERM while a worker hands many keys over (short handlers): nothing left claimed,
nothing run twice, no key run twice at once. Two processes serving one limit-1 handler,
one of them for one queue only, on keys whose rows sit in both queues: the narrow one
never takes (by claim or by hand-over) a row of the queue it does not serve, and every
row runs.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest
from django.db import transaction

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import assert_no_key_overlaps
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

WRITER = "dbworker-success-writer"


def handed_over() -> int:
    return WorkItem.objects.filter(claimed_by__endswith=f":{WRITER}").count()


def test_sigterm_during_hand_overs_leaves_nothing_claimed_and_runs_nothing_twice(
    start_worker,
) -> None:
    keys, per_key = 30, 8
    with transaction.atomic():
        for _ in range(per_key):
            for k in range(keys):
                Keyed.enqueue({"key": f"k{k}", "seconds": 0.01}, concurrency_key=f"k{k}")
    total = keys * per_key
    worker = start_worker("keyed", "--concurrency", "4")
    wait_until(lambda: handed_over() >= 20, timeout=60, what="hand-overs under way")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
    left = list(WorkItem.objects.filter(status=Status.CLAIMED).values("id", "claimed_by"))
    assert left == [], f"rows left claimed after the stop: {left}\n{worker.log()}"
    done = WorkItem.objects.filter(status=Status.SUCCEEDED).count()
    pending = WorkItem.objects.filter(status=Status.PENDING).count()
    assert done + pending == total
    assert 0 < done < total, "the stop came in the middle of the work"
    assert Execution.objects.filter(kind="start").count() == done, (
        "every started run ended as a recorded success (short handlers finish at a stop)"
    )
    assert_no_key_overlaps()

    # A second worker (burst) runs the rest: every row exactly once in all.
    rest = start_worker("keyed", "--burst", "--concurrency", "4")
    assert rest.wait(timeout=90) == 0, rest.log()
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == total
    starts = Counter(Execution.objects.filter(kind="start").values_list("key", flat=True))
    assert starts == Counter({f"k{k}": per_key for k in range(keys)}), starts
    assert_no_key_overlaps()


def test_a_narrow_worker_never_takes_a_row_of_a_queue_it_does_not_serve(start_worker) -> None:
    keys, per_queue = 4, 8
    with transaction.atomic():
        for _ in range(per_queue):
            for k in range(keys):
                # q2's rows of a key first in claim order: a hand-over in the narrow worker
                # that ignored its queue would take them.
                Keyed.enqueue(
                    {"key": f"k{k}", "seconds": 0.01, "q": "q2"},
                    concurrency_key=f"k{k}",
                    queue="q2",
                    priority=1,
                )
                Keyed.enqueue(
                    {"key": f"k{k}", "seconds": 0.01, "q": "q1"},
                    concurrency_key=f"k{k}",
                    queue="q1",
                )
    total = 2 * keys * per_queue
    narrow = start_worker("keyed", "--queue", "q1", "--concurrency", "4")
    wide = start_worker("keyed", "--queue", "q1", "--queue", "q2", "--concurrency", "4")
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == total,
        timeout=90,
        what="every row to succeed",
    )
    for proc in (narrow, wide):
        proc.signal(signal.SIGTERM)
    for proc in (narrow, wide):
        assert proc.wait(timeout=60) == 0, proc.log()
    by_queue = {
        q: Counter(
            int(by.split(":")[1])
            for by in WorkItem.objects.filter(queue=q).values_list("claimed_by", flat=True)
        )
        for q in ("q1", "q2")
    }
    assert narrow.pid not in by_queue["q2"], f"the q1-only worker took q2 rows: {by_queue}"
    assert handed_over() > 0
    assert_no_key_overlaps()
    assert Execution.objects.filter(kind="start").count() == total
