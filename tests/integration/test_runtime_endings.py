"""How an attempt's endings are settled: one hook call, one count, whatever the route.

A timed-out attempt's abandoned run may end after, or before, the thread that records
the timeout; an ending may be refused by the database; a hook may trace, log or read
the metrics; the watchers (task discovery, the orphan warning) must outlive a race and
a killed connection. Interleavings are forced with events that user code (a handler,
its ``backoff``, a log handler) waits on, never with sleeps that hope.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import worker_config

pytestmark = pytest.mark.django_db(transaction=True)

WORKER_LOG = logging.getLogger("django_dbworker.worker")


def start(names: list[str], **kwargs: Any) -> tuple[Worker, threading.Thread]:
    worker = Worker([registry[n] for n in names], worker_config(**kwargs))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def stop(worker: Worker, thread: threading.Thread) -> None:
    worker.stop(immediate=True)
    thread.join(15)
    assert not thread.is_alive(), "worker did not stop"


@pytest.fixture
def no_stray_threads() -> Iterator[None]:
    yield
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("dbworker")],
        timeout=30,
        what="worker threads to finish",
    )


# -- a timed-out attempt whose abandoned run records its failure first -----------------

LATE = {
    "timed_out": threading.Event(),
    "late_written": threading.Event(),
    "hooked": threading.Event(),
}
LATE_HOOKS: list[tuple[str | None, str | None]] = []


class LateFailureWins(WorkItemHandler):
    """Overruns its timeout, then fails for good (not retryable) in its abandoned run.

    ``backoff`` (called by the thread that records the timeout, before its
    write) holds that write back until the abandoned run's failure landed.
    """

    name = "late_failure_wins"
    timeout = 0.3
    max_attempts = 3
    retry_on = (KeyError,)

    def handle(self, payload: Any) -> None:
        LATE["timed_out"].wait(15)
        raise ValueError("late and final")

    def backoff(self, attempt: int) -> float:
        LATE["timed_out"].set()
        LATE["late_written"].wait(15)
        return 60.0

    def attempt_recorded(
        self, item: WorkItem, status: str | None, error: BaseException | None
    ) -> None:
        LATE_HOOKS.append((status, type(error).__name__ if error is not None else None))
        LATE["hooked"].set()


class _AfterLateWrite(logging.Handler):
    """In the abandoned run's thread: its failure is written (the log line follows the
    write); hold that thread until some attempt_recorded hook ran (or 5 s)."""

    def __init__(self, pk: int) -> None:
        super().__init__(logging.DEBUG)
        self.thread_name = f"dbworker-item-{pk}"

    def handle(self, record: logging.LogRecord) -> bool:
        # Not emit(): handle() would hold this handler's lock while waiting, and
        # block every other thread's log line (the fenced one) meanwhile.
        if threading.current_thread().name != self.thread_name:
            return False
        if record.msg.startswith("Work item %s (%s) failed on attempt"):
            LATE["late_written"].set()
            LATE["hooked"].wait(5)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        pass


def test_a_late_failure_that_landed_first_is_what_attempt_recorded_hears(
    no_stray_threads: None,
) -> None:
    """A timed-out attempt whose abandoned run writes ``failed`` before the timing-out thread
    writes the retry (which is then fenced): ``attempt_recorded`` hears ``failed``, the
    write that landed (a Tasks backend sends ``task_finished``), not ``(None, None)``.

    ``Ledger.settle_once`` gives the attempt's one hook call to the ending that is
    settled first; the late run's failure is settled as it is recorded, not only after
    its thread has returned (log lines, ``tidy``, ``tracker.finish``), so the fenced
    timeout cannot take the hook call first.
    """
    for event in LATE.values():
        event.clear()
    LATE_HOOKS.clear()
    item = LateFailureWins.enqueue({})
    held = _AfterLateWrite(item.pk)
    WORKER_LOG.addHandler(held)
    worker, thread = start(
        [LateFailureWins.name], concurrency=1, burst=True, max_abandoned_threads=10
    )
    try:
        thread.join(30)
        assert not thread.is_alive(), "burst worker did not finish"
    finally:
        WORKER_LOG.removeHandler(held)
        if thread.is_alive():
            stop(worker, thread)
    item.refresh_from_db()
    assert item.status == Status.FAILED  # the late run's failure landed
    assert "late and final" in item.last_error
    assert LATE_HOOKS == [(Status.FAILED, "ValueError")]


# -- where the hook of a failure runs ----------------------------------------------------

HOOK_SPANS: list[str | None] = []


class FailsWithHook(WorkItemHandler):
    name = "fails_with_hook"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        raise ValueError("no")

    def attempt_recorded(
        self, item: WorkItem, status: str | None, error: BaseException | None
    ) -> None:
        from opentelemetry import trace

        HOOK_SPANS.append(getattr(trace.get_current_span(), "name", None))


@pytest.fixture
def tracer_provider() -> Iterator[None]:
    from opentelemetry.sdk.trace import TracerProvider

    from django_dbworker import tracing

    tracing.use_tracer_provider(TracerProvider())
    yield
    tracing.use_tracer_provider(None)


def test_the_hook_of_a_recorded_failure_runs_inside_the_attempts_span(
    tracer_provider: None,
) -> None:
    """``attempt_recorded`` of a failure runs inside the attempt's ``process {queue}`` span,
    right after the failure is written: whatever a hook (a ``task_finished`` receiver)
    traces or logs is part of the job's span, as for a success.
    """
    from django_dbworker.testing import run_until_empty

    HOOK_SPANS.clear()
    FailsWithHook.enqueue({})
    assert run_until_empty(handlers=[FailsWithHook.name]) == {"failed": 1}
    assert HOOK_SPANS == ["process default"]


# -- the watchdog and the watchers -----------------------------------------------------


@pytest.mark.server_db
def test_the_orphan_watch_resumes_after_its_connection_is_killed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watcher (here the orphan warning) whose look fails with a ``DatabaseError`` closes its
    broken connection before it tries again, as the claim loop, heartbeat and pool threads
    do: with psycopg 3 every later look would fail with "the connection is closed".
    SPEC: the process "resumes when the database is back", task discovery and the orphan
    warning too.
    """
    from django_dbworker.worker.slow_checks import OrphanWatch
    from tests.conftest import kill_other_connections
    from tests.factories import make_item

    stopping = threading.Event()
    caplog.set_level(logging.WARNING, logger="django_dbworker")
    watch = OrphanWatch("default", interval=0.1)
    watch.attach(stopping=stopping, add_handlers=lambda classes: None)
    watch.start()
    try:
        make_item(handler="orphan-before")
        wait_until(lambda: "orphan-before" in caplog.text, what="the first warning")
        assert kill_other_connections() >= 1
        make_item(handler="orphan-after")
        wait_until(
            lambda: "orphan-after" in caplog.text,
            timeout=10,
            what="the orphan watch to warn again after its connection was killed",
        )
    finally:
        stopping.set()
        watch.join(5)


