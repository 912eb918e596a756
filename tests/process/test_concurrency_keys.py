"""Per-key concurrency limits across ``run_workers`` processes, from the handlers' own records.

The ``keyed`` handler (limit 1) writes a start and an end record per run,
named by its concurrency key: a key's records read start, end, start, end
in time order exactly when no two of its runs overlapped
(``assert_no_key_overlaps``).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from django.db import connection, transaction

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import assert_no_key_overlaps
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.pgbouncer
def test_three_processes_run_one_item_per_key_at_a_time_and_keys_side_by_side(
    start_worker,
) -> None:
    keys, per_key = 10, 6
    # Two threads and no prefetch buffer per process: one process holds at
    # most 2 of the 10 keys' slots, so the others must take keys too (a
    # buffer of claimed rows holds slots, and one process could hold them all).
    env = {"DBWORKER_PREFETCH_HORIZON": "0"}
    workers = [start_worker("keyed", "--concurrency", "2", env=env) for _ in range(3)]
    for worker in workers:
        worker.wait_for_log("Starting worker", timeout=60)
    for _ in range(per_key):
        for k in range(keys):
            Keyed.enqueue({"key": f"k{k}", "seconds": 0.1}, concurrency_key=f"k{k}")
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=120,
        what="every keyed item to succeed",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=60) == 0, worker.log()
    side_by_side = assert_no_key_overlaps()
    assert side_by_side > 1, "different keys never ran at the same time"
    assert Execution.objects.filter(kind="start").count() == keys * per_key
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}
    # The claims spread over the processes (each holds at most 2 slots of 10).
    assert Execution.objects.values("pid").distinct().count() >= 2


@pytest.mark.pgbouncer
def test_a_killed_workers_slot_is_freed_only_by_stale_recovery(start_worker) -> None:
    env = {"DBWORKER_STALE_AFTER": "1.0", "DBWORKER_HEARTBEAT_INTERVAL": "0.2"}
    first = Keyed.enqueue({"key": "solo", "first_seconds": 60}, concurrency_key="solo")
    victim = start_worker("keyed", env=env)
    wait_until(lambda: Execution.objects.filter(key="solo", kind="start").exists())
    dead_token = WorkItem.objects.get(pk=first.pk).claim_token
    second = Keyed.enqueue({"key": "solo"}, concurrency_key="solo")
    other = Keyed.enqueue({"key": "other"}, concurrency_key="other")
    victim.signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    survivor = start_worker("keyed", env=env)
    # Another key flows; this key waits for the dead worker's slot.
    wait_until(
        lambda: WorkItem.objects.get(pk=other.pk).status == Status.SUCCEEDED,
        timeout=30,
        what="the other key's item to succeed",
    )

    def done() -> bool:
        # Starts first, then the row: a second start was claimed after the
        # recovery committed, so the row read after it shows the recovery.
        starts = Execution.objects.filter(key="solo", kind="start").count()
        row = WorkItem.objects.get(pk=first.pk)
        if starts >= 2:
            assert not (row.status == Status.CLAIMED and row.claim_token == dead_token), (
                "a run of the key started while the killed worker still held its slot"
            )
        return (
            WorkItem.objects.filter(pk__in=[first.pk, second.pk], status=Status.SUCCEEDED).count()
            == 2
        )

    wait_until(done, timeout=60, what="both items of the key to succeed after recovery")
    # (The victim may have claimed the other key's item too before it died.)
    assert "stale work item(s)" in survivor.log()
    assert WorkItem.objects.get(pk=first.pk).attempts == 2
    assert WorkItem.objects.get(pk=second.pk).attempts == 1
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(timeout=60) == 0, survivor.log()
    # The killed run has no end record; every other run of the key had its own time.
    kinds = list(
        Execution.objects.filter(key="solo")
        .order_by("created_at", "id")
        .values_list("kind", flat=True)
    )
    assert kinds == ["start", "start", "end", "start", "end"], kinds


def test_burst_workers_leave_no_keyed_item_behind(start_worker) -> None:
    """A burst worker whose claim finds every key busy (held by the other) waits, not exits."""
    keys, per_key = 100, 10
    with transaction.atomic():
        for _ in range(per_key):
            for k in range(keys):
                Keyed.enqueue({"key": f"k{k}"}, concurrency_key=f"k{k}")
    workers = [start_worker("keyed", "--burst", "--concurrency", "8") for _ in range(2)]
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.log()
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key
    assert_no_key_overlaps()


def _urgent_row_of_a_busy_key(start_worker, *, feed: bool) -> tuple[bool, int]:
    """A key's rows in queue ``low`` (run by one worker), then a priority-100 row of the
    same key in queue ``high`` (run by another, idle): whether it started within 15 s, and
    how many ``low`` rows of the key started before it. ``feed``: ``low`` is fed as fast as
    it runs (a customer's steady stream of bulk work)."""
    with transaction.atomic():
        for i in range(20 if feed else 300):
            Keyed.enqueue({"key": f"low-{i}", "seconds": 0.03}, concurrency_key="k0", queue="low")
    low = start_worker("keyed", "--queue", "low", "--concurrency", "4")
    high = start_worker("keyed", "--queue", "high", "--concurrency", "4")
    for worker in (low, high):
        worker.wait_for_log("Starting worker", timeout=60)
    stop = threading.Event()

    def feeding() -> None:
        n = 20
        try:
            while not stop.is_set():
                Keyed.enqueue(
                    {"key": f"low-{n}", "seconds": 0.03}, concurrency_key="k0", queue="low"
                )
                n += 1
                time.sleep(0.03)
        finally:
            connection.close()

    feeder = threading.Thread(target=feeding)
    if feed:
        feeder.start()
    try:
        wait_until(
            lambda: Execution.objects.filter(kind="start", key__startswith="low-").count() >= 10,
            timeout=60,
            what="the low worker to run rows of k0",
        )
        mark = Execution.objects.order_by("-pk").values_list("pk", flat=True).first()
        Keyed.enqueue(
            {"key": "high", "seconds": 0.0}, concurrency_key="k0", queue="high", priority=100
        )
        started = None
        deadline = time.monotonic() + 15
        while started is None and time.monotonic() < deadline:
            started = Execution.objects.filter(kind="start", key="high").first()
            time.sleep(0.05)
    finally:
        stop.set()
        if feed:
            feeder.join(30)
    before = Execution.objects.filter(kind="start", key__startswith="low-", pk__gt=mark)
    if started is not None:
        before = before.filter(pk__lt=started.pk)
    for worker in (low, high):
        worker.signal(signal.SIGTERM)
    for worker in (low, high):
        assert worker.wait(timeout=60) == 0, worker.log()
    return started is not None, before.count()


@pytest.mark.parametrize("feed", [False, True], ids=["backlog", "steady-stream"])
def test_a_keys_rows_start_in_claim_order_across_queues_of_different_workers(
    start_worker, feed: bool
) -> None:
    """A key's slot goes to its best ready row, whichever queue it is in: the worker of the
    other queue leaves the key free for it (it claims at its next poll, 0.2 s in the tests),
    so a priority-100 row waits for the running row and a poll, not for the backlog."""
    started, low_before = _urgent_row_of_a_busy_key(start_worker, feed=feed)
    assert started, f"the priority-100 row of k0 waited 15 s behind {low_before} low rows of k0"
    assert low_before < 20, low_before
