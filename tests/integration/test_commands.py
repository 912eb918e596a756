"""dbworker_stats and dbworker_prune."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db.models.functions import Now

from django_dbworker.models import Status, WorkItem
from django_dbworker.stats import orphaned_handlers, queue_stats
from tests.conftest import wait_until
from tests.factories import make_item

pytestmark = pytest.mark.django_db


def test_stats_count_by_queue_and_status_with_lag() -> None:
    make_item(queue="a", run_after=Now() - timedelta(seconds=120))
    make_item(queue="a", status=Status.FAILED)
    make_item(queue="b", run_after=Now() + timedelta(hours=1))  # not claimable: no lag
    stats = queue_stats()
    assert stats["a"]["counts"] == {"pending": 1, "failed": 1}
    assert 119 <= (stats["a"]["oldest_pending_age"] or 0) < 180
    assert stats["b"]["oldest_pending_age"] is None
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == [
        "queue",
        "pending",
        "claimed",
        "succeeded",
        "failed",
        "cancelled",
        "oldest",
        "pending",
    ]
    assert lines[1].split()[:6] == ["a", "1", "0", "0", "1", "0"]


def test_stats_show_a_status_this_version_does_not_know() -> None:
    odd = make_item(queue="a")
    WorkItem.objects.filter(pk=odd.pk).update(status="weird")  # a newer version's, or by hand
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    header, row = out.getvalue().splitlines()[:2]
    assert header.split()[5:7] == ["cancelled", "weird"]
    assert row.split()[:7] == ["a", "0", "0", "0", "0", "0", "1"]


def _orphans() -> None:
    """Pending rows of two handlers no process registers, and decoys."""
    for age in (7200, 60):
        make_item(handler="gone-handler", created_at=Now() - timedelta(seconds=age))
    make_item(handler="also-gone", run_after=Now() + timedelta(hours=1))  # not due: still orphaned
    make_item(handler="gone-finished", status=Status.FAILED)  # not pending: nothing waits
    make_item(handler="echo")  # registered


def test_orphaned_handlers_are_pending_rows_of_unregistered_names() -> None:
    _orphans()
    orphans = orphaned_handlers()
    assert [(o["handler"], o["pending"]) for o in orphans] == [
        ("also-gone", 1),
        ("gone-handler", 2),
    ]
    assert 7199 <= orphans[1]["oldest_age"] < 7260
    assert 0 <= orphans[0]["oldest_age"] < 60


def test_stats_list_orphaned_handlers() -> None:
    _orphans()
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    text = out.getvalue()
    assert "not registered in this process" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["handler", "pending"])
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [r[:2] for r in rows] == [["also-gone", "1"], ["gone-handler", "2"]]
    assert rows[1][2].startswith("720") and "gone-finished" not in text


def test_stats_say_nothing_of_orphans_when_there_are_none() -> None:
    make_item(handler="echo")
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "registered" not in out.getvalue()


def test_prune_deletes_old_finished_rows_only() -> None:
    old = Now() - timedelta(days=10)
    keep_recent = make_item(status=Status.SUCCEEDED, finished_at=Now())
    old_ok = [make_item(status=Status.SUCCEEDED, finished_at=old) for _ in range(5)]
    old_failed = make_item(status=Status.FAILED, finished_at=old)
    pending = make_item(finished_at=old)  # odd, but must never be touched
    claimed = make_item(status=Status.CLAIMED, finished_at=old)
    out = StringIO()
    call_command(
        "dbworker_prune",
        "--older-than",
        "7d",
        "--status",
        "succeeded",
        "--batch-size",
        "2",
        stdout=out,
    )
    assert "Deleted 5 work item(s)" in out.getvalue()
    remaining = set(WorkItem.objects.values_list("pk", flat=True))
    assert remaining == {keep_recent.pk, old_failed.pk, pending.pk, claimed.pk}
    assert not remaining & {i.pk for i in old_ok}
    call_command("dbworker_prune", "--older-than", "1d", stdout=StringIO())
    assert set(WorkItem.objects.values_list("pk", flat=True)) == {
        keep_recent.pk,
        pending.pk,
        claimed.pk,
    }


@pytest.mark.parametrize("age", ["", "7 days", "-1d", "d"])
def test_prune_rejects_bad_ages(age: str) -> None:
    with pytest.raises(CommandError, match="--older-than"):
        call_command("dbworker_prune", "--older-than", age)


@pytest.mark.django_db(transaction=True)
def test_run_workers_repeats_the_orphan_warning_while_it_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rows of an unregistered handler enqueued after start-up are reported too."""
    from django_dbworker.worker.slow_checks import OrphanWatch

    stopping = threading.Event()
    caplog.set_level(logging.WARNING, logger="django_dbworker")
    thread = OrphanWatch("default", interval=0.1)
    thread.attach(stopping=stopping, add_handlers=lambda classes: None)
    thread.start()
    try:
        make_item(handler="moved-to-tasks-py")
        wait_until(lambda: "moved-to-tasks-py" in caplog.text, what="the repeated orphan warning")
    finally:
        stopping.set()
        thread.join(5)
    assert not thread.is_alive()
    assert "Is it defined in a `workers.py` module" in caplog.text


