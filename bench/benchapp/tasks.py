"""Benchmark ``@task`` functions (Django's Tasks framework on ``DBWorkerBackend``).

The same work as ``workers.py``'s handlers, declared as Django tasks, so
that the cost of the task layer itself is what ``bench/tasks_compare.py``
measures against a plain ``WorkItemHandler``.
"""

from __future__ import annotations

import time

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task  # type: ignore[no-redef]


@task
def noop() -> None:
    """No work at all, like ``BenchNoop``."""
    return None


@task
def latency() -> float:
    """Returns the wall-clock time at which the task started, like ``BenchLatency``."""
    return time.time()