# -- a timed-out attempt whose abandoned run cannot record anything --------------------

REFUSE = {"timed_out": threading.Event()}
REFUSE_SEEN: dict[str, Any] = {}
REFUSE_HOOKS: list[tuple[str | None, str | None]] = []
TABLE = "django_dbworker_workitem"
REFUSED_TEXT = "late and refused"


class LateUnrecorded(WorkItemHandler):
    """Overruns its timeout; its abandoned run then fails in a way the database refuses.

    ``backoff`` (the timing-out thread, before it writes the retry) waits for
    the abandoned run's thread to end, then notes whether the attempt is
    still in flight (heartbeated) while its timeout is not written yet.
    """

    name = "late_unrecorded"
    timeout = 0.3
    max_attempts = 3
    retry_on = (KeyError,)

    def handle_item(self, item: WorkItem) -> None:
        REFUSE_SEEN["pk"] = item.pk
        REFUSE["timed_out"].wait(15)
        raise ValueError(REFUSED_TEXT)

    def backoff(self, attempt: int) -> float:
        REFUSE["timed_out"].set()
        name = f"dbworker-item-{REFUSE_SEEN['pk']}"
        for thread in threading.enumerate():
            if thread.name == name:
                thread.join(15)
        worker = REFUSE_SEEN["worker"]
        REFUSE_SEEN["in_flight"] = REFUSE_SEEN["pk"] in [i.pk for i in worker.in_flight()]
        return 60.0

    def attempt_recorded(
        self, item: WorkItem, status: str | None, error: BaseException | None
    ) -> None:
        REFUSE_HOOKS.append((status, type(error).__name__ if error is not None else None))


