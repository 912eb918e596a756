"""Cancel running work and ``Snooze`` (SPEC "Flow control"), on the real databases.

Cancel: ``item.cancel()`` cancels a pending row at once and marks a claimed
one (``cancel_requested_at``); the heartbeat reports the mark per attempt,
and ``self.cancel_requested`` is True in the thread of that attempt only.
A handler that raises then ends ``cancelled`` (never retried), one that
returns ends ``succeeded``; a timed-out attempt with a request ends
``cancelled``; a late outcome of it is discarded by fencing.

Snooze: the row goes back to pending for that long without using an
attempt; ``snoozes`` counts, and the 101st fails the row.
"""

from __future__ import annotations

import math
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models.functions import Now

from django_dbworker import Cancelled, Snooze, transitions
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.outcomes import Outcome
from django_dbworker.registry import registry
from django_dbworker.tasks import task as dbtask
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import age_heartbeat, claim, make_due, make_item
from tests.integration.interleave import Racer
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

CANCELLED = "django_dbworker.errors.Cancelled"


# -- handlers ---------------------------------------------------------------------

#: What each cancellable run saw, by its payload's key: started, saw the request.
SEEN: dict[str, dict[str, Any]] = {}
RELEASE = threading.Event()


def _seen(key: str) -> dict[str, Any]:
    return SEEN.setdefault(key, {"started": threading.Event(), "cancel": threading.Event()})


class LoopUntilCancelled(WorkItemHandler):
    """Loops until it sees its cancel request, then raises (payload ``raise``) or returns.

    Payload ``key``: its record in ``SEEN``. It stops looping, without a
    request, when the test sets ``RELEASE``, and then says what it saw.
    """

    name = "cs_loop"
    max_attempts = 3

    def handle(self, payload: Any) -> Any:
        seen = _seen(payload["key"])
        seen["started"].set()
        while not self.cancel_requested:
            if RELEASE.wait(0.02):
                seen["saw"] = self.cancel_requested
                return "released"
        seen["saw"] = True
        seen["cancel"].set()
        if payload.get("raise") == "cancelled":
            raise Cancelled("stopping as asked")
        if payload.get("raise"):
            raise ValueError("stopped halfway")
        return "finished anyway"


class OverrunAfterCancel(WorkItemHandler):
    """Sees its cancel request, ignores it and overruns its timeout; returns when released."""

    name = "cs_overrun"
    timeout = 1.0
    max_attempts = 3

    def handle(self, payload: Any) -> Any:
        seen = _seen(payload["key"])
        seen["started"].set()
        wait_until(lambda: self.cancel_requested, timeout=20, what="the cancel request")
        seen["cancel"].set()
        RELEASE.wait(30)
        seen["late_saw"] = self.cancel_requested
        return "too late"


class CancelsItself(WorkItemHandler):
    name = "cs_self_cancel"
    max_attempts = 3

    def handle(self, payload: Any) -> Any:
        raise Cancelled("nothing to do for this customer")


class CancelledFromInside(WorkItemHandler):
    """Its row is cancelled (in the database) while it runs; it fails before any heartbeat."""

    name = "cs_cancel_then_fail"
    max_attempts = 3

    def handle(self, payload: Any) -> Any:
        assert WorkItem.objects.filter(handler=self.name, status=Status.CLAIMED).request_cancel()
        raise ValueError("failed after the request")


class Snoozer(WorkItemHandler):
    """Snoozes ``payload["times"]`` times (counted in Execution rows), then succeeds."""

    name = "cs_snooze"
    max_attempts = 2
    retry_on = (KeyError,)  # a Snooze is not a retry: retry_on does not matter

    def handle(self, payload: Any) -> Any:
        key = payload.get("key", "snooze")
        runs = Execution.objects.filter(key=key).count()
        Execution.objects.create(key=key)
        if runs < payload.get("times", 1):
            raise Snooze(payload.get("seconds", 30))
        return runs


class AtomicSnoozer(WorkItemHandler):
    name = "cs_atomic_snooze"
    atomic = True

    def handle(self, payload: Any) -> Any:
        Execution.objects.create(key="atomic-snooze")
        raise Snooze(timedelta(minutes=5))