def test_stats_show_schedules_with_their_last_run_and_next_slot() -> None:
    from datetime import UTC, datetime

    from django_dbworker.models import PeriodicSchedule
    from django_dbworker.worker.scheduler import ensure_schedules, take_slot
    from tests.testapp.workers import Nightly

    slot = datetime(2024, 5, 1, 1, 0, tzinfo=UTC)
    ensure_schedules(["nightly"], using="default")
    take_slot(Nightly, slot, using="default")
    PeriodicSchedule.objects.create(name="retired-schedule", last_slot=slot)
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    text = out.getvalue()
    assert "Schedules (periodic handlers; times in UTC):" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line}
    nightly = lines["nightly"]
    assert "at 03:00 every day (Europe/Paris)" in nightly
    assert "2024-05-01 01:00:00" in nightly and "pending (item" in nightly
    assert "every second" in lines["tick"]
    assert "(not registered here)" in lines["retired-schedule"]
    WorkItem.objects.all().delete()  # pruned
    assert "pruned (item" in _stats_line("nightly")


def _stats_line(name: str) -> str:
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    return next(line for line in out.getvalue().splitlines() if line.startswith(name + " "))


# From Django 6.1 run_workers' system checks look at every alias (on SQLite: a query).
@pytest.mark.django_db(transaction=True, databases=["default", "work"])
def test_burst_ends_with_an_info_summary_that_says_the_queue_is_drained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django_dbworker.contrib.prometheus.collector import register
    from tests.testapp.workers import Noop

    Noop.enqueue_many([{"n": n} for n in range(3)])
    caplog.set_level(logging.INFO, logger="django_dbworker")
    try:
        call_command("run_workers", "noop", "--burst", "--concurrency", "2")
    finally:
        register()  # run_workers takes the web process's queue collector away
    last = [r for r in caplog.records if r.name == "django_dbworker"][-1]
    assert last.levelno == logging.INFO
    message = last.getMessage()
    assert message.startswith("Burst done, the queue is drained"), message
    assert "nothing left to claim for handlers=noop, queues=all" in message
    assert "3 succeeded, 0 failed, 0 retried" in message


def test_stats_show_the_live_workers_only_with_the_items_each_holds() -> None:
    from django_dbworker.fleet.models import LiveWorker
    from django_dbworker.fleet.register import forget_stale, live_workers
    from tests.factories import claim

    LiveWorker.objects.create(
        name="h:1", queues=["a", "b"], handlers=["echo", "noop"], concurrency=3, version="0.1.0"
    )
    # Its pid starts like the first's: no prefix of "h:1:" matches its rows.
    LiveWorker.objects.create(name="h:12", handlers=[f"h{n}" for n in range(9)], concurrency=8)
    LiveWorker.objects.create(name="dead:7", handlers=["echo"])
    LiveWorker.objects.filter(name="dead:7").update(heartbeat_at=Now() - timedelta(seconds=61))
    for _ in range(3):
        make_item(handler="echo")
    claim(limit=2, worker="h:1:dbworker_0")
    claim(limit=1, worker="h:12:MainThread")

    assert [(w.name, w.claimed) for w in live_workers()] == [("h:1", 2), ("h:12", 1)]
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    section = out.getvalue().split("Workers: ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[0] == "2 live (times in UTC):"
    assert section[1].split() == [
        "host", "pid", "queues", "handlers", "concurrency", "claimed",
        "last", "heartbeat", "started", "at", "version",
    ]  # fmt: skip
    first = section[2].split()
    assert first[:6] == ["h", "1", "a,b", "echo,noop", "3", "2"]
    assert first[6].endswith("s") and float(first[6][:-1]) < 30 and first[7] == "ago"
    assert first[-1] == "0.1.0"
    assert section[3].split()[:7] == ["h", "12", "all", "9", "handlers", "8", "1"]
    # The dead process's row: never shown, deleted by the recovery pass's DELETE.
    assert forget_stale("default", 60.0) == 1
    assert sorted(LiveWorker.objects.values_list("name", flat=True)) == ["h:1", "h:12"]
    LiveWorker.objects.all().delete()
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "Workers: none live (no run_workers process wrote a heartbeat in the last 60s)." in (
        out.getvalue()
    )
