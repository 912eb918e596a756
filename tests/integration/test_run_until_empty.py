"""``run_until_empty`` and ``claim_next`` as users' tests meet them.

Each test says what the worker's burst run does for a user's test: it goes on
after a failed claim or a handler that broke its connection, records a refused
result as a failure (in the span too), refuses unknown names and queues, and
recovers and runs the rows a dead worker left; with ``include_scheduled`` it runs
retries, snoozes and later ``run_after`` rows as if their time had come, in that
order, stopping at ``max_items``.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from django.db import DatabaseError, connection
from django.db.models.functions import Now
from django.utils import timezone

from django_dbworker import Snooze, WorkItemHandler
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from tests.factories import age_heartbeat, claim, make_item

pytestmark = pytest.mark.django_db


class BurstNoop(WorkItemHandler):
    name = "burst_noop"

    def handle(self, payload: Any) -> None:
        return None


class SwallowsDbError(WorkItemHandler):
    """Swallows a database error without a savepoint (a common test-suite mistake).

    On PostgreSQL the caller's transaction is then aborted: every later
    statement fails with "current transaction is aborted".
    """

    name = "burst_swallows_db_error"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        with connection.cursor() as cursor, suppress(DatabaseError):
            cursor.execute("SELECT 1/0")


class NulResult(WorkItemHandler):
    """Returns a result PostgreSQL's jsonb refuses (\\u0000)."""

    name = "burst_nul_result"
    max_attempts = 3

    def handle(self, payload: Any) -> str:
        return "a\x00b"


class _Hung(Exception):
    pass


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise ``_Hung`` in this thread after ``seconds`` (run_until_empty runs here)."""

    def fire(signum: int, frame: Any) -> None:
        raise _Hung(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- run_until_empty: errors from claiming ------------------------------------------


def test_run_until_empty_raises_a_claim_error_instead_of_retrying_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claim that fails raises out of run_until_empty at once: a test fails, it does not
    hang in the claim loop's retries with backoff.
    """
    BurstNoop.enqueue(None)
    ops_class = type(operations())

    def broken_claim(self: Any, **kwargs: Any) -> Any:
        raise DatabaseError("claim refused (injected)")

    monkeypatch.setattr(ops_class, "claim", broken_claim)
    with deadline(5), pytest.raises(DatabaseError, match="injected"):
        run_until_empty(handlers=[BurstNoop])


@pytest.mark.postgres_only
def test_run_until_empty_in_an_aborted_transaction_raises_instead_of_hanging() -> None:
    """A handler that swallowed a database error leaves the test's transaction aborted: the
    next claim's "current transaction is aborted" raises, not retried forever.
    """
    SwallowsDbError.enqueue(None)
    with deadline(8), pytest.raises(DatabaseError):
        run_until_empty(handlers=[SwallowsDbError])


# -- run_until_empty: a result the database refuses ---------------------------------


@pytest.mark.postgres_only
def test_run_until_empty_refused_result_is_failed() -> None:
    item = NulResult.enqueue(None)
    assert run_until_empty(handlers=[NulResult]) == {"failed": 1}
    item.refresh_from_db()
    assert item.status == Status.FAILED
    assert item.attempts == 1