@pytest.fixture(autouse=True)
def _reset() -> Any:
    SEEN.clear()
    RELEASE.clear()
    yield
    RELEASE.set()


def row(pk: int) -> WorkItem:
    return WorkItem.objects.get(pk=pk)


# -- cancel: the verbs and the heartbeat --------------------------------------------


def test_cancel_of_a_pending_row_cancels_it_at_once() -> None:
    item = make_item()
    assert item.cancel() is True
    assert item.status == Status.CANCELLED
    assert item.finished_at is not None
    assert item.cancel_requested_at is None


def test_cancel_of_a_claimed_row_marks_it_and_leaves_it_claimed() -> None:
    make_item()
    (claimed,) = claim(handlers=["noop"])
    assert claimed.cancel() is True
    fresh = row(claimed.pk)
    assert fresh.status == Status.CLAIMED
    assert fresh.claim_token == claimed.claim_token
    assert fresh.cancel_requested_at is not None
    assert fresh.finished_at is None
    # The mark is the database's time: no later than its clock now.
    assert WorkItem.objects.filter(pk=claimed.pk, cancel_requested_at__lte=Now()).exists()
    # Asked twice: the first request stands, nothing changes.
    assert claimed.cancel() is False


def test_queryset_cancel_counts_cancelled_and_asked_rows() -> None:
    make_item()
    make_item()
    (running,) = claim(limit=1, handlers=["noop"])
    done = make_item(status=Status.SUCCEEDED)
    everything = WorkItem.objects.all()
    assert everything.cancel_pending() == 1
    assert everything.request_cancel() == 1
    assert everything.cancel() == 0  # nothing left to do
    assert row(done.pk).status == Status.SUCCEEDED
    assert row(running.pk).status == Status.CLAIMED
    assert WorkItem.objects.cancel_requested().get().pk == running.pk


def test_heartbeat_reports_cancel_requests_per_attempt() -> None:
    make_item()
    make_item()
    a, b = claim(handlers=["noop"])
    a.cancel()
    beat = transitions.beat({(a.pk, a.claim_token), (b.pk, b.claim_token)})
    assert beat.held == {(a.pk, a.claim_token), (b.pk, b.claim_token)}
    assert beat.cancel_requested == {(a.pk, a.claim_token)}
    # Another attempt of the row (an old token) is neither held nor asked.
    old = transitions.beat({(a.pk, uuid.uuid4())})
    assert old.held == set() and old.cancel_requested == set()
    # The plain heartbeat still answers the attempts held.
    assert transitions.heartbeat({(a.pk, a.claim_token)}) == {(a.pk, a.claim_token)}


# -- cancel: a running worker ---------------------------------------------------------


def test_only_the_cancelled_attempt_sees_its_request(background_worker) -> None:
    """Two attempts of one handler run in two threads of one instance: one is cancelled."""
    first = LoopUntilCancelled.enqueue({"key": "a", "raise": "error"})
    second = LoopUntilCancelled.enqueue({"key": "b", "raise": "error"})
    worker = background_worker(["cs_loop"], concurrency=2)
    assert _seen("a")["started"].wait(20) and _seen("b")["started"].wait(20)
    assert row(first.pk).cancel() is True
    assert _seen("a")["cancel"].wait(20), "the cancelled attempt never saw its request"
    wait_until(lambda: row(first.pk).status == Status.CANCELLED, what="a cancelled")
    assert row(second.pk).status == Status.CLAIMED
    RELEASE.set()
    wait_until(lambda: row(second.pk).status == Status.SUCCEEDED, what="b to succeed")
    assert SEEN["b"]["saw"] is False
    cancelled = row(first.pk)
    assert cancelled.attempts == 1
    assert cancelled.finished_at is not None
    assert cancelled.claim_token is None
    assert "cancelled by request" in cancelled.last_error
    assert "ValueError: stopped halfway" in cancelled.last_error
    wait_until(lambda: worker.outcomes[Outcome.CANCELLED] == 1, what="the ending settled")
    assert worker.outcomes[Outcome.RETRIED] == 0


