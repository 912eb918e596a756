"""Attack s14 on flow control (SPEC "Flow control"): pause lookalikes, rate windows,
cancel against stale recovery and against a retry, burst workers and paused keyed rows,
the longest snoozes.

Each test states the contract it holds the code to; a failure is a bug, not a
flaky wait: every wait is on a condition, bounded.
"""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models.functions import Now

from django_dbworker import Snooze, UnknownQueue, pause_queue, resume_queue, transitions
from django_dbworker.flow.models import RateStart
from django_dbworker.flow.queues import paused_queues
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.factories import age_heartbeat, claim, claim_rated, make_item, worker_config
from tests.integration.interleave import Racer

pytestmark = pytest.mark.django_db(transaction=True)


def row(pk: int) -> WorkItem:
    return WorkItem.objects.get(pk=pk)


# -- pause / resume: names that differ only in case are different queues ---------------
#
# Queue names are case-sensitive everywhere else: enqueue accepts "reports" and
# "Reports" as two queues, and the claim statements compare them byte for byte on
# every vendor (MySQL: the binary collation of migration 0005).


def test_pausing_a_queue_that_differs_from_a_paused_one_only_in_case_pauses_it() -> None:
    make_item(queue="reports")
    upper = make_item(queue="Reports")
    pause_queue("reports", by="ops")
    state = pause_queue("Reports", by="ops")
    assert state.name == "Reports" and state.paused, (
        f"pause_queue('Reports') answered the state of queue {state.name!r}"
    )
    assert paused_queues() == ["Reports", "reports"]
    claimed = claim(queues=None)
    assert claimed == [], (
        f"both queues are paused, yet row {upper.pk} of 'Reports' was claimed: "
        f"{[(i.pk, i.queue) for i in claimed]}"
    )


def test_resuming_a_lookalike_queue_leaves_the_paused_one_paused() -> None:
    lower = make_item(queue="reports")
    make_item(queue="Reports")
    pause_queue("Reports", by="ops")
    resume_queue("reports")  # a known queue (it has a row), running already: no change
    assert paused_queues() == ["Reports"], "resuming 'reports' resumed 'Reports'"
    assert [i.pk for i in claim(queues=None)] == [lower.pk]


def test_a_lookalike_of_a_paused_queue_that_nothing_knows_is_refused() -> None:
    make_item(queue="reports")
    pause_queue("reports", by="ops")
    # "REPORTS": no row, no handler and no pause names it; it is an unknown queue.
    with pytest.raises(UnknownQueue, match="'REPORTS'"):
        pause_queue("REPORTS")
    with pytest.raises(CommandError, match="Unknown queue 'REPORTS'"):
        call_command("dbworker_queue", "resume", "REPORTS")
    assert paused_queues() == ["reports"], "resuming 'REPORTS' resumed 'reports'"


# -- rate limits: each handler has its own window -----------------------------------------
#
# Handler names are case-sensitive registry keys, and the claims tell "s14_rated" from
# "S14_RATED" (MySQL: binary collation). The rate windows must too.


def test_a_rate_window_counts_only_its_own_handlers_starts() -> None:
    for i in range(2):
        make_item("s14_rated", payload={"i": i})
        make_item("S14_RATED", payload={"i": i})
    first = claim_rated(
        handler="s14_rated", starts=1, period=3600.0, limit=5, queues=None, worker="t:1:a"
    )
    assert [i.handler for i in first] == ["s14_rated"]
    other = claim_rated(
        handler="S14_RATED", starts=1, period=3600.0, limit=5, queues=None, worker="t:1:a"
    )
    # "S14_RATED" has started nothing: its window allows one start now.
    assert [i.handler for i in other] == ["S14_RATED"], (
        "S14_RATED was held back by the start of s14_rated",
        list(RateStart.objects.values_list("handler", "started_at")),
    )


