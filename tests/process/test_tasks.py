"""Django ``@task`` functions under a real ``run_workers``: crash recovery, side by side."""

from __future__ import annotations

import signal

import pytest

from django_dbworker.models import Status, WorkItem
from django_dbworker.tasks.compat import TaskResultStatus
from tests.conftest import wait_until
from tests.testapp import tasks
from tests.testapp.models import Execution
from tests.testapp.workers import Record

pytestmark = pytest.mark.django_db(transaction=True)

FAST_STALE = {"DBWORKER_STALE_AFTER": "1.0"}


@pytest.mark.pgbouncer
def test_a_task_killed_mid_run_is_recovered_and_finishes(start_worker) -> None:
    result = tasks.kill_worker.enqueue("k", times=1)
    first = start_worker("tests.testapp.tasks.kill_worker")
    assert first.wait() == -signal.SIGKILL  # the task killed its worker mid-run
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING  # nobody finished it
    second = start_worker("tests.testapp.tasks.kill_worker", env=FAST_STALE)
    wait_until(
        lambda: WorkItem.objects.get(pk=int(result.id)).status == Status.SUCCEEDED,
        timeout=30,
        what="the recovered task to succeed",
    )
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == "survived"
    assert result.attempts == 2 and len(result.worker_ids) == 2
    first_worker, second_worker = result.worker_ids
    assert f":{first.pid}:" in first_worker and f":{second.pid}:" in second_worker
    (lost,) = result.errors
    assert lost.exception_class_path == "django_dbworker.errors.WorkerLost"
    assert first_worker in lost.traceback
    assert Execution.objects.filter(key="k").count() == 2
    second.signal(signal.SIGTERM)
    assert second.wait() == 0


def test_tasks_and_handlers_share_one_worker(start_worker) -> None:
    results = [tasks.add.enqueue(n, n) for n in range(20)]
    Record.enqueue_many([{"key": str(n)} for n in range(20)])
    worker = start_worker("--burst")
    assert worker.wait(timeout=60) == 0, worker.log()
    for n, result in enumerate(results):
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 2 * n
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 40
    assert "tests.testapp.tasks.add" in worker.log()  # listed among the handlers
