"""Attacks on ``DBWorkerBackend`` (issue 12) under a real ``run_workers``."""

from __future__ import annotations

import os

import pytest

from django_dbworker.models import Status, WorkItem
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


def test_a_task_defined_outside_a_tasks_module_runs_on_run_workers(start_worker) -> None:
    """Django lets ``@task`` live in any module; our worker runs only autodiscovered ones.

    ``Task.module_path`` is the import path the row stores (our ``handler``),
    and django-tasks-db's worker imports it (``import_string(task_path)``,
    models.py ``DBTaskResult.task``), so a task in ``myapp/emails.py`` runs.
    ``run_workers`` only knows handlers registered by ``<app>.workers`` and
    ``<app>.tasks`` imports: the row stays READY forever (the worker logs it
    as an orphan). Issue 12: "moving from django-tasks-db is a settings
    change".
    """
    result = outside_a_tasks_module.enqueue("anywhere")
    worker = start_worker("--burst")
    assert worker.wait(timeout=60) == 0, worker.log()
    row = WorkItem.objects.get(pk=int(result.id))
    assert row.status == Status.SUCCEEDED, f"{row.status}; worker log:\n{worker.log()}"
    result.refresh()
    assert result.return_value == "anywhere"
    assert Execution.objects.filter(key="anywhere").exclude(pid=os.getpid()).exists()
