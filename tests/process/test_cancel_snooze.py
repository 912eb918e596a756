"""Cancel of running work and Snooze through ``manage.py run_workers`` subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from django_dbworker.models import Status, WorkItem
from tests.conftest import ROOT, WorkerProcess, wait_until
from tests.testapp.models import Execution
from tests.testapp.tasks import cancels_itself, fail_when_told
from tests.testapp.workers import (
    IgnoresCancelOnFirstRun,
    PassesCheckToLongCall,
    SnoozeOnce,
    StopWhenCancelled,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.pgbouncer
def test_a_running_item_cancelled_from_outside_ends_cancelled_after_one_attempt(
    start_worker,
) -> None:
    item = StopWhenCancelled.enqueue({"key": "export"})
    worker = start_worker("stop_when_cancelled", "--concurrency", "2")
    wait_until(
        lambda: Execution.objects.filter(key="export", kind="run").exists(),
        timeout=60,
        what="the handler to start",
    )
    assert WorkItem.objects.get(pk=item.pk).cancel() is True
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.CANCELLED,
        timeout=30,
        what="the item to end cancelled",
    )
    row = WorkItem.objects.get(pk=item.pk)
    assert row.attempts == 1
    assert row.claim_token is None
    assert "cancelled by request" in row.last_error
    assert "RuntimeError: stopped: cancel requested" in row.last_error
    # It saw the request, and ran once: not retried although attempts remain.
    assert Execution.objects.filter(key="export", kind="saw-cancel").count() == 1
    assert Execution.objects.filter(key="export", kind="run").count() == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert "1 cancelled" in worker.log()
    assert Execution.objects.filter(key="export", kind="run").count() == 1
    assert WorkItem.objects.get(pk=item.pk).status == Status.CANCELLED


@pytest.mark.pgbouncer
def test_a_snoozing_item_runs_again_without_using_an_attempt(start_worker) -> None:
    """``max_attempts = 1``: a snooze counted as an attempt would leave none for the rerun."""
    item = SnoozeOnce.enqueue({"key": "later", "seconds": 1.5})
    worker = start_worker("snooze_once")
    wait_until(
        lambda: WorkItem.objects.filter(pk=item.pk, status=Status.PENDING, snoozes=1).exists(),
        timeout=60,
        what="the snooze",
    )
    snoozed = WorkItem.objects.get(pk=item.pk)
    assert snoozed.attempts == 0
    assert snoozed.last_error == ""
    # Due 1.5 s after the snooze was written, by the database clock (one statement).
    assert snoozed.updated_at is not None
    assert 1.4 <= (snoozed.run_after - snoozed.updated_at).total_seconds() <= 1.6
    wait_until(
        lambda: WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED,
        timeout=30,
        what="the run after the snooze",
    )
    done = WorkItem.objects.get(pk=item.pk)
    assert (done.attempts, done.snoozes, done.result) == (1, 1, 2)
    assert Execution.objects.filter(key="later", kind="run").count() == 2
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert "1 succeeded, 0 failed, 0 retried, 0 released, 1 snoozed" in worker.log()


def test_a_cancelled_attempt_that_overruns_ends_cancelled_and_its_late_success_is_discarded(
    start_worker,
) -> None:
    from tests.testapp.workers import OverrunAfterCancel

    item = OverrunAfterCancel.enqueue({"key": "slow-export"})
    worker = start_worker("overrun_after_cancel")
    wait_until(
        lambda: Execution.objects.filter(key="slow-export", kind="run").exists(),
        timeout=60,
        what="the handler to start",
    )
    WorkItem.objects.get(pk=item.pk).cancel()
    wait_until(
        lambda: Execution.objects.filter(key="slow-export", kind="late").exists(),
        timeout=30,
        what="the abandoned run to end",
    )
    worker.wait_for_log("Discarded the outcome of work item", timeout=20)
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.CANCELLED
    assert row.result is None
    assert row.attempts == 1
    assert "cancelled by request" in row.last_error and "TimeoutError" in row.last_error
    assert Execution.objects.filter(key="slow-export", kind="saw-cancel").count() == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert Execution.objects.filter(key="slow-export", kind="run").count() == 1


class SignalledWorker(WorkerProcess):
    """``run_workers`` that records the Django task signals it sends (Execution rows)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.process.run_workers_with_task_signals", *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def signalled_worker(
    worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., SignalledWorker]]:
    started: list[SignalledWorker] = []

    def start(*args: str) -> SignalledWorker:
        proc = SignalledWorker(list(args), worker_env, tmp_path / f"signalled-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def runs(key: str, kind: str = "run") -> int:
    return Execution.objects.filter(key=key, kind=kind).count()


def row(item: WorkItem) -> WorkItem:
    return WorkItem.objects.get(pk=item.pk)


# -- a cancel request outliving its attempt --------------------------------------------


def test_cancel_requested_item_released_at_shutdown_is_not_run_again(start_worker) -> None:
    """SIGTERM while a cancel-requested item runs past SHUTDOWN_TIMEOUT: the row is
    released back to ``pending`` with its request still set, and the next worker runs the
    work the operator cancelled once more (it ends ``succeeded``).

    Expected: the operator asked this attempt to stop and the worker stopped it; the
    row ends ``cancelled`` (``transitions.release`` should end rows with
    ``cancel_requested_at`` set as cancelled instead of handing them back).
    """
    item = IgnoresCancelOnFirstRun.enqueue({"key": "release"})
    first = start_worker("ignores_cancel_on_first_run", env={"DBWORKER_SHUTDOWN_TIMEOUT": "1"})
    wait_until(lambda: runs("release") == 1, timeout=60, what="the first run")
    assert row(item).cancel() is True
    wait_until(lambda: runs("release", "saw-cancel") == 1, timeout=30, what="the request heard")
    first.signal(signal.SIGTERM)
    assert first.wait() == 0
    after_release = row(item)
    second = start_worker("ignores_cancel_on_first_run", "--burst")
    assert second.wait(60) == 0
    final = row(item)
    assert (after_release.status, final.status, runs("release")) == (
        Status.CANCELLED,
        Status.CANCELLED,
        1,
    ), (
        f"after the release: {after_release.status}, cancel_requested_at="
        f"{after_release.cancel_requested_at}; then {final.status} with result "
        f"{final.result!r} after {runs('release')} runs"
    )


def test_cancel_requested_item_of_a_dead_worker_is_not_run_again(start_worker) -> None:
    """SIGKILL of the worker running a cancel-requested item: stale recovery puts the row
    back to ``pending`` (its request kept) and another worker runs the cancelled work again
    to ``succeeded``.

    Expected: the attempt that was asked to stop is over (its worker died); the row ends
    ``cancelled``, not run again (``transitions.recover_stale``: rows with
    ``cancel_requested_at`` set go to ``cancelled``, like those out of attempts go to
    ``failed``).
    """
    env = {"DBWORKER_STALE_AFTER": "1.5"}
    item = IgnoresCancelOnFirstRun.enqueue({"key": "stale"})
    first = start_worker("ignores_cancel_on_first_run", env=env)
    wait_until(lambda: runs("stale") == 1, timeout=60, what="the first run")
    assert row(item).cancel() is True
    wait_until(lambda: runs("stale", "saw-cancel") == 1, timeout=30, what="the request heard")
    first.kill()
    second = start_worker("ignores_cancel_on_first_run", env=env)
    wait_until(
        lambda: row(item).status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED),
        timeout=60,
        what="the row to end",
    )
    second.signal(signal.SIGTERM)
    assert second.wait() == 0
    final = row(item)
    assert (final.status, runs("stale")) == (Status.CANCELLED, 1), (
        f"{final.status} with result {final.result!r} after {runs('stale')} runs; "
        f"last_error={final.last_error[:200]!r}"
    )