def test_another_handlers_claim_never_clears_a_window_that_is_still_running() -> None:
    """A "1/h" handler starts at most once in any hour, whatever other handlers do."""
    hourly = [make_item("s14_rated", payload={"i": i}) for i in range(2)]
    make_item("S14_RATED", queue="s14-held")
    pause_queue("s14-held")  # its rows are ready but claimed by nobody

    def hourly_claim() -> list[WorkItem]:
        return claim_rated(
            handler="s14_rated", starts=1, period=3600.0, limit=5, queues=None, worker="t:1:a"
        )

    assert len(hourly_claim()) == 1
    # Ten seconds pass (by the database's clock): well inside the hour.
    (start,) = RateStart.objects.values_list("pk", flat=True)
    RateStart.objects.filter(pk=start).update(started_at=Now() - timedelta(seconds=10))
    assert hourly_claim() == []
    # Another handler, "1/s", tries to claim: its row is in a paused queue.
    got = claim_rated(
        handler="S14_RATED", starts=1, period=1.0, limit=5, queues=None, worker="t:1:b"
    )
    assert got == []
    again = hourly_claim()
    assert again == [], (
        "a second start of s14_rated ('1/h') ten seconds after its first: the window's "
        "start row was deleted by S14_RATED's claim",
        [i.pk for i in again],
        [i.pk for i in hourly],
    )


# -- cancel against stale recovery ---------------------------------------------------------


@pytest.mark.server_db
def test_a_cancel_request_made_while_recovery_reads_the_row_is_not_lost() -> None:
    """The request lands between the recovery's read of the stale rows and its write.

    Either order of the two gives a cancelled row: asked first, recovery cancels it
    (``stale._cancel_asked``); recovered first, ``cancel()`` finds it pending and
    cancels it at once. Never a pending row that runs again with the request on it.
    """
    make_item()
    (item,) = claim(handlers=["noop"])
    age_heartbeat(item, 120)
    racers: list[Racer] = []

    def cancel_after_the_read(execute: Any, sql: str, params: Any, many: bool, ctx: Any) -> Any:
        result = execute(sql, params, many, ctx)
        text = sql.lstrip().upper()
        if (
            not racers
            and text.startswith("SELECT")
            and "CANCEL_REQUESTED_AT" in text
            and "HEARTBEAT_AT" in text
        ):
            racers.append(Racer(lambda: WorkItem.objects.get(pk=item.pk).cancel()))
            racers[0].outcome()
        return result

    with connection.execute_wrapper(cancel_after_the_read):
        transitions.recover_stale(stale_after=60)
    assert racers, "the recovery's read of the stale rows was not seen"
    assert racers[0].result is True  # the operator was told the row is asked to stop
    final = row(item.pk)
    assert final.status == Status.CANCELLED, (
        f"cancel() answered True, but the row is {final.status} "
        f"(cancel_requested_at={final.cancel_requested_at}, attempts={final.attempts}): "
        "it will run again"
    )


# -- burst mode and paused keyed rows -------------------------------------------------------


def _burst_exits(names: list[str], timeout: float = 15.0) -> bool:
    """Run a burst worker (not inline) in a thread; whether it returned within ``timeout``."""
    worker = Worker([registry[n] for n in names], worker_config(burst=True, poll_interval=0.1))
    thread = threading.Thread(target=worker.run, daemon=True, name="s14-burst")
    thread.start()
    thread.join(timeout)
    exited = not thread.is_alive()
    if not exited:
        worker.stop(immediate=True)
        thread.join(15)
        assert not thread.is_alive(), "the burst worker did not stop"
    return exited


