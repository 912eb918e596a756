"""``run_until_empty`` and ``claim_next`` as users' tests meet them.

Written by the review of the issue 9 refactor (which must not change
behaviour): each test states the behaviour before it (06bc459) and failed
on the refactor before its fix. Handlers here are registered as ``r9_*``.
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

pytestmark = pytest.mark.django_db


class R9Noop(WorkItemHandler):
    name = "r9_noop"

    def handle(self, payload: Any) -> None:
        return None


class R9SwallowsDbError(WorkItemHandler):
    """Swallows a database error without a savepoint (a common test-suite mistake).

    On PostgreSQL the caller's transaction is then aborted: every later
    statement fails with "current transaction is aborted".
    """

    name = "r9_swallows_db_error"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        with connection.cursor() as cursor, suppress(DatabaseError):
            cursor.execute("SELECT 1/0")


class R9NulResult(WorkItemHandler):
    """Returns a result PostgreSQL's jsonb refuses (\\u0000)."""

    name = "r9_nul_result"
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
    """Before: a claim that fails raised out of run_until_empty at once.

    After: the inline Worker's claim loop logs it, closes the caller's
    connection (close_quietly) and retries with backoff forever: a test
    hangs instead of failing.
    """
    R9Noop.enqueue(None)
    ops_class = type(operations())

    def broken_claim(self: Any, **kwargs: Any) -> Any:
        raise DatabaseError("claim refused (injected)")

    monkeypatch.setattr(ops_class, "claim", broken_claim)
    with deadline(5), pytest.raises(DatabaseError, match="injected"):
        run_until_empty(handlers=[R9Noop])


@pytest.mark.postgres_only
def test_run_until_empty_in_an_aborted_transaction_raises_instead_of_hanging() -> None:
    """Before: the next claim failed with "current transaction is aborted" and raised.

    After: the claim loop swallows that error, closes the test's connection
    and retries forever (backoff up to 10 s).
    """
    R9SwallowsDbError.enqueue(None)
    with deadline(8), pytest.raises(DatabaseError):
        run_until_empty(handlers=[R9SwallowsDbError])


# -- run_until_empty: a result the database refuses ---------------------------------


@pytest.mark.postgres_only
def test_run_until_empty_refused_result_is_failed() -> None:
    item = R9NulResult.enqueue(None)
    assert run_until_empty(handlers=[R9NulResult]) == {"failed": 1}
    item.refresh_from_db()
    assert item.status == Status.FAILED
    assert item.attempts == 1


@pytest.mark.postgres_only
def test_run_until_empty_refused_result_span_says_failed() -> None:
    """Before: the process span of an attempt whose result was refused said "failed".

    After: run_until_empty hands the success to the (inline) writer, execute()
    returns DEFERRED and marks the span "succeeded" before the writer's
    refusal turns the attempt into "failed".
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
        R9NulResult.enqueue(None)
        assert run_until_empty(handlers=[R9NulResult]) == {"failed": 1}
    finally:
        tracing.use_tracer_provider(None)
    (span,) = [s for s in memory.get_finished_spans() if s.name.startswith("process")]
    assert span.attributes["dbworker.outcome"] == "failed"
    assert WorkItem.objects.get().status == Status.FAILED


# -- run_until_empty: what it runs ----------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_run_until_empty_refuses_own_table_handlers() -> None:
    """Before: a name of an own-table Handler[T] claimed no WorkItem: {} and nothing ran.

    The refactored worker started its HandlerLoop thread, outside the caller's
    transaction. Now the name is refused with a clear error, and nothing runs.
    """
    from tests.testapp.models import Invoice

    invoice = Invoice.objects.create()
    with pytest.raises(ValueError, match="own-table Handler"):
        run_until_empty(handlers=["invoice-mailer"])
    invoice.refresh_from_db()
    assert invoice.status == "pending"


def test_run_until_empty_refuses_an_invalid_queue_name() -> None:
    """Before: a queue name no row can have ran nothing, silently; now a clear error."""
    R9Noop.enqueue(None)
    with pytest.raises(ValueError, match="queue"):
        run_until_empty(handlers=[R9Noop], queues=["no such queue"])
    assert WorkItem.objects.get().status == Status.PENDING


def test_run_until_empty_max_items_raises_only_when_work_remains() -> None:
    """Before: running exactly ``max_items`` items raised even when nothing remained."""
    R9Noop.enqueue_many([None, None])
    assert run_until_empty(handlers=[R9Noop], max_items=2) == {"succeeded": 2}
    R9Noop.enqueue_many([None, None, None])
    with pytest.raises(RuntimeError, match="ran 2 items and work remains"):
        run_until_empty(handlers=[R9Noop], max_items=2)


# -- claim_next: own tables on any Django database ----------------------------------


def test_claim_next_works_on_a_database_dbworker_does_not_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: claim_next asked Django's ``features.has_select_for_update_skip_locked``,
    so an own table on any backend (MySQL, Oracle, ...) could be claimed.

    After: claiming.py asks ``operations(db).supports_skip_locked``, and
    ``operations`` raises UnsupportedDatabase for every vendor but
    PostgreSQL and SQLite. (The vendor name is faked here; the connection
    and its features are the real ones.)
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
    """Before: run_until_empty read none of the worker's tuning settings.

    After: it builds a WorkerConfig, whose defaults come from DBWORKER and
    whose __post_init__ validates them; a value the system checks would
    flag (they do not run under pytest) now makes run_until_empty raise
    InvalidValue. Here CONCURRENCY = 0 (e.g. "no background workers in tests").
    """
    from django.test import override_settings

    R9Noop.enqueue(None)
    with override_settings(DBWORKER={"CONCURRENCY": 0}):
        assert run_until_empty(handlers=[R9Noop]) == {"succeeded": 1}
