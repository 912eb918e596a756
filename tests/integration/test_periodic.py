"""Periodic slots against a real database: compare-and-set, races, prune, catch-up, skips."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.db import connections
from django.db.models import Count
from django.db.models.functions import Now
from prometheus_client import CollectorRegistry

from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import PeriodicSchedule, Status, WorkItem
from django_dbworker.periodic.handler import slot_key
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from django_dbworker.worker.scheduler import (
    Scheduler,
    SlotOutcome,
    due_slots,
    ensure_schedules,
    take_slot,
)
from tests.conftest import wait_until
from tests.factories import worker_config
from tests.testapp.models import Execution
from tests.testapp.workers import Nightly, Tick

pytestmark = pytest.mark.django_db(transaction=True)

SLOT = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def items_of(name: str) -> list[WorkItem]:
    return list(WorkItem.objects.filter(handler=name).order_by("id"))


def db_now() -> datetime:
    ensure_schedules(["tick"], using="default")
    return PeriodicSchedule.objects.annotate(now=Now()).values_list("now", flat=True)[0]


def test_a_slot_is_taken_once_and_becomes_a_work_item_keyed_by_its_time() -> None:
    ensure_schedules(["tick"], using="default")
    assert take_slot(Tick, SLOT, using="default") == SlotOutcome.ENQUEUED
    assert take_slot(Tick, SLOT, using="default") == SlotOutcome.TAKEN
    # An older slot is never taken after a newer one.
    assert take_slot(Tick, SLOT - timedelta(seconds=1), using="default") == SlotOutcome.TAKEN
    (item,) = items_of("tick")
    assert item.unique_key == slot_key(SLOT) == "2024-05-01T12:00:00+00:00"
    assert item.payload == {"slot": slot_key(SLOT)}
    assert item.run_after == SLOT
    row = PeriodicSchedule.objects.get(name="tick")
    assert (row.last_slot, row.last_item_id) == (SLOT, item.pk)


def test_the_slot_reaches_run_as_argument_and_as_self_slot() -> None:
    ensure_schedules(["tick", "nightly"], using="default")
    take_slot(Tick, SLOT, using="default")
    take_slot(Nightly, SLOT, using="default")
    assert run_until_empty() == {"succeeded": 2}
    assert set(Execution.objects.values_list("kind", "key")) == {
        ("tick", slot_key(SLOT)),
        ("nightly", slot_key(SLOT)),
    }
    nightly = WorkItem.objects.get(handler="nightly")
    assert nightly.queue == "reports"
    assert nightly.result == {"report_for": slot_key(SLOT)}


def test_racing_schedulers_enqueue_each_slot_exactly_once() -> None:
    ensure_schedules(["tick"], using="default")
    racers, slots = 3, 15
    barrier = threading.Barrier(racers)
    outcomes: list[SlotOutcome] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def race() -> None:
        try:
            for n in range(slots):
                barrier.wait(timeout=30)
                outcome = take_slot(Tick, SLOT + timedelta(seconds=n), using="default")
                with lock:
                    outcomes.append(outcome)
                # The slot's run "finishes" before the next round, so that
                # every slot is enqueued rather than skipped.
                if barrier.wait(timeout=30) == 0:
                    WorkItem.objects.filter(handler="tick").update(status=Status.SUCCEEDED)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=race) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert outcomes.count(SlotOutcome.ENQUEUED) == slots
    assert outcomes.count(SlotOutcome.TAKEN) == slots * (racers - 1)
    keys = WorkItem.objects.filter(handler="tick").values("unique_key").annotate(n=Count("id"))
    assert {row["unique_key"] for row in keys} == {
        slot_key(SLOT + timedelta(seconds=n)) for n in range(slots)
    }
    assert {row["n"] for row in keys} == {1}


def test_pruning_finished_slots_never_makes_them_run_again() -> None:
    ensure_schedules(["tick"], using="default")
    for n in range(5):
        take_slot(Tick, SLOT + timedelta(seconds=n), using="default")
        assert run_until_empty() == {"succeeded": 1}
    call_command("dbworker_prune", "--older-than", "0s", stdout=open("/dev/null", "w"))  # noqa: SIM115
    assert not WorkItem.objects.exists()
    for n in range(5):
        assert take_slot(Tick, SLOT + timedelta(seconds=n), using="default") == SlotOutcome.TAKEN
    assert not WorkItem.objects.exists()
    # The schedule row itself is not the prune command's to delete.
    assert PeriodicSchedule.objects.get(name="tick").last_slot == SLOT + timedelta(seconds=4)


def test_a_new_schedule_starts_with_the_next_slot_not_a_past_one() -> None:
    due, now, upcoming = due_slots([Nightly], using="default")
    assert due == []
    assert upcoming is not None and upcoming > now
    assert upcoming == Nightly.get_schedule().following(now)


def test_after_downtime_only_the_latest_missed_slot_runs_once() -> None:
    ensure_schedules(["tick", "nightly"], using="default")
    now = db_now()
    # The last slots taken were ten days (nightly) and ten minutes (tick) ago.
    PeriodicSchedule.objects.filter(name="nightly").update(last_slot=now - timedelta(days=10))
    PeriodicSchedule.objects.filter(name="tick").update(last_slot=now - timedelta(minutes=10))
    scheduler = Scheduler([Tick, Nightly], using="default")
    scheduler.tick()
    nightly = items_of("nightly")
    assert len(nightly) == 1
    assert nightly[0].unique_key == slot_key(Nightly.get_schedule().latest(now))  # type: ignore[arg-type]
    ticks = items_of("tick")
    assert 1 <= len(ticks) <= 2  # the latest slot; maybe one more if a second passed
    assert scheduler.taken[SlotOutcome.ENQUEUED] == len(ticks) + 1
    scheduler.tick()
    assert len(items_of("nightly")) == 1


def test_a_slot_due_while_the_previous_run_is_live_is_skipped_and_counted() -> None:
    reg = CollectorRegistry()
    metrics = WorkerMetrics(reg)
    ensure_schedules(["tick"], using="default")
    assert take_slot(Tick, SLOT, using="default", metrics=metrics) == SlotOutcome.ENQUEUED
    nxt = SLOT + timedelta(seconds=1)
    assert take_slot(Tick, nxt, using="default", metrics=metrics) == SlotOutcome.SKIPPED
    assert take_slot(Tick, nxt, using="default", metrics=metrics) == SlotOutcome.TAKEN
    assert len(items_of("tick")) == 1
    assert PeriodicSchedule.objects.get(name="tick").skipped == 1
    assert reg.get_sample_value("periodic_worker_skipped_total", {"worker": "tick"}) == 1
    # Once the run finished, the next slot runs again.
    run_until_empty()
    later = SLOT + timedelta(seconds=2)
    assert take_slot(Tick, later, using="default", metrics=metrics) == SlotOutcome.ENQUEUED


def test_a_failed_enqueue_rolls_the_schedule_back() -> None:
    class BadQueue(Tick):
        name = "bad_queue_tick"
        queue = "no spaces allowed"

    try:
        ensure_schedules([BadQueue.name], using="default")
        with pytest.raises(ValueError, match="Queue name"):
            take_slot(BadQueue, SLOT, using="default")
        assert PeriodicSchedule.objects.get(name=BadQueue.name).last_slot is None
    finally:
        from django_dbworker.registry import registry

        registry.unregister(BadQueue.name)


def test_a_burst_worker_takes_the_due_slot_runs_it_and_counts_periodic_metrics() -> None:
    reg = CollectorRegistry()
    ensure_schedules(["nightly"], using="default")
    PeriodicSchedule.objects.filter(name="nightly").update(last_slot=db_now() - timedelta(days=2))
    Worker([Nightly], worker_config(burst=True), metrics=WorkerMetrics(reg)).run()
    (item,) = items_of("nightly")
    assert item.status == Status.SUCCEEDED
    labels = {"worker": "nightly", "status": "succeeded"}
    assert reg.get_sample_value("periodic_worker_runs_total", labels) == 1
    assert reg.get_sample_value("periodic_worker_run_duration_seconds_count", labels) == 1
    assert reg.get_sample_value("worker_tasks_total", labels) == 1


def test_a_running_worker_enqueues_each_second_on_time_and_skips_behind_slow_runs(
    background_worker: Callable[..., Worker],
) -> None:
    background_worker(["tick", "slow_tick"])
    wait_until(
        lambda: WorkItem.objects.filter(handler="tick", status=Status.SUCCEEDED).count() >= 4,
        timeout=15,
        what="four tick slots to run",
    )
    wait_until(
        lambda: PeriodicSchedule.objects.filter(name="slow_tick", skipped__gte=2).exists(),
        timeout=15,
        what="slow_tick to skip slots behind its slow runs",
    )
    # Each slot's item was created before the next slot was due, whatever the load (by
    # the database clock; the item's created_at is the database's too).
    for item in WorkItem.objects.filter(handler="tick"):
        late = (item.created_at - datetime.fromisoformat(item.unique_key)).total_seconds()
        assert 0 <= late < 1.0, (item.unique_key, item.created_at)
    # Slow runs never overlap: at most one slow_tick item was ever live at once.
    slow = items_of("slow_tick")
    for earlier, later in itertools.pairwise(slow):
        assert later.created_at >= earlier.finished_at  # type: ignore[operator]


def test_a_periodic_handler_enqueued_by_hand_runs_with_now_as_its_slot() -> None:
    before = datetime.now(UTC)
    Nightly.enqueue()
    assert run_until_empty() == {"succeeded": 1}
    (key,) = Execution.objects.filter(kind="nightly").values_list("key", flat=True)
    assert datetime.fromisoformat(key) >= before
    assert not PeriodicSchedule.objects.exists()  # the schedule is not touched