@pytest.fixture
def refuse_late_failures() -> Iterator[None]:
    """The database refuses to record the abandoned run's failure (and its plain fallback)."""
    from django.db import connection

    refused = (
        f"NEW.status = 'failed' AND (NEW.last_error LIKE '%{REFUSED_TEXT}%' "
        "OR NEW.last_error LIKE 'The outcome could not be recorded%')"
    )
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION refuse_late() RETURNS trigger AS $$ BEGIN "
                f"IF {refused} THEN RAISE EXCEPTION 'refused'; END IF; "
                "RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            cursor.execute(
                f"CREATE TRIGGER refuse_late BEFORE UPDATE ON {TABLE} "
                "FOR EACH ROW EXECUTE FUNCTION refuse_late()"
            )
        elif connection.vendor == "sqlite":
            cursor.execute(
                f"CREATE TRIGGER refuse_late BEFORE UPDATE ON {TABLE} "
                f"FOR EACH ROW WHEN {refused} BEGIN SELECT RAISE(ABORT, 'refused'); END"
            )
        else:  # MySQL/MariaDB: SIGNAL is error 1644, not a transient one
            cursor.execute(
                f"CREATE TRIGGER refuse_late BEFORE UPDATE ON {TABLE} FOR EACH ROW "
                f"IF {refused} THEN "
                "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused'; END IF"
            )
    yield
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"DROP TRIGGER IF EXISTS refuse_late ON {TABLE}")
            cursor.execute("DROP FUNCTION IF EXISTS refuse_late()")
        else:
            cursor.execute("DROP TRIGGER IF EXISTS refuse_late")


def test_an_abandoned_run_that_records_nothing_does_not_take_the_attempts_ending(
    refuse_late_failures: None, no_stray_threads: None
) -> None:
    """A timed-out attempt whose abandoned run then fails in a way the database refuses (the
    failure and its plain fallback) ends ``UNRECORDED``: that late ending neither retires
    the attempt nor takes its one settle. The row, still claimed by the attempt, stays
    heartbeated until its timeout is recorded, whose hook and count it is.
    """
    REFUSE["timed_out"].clear()
    REFUSE_SEEN.clear()
    REFUSE_HOOKS.clear()
    item = LateUnrecorded.enqueue({})
    worker = Worker(
        [LateUnrecorded], worker_config(concurrency=1, burst=True, max_abandoned_threads=10)
    )
    REFUSE_SEEN["worker"] = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        stop(worker, thread)
        pytest.fail("the burst worker did not finish")
    item.refresh_from_db()
    assert item.status == Status.PENDING  # the timeout's retry was recorded
    assert "TimeoutError" in item.last_error
    assert REFUSE_SEEN["in_flight"], "retired (no heartbeat) before its outcome was written"
    assert REFUSE_HOOKS == [(Status.PENDING, "TimeoutError")]
    assert dict(worker.outcomes) == {"timeout": 1}


GAUGE: dict[str, Any] = {}


class FailsAndReadsGauge(WorkItemHandler):
    name = "fails_reads_gauge"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        raise ValueError("no")

    def attempt_recorded(
        self, item: WorkItem, status: str | None, error: BaseException | None
    ) -> None:
        GAUGE["seen"] = GAUGE["registry"].get_sample_value(
            "worker_tasks_in_flight", {"worker": self.name}
        )


