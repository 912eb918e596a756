"""``run_until_empty`` and ``claim_next`` as users' tests meet them.

Each test says what the worker's burst run does for a user's test: it goes on
after a failed claim or a handler that broke its connection, records a refused
result as a failure (in the span too), refuses unknown names and queues, and
recovers and runs the rows a dead worker left.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest
from django.db import DatabaseError, connection

from django_dbworker import WorkItemHandler
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