def test_a_handler_that_raises_cancelled_after_the_request_ends_cancelled(
    background_worker,
) -> None:
    item = LoopUntilCancelled.enqueue({"key": "c", "raise": "cancelled"})
    background_worker(["cs_loop"])
    assert _seen("c")["started"].wait(20)
    row(item.pk).cancel()
    wait_until(lambda: row(item.pk).status == Status.CANCELLED, what="cancelled")
    assert "Cancelled: stopping as asked" in row(item.pk).last_error


def test_a_handler_that_returns_after_the_request_succeeds(background_worker) -> None:
    item = LoopUntilCancelled.enqueue({"key": "d"})
    background_worker(["cs_loop"])
    assert _seen("d")["started"].wait(20)
    row(item.pk).cancel()
    wait_until(lambda: row(item.pk).status == Status.SUCCEEDED, what="succeeded")
    assert row(item.pk).result == "finished anyway"


def test_a_timed_out_attempt_with_a_cancel_request_ends_cancelled(background_worker) -> None:
    """Not retried although attempts remain; the abandoned run's late success is fenced."""
    item = OverrunAfterCancel.enqueue({"key": "e"})
    worker = background_worker(["cs_overrun"])
    assert _seen("e")["started"].wait(20)
    row(item.pk).cancel()
    assert _seen("e")["cancel"].wait(20)
    wait_until(lambda: row(item.pk).status == Status.CANCELLED, what="cancelled by the timeout")
    cancelled = row(item.pk)
    assert "cancelled by request" in cancelled.last_error
    assert "TimeoutError" in cancelled.last_error
    RELEASE.set()
    wait_until(lambda: worker.outcomes[Outcome.CANCELLED] == 1, what="the ending settled")
    wait_until(lambda: "late_saw" in SEEN["e"], what="the abandoned run to end")
    # Its own thread kept its attempt: it still sees the request.
    assert SEEN["e"]["late_saw"] is True
    final = row(item.pk)
    assert final.status == Status.CANCELLED
    assert final.result is None
    assert final.attempts == 1


def test_a_late_outcome_of_a_cancelled_attempt_is_discarded() -> None:
    make_item(handler="cs_self_cancel")
    (item,) = claim(handlers=["cs_self_cancel"])
    token = item.claim_token
    assert token is not None
    WorkItem.objects.filter(pk=item.pk).request_cancel()
    assert (
        transitions.cancel_running(item, error="cancelled by request", error_class=CANCELLED)
        is True
    )
    assert row(item.pk).status == Status.CANCELLED
    # The same attempt's late success and failure: fenced, nothing changes.
    assert transitions.succeed([(item.pk, token, '"late"')]) == set()
    assert transitions.fail(item, error="late") is False
    assert transitions.retry_later(item, delay=0, error="late") is False
    assert transitions.snooze(item, delay=0) is False
    assert row(item.pk).status == Status.CANCELLED
    assert row(item.pk).result is None


def test_a_handler_may_cancel_itself_without_a_request() -> None:
    item = CancelsItself.enqueue({})
    assert run_until_empty(["cs_self_cancel"]) == {"cancelled": 1}
    cancelled = row(item.pk)
    assert cancelled.status == Status.CANCELLED
    assert cancelled.attempts == 1
    assert "Cancelled: nothing to do for this customer" in cancelled.last_error
    assert cancelled.cancel_requested_at is None


def test_a_failure_after_a_request_the_worker_has_not_heard_of_ends_cancelled() -> None:
    """The database decides: the retry's write does not put a cancel-requested row back."""
    item = CancelledFromInside.enqueue({})
    assert run_until_empty(["cs_cancel_then_fail"]) == {"cancelled": 1}
    cancelled = row(item.pk)
    assert cancelled.status == Status.CANCELLED
    assert "cancelled by request" in cancelled.last_error
    assert "ValueError: failed after the request" in cancelled.last_error


def test_retry_of_a_cancelled_row_clears_its_request() -> None:
    make_item()
    (claimed,) = claim(handlers=["noop"])
    claimed.cancel()
    assert transitions.cancel_running(claimed, error="cancelled by request", error_class=CANCELLED)
    assert row(claimed.pk).retry() is True
    again = row(claimed.pk)
    assert again.status == Status.PENDING
    assert again.cancel_requested_at is None


