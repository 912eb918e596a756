"""Fault paths where an attempt's outcome could go unrecorded, or be the wrong one.

More of what test_faults.py proves (every claimed attempt ends in exactly
one recorded outcome): error text that cannot be encoded, a dropped
connection in the writer's check of fenced rows, a result the database
refuses inside a test transaction or by its size, and SIGTERM while the
database is read-only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import OperationalError, connection

from django_dbworker import transitions
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import steal_claim, worker_config
from tests.testapp.models import Execution
from tests.testapp.workers import (
    Echo,
    HugeResult,
    NonAtomicLinger,
    NulResult,
    QuietSleep,
    SurrogateErrorNoRetry,
    SurrogateErrorTimed,
)


def start(names: list[str], **kwargs: Any) -> tuple[Worker, threading.Thread]:
    worker = Worker([registry[n] for n in names], worker_config(**kwargs))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def finish(worker: Worker, thread: threading.Thread, timeout: float) -> bool:
    """Join the worker thread; stop it (and report False) if it does not end in time."""
    thread.join(timeout)
    if not thread.is_alive():
        return True
    worker.stop(immediate=True)
    thread.join(10)
    return False


# -- error text that cannot be encoded ------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_error_message_with_a_lone_surrogate_is_recorded_under_a_timeout() -> None:
    # A message quoting a file name decoded with surrogateescape (os.listdir,
    # sys.argv) holds a lone surrogate. format_error must not raise on it; here it
    # does (clean_error_text -> cap_text encodes to UTF-8 outside the try), the
    # runner thread dies, and the pool thread reports "failed" without writing:
    # the row stays claimed with no owner until stale recovery re-runs it.
    item = SurrogateErrorTimed.enqueue({"key": "s"})
    worker, thread = start(["surrogate_error_timed"], burst=True)
    assert finish(worker, thread, 30), "the burst worker did not finish"
    row = WorkItem.objects.get(pk=item.pk)
    assert Execution.objects.filter(key="s").count() == 1
    # Expected: failed (max_attempts = 1) with the ValueError in last_error.
    assert row.status == Status.FAILED, (row.status, row.last_error)
    assert "ValueError" in row.last_error
    assert not worker.in_flight()


@pytest.mark.django_db(transaction=True)
def test_an_error_message_with_a_lone_surrogate_outside_retry_on_fails_at_once() -> None:
    # ValueError is not in retry_on = (ConnectionError,): one attempt, then failed.
    # Formatting raises UnicodeEncodeError; execute()'s last-resort handler then
    # formats that error, whose chained context holds the same surrogate, and
    # raises again out of execute(): the row stays claimed with no owner.
    item = SurrogateErrorNoRetry.enqueue({"key": "r"})
    worker, thread = start(["surrogate_error_no_retry"], burst=True)
    assert finish(worker, thread, 30), "the burst worker did not finish"
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED, (row.status, row.attempts, row.last_error)
    assert row.attempts == 1
    assert row.last_error.startswith("ValueError: cannot import report-"), row.last_error


@pytest.mark.django_db(transaction=True)
def test_run_until_empty_records_a_lone_surrogate_error_as_the_handlers_error() -> None:
    item = SurrogateErrorNoRetry.enqueue({"key": "u"})
    counts = run_until_empty(["surrogate_error_no_retry"])
    row = WorkItem.objects.get(pk=item.pk)
    assert counts == {"failed": 1}, (counts, row.status, row.last_error)
    assert row.status == Status.FAILED


# -- the writer's check of fenced rows -------------------------------------------------


@pytest.fixture
def flaky_fence_check() -> Iterator[list[int]]:
    """The writer's "already recorded?" SELECT hits one dropped connection."""
    original = transitions.already_succeeded
    calls: list[int] = []

    def once(attempts: Any, using: Any = None) -> Any:
        calls.append(len(attempts))
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return original(attempts, using)

    transitions.already_succeeded = once  # type: ignore[assignment]
    yield calls
    transitions.already_succeeded = original


@pytest.mark.django_db(transaction=True)
def test_a_connection_blip_in_the_fence_check_does_not_leak_the_attempt(
    flaky_fence_check: list[int],
) -> None:
    # Attempt 1 is recovered as stale while it runs; the same burst worker
    # re-claims the row (attempt 2). Attempt 1's late success is fenced out, so
    # the writer asks the database whether its own earlier try wrote it; that
    # SELECT is not retried (not under persist), a transient error there
    # settles every entry of the batch with the error, and the callback leaves
    # those attempts in flight for ever: the burst worker never exits.
    item = NonAtomicLinger.enqueue({"key": "l", "seconds": 1.0})
    worker, thread = start(["linger"], burst=True)
    wait_until(lambda: Execution.objects.filter(key="l", kind="start").count() == 1)
    steal_claim(item.pk)
    wait_until(lambda: Execution.objects.filter(key="l", kind="end").count() == 2, timeout=15)
    wait_until(lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED, timeout=5)
    # The check runs after the batch commit, which may be the one that recorded attempt 2.
    wait_until(lambda: bool(flaky_fence_check), what="the fenced success to reach the check")
    assert finish(worker, thread, 10), (
        f"burst worker never exited; still in flight: {[a.pk for a in worker.in_flight()]}"
    )


