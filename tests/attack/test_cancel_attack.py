"""Attacks on cancel of running work and Snooze (issue 21, SPEC "Flow control").

Each test is one finding: it fails on the code under review (branch
h-cancel) and says in its docstring what it shows. Workers are real
``run_workers`` subprocesses (``tests/attack/run_workers.py``: the command
with this folder's handlers imported), stopped with real signals; waits are
bounded.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from django_dbworker.errors import MAX_SNOOZE_SECONDS, Snooze
from django_dbworker.models import Status, WorkItem
from tests.attack.tasks import cancels_itself, fail_when_told
from tests.attack.workers import IgnoresCancelOnFirstRun, PassesCheckToLongCall
from tests.conftest import ROOT, WorkerProcess, wait_until
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


class AttackWorker(WorkerProcess):
    """``run_workers`` through ``tests/attack/run_workers.py`` (this folder's handlers)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.attack.run_workers", *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def attack_worker(
    worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., AttackWorker]]:
    started: list[AttackWorker] = []

    def start(*args: str, env: dict[str, str] | None = None) -> AttackWorker:
        proc = AttackWorker(
            list(args), {**worker_env, **(env or {})}, tmp_path / f"worker-{len(started)}.log"
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def runs(key: str, kind: str = "run") -> int:
    return Execution.objects.filter(key=key, kind=kind).count()


def row(item: WorkItem) -> WorkItem:
    return WorkItem.objects.get(pk=item.pk)


# -- a cancel request outliving its attempt ---------------------------------------------


def test_cancel_requested_item_released_at_shutdown_is_not_run_again(attack_worker) -> None:
    """SIGTERM while a cancel-requested item runs past SHUTDOWN_TIMEOUT: the row is
    released back to ``pending`` with its request still set, and the next worker runs the
    work the operator cancelled once more (it ends ``succeeded``).

    Expected: the operator asked this attempt to stop and the worker stopped it; the
    row ends ``cancelled`` (``transitions.release`` should end rows with
    ``cancel_requested_at`` set as cancelled instead of handing them back).
    """
    item = IgnoresCancelOnFirstRun.enqueue({"key": "release"})
    first = attack_worker("atk_ignores_cancel", env={"DBWORKER_SHUTDOWN_TIMEOUT": "1"})
    wait_until(lambda: runs("release") == 1, timeout=60, what="the first run")
    assert row(item).cancel() is True
    wait_until(lambda: runs("release", "saw-cancel") == 1, timeout=30, what="the request heard")
    first.signal(signal.SIGTERM)
    assert first.wait() == 0
    after_release = row(item)
    second = attack_worker("atk_ignores_cancel", "--burst")
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


def test_cancel_requested_item_of_a_dead_worker_is_not_run_again(attack_worker) -> None:
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
    first = attack_worker("atk_ignores_cancel", env=env)
    wait_until(lambda: runs("stale") == 1, timeout=60, what="the first run")
    assert row(item).cancel() is True
    wait_until(lambda: runs("stale", "saw-cancel") == 1, timeout=30, what="the request heard")
    first.kill()
    second = attack_worker("atk_ignores_cancel", env=env)
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
    attack_worker,
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
    worker = attack_worker("atk_long_call")
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


def test_task_cancelled_while_running_sends_task_finished(attack_worker) -> None:
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
    worker = attack_worker()
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


def test_task_that_cancels_itself_has_one_error_for_its_one_attempt(attack_worker) -> None:
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
    worker = attack_worker("--burst")
    assert worker.wait(60) == 0
    assert WorkItem.objects.get(pk=int(result.id)).status == Status.CANCELLED
    fetched = cancels_itself.get_backend().get_result(result.id)
    classes = [error.exception_class_path for error in fetched.errors]
    assert (len(fetched.worker_ids), classes) == (1, ["django_dbworker.errors.Cancelled"])


# -- Snooze arguments ------------------------------------------------------------------


def test_snooze_of_an_int_too_big_for_a_float_is_cut_to_ten_years() -> None:
    """``Snooze(seconds)``: "more than MAX_SNOOZE_SECONDS (ten years) is cut to that", and
    anything else is a TypeError or ValueError. ``Snooze(2**1024)`` raises
    ``OverflowError`` from ``float(value)`` (errors.snooze_seconds) instead.

    Fix: ``snooze_seconds``: for an ``int`` compare before converting
    (``if isinstance(value, int) and value > MAX_SNOOZE_SECONDS: return MAX_SNOOZE_SECONDS``)
    or catch ``OverflowError`` and cut.
    """
    assert Snooze(2**1024).seconds == MAX_SNOOZE_SECONDS
