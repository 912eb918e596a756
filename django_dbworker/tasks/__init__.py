"""Django's Tasks framework on django-dbworker: ``DBWorkerBackend``.

::

    TASKS = {"default": {"BACKEND": "django_dbworker.tasks.DBWorkerBackend"}}

Then ``@task`` functions (``django.tasks.task``, or ``django_tasks.task`` on
Django 5.2) enqueue ``WorkItem`` rows that ``manage.py run_workers`` runs;
``django_dbworker.tasks.task`` also takes the worker's options
(``max_attempts``, ``timeout``, ``atomic``, ``sensitive``, ``unique_key``).
See docs/topics/tasks.md.
"""

from __future__ import annotations

from django_dbworker.tasks.backend import DBWorkerBackend, DBWorkerTask, task

__all__ = ["DBWorkerBackend", "DBWorkerTask", "task"]