def test_a_burst_worker_leaves_a_paused_queue_alone_with_or_without_keys() -> None:
    """--burst ends when nothing is claimable; a paused queue's rows are claimable by no
    worker. Unkeyed, the burst worker exits; keyed, it must not wait for them for ever."""
    from tests.testapp.workers import Keyed, Paused

    Paused.enqueue({"key": "plain"})
    pause_queue("pausable")
    assert _burst_exits(["pausable"]), "burst did not exit with a paused unkeyed row"

    Keyed.enqueue({"key": "k"}, concurrency_key="k", queue="pausable")
    assert _burst_exits(["keyed"]), (
        "a burst worker for a handler with a concurrency_limit never exits while a keyed "
        "row waits in a paused queue (keys_busy counts it as waiting for a key's slot)"
    )
    assert WorkItem.objects.filter(status=Status.PENDING, attempts=0).count() == 2


# -- cancel against a retry -------------------------------------------------------------


@pytest.mark.server_db
@pytest.mark.parametrize("verb", ["item.cancel", "queryset.cancel"])
def test_cancel_of_a_running_item_whose_attempt_is_being_retried_is_not_lost(verb: str) -> None:
    """``item.cancel()`` (or ``QuerySet.cancel()``) on a claimed row whose failed attempt
    is written back to pending (a retry) between the two halves of the cancel.

    Either order of the two gives a cancelled row: cancel first, the retry's write refuses
    a row asked to stop (``failures._cancelled_instead`` then ends it cancelled); retry
    first, the cancel finds it pending and cancels it at once. Never a pending row that
    runs again with no cancel recorded, while ``cancel()`` answers "nothing changed".
    """
    make_item()
    (item,) = claim(handlers=["noop"])
    racers: list[Racer] = []

    def retry_after_the_pending_read(
        execute: Any, sql: str, params: Any, many: bool, ctx: Any
    ) -> Any:
        result = execute(sql, params, many, ctx)
        if (
            not racers
            and sql.lstrip().upper().startswith("SELECT")
            and "pending" in [str(p) for p in (params or ())]
        ):
            racers.append(
                Racer(lambda: transitions.retry_later(item, delay=60.0, error="ValueError: boom"))
            )
            racers[0].outcome()
        return result

    target = WorkItem.objects.get(pk=item.pk)
    with connection.execute_wrapper(retry_after_the_pending_read):
        if verb == "item.cancel":
            changed: object = target.cancel()
        else:
            changed = WorkItem.objects.filter(pk=item.pk).cancel()
    assert racers, "the cancel's read of the pending rows was not seen"
    assert racers[0].result is True  # the attempt's retry was written
    final = row(item.pk)
    assert final.status == Status.CANCELLED, (
        f"cancel() answered {changed}; the row is {final.status} "
        f"(cancel_requested_at={final.cancel_requested_at}, run_after={final.run_after}): "
        "the operator's cancel was lost and the item will run again"
    )


# -- snooze: the longest delays reach the database on every vendor ------------------------


class S14SnoozeLong(WorkItemHandler):
    """Snoozes for ``payload["delay"]`` (a name below), every run."""

    name = "s14_snooze_long"
    max_attempts = 2

    def handle(self, payload: Any) -> Any:
        delays: dict[str, float | timedelta] = {
            "inf": math.inf,
            "big_int": 10**30,
            "max_timedelta": timedelta.max,
        }
        raise Snooze(delays[payload["delay"]])


@pytest.mark.parametrize("delay", ["inf", "big_int", "max_timedelta"])
def test_the_longest_snooze_is_ten_years_on_every_database(delay: str) -> None:
    item = S14SnoozeLong.enqueue({"delay": delay})
    assert run_until_empty(["s14_snooze_long"]) == {"snoozed": 1}
    snoozed = row(item.pk)
    assert (snoozed.status, snoozed.attempts, snoozed.snoozes) == (Status.PENDING, 0, 1)
    due = WorkItem.objects.filter(pk=item.pk)
    years = timedelta(days=10 * 365)
    assert due.filter(run_after__gt=Now() + years - timedelta(minutes=1)).exists()
    assert due.filter(run_after__lt=Now() + years + timedelta(minutes=1)).exists()
