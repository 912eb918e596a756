"""The per-attempt hooks and the Tasks backend built on them.

``attempt_started`` / ``attempt_recorded`` are called once per attempt and
never take the worker down; the TaskHandler keeps one TaskResult per attempt
and forgets it when the attempt is recorded; ``task_finished`` receivers run
where they hold up only their own task; and stale recovery of a mass crash
fits in one pass of the worker. In-process, like
tests/integration/test_tasks_django_contract.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from django_dbworker.enqueuing import enqueue
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.tasks import handler as task_handler_module
from django_dbworker.tasks import task as dbtask
from django_dbworker.tasks.compat import (
    TaskResultStatus,
    task_backends,
    task_finished,
    task_started,
)
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import claim, worker_config

pytestmark = pytest.mark.django_db


# -- tasks of this module (registered when it is imported, like any @task) ------------


@dbtask(takes_context=True)
def where_am_i(context: Any) -> dict[str, Any]:
    """Says how its context's task and ``get_result``'s task see this very run."""
    mine = context.task_result
    fresh = task_backends[mine.backend].get_result(mine.id)
    return {
        "context": [mine.task.priority, mine.task.queue_name],
        "get_result": [fresh.task.priority, fresh.task.queue_name],
    }


@dbtask(max_attempts=1)
def last_chance(key: str) -> str:
    return key


# A timeout the start's own read stays well inside, even on a loaded machine.
@dbtask(timeout=1.0, max_attempts=1)
def fails_after_slow_start(key: str) -> None:
    raise ValueError(f"fails: {key}")


# -- helpers ---------------------------------------------------------------------------


@pytest.fixture
def finished() -> Iterator[list[tuple[str, str, bool]]]:
    """(result id, status, has finished_at) of every ``task_finished`` sent."""
    sent: list[tuple[str, str, bool]] = []
    lock = threading.Lock()

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        with lock:
            sent.append(
                (task_result.id, str(task_result.status), task_result.finished_at is not None)
            )

    task_finished.connect(receiver)
    yield sent
    task_finished.disconnect(receiver)


def no_item_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("dbworker-item-")]


# -- attempt_recorded: once per attempt ---------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_timed_out_attempt_is_recorded_once_when_its_late_run_succeeds(
    background_worker: Callable[..., Worker], request: pytest.FixtureRequest
) -> None:
    """``attempt_recorded`` is "called once per attempt"; a late success calls it twice.

    The attempt times out: the worker records the failure and calls
    ``attempt_recorded(item, "failed", TimeoutError)``. The abandoned thread
    returns later, hands its success to the success writer, whose fenced
    write finds the row no longer claimed: ``written`` calls
    ``attempt_recorded(item, None, None)`` again for the same attempt (same
    row, same claim token). A hook that counts attempts, or releases a
    per-attempt resource, sees two endings of one attempt. (A late failure
    or a late atomic success is not reported again: only this path is.)
    """
    calls: list[tuple[int, Any, Any, Any]] = []

    class LateSuccess(WorkItemHandler):
        name = "late_success_hook"
        timeout = 0.3
        max_attempts = 1

        def handle(self, payload: Any) -> str:
            time.sleep(payload["sleep"])
            return "late"

        def attempt_recorded(self, item: Any, status: Any, error: Any) -> None:
            calls.append((item.pk, item.claim_token, status, type(error).__name__))

    request.addfinalizer(lambda: registry.unregister(LateSuccess.name))
    item = enqueue(LateSuccess.name, {"sleep": 1.0})
    background_worker([LateSuccess.name])
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.FAILED,
        timeout=20,
        what="the attempt to time out",
    )
    wait_until(no_item_threads, timeout=20, what="the abandoned run to end")
    time.sleep(1.0)  # the success writer settles the late success
    attempts = {(pk, token) for pk, token, _, _ in calls}
    assert len(attempts) == 1
    assert calls == [(item.pk, calls[0][1], "failed", "TimeoutError")], calls


# -- TaskHandler: one TaskResult per attempt ----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_slow_task_started_receiver_neither_repeats_task_started_nor_leaks_a_result(
    background_worker: Callable[..., Worker],
) -> None:
    """A ``task_started`` receiver slower than the task's timeout: two task_started, one leak.

    The timeout clock runs from before ``attempt_started``. The worker times
    the attempt out and ``attempt_recorded`` pops its TaskResult; when the
    receiver returns, ``handle_item`` finds no result for the attempt and
    calls ``attempt_started`` again: a second ``task_started`` for the
    same attempt, and a new entry in ``TaskHandler._running``. The task then
    fails; the failure write is fenced and the abandoned thread reports
    nothing, so the entry is never removed: one TaskResult (payload,
    arguments, errors) kept for the life of the process per such attempt.
    """
    started: list[str] = []

    def slow(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.task.func is fails_after_slow_start.func:
            started.append(task_result.id)
            time.sleep(2.0)

    task_started.connect(slow)
    try:
        result = fails_after_slow_start.enqueue("slow start")
        worker = background_worker([fails_after_slow_start.module_path])
        wait_until(
            lambda: WorkItem.objects.get(pk=int(result.id)).status == Status.FAILED,
            timeout=20,
            what="the attempt to time out",
        )
        wait_until(no_item_threads, timeout=20, what="the abandoned run to end")
        time.sleep(0.5)
    finally:
        task_started.disconnect(slow)
    handler = worker.work_item_handlers[fails_after_slow_start.module_path]
    leaked = dict(handler._running)  # type: ignore[attr-defined]
    assert (started, len(leaked)) == ([result.id], 0)


@pytest.mark.django_db(transaction=True)
def test_an_attempt_recorded_while_its_start_reads_the_row_leaves_no_result_behind(
    background_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start's read of the row outlasts the timeout (a slow new connection).

    The worker records the timed-out attempt, and ``attempt_recorded`` finds
    nothing to pop, while ``attempt_started`` is still reading; when the read
    returns, the result must not be kept for an attempt already recorded (it
    would stay for the life of the process), nor announced by task_started.
    """
    real = task_handler_module._running_row
    started: list[str] = []

    def slow_read(item: Any, **kwargs: Any) -> Any:
        row = real(item, **kwargs)
        time.sleep(2.0)  # longer than the task's 1 s timeout
        return row

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        started.append(task_result.id)

    monkeypatch.setattr(task_handler_module, "_running_row", slow_read)
    task_started.connect(receiver)
    try:
        result = fails_after_slow_start.enqueue("slow read")
        worker = background_worker([fails_after_slow_start.module_path])
        wait_until(
            lambda: WorkItem.objects.get(pk=int(result.id)).status == Status.FAILED,
            timeout=20,
            what="the attempt to time out",
        )
        wait_until(no_item_threads, timeout=20, what="the abandoned run to end")
    finally:
        task_started.disconnect(receiver)
    handler = worker.work_item_handlers[fails_after_slow_start.module_path]
    assert dict(handler._running) == {}  # type: ignore[attr-defined]
    assert started == []


