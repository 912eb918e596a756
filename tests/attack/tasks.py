"""A Django ``@task`` of the cancel attack tests, imported by ``tests/attack/run_workers.py``."""

from __future__ import annotations

import time

from tests.attack.workers import flag, record

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef]


@task
def fail_when_told(key: str) -> str:
    """Runs until the test creates Execution(key, "go") (30 s at most), then raises."""
    record(key)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not flag(key, "go"):
        time.sleep(0.05)
    raise ValueError("the task failed after its cancel request")


@task
def cancels_itself(key: str) -> str:
    """Cancels its own item (SPEC: a handler may raise ``Cancelled`` unasked)."""
    from django_dbworker import Cancelled

    record(key)
    raise Cancelled("nothing to do")