def test_the_hook_of_a_recorded_failure_runs_while_the_attempt_counts_in_flight(
    no_stray_threads: None,
) -> None:
    """A failure's ``attempt_recorded`` runs while ``worker_tasks_in_flight`` still counts the
    attempt: a slow ``task_finished`` receiver holds a pool thread, and the gauge says so.
    """
    from prometheus_client import CollectorRegistry

    from django_dbworker.metrics import WorkerMetrics

    reg = CollectorRegistry()
    GAUGE.clear()
    GAUGE["registry"] = reg
    FailsAndReadsGauge.enqueue({})
    worker = Worker(
        [FailsAndReadsGauge], worker_config(concurrency=1, burst=True), metrics=WorkerMetrics(reg)
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        stop(worker, thread)
        pytest.fail("the burst worker did not finish")
    assert dict(worker.outcomes) == {"failed": 1}
    assert GAUGE["seen"] == 1.0


# -- an async coroutine that will not stop when cancelled ------------------------------

STUBBORN = {"cancelled": threading.Event(), "release": threading.Event(), "returned": None}


class StubbornAsync(WorkItemHandler):
    """Swallows the cancel of its timeout and goes on until the test releases it."""

    name = "stubborn_async"
    timeout = 0.2
    max_attempts = 1

    async def handle(self, payload: Any) -> str:
        import asyncio

        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            STUBBORN["cancelled"].set()
        while not STUBBORN["release"].is_set():
            await asyncio.sleep(0.01)
        STUBBORN["returned"] = True
        return "late"


def test_an_async_attempt_that_ignores_its_cancel_is_recorded_and_its_late_result_dropped(
    no_stray_threads: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At its timeout the coroutine is cancelled; one that swallows the cancel gets
    CANCEL_GRACE, then its attempt is recorded as timed out without it (logged), and what it
    returns later is never written. The attempt is counted once, in the in-flight gauge while
    it ran and in the duration histogram and outcome count when it ended."""
    from prometheus_client import CollectorRegistry

    from django_dbworker.metrics import WorkerMetrics

    monkeypatch.setattr("django_dbworker.worker.execution.CANCEL_GRACE", 0.2)
    STUBBORN["cancelled"].clear()
    STUBBORN["release"].clear()
    STUBBORN["returned"] = None
    reg = CollectorRegistry()
    item = StubbornAsync.enqueue({})
    worker = Worker([StubbornAsync], worker_config(concurrency=1), metrics=WorkerMetrics(reg))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: WorkItem.objects.get(pk=item.pk).status == Status.FAILED,
            timeout=30,
            what="the timed-out attempt to be recorded",
        )
        assert STUBBORN["cancelled"].is_set() and STUBBORN["returned"] is None
        STUBBORN["release"].set()
        wait_until(lambda: STUBBORN["returned"], timeout=10, what="the stubborn coroutine to end")
    finally:
        STUBBORN["release"].set()
        stop(worker, thread)  # writes whatever was handed to the success writer
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED and row.result is None
    assert "TimeoutError" in row.last_error
    assert "did not stop within" in caplog.text
    labels = {"worker": "stubborn_async"}
    assert reg.get_sample_value("worker_tasks_in_flight", labels) == 0.0
    assert dict(worker.outcomes) == {"timeout": 1}
    assert reg.get_sample_value(
        "worker_task_duration_seconds_count", labels | {"status": "timeout"}
    )


class RaisesCancelledError(WorkItemHandler):
    """An awaited task cancelled inside the handler: its CancelledError leaks out."""

    name = "raises_cancelled_error"

    async def handle(self, payload: Any) -> None:
        import asyncio

        raise asyncio.CancelledError


def test_a_cancelled_error_of_the_handlers_own_is_a_failure_not_a_cancel(
    no_stray_threads: None,
) -> None:
    """Only a cancel request (or a lost claim) ends an async attempt ``cancelled``; a
    CancelledError its coroutine raises by itself fails it like any BaseException
    (not in ``retry_on``: failed at once), as ``run_until_empty`` does."""
    item = RaisesCancelledError.enqueue({})
    worker = Worker([RaisesCancelledError], worker_config(burst=True))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the burst worker did not finish"
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED and "CancelledError" in row.last_error, row.last_error
    assert "cancelled by request" not in row.last_error
