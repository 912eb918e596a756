"""``DBWorkerBackend`` against Django's Tasks contract, one clause per test.

Every test states Django's contract (django/tasks/*, django-tasks-db's worker,
SPEC.md "Django Tasks backend") and checks our backend against it.
They run in-process like tests/integration/test_tasks.py, on SQLite and
PostgreSQL, Django 5.2 + backport and Django 6.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_dbworker import transitions
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.tasks import task as dbtask
from django_dbworker.tasks.compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
    task_finished,
)
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import age_heartbeat, claim
from tests.testapp import tasks
from tests.testapp.models import Effect, Execution

pytestmark = pytest.mark.django_db


@dbtask(takes_context=True, max_attempts=2)
def compare_context(context: Any, key: str) -> dict[str, Any]:
    """Fails its first two runs; then says what its context and get_result see."""
    Execution.objects.create(key=key)
    runs = Execution.objects.filter(key=key).count()
    mine = context.task_result
    fresh = task_backends[mine.backend].get_result(mine.id)
    if runs <= 2:
        raise ConnectionError(f"run {runs} fails")
    return {
        "context": [context.attempt, len(mine.errors), len(mine.worker_ids)],
        "get_result": [fresh.attempts, len(fresh.errors), len(fresh.worker_ids)],
    }


@pytest.fixture
def finished() -> Iterator[list[tuple[str, str]]]:
    """(result id, status) of every ``task_finished`` sent while the test runs."""
    sent: list[tuple[str, str]] = []
    lock = threading.Lock()

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        with lock:
            sent.append((task_result.id, str(task_result.status)))

    task_finished.connect(receiver)
    yield sent
    task_finished.disconnect(receiver)


# -- get_result of ids it never issued ---------------------------------------------


#: The id's digits as Arabic-Indic digits (U+0660..U+0669): str.isdigit() is true.
ARABIC_INDIC = str.maketrans("0123456789", "".join(chr(0x660 + n) for n in range(10)))


@pytest.mark.parametrize("shape", ["\u00b2", "{arabic}", "0{id}", "\u0660{id}"])
def test_get_result_of_an_id_it_never_issued_raises_does_not_exist(shape: str) -> None:
    """Django: ``get_result`` raises TaskResultDoesNotExist if such result does not exist.

    ``_row_id`` accepts any ``str.isdigit()`` text: '²' is a digit to
    ``isdigit`` but not to ``int`` (ValueError escapes), and U+0661 (Arabic-Indic
    digit one) or '01' are read as row 1, so the result returned has another id
    than the one asked for.
    """
    result = tasks.add.enqueue(1, 2)
    asked = shape.format(id=result.id, arabic=result.id.translate(ARABIC_INDIC))
    try:
        fetched = task_backends["default"].get_result(asked)
    except TaskResultDoesNotExist:
        return
    assert fetched.id == asked, f"get_result({asked!r}) returned the result of id {fetched.id!r}"


# -- task_finished: when, how often, saying what -------------------------------------


def test_a_task_finished_receiver_that_refreshes_sees_the_finished_task() -> None:
    """``task_finished`` is sent before the outcome is written.

    django-tasks-db's worker sends it after ``set_successful()`` saved the
    row (db_worker.py run_task), so a receiver that calls
    ``task_result.refresh()`` (or ``get_result``) reads the finished result.
    Ours reads RUNNING with no ``finished_at``: refresh() even turns the
    SUCCESSFUL result the receiver got back into RUNNING.
    """
    seen: list[tuple[str, bool]] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        task_result.refresh()
        seen.append((str(task_result.status), task_result.finished_at is not None))

    task_finished.connect(receiver)
    try:
        tasks.add.enqueue(1, 2)
        assert run_until_empty() == {"succeeded": 1}
    finally:
        task_finished.disconnect(receiver)
    assert seen == [("SUCCESSFUL", True)]


def test_task_finished_never_says_successful_for_a_task_recorded_failed(
    finished: list[tuple[str, str]],
) -> None:
    """A return value JSON cannot hold (inf) is recorded FAILED, but the signal says SUCCESSFUL.

    handle_item normalises with Django's ``normalize_json`` (which keeps
    inf/NaN), sends ``task_finished`` SUCCESSFUL, then the worker's
    ``ensure_json(allow_nan=False)`` refuses the value and records FAILED.
    django-tasks-db sets the result first and reports the failure to
    the receivers ("So errors setting it (eg JSON encode) can still be
    recorded").
    """
    result = tasks.infinite.enqueue()
    run_until_empty()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED  # what the row says
    assert finished == [(result.id, "FAILED")]


def test_task_finished_receivers_of_a_failed_atomic_task_keep_their_writes() -> None:
    """For ``atomic`` tasks the signals are sent inside the task's transaction.

    A ``task_finished`` receiver told that the task FAILED writes a row (an
    audit log, a notification); the task's exception then rolls the
    transaction back, and the receiver's write with it. The signal describes
    the task's end, and must be sent after its transaction is over.
    """

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.status == TaskResultStatus.FAILED:
            Effect.objects.create(key=f"receiver saw {task_result.id} fail")

    task_finished.connect(receiver)
    try:
        result = tasks.atomic_effect.enqueue("undone", True)
        run_until_empty()
    finally:
        task_finished.disconnect(receiver)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert not Effect.objects.filter(key="undone").exists()  # the task's own write: undone
    assert Effect.objects.filter(key=f"receiver saw {result.id} fail").exists()


@pytest.mark.django_db(transaction=True)
def test_a_timed_out_last_attempt_sends_task_finished_failed_not_successful(
    background_worker: Callable[..., Worker], finished: list[tuple[str, str]]
) -> None:
    """A task that times out on its last attempt ends FAILED; its signals must say so.

    The abandoned thread sends ``task_finished`` SUCCESSFUL when the function
    returns late (its outcome is fenced out, the row stays FAILED), and no
    ``task_finished`` FAILED is ever sent for the timeout.
    """
    result = tasks.overrun.enqueue(1.0)  # timeout=0.3, max_attempts=1
    background_worker(["tests.testapp.tasks.overrun"])
    wait_until(
        lambda: WorkItem.objects.get(pk=int(result.id)).status == Status.FAILED,
        timeout=20,
        what="the overrunning task to fail by its timeout",
    )
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("dbworker-item-")],
        timeout=20,
        what="the abandoned run to end",
    )
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[-1].exception_class_path == "builtins.TimeoutError"
    # Sent after the FAILED commit, by the thread that recorded it.
    wait_until(lambda: bool(finished), what="task_finished")
    assert finished == [(result.id, "FAILED")]


def test_a_deduplicated_enqueue_sends_no_second_task_enqueued() -> None:
    """A ``unique_key`` enqueue that finds a live row enqueues nothing, yet ``task_enqueued`` fires.

    Receivers counting enqueued tasks (metrics, audit) count two for one row.
    """
    sent: list[str] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        sent.append(task_result.id)

    task_enqueued.connect(receiver)
    try:
        first = tasks.rebuild.enqueue("index")
        again = tasks.rebuild.enqueue("index")
    finally:
        task_enqueued.disconnect(receiver)
    assert again.id == first.id and WorkItem.objects.count() == 1
    assert sent == [first.id]


# -- the backend a task is enqueued on -----------------------------------------------


def test_a_task_enqueued_on_another_backend_gets_that_backends_options() -> None:
    """``task.using(backend=...)`` takes that backend's OPTIONS, or is refused.

    ``max_attempts`` is per row: the target backend's default applies. The
    options that say how a function runs (timeout, atomic, sensitive) belong
    to its one handler: a backend whose defaults differ refuses the task
    (InvalidTask) rather than run it with the other backend's.
    """
    on_retrying = tasks.add.using(backend="retrying").enqueue(1, 2)
    assert WorkItem.objects.get(pk=int(on_retrying.id)).max_attempts == 6
    on_default = tasks.add.enqueue(1, 2)
    assert WorkItem.objects.get(pk=int(on_default.id)).max_attempts == 3  # DBWORKER's
    with pytest.raises(InvalidTask, match="timeout"):
        tasks.add.using(backend="patient")  # TIMEOUT 30 there, none where add was declared
    with pytest.raises(InvalidTask, match="timeout"):
        tasks.patient.using(backend="default")
    assert WorkItem.objects.count() == 2


def test_get_result_on_a_backend_returns_a_task_of_that_backend() -> None:
    """``TaskResult.backend`` and ``TaskResult.task.backend`` disagree.

    ``get_result`` on "patient" returns the task as first declared (backend
    "default"), while ``enqueue`` there returned a task of "patient";
    ``result.task.get_backend()`` (used by ``refresh()``) is then another
    backend than ``result.backend``. django-tasks-db returns
    ``task.using(backend=self.backend_name)``.
    """
    enqueued = tasks.add.using(backend="retrying").enqueue(1, 2)
    assert enqueued.task.backend == "retrying"
    fetched = task_backends["retrying"].get_result(enqueued.id)
    assert fetched.backend == "retrying"
    assert fetched.task.backend == fetched.backend


def test_get_result_on_a_backend_the_task_cannot_use_is_consistent() -> None:
    """``add`` refuses backend "patient" (its TIMEOUT differs); "patient" returns its results.

    ``_as_enqueued`` tries ``task.using(backend="patient")``, which raises
    InvalidTask, and then keeps the task as declared: the result says
    ``backend == "patient"`` while ``result.task.backend == "default"``,
    the inconsistency already fixed for compatible backends. "patient"
    cannot have issued this id (``add`` can never be enqueued there): like
    an id it never issued, it should raise ``TaskResultDoesNotExist``, or
    at least answer a result whose task is on the backend it names.
    """
    result = tasks.add.enqueue(1, 2)
    with pytest.raises(InvalidTask):
        tasks.add.using(backend="patient")
    try:
        fetched = task_backends["patient"].get_result(result.id)
    except TaskResultDoesNotExist:
        return
    assert fetched.task.backend == fetched.backend, (fetched.backend, fetched.task.backend)


# -- TaskContext after an operator retry ---------------------------------------------


def test_the_context_of_a_task_retried_by_an_operator_matches_get_result() -> None:
    """After admin Retry (attempts reset to 0, error_history kept) the context forgets history.

    ``_running_row`` reads ``error_history`` only when ``item.attempts > 1``;
    the first run after a retry has attempts == 1, so its TaskContext says
    attempt 1 with no errors while ``get_result`` of the same row, at the
    same moment, says attempt 3 with 2 errors. A task that decides by
    ``context.attempt`` (like tests/testapp/tasks.py ``flaky``) behaves
    differently on that run.
    """
    result = compare_context.enqueue("op")
    run_until_empty(include_scheduled=True)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and len(result.errors) == 2
    assert WorkItem.objects.get(pk=int(result.id)).retry()  # the admin's Retry action
    run_until_empty()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    seen = result.return_value
    assert seen["context"] == seen["get_result"] == [3, 2, 3]


# -- error_history that is not a JSON array ------------------------------------------


@pytest.mark.usefixtures("slow_retries")
def test_a_failure_is_recorded_whatever_error_history_holds() -> None:
    """A row whose ``error_history`` is not a JSON array (edited by hand) breaks failure writes.

    PostgreSQL: ``jsonb_array_length`` raises on a non-array, so the retry
    write, then the "plain failure" fallback (which appends history too)
    fail: the attempt is UNRECORDED and the row stays claimed until stale
    recovery (which appends history the same way). execution.py promises
    that every attempt ends in exactly one recorded outcome. SQLite:
    ``json_insert`` leaves a non-array as it is, so the failed attempt is
    silently not recorded.
    """
    result = tasks.always_fails.enqueue("g")
    WorkItem.objects.filter(pk=int(result.id)).update(error_history={"note": "cleared by ops"})
    run_until_empty()
    row = WorkItem.objects.get(pk=int(result.id))
    assert row.status == Status.PENDING, f"row left {row.status} after a failed attempt"
    fetched = task_backends["default"].get_result(result.id)
    assert [e.exception_class_path for e in fetched.errors] == ["builtins.ValueError"]


def test_stale_recovery_survives_a_row_whose_error_history_is_not_an_array() -> None:
    """One row with a non-array ``error_history`` must not block recovery of the others.

    ``recover_stale`` updates all stale rows of a handler in one statement
    that appends to ``error_history``: on PostgreSQL it raises for the
    whole batch, so no task of that handler is ever recovered.
    """
    good = tasks.add.enqueue(1, 1)
    bad = tasks.add.enqueue(2, 2)
    WorkItem.objects.filter(pk=int(bad.id)).update(error_history="not a list")
    claimed = claim(handlers=["tests.testapp.tasks.add"], worker="dead:1:main")
    assert len(claimed) == 2
    for item in claimed:
        age_heartbeat(item, 3600)
    recovered = transitions.recover_stale(stale_after=60)
    assert recovered.requeued == 2
    for result in (good, bad):
        errors = task_backends["default"].get_result(result.id).errors
        assert [e.exception_class_path for e in errors] == ["django_dbworker.errors.WorkerLost"]


# -- what validation accepts, enqueue and the worker must take -----------------------


def test_a_whole_number_priority_that_validation_accepts_can_be_enqueued() -> None:
    """Django's ``validate_task`` accepts ``priority=5.0`` (a whole number); enqueue refuses it.

    django/tasks/backends/base.py: ``int(task.priority) != task.priority``
    is the check, so 5.0 (and True) pass ``validate_task``, the ``@task``
    declaration succeeds, and every ``enqueue`` then raises our
    ``EnqueueError`` ("Priority must be an integer"). Either ``validate_task``
    refuses it (InvalidTask) or ``enqueue`` stores ``int(priority)``.
    """
    try:
        variant = tasks.add.using(priority=5.0)
    except InvalidTask:
        return  # refused where it is declared: consistent
    result = variant.enqueue(1, 2)
    assert WorkItem.objects.get(pk=int(result.id)).priority == 5


@pytest.mark.django_db(transaction=True)
def test_a_task_timeout_that_validation_accepts_does_not_break_its_runs(
    background_worker: Callable[..., Worker], request: pytest.FixtureRequest
) -> None:
    """``timeout=float("inf")`` passes the new TASK_OPTIONS validation, then every run fails.

    ``validation.positive_number`` accepts infinity (and anything above
    ``threading.TIMEOUT_MAX``); the worker's ``runner.join(timeout)`` raises
    OverflowError, the attempt is recorded failed while the task still runs
    in the abandoned thread (and runs again on each retry). The backend's
    ``check()`` accepts ``OPTIONS["TIMEOUT"] = inf`` too.
    """

    def sleeps(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    sleeps.__qualname__ = "sleeps_with_infinite_timeout"
    try:
        declared = dbtask(timeout=float("inf"), max_attempts=1)(sleeps)
    except InvalidTask:
        return  # refused where it is declared: fine
    result = declared.enqueue(0.3)
    request.addfinalizer(lambda: registry.unregister(declared.module_path))
    background_worker([declared.module_path])
    wait_until(
        lambda: WorkItem.objects.get(pk=int(result.id)).status in (Status.SUCCEEDED, Status.FAILED),
        timeout=20,
        what="the task to finish",
    )
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("dbworker-item-")],
        timeout=20,
        what="the run to end",
    )
    row = WorkItem.objects.get(pk=int(result.id))
    assert row.status == Status.SUCCEEDED, row.last_error[:300]


def test_a_task_failed_by_stale_recovery_sends_task_finished(
    finished: list[tuple[str, str]],
) -> None:
    """A task whose last attempt died with its worker ends FAILED, and no one says so.

    The worker's stale-recovery pass turns the row FAILED (WorkerLost, attempts
    used up); ``task_finished`` is never sent for it, in any process, so a
    receiver waiting for the end of the task (notify the user, release a
    resource) waits forever. The contract: "task_finished ... signals fire in the
    right processes"; a task left running by a crashed worker "is recovered
    like any WorkItem" (SPEC.md).
    """
    result = tasks.add.enqueue(1, 1)
    WorkItem.objects.filter(pk=int(result.id)).update(max_attempts=1)
    (item,) = claim(handlers=["tests.testapp.tasks.add"], worker="dead:1:main")
    age_heartbeat(item, 3600)
    run_until_empty()  # the worker's recovery pass runs first
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[-1].exception_class_path == "django_dbworker.errors.WorkerLost"
    assert finished == [(result.id, "FAILED")]