# -- snooze -----------------------------------------------------------------------------


def test_a_snooze_keeps_the_attempt_and_counts_the_snooze() -> None:
    item = Snoozer.enqueue({"times": 1, "seconds": 30})
    assert run_until_empty(["cs_snooze"]) == {"snoozed": 1}
    snoozed = row(item.pk)
    assert snoozed.status == Status.PENDING
    assert snoozed.attempts == 0
    assert snoozed.snoozes == 1
    assert snoozed.claim_token is None
    assert snoozed.last_error == ""
    assert not snoozed.error_history  # no entry: a snooze is not an error
    # Due about 30 s from now by the database's clock.
    due = WorkItem.objects.filter(pk=item.pk)
    assert due.filter(run_after__gt=Now() + timedelta(seconds=25)).exists()
    assert due.filter(run_after__lt=Now() + timedelta(seconds=35)).exists()
    # It runs again once due, and that run is its first attempt.
    make_due()
    assert run_until_empty(["cs_snooze"]) == {"succeeded": 1}
    done = row(item.pk)
    assert done.status == Status.SUCCEEDED
    assert done.attempts == 1
    assert done.snoozes == 1
    assert done.result == 1


def test_the_hundredth_snooze_snoozes_and_the_next_one_fails_the_row() -> None:
    item = Snoozer.enqueue({"times": 5, "seconds": 1})
    WorkItem.objects.filter(pk=item.pk).update(snoozes=99)
    assert run_until_empty(["cs_snooze"]) == {"snoozed": 1}
    assert row(item.pk).snoozes == 100
    assert row(item.pk).status == Status.PENDING
    make_due()
    assert run_until_empty(["cs_snooze"]) == {"failed": 1}
    failed = row(item.pk)
    assert failed.status == Status.FAILED
    assert failed.snoozes == 100
    assert failed.attempts == 1
    assert "snoozed more than 100 times" in failed.last_error
    assert "django_dbworker.errors.Snooze" in failed.last_error
    assert failed.finished_at is not None


def test_a_snooze_in_an_atomic_handler_rolls_back_its_writes() -> None:
    item = AtomicSnoozer.enqueue({})
    assert run_until_empty(["cs_atomic_snooze"]) == {"snoozed": 1}
    assert not Execution.objects.filter(key="atomic-snooze").exists()
    snoozed = row(item.pk)
    assert snoozed.status == Status.PENDING
    assert snoozed.snoozes == 1
    assert snoozed.attempts == 0
    assert WorkItem.objects.filter(pk=item.pk, run_after__gt=Now() + timedelta(minutes=4)).exists()


def test_the_snooze_write_leaves_a_cancel_requested_row_alone() -> None:
    """The recorder then writes ``cancelled`` (``failures.py``)."""
    make_item(handler="cs_snooze")
    (item,) = claim(handlers=["cs_snooze"])
    WorkItem.objects.filter(pk=item.pk).request_cancel()
    assert transitions.snooze(item, delay=10) is False  # the write leaves it alone
    assert row(item.pk).status == Status.CLAIMED


# -- visible: stats ---------------------------------------------------------------------


def test_stats_count_cancel_requests_and_snoozed_rows() -> None:
    from io import StringIO

    from django_dbworker.stats import flow_stats

    make_item()
    make_item()
    (running, idle) = claim(handlers=["noop"])
    running.cancel()
    make_item(snoozes=3)
    make_item(status=Status.SUCCEEDED, snoozes=2)  # finished: not counted
    assert flow_stats() == {"cancel_requested": 1, "snoozed": 1}
    out = StringIO()
    call_command("dbworker_stats", stdout=out)
    assert "Running items asked to cancel: 1; pending items that snoozed: 1." in out.getvalue()
    assert idle.cancel_requested_at is None


# -- visible: metrics --------------------------------------------------------------------