@pytest.mark.postgres_only
def test_run_until_empty_refused_result_span_says_failed() -> None:
    """The process span of an attempt whose result the success writer refused says "failed",
    not the "succeeded" it had before the inline writer's refusal.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from django_dbworker import tracing

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use_tracer_provider(provider)
    try:
        NulResult.enqueue(None)
        assert run_until_empty(handlers=[NulResult]) == {"failed": 1}
    finally:
        tracing.use_tracer_provider(None)
    (span,) = [s for s in memory.get_finished_spans() if s.name.startswith("process")]
    assert span.attributes["dbworker.outcome"] == "failed"
    assert WorkItem.objects.get().status == Status.FAILED


# -- run_until_empty: what it runs ----------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_run_until_empty_refuses_own_table_handlers() -> None:
    """A name of an own-table ``Handler[T]`` is refused with a clear error, and nothing runs
    (its HandlerLoop thread would run outside the caller's transaction).
    """
    from tests.testapp.models import Invoice

    invoice = Invoice.objects.create()
    with pytest.raises(ValueError, match="own-table Handler"):
        run_until_empty(handlers=["invoice-mailer"])
    invoice.refresh_from_db()
    assert invoice.status == "pending"


def test_run_until_empty_refuses_an_invalid_queue_name() -> None:
    """A queue name no row can have is a clear error, not a silent run of nothing."""
    BurstNoop.enqueue(None)
    with pytest.raises(ValueError, match="queue"):
        run_until_empty(handlers=[BurstNoop], queues=["no such queue"])
    assert WorkItem.objects.get().status == Status.PENDING


def test_run_until_empty_max_items_raises_only_when_work_remains() -> None:
    """Running exactly ``max_items`` items raises only when work remains."""
    BurstNoop.enqueue_many([None, None])
    assert run_until_empty(handlers=[BurstNoop], max_items=2) == {"succeeded": 2}
    BurstNoop.enqueue_many([None, None, None])
    with pytest.raises(RuntimeError, match="ran 2 items and work remains"):
        run_until_empty(handlers=[BurstNoop], max_items=2)


class TwoAMinute(WorkItemHandler):
    name = "burst_two_a_minute"
    rate_limit = "2/m"

    def handle(self, payload: Any) -> None:
        return None


def test_max_items_does_not_count_rows_a_rate_limit_held_back() -> None:
    """Rows a rate limit holds back stay pending, as a worker leaves them (the docstring):
    with room for three runs, two run and the third waits for the window, without a
    RuntimeError that says three ran and blames a handler that retries forever."""
    TwoAMinute.enqueue_many([1, 2, 3])
    assert run_until_empty(handlers=[TwoAMinute], max_items=3) == {"succeeded": 2}
    assert WorkItem.objects.filter(status=Status.PENDING).count() == 1


# -- claim_next: own tables on any Django database ----------------------------------


def test_claim_next_works_on_a_database_dbworker_does_not_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """claim_next asks Django's ``features.has_select_for_update_skip_locked``, not
    django-dbworker's vendor operations: an own table on any backend that skips locked rows
    can be claimed. (The vendor name is faked here; the connection and its features are
    the real ones.)
    """
    from django.db import connections

    from django_dbworker import claim_next
    from tests.testapp.models import Invoice

    invoice = Invoice.objects.create()
    monkeypatch.setattr(connections["default"], "vendor", "mysql")
    claimed = claim_next(Invoice.objects.filter(status="pending").order_by("id"), status="sending")
    assert claimed is not None and claimed.pk == invoice.pk


# -- run_until_empty and worker tuning settings -------------------------------------


def test_run_until_empty_does_not_depend_on_worker_tuning_settings() -> None:
    """run_until_empty reads none of the worker's tuning settings: a value the system checks
    would flag (they do not run under pytest), here CONCURRENCY = 0 ("no background workers
    in tests"), does not make it raise.
    """
    from django.test import override_settings

    BurstNoop.enqueue(None)
    with override_settings(DBWORKER={"CONCURRENCY": 0}):
        assert run_until_empty(handlers=[BurstNoop]) == {"succeeded": 1}


# -- rows a dead worker left are recovered and run ---------------------------------------


@pytest.mark.django_db(transaction=True)
def test_run_until_empty_recovers_and_runs_a_dead_workers_row() -> None:
    make_item()
    [item] = claim(limit=1, handlers=["noop"], worker="dead:1:main")
    age_heartbeat(item, 3600)
    counts = run_until_empty(["noop"])
    assert WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED, counts


# -- run_until_empty(include_scheduled=True): retries, snoozes and run_after --------


class AlwaysFails(WorkItemHandler):
    name = "burst_always_fails"
    max_attempts = 3
    calls: ClassVar[list[int]] = []

    def handle(self, payload: Any) -> None:
        self.calls.append(payload)
        raise ConnectionError(f"down, call {len(self.calls)}")


class SnoozesTwice(WorkItemHandler):
    name = "burst_snoozes_twice"
    calls: ClassVar[list[int]] = []

    def handle(self, payload: Any) -> str:
        self.calls.append(payload)
        if len(self.calls) <= 2:
            raise Snooze(3600)
        return "done"


class SnoozesForever(WorkItemHandler):
    name = "burst_snoozes_forever"

    def handle(self, payload: Any) -> None:
        raise Snooze(60)


class Records(WorkItemHandler):
    name = "burst_records"
    calls: ClassVar[list[Any]] = []

    def handle(self, payload: Any) -> None:
        self.calls.append(payload)


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    for handler in (AlwaysFails, SnoozesTwice, Records):
        handler.calls.clear()


@pytest.mark.usefixtures("slow_retries")
def test_run_until_empty_by_default_leaves_a_future_retry_pending() -> None:
    item = AlwaysFails.enqueue(1)
    assert run_until_empty(handlers=[AlwaysFails]) == {"retried": 1}
    item.refresh_from_db()
    assert (item.status, item.attempts) == (Status.PENDING, 1)
    assert WorkItem.objects.filter(pk=item.pk, run_after__gt=Now()).exists()


@pytest.mark.usefixtures("slow_retries")
def test_include_scheduled_runs_a_failing_handler_through_every_attempt_to_failed() -> None:
    item = AlwaysFails.enqueue(1)
    counts = run_until_empty(handlers=[AlwaysFails], include_scheduled=True)
    assert counts == {"retried": 2, "failed": 1}
    item.refresh_from_db()
    assert (item.status, item.attempts, AlwaysFails.calls) == (Status.FAILED, 3, [1, 1, 1])
    assert "down, call 3" in item.last_error


def test_include_scheduled_runs_a_snoozing_handler_to_its_end() -> None:
    item = SnoozesTwice.enqueue(1)
    counts = run_until_empty(handlers=[SnoozesTwice], include_scheduled=True)
    assert counts == {"snoozed": 2, "succeeded": 1}
    item.refresh_from_db()
    assert (item.status, item.snoozes, item.attempts) == (Status.SUCCEEDED, 2, 1)
    assert item.result == "done"


def test_include_scheduled_stops_a_handler_that_snoozes_forever_at_max_items() -> None:
    item = SnoozesForever.enqueue(None)
    with pytest.raises(
        RuntimeError, match="ran 5 items and work remains: 1 pending 'burst_snoozes_forever'"
    ):
        run_until_empty(handlers=[SnoozesForever], max_items=5, include_scheduled=True)
    item.refresh_from_db()
    assert (item.status, item.snoozes) == (Status.PENDING, 5)


def test_include_scheduled_runs_later_rows_in_the_order_of_their_times() -> None:
    """Rows made due in the order their times come (not all at once, then by id)."""
    now = timezone.now()
    Records.enqueue("in two hours", run_after=now + timedelta(hours=2))
    Records.enqueue("in one hour", run_after=now + timedelta(hours=1))
    Records.enqueue("now")
    assert run_until_empty(handlers=[Records], include_scheduled=True) == {"succeeded": 3}
    assert Records.calls == ["now", "in one hour", "in two hours"]


class SnoozesAnHourOnce(WorkItemHandler):
    """Logs its run in ``Records.calls`` (one log for both handlers), snoozes an hour the
    first time."""

    name = "burst_snoozes_an_hour_once"

    def handle(self, payload: Any) -> None:
        Records.calls.append(payload)
        if Records.calls.count(payload) == 1:
            raise Snooze(3600)


def test_include_scheduled_runs_a_snoozed_row_when_its_snooze_would_end() -> None:
    """ "In the order their times would come": a row due in 1 h that snoozes an hour comes
    back at 2 h, after a row due at 1 h 30; the snooze is not cut short to run first."""
    now = timezone.now()
    SnoozesAnHourOnce.enqueue("snoozer", run_after=now + timedelta(hours=1))
    Records.enqueue("at 1h30", run_after=now + timedelta(hours=1, minutes=30))
    counts = run_until_empty(handlers=[SnoozesAnHourOnce, Records], include_scheduled=True)
    assert counts == {"snoozed": 1, "succeeded": 2}
    assert Records.calls == ["snoozer", "at 1h30", "snoozer"]


@pytest.mark.usefixtures("slow_retries")
def test_include_scheduled_runs_a_child_only_after_its_parent_succeeds() -> None:
    """A child (``after=``) of a parent that is retried runs once its parent succeeded."""
    parent = SnoozesTwice.enqueue(1)
    child = Records.enqueue("child", after=[parent])
    counts = run_until_empty(handlers=[SnoozesTwice, Records], include_scheduled=True)
    assert counts == {"snoozed": 2, "succeeded": 2}
    child.refresh_from_db()
    assert child.status == Status.SUCCEEDED
    assert Records.calls == ["child"]


def test_include_scheduled_leaves_a_paused_queues_rows_as_they_are() -> None:
    """A paused queue's scheduled row stays pending, its ``run_after`` unchanged; the
    other queues' rows run."""
    from django_dbworker.flow.queues import pause_queue

    later = timezone.now() + timedelta(hours=1)
    held = Records.enqueue("paused", queue="held", run_after=later)
    Records.enqueue("running", run_after=later)
    pause_queue("held")
    assert run_until_empty(handlers=[Records], include_scheduled=True) == {"succeeded": 1}
    before = held.run_after
    held.refresh_from_db()
    assert (held.status, held.run_after, Records.calls) == (Status.PENDING, before, ["running"])


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"max_items": 0}, "max_items"),
        ({"max_items": "10"}, "max_items"),
        ({"include_scheduled": "yes"}, "include_scheduled"),
    ],
)
def test_run_until_empty_refuses_bad_options(options: dict[str, Any], error: str) -> None:
    Records.enqueue(None)
    with pytest.raises((TypeError, ValueError), match=error):
        run_until_empty(handlers=[Records], **options)
    assert WorkItem.objects.get().status == Status.PENDING


def test_run_until_empty_writes_no_register_row() -> None:
    """Inline, in the caller's transaction, there is no process to show on the Workers page."""
    from django_dbworker.fleet.models import LiveWorker

    item = make_item(handler="burst_noop")
    run_until_empty(["burst_noop"])
    assert WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED
    assert not LiveWorker.objects.exists()


def test_an_async_handler_runs_to_its_end_inline() -> None:
    """``run_until_empty`` runs an ``async def handle`` in the caller's thread (no event
    loop of the worker's), to its end, its result stored as a sync handler's is."""
    from tests.testapp.workers import AsyncSleep

    item = AsyncSleep.enqueue({"key": "inline", "seconds": 0})
    run_until_empty()
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.SUCCEEDED and row.result == {"slept": 0}