def test_a_last_attempt_whose_start_fails_sends_task_finished_failed(
    monkeypatch: pytest.MonkeyPatch, finished: list[tuple[str, str, bool]]
) -> None:
    """``attempt_started`` raising is the attempt's failure; its task_finished says RUNNING.

    The connection drops as the attempt starts (``TaskHandler.attempt_started``
    reads ``error_history``). The worker records the failure; on the last
    attempt the row is FAILED and ``attempt_recorded(item, "failed", exc)``
    finds no TaskResult for the attempt, so it builds one from the claimed
    ``item`` in memory, whose ``status`` is still "claimed": receivers are
    told the task finished with status RUNNING (``_recorded_row`` expects a
    row read after the write, as stale recovery passes it). Also worth
    a look: a connection blip in the worker's own bookkeeping read costs
    the task an attempt (here its only one) before its function ever ran.
    """
    real = task_handler_module._running_row
    calls = {"n": 0}

    def flaky_read(item: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return real(item)

    monkeypatch.setattr(task_handler_module, "_running_row", flaky_read)
    result = last_chance.enqueue("x")
    run_until_empty([last_chance.module_path])
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert finished == [(result.id, "FAILED", True)]


def test_the_running_task_agrees_with_get_result_on_its_priority_and_queue() -> None:
    """The worker's TaskResult is the declared task's, not the enqueued one's.

    ``where_am_i.using(priority=7, queue_name="other").enqueue()``: the row
    has priority 7 and queue "other", ``get_result`` answers
    ``task.using(priority=7, queue_name="other")``, but
    the TaskResult the worker builds (``TaskContext.task_result``, and the
    one ``task_started``/``task_finished`` receivers get) carries the task
    as declared: priority 0, queue "default". django-tasks-db's worker
    builds it from the row (``DBTaskResult.task``: ``task.using(priority=,
    queue_name=, run_after=, backend=)``). A task that re-enqueues itself
    through ``context.task_result.task`` lands on another queue.
    """
    result = where_am_i.using(priority=7, queue_name="other").enqueue()
    run_until_empty([where_am_i.module_path])
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    seen = result.return_value
    assert seen["get_result"] == [7, "other"]
    assert seen["context"] == seen["get_result"]


# -- where task_finished receivers run ------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_slow_task_finished_receiver_does_not_hold_up_other_handlers_successes(
    background_worker: Callable[..., Worker],
) -> None:
    """``task_finished`` runs on the success writer thread: one slow receiver stalls them all.

    A successful non-atomic task's ``attempt_recorded`` is called by the
    writer's callback, in the writer thread, so its receivers (user code:
    an e-mail, an HTTP call, a lock) run there too. While one receiver
    waits, no success of any handler in the process is written: a plain
    ``noop`` item, done in microseconds, stays claimed. django-tasks-db
    (and Django's ImmediateBackend) run the receiver in the task's own
    thread, holding up that task only; the hook's docstring asks to "keep
    it short", but a Django user writing a ``task_finished`` receiver
    cannot know it runs on the engine's writer.
    """
    from tests.testapp import tasks

    entered = threading.Event()
    release = threading.Event()

    def slow(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.task.func is tasks.add.func:
            entered.set()
            release.wait(15)

    task_finished.connect(slow)
    try:
        background_worker([tasks.add.module_path, "noop"])
        tasks.add.enqueue(1, 2)
        assert entered.wait(15), "the task did not finish"
        plain = enqueue("noop", {})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if WorkItem.objects.get(pk=plain.pk).status == Status.SUCCEEDED:
                break
            time.sleep(0.05)
        status = WorkItem.objects.get(pk=plain.pk).status
    finally:
        release.set()
        task_finished.disconnect(slow)
    assert status == Status.SUCCEEDED, f"the noop item is still {status} 5s later"


# -- recover_stale: the per-row failures -------------------------------------------


def _stale_exhausted_rows(count: int, handler: str = "noop") -> None:
    WorkItem.objects.bulk_create(
        [WorkItem(handler=handler, payload={}, max_attempts=1) for _ in range(count)]
    )
    claimed = claim(limit=count, handlers=[handler], worker="dead:1:main")
    assert len(claimed) == count
    WorkItem.objects.filter(status=Status.CLAIMED).update(heartbeat_at=Now() - timedelta(hours=1))


def test_recovering_a_mass_crash_fits_in_one_pass_of_the_worker() -> None:
    """Failing exhausted rows one UPDATE each makes the pass too slow to commit.

    A worker with ``max_attempts=1`` jobs (or on last attempts) holds up to
    running + buffered rows claimed (MAX_CLAIM 500 per statement, more
    across statements); when a fleet is killed (OOM, node loss) every such row
    is stale and exhausted. ``recover_stale`` fails them with one UPDATE per
    handler per batch of 500, not one per row: the worker's pass is rolled back
    as "it had to wait" (``_RecoveryWaited``) when it takes longer than
    HEARTBEAT_INTERVAL, and put off; every later pass would redo the same
    thousands of UPDATEs and be rolled back again, until STALE_AFTER more has
    passed, (on SQLite) holding the database write lock each time. Here: one
    pass of the worker, HEARTBEAT_INTERVAL 5 s (the production default), over
    2,000 rows: every one is failed.
    """
    _stale_exhausted_rows(2000)
    # The bound under test is the number of statements. The time it makes
    # the pass take depends on the machine (about 0.1 s per 500 rows on a
    # quiet one; more under load), so the worker gets the production order
    # of HEARTBEAT_INTERVAL, not the suite's 0.3 s, lest a loaded run roll
    # the pass back for having waited.
    worker = Worker([registry["noop"]], worker_config(heartbeat_interval=5.0))
    with CaptureQueriesContext(connection) as queries:
        worker.recovery.maybe_recover()
    left = WorkItem.objects.filter(status=Status.CLAIMED).count()
    # One UPDATE per handler per 500 rows: about 15 statements, 0.06 s (SQLite) /
    # 0.11 s (PostgreSQL) for the 2,000 rows; one per row: 2,015 statements,
    # 2.2 s / 5.1 s (more than the production HEARTBEAT_INTERVAL of 5 s).
    assert (left, len(queries) <= 100) == (0, True), (
        f"{left} rows still claimed after the pass ({len(queries)} statements)"
    )


# -- the hooks must not raise ----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_hook_that_raises_a_base_exception_does_not_kill_the_success_writer(
    background_worker: Callable[..., Worker], request: pytest.FixtureRequest
) -> None:
    """The hook runner (``settle._run_hook``) catches more than ``Exception``.

    execution.py promises that nothing a handler does (``BaseException``
    included: tests/testapp/workers.py SystemExiter) changes how the worker
    goes on. ``attempt_recorded`` is handler code too (``task_finished``
    receivers are called from it, and ``send_robust`` catches only
    ``Exception``). Raised on the success writer thread, a ``SystemExit``
    escapes ``_Pending.finish``, ends the writer thread and leaves the
    rest of its batch unsettled; the worker's watchdog then stops the
    process as unhealthy ("the success writer thread died").
    """

    class ExitingHook(WorkItemHandler):
        name = "exiting_hook"
        max_attempts = 1

        def handle(self, payload: Any) -> str:
            return "ok"

        def attempt_recorded(self, item: Any, status: Any, error: Any) -> None:
            raise SystemExit("a receiver called sys.exit()")

    request.addfinalizer(lambda: registry.unregister(ExitingHook.name))
    first = enqueue(ExitingHook.name, {})
    worker = background_worker([ExitingHook.name, "noop"])
    wait_until(
        lambda: WorkItem.objects.get(pk=first.pk).status == Status.SUCCEEDED,
        timeout=20,
        what="the first item to succeed",
    )
    time.sleep(0.5)
    later = enqueue("noop", {})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and worker.unhealthy is None:
        if WorkItem.objects.get(pk=later.pk).status == Status.SUCCEEDED:
            break
        time.sleep(0.05)
    assert worker.unhealthy is None, worker.unhealthy
    assert WorkItem.objects.get(pk=later.pk).status == Status.SUCCEEDED