def test_metrics_count_cancelled_and_snoozed_attempts() -> None:
    from prometheus_client import CollectorRegistry

    from django_dbworker.metrics import WorkerMetrics
    from django_dbworker.worker.runtime import WorkerConfig

    reg = CollectorRegistry()
    CancelsItself.enqueue({})
    Snoozer.enqueue({"times": 1, "seconds": 60})
    worker = Worker(
        [registry["cs_self_cancel"], registry["cs_snooze"]],
        WorkerConfig(burst=True, inline=True, concurrency=1, batch_size=1),
        metrics=WorkerMetrics(reg),
    )
    worker.run()

    def count(name: str, status: str) -> float:
        labels = {"worker": name, "status": status}
        return reg.get_sample_value("worker_tasks_total", labels) or 0.0

    assert count("cs_self_cancel", "cancelled") == 1
    assert count("cs_snooze", "snoozed") == 1
    assert count("cs_snooze", "retried") == 0


# -- rows asked to stop that their worker gives back or loses ----------------------------


def test_a_released_row_asked_to_stop_ends_cancelled() -> None:
    make_item()
    make_item()
    asked, other = claim(handlers=["noop"])
    asked.cancel()
    assert transitions.release([asked, other]) == 2
    cancelled, released = row(asked.pk), row(other.pk)
    assert cancelled.status == Status.CANCELLED
    assert cancelled.finished_at is not None
    assert "cancelled by request" in cancelled.last_error
    assert (released.status, released.finished_at, released.attempts) == (
        Status.PENDING,
        None,
        0,
    )


def test_stale_recovery_cancels_a_row_asked_to_stop() -> None:
    from tests.factories import age_heartbeat

    make_item()
    make_item()
    asked, other = claim(handlers=["noop"])
    asked.cancel()
    for item in (asked, other):
        age_heartbeat(item, 120)
    result = transitions.recover_stale(stale_after=60)
    assert (result.requeued, result.failed, result.cancelled) == (1, 0, 1)
    assert result.by_handler == {"noop": 2}
    cancelled = row(asked.pk)
    assert cancelled.status == Status.CANCELLED
    assert "cancelled by request" in cancelled.last_error
    assert cancelled.claim_token is None
    assert row(other.pk).status == Status.PENDING


# -- the Django Tasks backend ------------------------------------------------------------


@dbtask(max_attempts=3)
def cs_gives_up(key: str) -> None:
    raise Cancelled(f"nothing to do for {key}")


@dbtask(max_attempts=1)
def cs_later(key: str) -> str:
    if not Execution.objects.filter(key=key).exists():
        Execution.objects.create(key=key)
        raise Snooze(60)
    return key


def test_tasks_that_cancel_or_snooze_read_as_django_expects() -> None:
    """A cancelled task reads FAILED (Django has no "cancelled") and finishes once;
    a snoozed one is still READY and has not finished."""
    from django_dbworker.tasks.compat import TaskResultStatus, task_finished

    sent: list[tuple[str, str]] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        sent.append((task_result.id, str(task_result.status)))

    task_finished.connect(receiver)
    try:
        cancelled = cs_gives_up.enqueue("k")
        snoozed = cs_later.enqueue("s")
        outcomes = run_until_empty([cancelled.task.module_path, snoozed.task.module_path])
    finally:
        task_finished.disconnect(receiver)
    assert outcomes == {"cancelled": 1, "snoozed": 1}
    cancelled.refresh()
    assert cancelled.status == TaskResultStatus.FAILED
    assert cancelled.errors[-1].exception_class_path == "django_dbworker.errors.Cancelled"
    snoozed.refresh()
    assert snoozed.status == TaskResultStatus.READY
    assert row(int(snoozed.id)).attempts == 0
    assert sent == [(cancelled.id, str(TaskResultStatus.FAILED))]


# -- cancel: one transaction, claimed rows locked in id order -------------------------


