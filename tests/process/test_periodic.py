"""Periodic handlers in real ``run_workers`` processes: one run per slot in the cluster."""

from __future__ import annotations

import itertools
import signal
from datetime import datetime, timedelta

import pytest
from django.db.models import Count
from django.db.models.functions import Now

from django_dbworker.models import PeriodicSchedule, Status, WorkItem
from django_dbworker.periodic.handler import slot_key
from tests.conftest import wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import Nightly

pytestmark = pytest.mark.django_db(transaction=True)


def slot_table() -> list[tuple[str, int, int, str]]:
    """(slot, work items, runs, statuses) per slot of ``tick``, in slot order."""
    items = {
        row["unique_key"]: row
        for row in WorkItem.objects.filter(handler="tick")
        .values("unique_key")
        .annotate(n=Count("id"))
    }
    runs = {
        row["key"]: row["n"]
        for row in Execution.objects.filter(kind="tick").values("key").annotate(n=Count("id"))
    }
    statuses: dict[str, set[str]] = {}
    for key, status in WorkItem.objects.filter(handler="tick").values_list("unique_key", "status"):
        statuses.setdefault(key, set()).add(status)
    return [
        (
            key,
            items.get(key, {"n": 0})["n"],
            runs.get(key, 0),
            ",".join(sorted(statuses.get(key, ()))),
        )
        for key in sorted(set(items) | set(runs))
    ]


@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.pgbouncer
def test_every_slot_runs_once_across_several_processes(start_worker, processes: int) -> None:
    workers = [start_worker("tick", "--concurrency", "2") for _ in range(processes)]
    for worker in workers:
        worker.wait_for_log("Schedule tick: every second, queue default; next slot")
    # Every process is up; from now on, several seconds of slots.
    first = WorkItem.objects.filter(handler="tick").count()
    wait_until(
        lambda: (
            WorkItem.objects.filter(handler="tick", status=Status.SUCCEEDED).count() >= first + 6
        ),
        timeout=30,
        what="six more slots to run",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait() == 0, worker.log()
    table = slot_table()
    logs = "\n".join(w.log() for w in workers)
    # Each slot: exactly one WorkItem, one run, succeeded; none missing in between.
    assert table, logs
    assert all(row[1:] == (1, 1, "succeeded") for row in table), (table, logs)
    slots = [datetime.fromisoformat(row[0]) for row in table]
    assert len(slots) >= 6
    assert {b - a for a, b in itertools.pairwise(slots)} == {timedelta(seconds=1)}, table
    assert "Skipped slot" not in logs
    # Each slot's item was created before the next slot was due, whatever the load (DB clock).
    for item in WorkItem.objects.filter(handler="tick"):
        late = (item.created_at - datetime.fromisoformat(item.unique_key)).total_seconds()
        assert 0 <= late < 1.0, (item.unique_key, late)
    pids = dict(Execution.objects.filter(kind="tick").values_list("key", "pid"))
    print(f"\nslot table of {processes} processes (slot, items, runs, status, run by pid):")
    for row in table:
        print("  ", *row, pids.get(row[0]))


def test_a_restart_after_downtime_runs_the_latest_missed_slot_once(start_worker) -> None:
    PeriodicSchedule.objects.create(name="nightly")
    # The last slot taken was three days ago: two nightly slots were missed.
    PeriodicSchedule.objects.filter(name="nightly").update(last_slot=Now() - timedelta(days=3))
    worker = start_worker("nightly")
    wait_until(
        lambda: WorkItem.objects.filter(handler="nightly", status=Status.SUCCEEDED).exists(),
        timeout=20,
        what="the catch-up slot to run",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert "missed slots while no worker ran it; running only the latest" in worker.log()
    (item,) = WorkItem.objects.filter(handler="nightly")
    now = PeriodicSchedule.objects.annotate(now=Now()).values_list("now", flat=True)[0]
    latest = Nightly.get_schedule().latest(now)
    assert latest is not None and item.unique_key == slot_key(latest)
    assert Execution.objects.filter(kind="nightly").count() == 1
    # Started again: the slot is not run a second time.
    again = start_worker("nightly", "--burst")
    assert again.wait() == 0
    assert WorkItem.objects.filter(handler="nightly").count() == 1
