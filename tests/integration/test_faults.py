"""Fault paths: every claimed attempt ends in exactly one recorded outcome.

Each test here reproduces one way an attempt used to end without an owner
("Every claimed attempt ends in exactly one recorded outcome"): a
superseded attempt forgetting the newer one, writes the database refuses,
failures that cannot be formatted, a heartbeat thread that dies, secrets in
error texts, abandoned threads without a bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from django_dbworker import errortext, tracing
from django_dbworker.fleet.models import LiveWorker
from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from django_dbworker.worker.identity import process_id
from tests.conftest import kill_other_connections, wait_until
from tests.factories import worker_config
from tests.testapp.models import Execution
from tests.testapp.workers import (
    Echo,
    LongError,
    NulError,
    NulResult,
    OverrunOnce,
    Record,
    SecretSlowFail,
    Sleep,
    Slow,
    Unprintable,
)

pytestmark = pytest.mark.django_db(transaction=True)


def run_burst(names: list[str], timeout: float = 30.0, **kwargs: Any) -> Worker:
    """Run a burst worker; fail (instead of hanging) if it does not finish."""
    worker = Worker([registry[n] for n in names], worker_config(burst=True, **kwargs))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        worker.stop(immediate=True)
        thread.join(10)
        pytest.fail(f"the burst worker did not finish within {timeout}s")
    return worker


def run_until_finished(names: list[str], timeout: float = 30.0, **kwargs: Any) -> None:
    """Burst runs until no row is pending or claimed (retries come back after a backoff)."""
    live = (Status.PENDING, Status.CLAIMED)
    wait_until(
        lambda: (
            run_burst(names, timeout=timeout, **kwargs)
            and not WorkItem.objects.filter(status__in=live).exists()
        ),
        timeout=timeout,
        interval=0.05,
        what="every item to finish",
    )


# -- fault 1: attempt identity --------------------------------------------------------


def test_a_superseded_attempts_late_ending_leaves_the_newer_attempt_alone(
    background_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    # Attempt 1 overruns the 3 s timeout (which is longer than STALE_AFTER)
    # and returns at 3.5 s, while attempt 2 (claimed again by this same
    # worker) still runs for 2.5 s: it must stay heartbeated and owned.
    item = OverrunOnce.enqueue({"key": "o", "durations": [3.5, 2.5]})
    background_worker(["overrun_once"], stale_after=1.0)
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED,
        timeout=20,
        what="the retry to succeed",
    )
    row = WorkItem.objects.get(pk=item.pk)
    assert row.attempts == 2, row.last_error
    assert row.result == 2
    assert Execution.objects.filter(key="o", kind="start").count() == 2
    assert "Recovered as stale" not in caplog.text


# -- fault 2: a success the database refuses ----------------------------------------------


@pytest.mark.postgres_only
def test_a_result_the_database_refuses_fails_that_item_alone() -> None:
    bad = NulResult.enqueue({"key": "bad"})
    good = Echo.enqueue_many([{"n": n} for n in range(10)])
    worker = run_burst(["nul_result", "echo"])
    row = WorkItem.objects.get(pk=bad.pk)
    assert row.status == Status.FAILED
    assert row.last_error.startswith("result could not be stored: "), row.last_error
    assert row.attempts == 1  # not retried: the same result would be refused again
    assert Execution.objects.filter(key="bad").count() == 1
    assert {r.status for r in WorkItem.objects.filter(pk__in=[g.pk for g in good])} == {
        Status.SUCCEEDED
    }
    assert not worker.in_flight()


# -- fault 3: failures that cannot be recorded as they are --------------------------------


def test_an_exception_whose_str_raises_is_recorded() -> None:
    item = Unprintable.enqueue({"key": "u"})
    run_until_finished(["unprintable"])
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED
    assert row.attempts == 2
    assert "UnprintableError" in row.last_error


@pytest.mark.parametrize("name", ["raising_backoff", "infinite_backoff", "nan_backoff"])
def test_a_backoff_that_raises_or_is_not_finite_still_retries(name: str) -> None:
    item = registry[name].enqueue({"key": name})  # type: ignore[attr-defined]
    run_until_finished([name], timeout=60)
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED, row.last_error
    assert row.attempts == 2
    assert Execution.objects.filter(key=name).count() == 2
    assert "ConnectionError: retry me" in row.last_error


def test_a_nul_character_in_the_error_text_is_recorded() -> None:
    item = NulError.enqueue({"key": "n"})
    run_burst(["nul_error"])
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED
    assert "ValueError: bad \\x00 byte" in row.last_error


@pytest.fixture
def sdk_tracing() -> Iterator[None]:
    tracing.use_tracer_provider(TracerProvider())
    yield
    tracing.use_tracer_provider(None)


@pytest.mark.parametrize("context", [["not", "a", "dict"], {"traceparent": 5}, "text"])
def test_a_malformed_trace_context_does_not_strand_the_row(sdk_tracing: None, context: Any) -> None:
    item = Record.enqueue({"key": "t"})
    WorkItem.objects.filter(pk=item.pk).update(trace_context=context)
    run_burst(["record"])
    assert WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED
    assert Execution.objects.filter(key="t").count() == 1


def test_run_until_empty_records_failures_it_cannot_format() -> None:
    item = Unprintable.enqueue({"key": "r"})
    counts = run_until_empty(["unprintable"])
    assert WorkItem.objects.get(pk=item.pk).status in (Status.PENDING, Status.FAILED)
    assert sum(counts.values()) >= 1


# -- fault 4: the heartbeat cannot die -------------------------------------------------------


@pytest.fixture
def refuse_heartbeats() -> Iterator[Callable[[bool], None]]:
    """A trigger that makes heartbeat UPDATEs raise a non-transient error (P0001)."""
    table = WorkItem._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE dbw_refuse (on_ boolean NOT NULL)")
        cursor.execute("INSERT INTO dbw_refuse VALUES (false)")
        cursor.execute(
            "CREATE FUNCTION dbw_refuse_heartbeat() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN IF (SELECT on_ FROM dbw_refuse) THEN "
            "RAISE EXCEPTION 'heartbeats refused by the test'; END IF; RETURN NEW; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER dbw_refuse BEFORE UPDATE ON {table} FOR EACH ROW "
            "WHEN (OLD.status = 'claimed' AND NEW.status = 'claimed') "
            "EXECUTE FUNCTION dbw_refuse_heartbeat()"
        )

    def switch(on: bool) -> None:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE dbw_refuse SET on_ = %s", [on])

    yield switch
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TRIGGER IF EXISTS dbw_refuse ON {table}")
        cursor.execute("DROP FUNCTION IF EXISTS dbw_refuse_heartbeat()")
        cursor.execute("DROP TABLE IF EXISTS dbw_refuse")


@pytest.mark.postgres_only
def test_the_heartbeat_survives_errors_that_are_not_connection_errors(
    background_worker: Callable[..., Worker],
    refuse_heartbeats: Callable[[bool], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    refuse_heartbeats(True)
    item = OverrunOnce.enqueue({"key": "h", "durations": [2.8]})
    worker = background_worker(["overrun_once"], stale_after=1.5, heartbeat_interval=0.1)
    wait_until(lambda: "heartbeats refused by the test" in caplog.text, what="a refused beat")
    refuse_heartbeats(False)
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED,
        timeout=20,
        what="the long item to succeed",
    )
    row = WorkItem.objects.get(pk=item.pk)
    assert row.attempts == 1, row.last_error
    assert worker.unhealthy is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_heartbeat_thread_stops_the_worker(caplog: pytest.LogCaptureFixture) -> None:
    from django_dbworker.worker import heartbeat

    Record.enqueue({"key": "w"})
    worker = Worker([Record], worker_config(heartbeat_interval=0.05))
    original = heartbeat.Heartbeat.beat

    def die(self: heartbeat.Heartbeat) -> None:
        raise SystemExit("the heartbeat thread dies")

    heartbeat.Heartbeat.beat = die  # type: ignore[method-assign]
    try:
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        thread.join(20)
    finally:
        heartbeat.Heartbeat.beat = original  # type: ignore[method-assign]
    assert not thread.is_alive(), "the worker kept running without heartbeats"
    assert worker.unhealthy is not None and "heartbeat" in worker.unhealthy
    assert "heartbeat" in caplog.text.lower()


REGISTER_FAILED = "Could not write this worker's row of the Workers page"


@pytest.mark.server_db
def test_a_register_row_locked_by_another_connection_holds_up_no_item_heartbeat(
    background_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    """The register write waits for a lock only briefly (a second at most), fails, is
    said once and retried quietly: the items' heartbeats go on, for longer than
    STALE_AFTER, and the row is written again once the lock is gone."""
    caplog.set_level(logging.INFO, logger="django_dbworker")
    item = Sleep.enqueue({"key": "r", "seconds": 6.0})
    stale_after = 2.5
    background_worker(["sleep"], stale_after=stale_after, heartbeat_interval=0.2)
    register = LiveWorker.objects.filter(name=process_id())
    wait_until(register.exists, what="the worker's register row")
    wait_until(lambda: Execution.objects.filter(key="r", kind="start").exists())
    with transaction.atomic():
        held = register.select_for_update().get()  # until the block ends
        wait_until(lambda: REGISTER_FAILED in caplog.text, what="a register write to fail")
        # The item's heartbeat moves on while the register row stays as it was.
        wait_until(
            lambda: (
                WorkItem.objects.get(pk=item.pk).heartbeat_at
                > held.heartbeat_at + timedelta(seconds=stale_after + 0.5)
            ),
            timeout=15,
            what="the item's heartbeats to go on past STALE_AFTER",
        )
        assert WorkItem.objects.get(pk=item.pk).status == Status.CLAIMED
    # Written again (or, had a recovery pass deleted it as stale meanwhile, inserted again).
    wait_until(
        register.filter(heartbeat_at__gt=held.heartbeat_at).exists, what="the row written again"
    )
    wait_until(lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED, timeout=20)
    assert WorkItem.objects.get(pk=item.pk).attempts == 1
    assert caplog.text.count(REGISTER_FAILED) == 1
    assert "row of the Workers page is written again" in caplog.text
    assert "Recovered" not in caplog.text


def test_a_register_that_cannot_be_written_stops_no_item_heartbeat(
    background_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    """Its table gone (renamed away): every register write fails, is said once, and the
    item outlives STALE_AFTER on its heartbeats; the row is back with the table."""
    caplog.set_level(logging.INFO, logger="django_dbworker")
    table = LiveWorker._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        item = Sleep.enqueue({"key": "m", "seconds": 2.5})
        background_worker(["sleep"], stale_after=1.0, heartbeat_interval=0.1)
        wait_until(lambda: REGISTER_FAILED in caplog.text, what="a register write to fail")
        wait_until(
            lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED,
            timeout=20,
            what="the item to succeed",
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
    assert WorkItem.objects.get(pk=item.pk).attempts == 1
    assert "Recovered" not in caplog.text
    wait_until(LiveWorker.objects.filter(name=process_id()).exists, what="the row, back")
    assert caplog.text.count(REGISTER_FAILED) == 1
    assert "row of the Workers page is written again" in caplog.text


# -- fault 5: sensitive stays sensitive ---------------------------------------------------


def test_a_sensitive_handlers_error_keeps_type_and_frames_not_the_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="django_dbworker")
    item = SecretSlowFail.enqueue({"password": "hunter2"})
    run_until_finished(["secret_retry"])
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED
    assert "hunter2" not in row.last_error
    assert row.last_error.startswith("KeyError: [redacted]")
    assert "ValueError: [redacted]" in row.last_error  # the chained cause, redacted too
    assert 'File "' in row.last_error and "in handle" in row.last_error
    assert "hunter2" not in caplog.text


# -- fault 6: abandoned threads -----------------------------------------------------------


def test_abandoned_threads_are_counted_and_capped(caplog: pytest.LogCaptureFixture) -> None:
    registry_ = CollectorRegistry()
    metrics = WorkerMetrics(registry_)
    # Runs long enough to be still abandoned (counted) when the worker has
    # stopped, however slowly a loaded machine drains it.
    Slow.enqueue_many([{"key": f"a{n}", "seconds": 5.0} for n in range(3)])
    # Two run at once; the first timeout reaches the cap of one: no third claim.
    worker = Worker([Slow], worker_config(concurrency=2, max_abandoned_threads=1), metrics=metrics)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the worker kept claiming past the cap"
    assert worker.unhealthy is not None and "abandoned" in worker.unhealthy
    # The second run overran too while the worker drained.
    assert registry_.get_sample_value("worker_abandoned_threads") == 2
    assert worker.abandoned.count == 2
    # The third item was never claimed: the worker stopped at the cap.
    assert WorkItem.objects.filter(status=Status.PENDING, attempts=0).count() == 1
    wait_until(
        lambda: registry_.get_sample_value("worker_abandoned_threads") == 0,
        timeout=10,
        what="the abandoned threads to end and be counted out",
    )


def test_late_outcomes_of_abandoned_threads_are_fenced_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.testapp.workers import SlowFail

    registry_ = CollectorRegistry()
    metrics = WorkerMetrics(registry_)
    item = SlowFail.enqueue({"key": "late", "seconds": 1.0})
    # Both attempts time out; a burst may end before the retry is due.
    while WorkItem.objects.get(pk=item.pk).status == Status.PENDING:
        Worker([SlowFail], worker_config(burst=True), metrics=metrics).run()
    assert WorkItem.objects.get(pk=item.pk).status == Status.FAILED
    wait_until(
        lambda: caplog.text.count("Discarded the outcome of work item") == 2,
        what="both late failures to be discarded",
    )
    # The abandoned thread logs, closes its connection, and only then counts.
    wait_until(
        lambda: registry_.get_sample_value("worker_fenced_total", {"worker": "slow_fail"}) == 2,
        what="both late failures to be counted",
    )


@pytest.mark.server_db
def test_a_connection_killed_while_idle_does_not_cost_the_next_job_an_attempt(
    background_worker: Callable[..., Worker],
) -> None:
    from django_dbworker.worker.connections import IDLE_CHECK_AFTER

    first = Record.enqueue({"key": "warm"})
    background_worker(["record"], concurrency=1)
    wait_until(lambda: WorkItem.objects.get(pk=first.pk).status == Status.SUCCEEDED)
    assert kill_other_connections() >= 1
    # The pool thread's connection is now dead and idle past the threshold.
    time.sleep(IDLE_CHECK_AFTER + 0.2)
    item = Record.enqueue({"key": "after"})
    wait_until(lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED, timeout=20)
    row = WorkItem.objects.get(pk=item.pk)
    assert row.attempts == 1, row.last_error


# -- fault 8: smaller ones ----------------------------------------------------------------


def test_last_error_is_capped_in_bytes() -> None:
    text = errortext.format_error(ValueError("é" * 20_000))
    assert len(text.encode("utf-8")) <= errortext.MAX_ERROR_BYTES
    assert text.startswith("ValueError: éé")


def test_the_failure_log_line_is_truncated(caplog: pytest.LogCaptureFixture) -> None:
    item = LongError.enqueue({"key": "long"})
    run_burst(["long_error"])
    assert WorkItem.objects.get(pk=item.pk).status == Status.FAILED
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("django_dbworker")]
    assert any("long_error" in line for line in lines)
    assert max(len(line) for line in lines) < 2_000


def test_no_lost_claim_warnings_for_rows_that_succeeded(caplog: pytest.LogCaptureFixture) -> None:
    Record.enqueue_many([{"key": f"q{n}"} for n in range(400)])
    run_burst(["record"], heartbeat_interval=0.001, timeout=60)
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 400
    assert "Lost the claim" not in caplog.text