# -- cancel_requested read from another thread -----------------------------------------


def test_cancel_check_passed_to_a_long_call_works_on_the_calls_own_thread(
    start_worker,
) -> None:
    """The README's pattern ``upload(path, should_stop=lambda: self.cancel_requested)``:
    a long call that runs its checks on a thread of its own (a transfer manager, a
    ThreadPoolExecutor, ``async_to_sync``) never sees the request, because
    ``cancel_requested`` reads a ``threading.local`` of the worker's thread.

    Expected: the check passed as a callable reports the attempt's request wherever it
    is called (e.g. a per-attempt ``self.cancel_check`` bound to the attempt, or a
    ``contextvars`` value for ``async_to_sync``; at least the README must say so).
    """
    item = PassesCheckToLongCall.enqueue({"key": "long-call", "seconds": 8})
    worker = start_worker("passes_check_to_long_call")
    wait_until(lambda: runs("long-call") == 1, timeout=60, what="the handler to start")
    assert row(item).cancel() is True
    wait_until(
        lambda: row(item).status in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED),
        timeout=60,
        what="the row to end",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    final = row(item)
    assert final.status == Status.CANCELLED, (
        f"{final.status}, result {final.result!r}; the handler's own thread saw the "
        f"request: {runs('long-call', 'main-saw') == 1}"
    )


