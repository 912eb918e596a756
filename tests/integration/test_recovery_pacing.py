"""When the worker runs stale recovery, on a clock the test moves (no sleeping).

The pass is put off while this process's own writes were held up (a
heartbeat that could not be written is no sign of a dead worker), runs
again once they flow, and runs regardless once it was put off for longer
than STALE_AFTER: recovery is delayed, never lost. The rows' staleness is
the database's clock (aged heartbeats); the pacing is the worker's clock,
a ``ManualClock`` here.
"""

from __future__ import annotations

import math

import pytest

from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from django_dbworker.worker.clock import ManualClock
from tests.factories import age_heartbeat, claim, make_item, worker_config
from tests.testapp.workers import Noop

pytestmark = pytest.mark.django_db(transaction=True)


def _stale_row() -> WorkItem:
    make_item()
    [item] = claim(limit=1)
    age_heartbeat(item, 3600)
    return item


def _status(item: WorkItem) -> str:
    return WorkItem.objects.get(pk=item.pk).status


def test_recovery_waits_while_own_writes_are_held_up_then_runs() -> None:
    clock = ManualClock()
    worker = Worker([Noop], worker_config(heartbeat_interval=1.0, stale_after=60.0), clock=clock)
    recovery = worker.recovery
    item = _stale_row()
    recovery.observe_write(math.inf)  # a heartbeat just failed
    recovery.maybe_recover()
    assert _status(item) == Status.CLAIMED, "recovered while this worker's writes waited"
    # Writes flowed for two heartbeat intervals since, and the next pass is due.
    clock.advance(max(2.5, recovery.interval() * 1.25))
    recovery.maybe_recover()
    assert _status(item) == Status.PENDING


def test_recovery_put_off_for_longer_than_stale_after_runs_regardless() -> None:
    clock = ManualClock()
    worker = Worker([Noop], worker_config(heartbeat_interval=1.0, stale_after=4.0), clock=clock)
    recovery = worker.recovery
    item = _stale_row()
    # Writes keep waiting (SQLite's write lock held by a long transaction, say).
    for _ in range(4):
        recovery.observe_write(math.inf)
        recovery.maybe_recover()
        assert _status(item) == Status.CLAIMED
        clock.advance(1.0)
    clock.advance(1.5)
    recovery.observe_write(math.inf)
    recovery.maybe_recover()
    assert _status(item) == Status.PENDING, "recovery was put off for good"


def test_recovery_runs_at_its_interval_not_at_every_step() -> None:
    clock = ManualClock()
    worker = Worker([Noop], worker_config(stale_after=8.0), clock=clock)
    recovery = worker.recovery
    recovery.maybe_recover()  # the first pass: nothing stale yet
    item = _stale_row()
    recovery.maybe_recover()
    assert _status(item) == Status.CLAIMED, "a second pass at once"
    clock.advance(recovery.interval() * 1.25)  # past the jittered interval's top
    recovery.maybe_recover()
    assert _status(item) == Status.PENDING


class _SlowPassClock(ManualClock):
    """Every reading is two seconds after the one before: each pass looks slow."""

    def now(self) -> float:
        moment = super().now()
        self.advance(2.0)
        return moment


def test_a_slow_pass_inside_a_callers_transaction_keeps_its_work_and_the_transaction() -> None:
    """run_until_empty in a test's transaction: a pass that took longer than a heartbeat
    interval is not put off by raising out of it (its transaction is the caller's: the
    error would leave it broken for the claim that follows, seen on a loaded MariaDB)."""
    from django.db import transaction

    worker = Worker(
        [Noop], worker_config(heartbeat_interval=1.0, stale_after=60.0), clock=_SlowPassClock()
    )
    item = _stale_row()
    with transaction.atomic():
        worker.recovery.maybe_recover()
        assert _status(item) == Status.PENDING  # a query after it works, and it recovered
    assert _status(item) == Status.PENDING
