"""``run_workers`` finds ``@task`` functions wherever they live, and imports nothing else.

A task in a module named neither ``tasks`` nor ``workers`` runs, whether its
row was pending when the worker started or enqueued after; a pending row's
handler name that is no task's import path is not imported. Under a real
``run_workers``.
"""

from __future__ import annotations

import os
import signal

import pytest

from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.testapp.models import Execution

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)


@task
def outside_a_tasks_module(key: str) -> str:
    """A ``@task`` in a module named neither ``tasks`` nor ``workers`` (here: a test module)."""
    Execution.objects.create(key=key, pid=os.getpid())
    return key


@task
def enqueued_after_start(key: str) -> str:
    """A ``@task`` in a module that is neither ``tasks`` nor ``workers`` (a test module)."""
    Execution.objects.create(key=key, pid=os.getpid())
    return key


def test_a_task_defined_outside_a_tasks_module_runs_on_run_workers(start_worker) -> None:
    """Django lets ``@task`` live in any module; our worker runs only autodiscovered ones.

    ``Task.module_path`` is the import path the row stores (our ``handler``),
    and django-tasks-db's worker imports it (``import_string(task_path)``,
    models.py ``DBTaskResult.task``), so a task in ``myapp/emails.py`` runs.
    ``run_workers`` only knows handlers registered by ``<app>.workers`` and
    ``<app>.tasks`` imports: the row stays READY forever (the worker logs it
    as an orphan). Moving from django-tasks-db should be a settings change.
    """
    result = outside_a_tasks_module.enqueue("anywhere")
    worker = start_worker("--burst")
    assert worker.wait(timeout=60) == 0, worker.log()
    row = WorkItem.objects.get(pk=int(result.id))
    assert row.status == Status.SUCCEEDED, f"{row.status}; worker log:\n{worker.log()}"
    result.refresh()
    assert result.return_value == "anywhere"
    assert Execution.objects.filter(key="anywhere").exclude(pid=os.getpid()).exists()


def test_a_task_outside_a_tasks_module_enqueued_after_the_worker_started_runs(
    start_worker,
) -> None:
    """A task module is imported for rows enqueued after ``run_workers`` started too.

    A task living in ``myapp/emails.py`` that is first enqueued after the
    worker started (a deploy: workers restart first, the web enqueues later;
    or simply the first signup of the day) is claimed and run, not left READY
    until the worker restarts. django-tasks-db's worker imports the task of
    each row it runs (``DBTaskResult.task``: ``import_string``), whenever it
    was enqueued: moving from django-tasks-db is a settings change.
    """
    worker = start_worker()
    try:
        worker.wait_for_log("Starting worker", timeout=60)
        result = enqueued_after_start.enqueue("late arrival")
        wait_until(
            lambda: WorkItem.objects.get(pk=int(result.id)).status != Status.PENDING,
            timeout=15,
            what="the task enqueued after the worker started to be claimed",
        )
        wait_until(
            lambda: WorkItem.objects.get(pk=int(result.id)).status == Status.SUCCEEDED,
            timeout=15,
            what="the task to succeed",
        )
    finally:
        worker.signal(signal.SIGTERM)
        worker.wait(30)


def test_run_workers_imports_only_task_modules_for_pending_rows(start_worker) -> None:
    """Any dotted handler name of a pending row is imported, task or not, before anything else.

    ``_import_pending_tasks`` hands every unregistered pending handler name
    that looks like ``a.b`` to ``import_string``: the rows of a class
    handler another deployment runs (``reports.daily``, ``email.send``: the
    usual dotted handler names), of a handler since renamed, or written by
    anything that can insert a row, make ``run_workers`` import whatever
    module the first part names, with its import-time side effects, though
    no ``@task`` can come of it. Here a row of handler ``this.s`` makes the
    worker print the Zen of Python (the stdlib module ``this`` prints it when
    imported). The import is only needed for names a DBWorkerBackend wrote:
    the import path of a Task (``Task.module_path``), in an installed app.
    """
    WorkItem.objects.create(handler="this.s", payload={}, max_attempts=1)
    worker = start_worker("--burst")
    assert worker.wait(timeout=60) == 0, worker.log()
    assert "The Zen of Python" not in worker.log(), worker.log()[:600]