def _statements(action: Any) -> list[tuple[str, bool]]:
    """Each statement ``action()`` runs on the default alias, and whether in a transaction."""
    from django.db import connection

    seen: list[tuple[str, bool]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append((sql, connection.in_atomic_block))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        action()
    return seen


def test_item_cancel_runs_its_statements_in_one_transaction() -> None:
    """The pending and the claimed halves of ``item.cancel()`` share one transaction."""
    make_item()
    (claimed,) = claim(handlers=["noop"])
    changed: list[bool] = []
    statements = _statements(lambda: changed.append(claimed.cancel()))
    assert changed == [True]
    # The pending half reads the pending ids first (none here: no UPDATE of its own);
    # the claimed half asks the row. Every statement of both, in the one transaction.
    touching = [
        (sql, atomic)
        for sql, atomic in statements
        if sql.lstrip().upper().startswith(("UPDATE", "SELECT"))
        and "LIMIT 21" not in sql  # the item's refresh_from_db(), after the transaction
    ]
    assert any(sql.lstrip().upper().startswith("UPDATE") for sql, _ in touching), statements
    assert len(touching) >= 2 and all(atomic for _, atomic in touching), touching


def test_queryset_cancel_asks_claimed_rows_in_one_transaction_locked_in_id_order() -> None:
    """``QuerySet.cancel()``: one transaction; on MySQL the claimed rows it asks are locked
    first by primary key in ascending order, as the heartbeat locks them (no deadlock)."""
    from django.db import connection

    for _ in range(3):
        make_item()
    running = claim(limit=2, handlers=["noop"])
    statements = _statements(lambda: WorkItem.objects.all().cancel())
    writes = [
        (sql, atomic)
        for sql, atomic in statements
        if sql.lstrip().upper().startswith("UPDATE") or "FOR UPDATE" in sql.upper()
    ]
    assert writes and all(atomic for _, atomic in writes), statements
    if connection.vendor == "mysql":
        upper = [sql.upper() for sql, _ in writes]
        lock = next(i for i, sql in enumerate(upper) if "FOR UPDATE" in sql)
        ask = next(i for i, sql in enumerate(upper) if "SET `CANCEL_REQUESTED_AT`" in sql)
        assert lock < ask, writes
    assert {item.pk for item in WorkItem.objects.cancel_requested()} == {r.pk for r in running}
    assert WorkItem.objects.filter(status=Status.CANCELLED).count() == 1


# -- Django tasks: one error per attempt ---------------------------------------------


@dbtask(max_attempts=3)
def cs_fails_once(key: str) -> None:
    raise ValueError(f"first attempt of {key}")


def test_a_task_cancelled_by_its_attempt_shows_that_attempts_error_once() -> None:
    """An attempt that raised something else after a request ends ``cancelled`` with
    its own class in the history: its one error, no ``Cancelled`` marker added."""
    from django_dbworker.tasks.compat import TaskResultStatus

    result = cs_fails_once.enqueue("asked")
    (item,) = claim(handlers=[result.task.module_path])
    assert item.cancel() is True
    assert transitions.cancel_running(
        item, error="cancelled by request: ValueError: stopped", error_class="builtins.ValueError"
    )
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"]


@pytest.mark.usefixtures("slow_retries")
def test_a_task_cancelled_while_pending_after_a_failed_attempt_gets_the_marker() -> None:
    """The failed attempt's error, then the marker of the cancel (no attempt of its own)."""
    result = cs_fails_once.enqueue("retried")
    assert run_until_empty([result.task.module_path]) == {"retried": 1}
    assert WorkItem.objects.filter(pk=int(result.id)).cancel() == 1
    result.refresh()
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError", CANCELLED]


def test_cancel_check_outside_a_workers_attempt_is_always_false() -> None:
    check = LoopUntilCancelled().cancel_check
    assert check() is False


# -- a cancel request is never lost to stale recovery or a retry -------------------------


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


class SnoozeLong(WorkItemHandler):
    """Snoozes for ``payload["delay"]`` (a name below), every run."""

    name = "snooze_long"
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
    item = SnoozeLong.enqueue({"delay": delay})
    assert run_until_empty(["snooze_long"]) == {"snoozed": 1}
    snoozed = row(item.pk)
    assert (snoozed.status, snoozed.attempts, snoozed.snoozes) == (Status.PENDING, 0, 1)
    due = WorkItem.objects.filter(pk=item.pk)
    years = timedelta(days=10 * 365)
    assert due.filter(run_after__gt=Now() + years - timedelta(minutes=1)).exists()
    assert due.filter(run_after__lt=Now() + years + timedelta(minutes=1)).exists()