# -- Django Tasks: a started task that ends cancelled ----------------------------------


def test_task_cancelled_while_running_sends_task_finished(signalled_worker) -> None:
    """A ``@task`` that started (``task_started`` sent) and ends ``cancelled`` after a
    cancel request never gets its ``task_finished``: ``TaskHandler.attempt_recorded``
    sends it only for ``succeeded``/``failed``. Before this change a cancelled task had
    never started; now receivers that pair the two signals leak a running task.

    Expected: ``task_finished`` with status FAILED (and the Cancelled error) for an
    attempt recorded ``cancelled`` (django_dbworker/tasks/handler.py, attempt_recorded:
    ``status not in (SUCCEEDED, FAILED, CANCELLED)``).
    """
    result = fail_when_told.enqueue("t1")
    key = f"task:{result.id}"
    worker = signalled_worker()
    wait_until(lambda: runs(key, "started") == 1, timeout=60, what="task_started")
    assert WorkItem.objects.get(pk=int(result.id)).cancel() is True
    Execution.objects.create(key="t1", kind="go")
    wait_until(
        lambda: WorkItem.objects.get(pk=int(result.id)).status != Status.CLAIMED,
        timeout=60,
        what="the task to end",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    status = WorkItem.objects.get(pk=int(result.id)).status
    assert status == Status.CANCELLED
    assert runs(key, "finished") == 1, f"task_finished sent {runs(key, 'finished')} times"


def test_task_that_cancels_itself_has_one_error_for_its_one_attempt(start_worker) -> None:
    """A ``@task`` that raises ``Cancelled`` on its first attempt: ``get_result`` shows two
    ``Cancelled`` errors for one attempt. ``cancel_running`` now writes the attempt into
    ``error_history`` (class ``django_dbworker.errors.Cancelled``), and
    ``tasks/results.build`` still appends its own ``Cancelled`` marker for every cancelled
    row, which was right only while a cancelled row had never run.

    Expected (SPEC "Django Tasks backend": errors, one per failed attempt): one error.
    Fix: in ``build``, append the marker only when the last history entry is not the
    cancelled attempt's own (e.g. ``row.attempts > len(entries)``-style check, or when
    ``entries[-1]["exception_class_path"] != CANCELLED``).
    """
    result = cancels_itself.enqueue("self")
    worker = start_worker("--burst")
    assert worker.wait(60) == 0
    assert WorkItem.objects.get(pk=int(result.id)).status == Status.CANCELLED
    fetched = cancels_itself.get_backend().get_result(result.id)
    classes = [error.exception_class_path for error in fetched.errors]
    assert (len(fetched.worker_ids), classes) == (1, ["django_dbworker.errors.Cancelled"])