# -- run_until_empty inside a TestCase transaction (PostgreSQL) -------------------------


@pytest.mark.postgres_only
@pytest.mark.django_db
def test_run_until_empty_in_a_test_transaction_records_a_refused_result() -> None:
    # In a TestCase the outcome writes share the test's transaction; the refused
    # success UPDATE (NUL in jsonb) aborts it, so the fallback "failed" record
    # and every later query raise InFailedSqlTransaction: the refused result is
    # never recorded and run_until_empty raises.
    item = NulResult.enqueue({"key": "n"})
    counts = run_until_empty(["nul_result"])
    row = WorkItem.objects.get(pk=item.pk)
    assert counts == {"failed": 1}
    assert row.status == Status.FAILED
    assert row.last_error.startswith("result could not be stored: ")


# -- SIGTERM during a read-only window (PostgreSQL) -------------------------------------


def _admin_cursor_execute(sql: str) -> None:
    """Run ``sql`` on a connection of its own that ignores the read-only default."""
    import psycopg

    settings = connection.settings_dict
    conn = psycopg.connect(
        host=settings["HOST"],
        port=settings["PORT"],
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        dbname=settings["NAME"],
        autocommit=True,
    )
    try:
        conn.execute("SET default_transaction_read_only = off")
        conn.execute(sql)
        conn.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()


@pytest.fixture
def read_only_window() -> Iterator[Any]:
    def switch(on: bool) -> None:
        if on:
            _admin_cursor_execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            _admin_cursor_execute("ALTER SYSTEM RESET default_transaction_read_only")

    yield switch
    switch(False)
    time.sleep(0.2)  # let every backend read the reloaded configuration


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_sigterm_during_a_read_only_window_does_not_release_a_finished_job(
    read_only_window: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The handler returns while the server is read-only (a failover); its
    # success waits in the writer, which retries with a growing backoff.
    # SIGTERM: the drain used to wait for the writer only max(1, SHUTDOWN_TIMEOUT
    # left), then release every attempt still in flight, the finished one
    # included: it went back to pending and ran again.
    item = QuietSleep.enqueue({"key": "ro", "seconds": 0.5})
    worker, thread = start(["quiet_sleep"], shutdown_timeout=0.5)
    wait_until(lambda: Execution.objects.filter(key="ro", kind="start").exists())
    read_only_window(True)
    wait_until(
        lambda: (
            "while recording successes (cannot execute UPDATE in a read-only "
            "transaction); retrying in 3.2s" in caplog.text
        ),
        timeout=20,
        what="the writer to back off",
    )
    worker.stop()  # SIGTERM
    # The handler is done: the drain waits for its outcome, not for the pool.
    wait_until(lambda: worker.pool is not None and worker.pool.busy() == 0)
    read_only_window(False)
    assert finish(worker, thread, 45), "the worker did not stop"
    row = WorkItem.objects.get(pk=item.pk)
    assert Execution.objects.filter(key="ro", kind="start").count() == 1
    # The handler returned, so the row is succeeded; it must not be handed
    # back as never run.
    assert row.status == Status.SUCCEEDED, (row.status, row.attempts, row.last_error)
    assert "Released" not in caplog.text


# -- a result the database refuses with a "program limit" error (PostgreSQL) -----------


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_result_too_large_for_jsonb_fails_that_item_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # PostgreSQL refuses a jsonb string over 256 MiB with SQLSTATE 54000
    # (program_limit_exceeded), which psycopg/Django raise as OperationalError.
    # db/errors.py is_transient() calls every OperationalError transient, so
    # the writer's persist() retries the same refused batch for ever (backoff
    # up to 10 s): the item is never recorded, nor is any other success queued
    # behind it, and the burst worker never exits.
    # Sending 256 MiB (twice: in the batch, then alone) takes seconds, a minute on a
    # loaded machine: the wait is long, and the fault (a retry) ends it at once.
    bad = HugeResult.enqueue({"key": "huge"})
    good = Echo.enqueue_many([{"n": n} for n in range(5)])
    worker, thread = start(["huge_result", "echo"], burst=True)
    wait_until(
        lambda: not thread.is_alive() or "while recording successes" in caplog.text,
        timeout=300,
        what="the burst worker to finish",
    )
    assert "while recording successes" not in caplog.text, "the refused write was retried"
    finished = finish(worker, thread, 0)
    row = WorkItem.objects.get(pk=bad.pk)
    assert finished, f"the burst worker did not finish; huge item is {row.status}"
    assert row.status == Status.FAILED
    assert row.last_error.startswith("result could not be stored: ")
    assert Execution.objects.filter(key="huge").count() == 1
    assert {r.status for r in WorkItem.objects.filter(pk__in=[g.pk for g in good])} == {
        Status.SUCCEEDED
    }
