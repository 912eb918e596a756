"""Attack tests on ``manage.py run_workers`` as a real subprocess."""

from __future__ import annotations

import pytest

from django_dbworker.models import WorkItem
from tests.testapp.models import Execution
from tests.testapp.workers import Slow

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_worker_stopped_by_its_watchdog_exits_non_zero(start_worker) -> None:
    # Concurrency 1 makes the abandoned-thread cap 1: the first timeout of the
    # "slow" handler (0.5 s timeout, sleeps 3 s) reaches it. The watchdog logs
    # that it stops the worker "and exits non-zero so that a supervisor restarts
    # it" (Worker.unhealthy is set), but run_workers never reads
    # Worker.unhealthy and exits 0, so a supervisor that restarts on failure
    # (systemd Restart=on-failure, Kubernetes Job) leaves the queue unserved.
    Slow.enqueue({"key": "w", "seconds": 3})
    worker = start_worker("slow", env={"DBWORKER_CONCURRENCY": "1"})
    worker.wait_for_log("Stopping this worker", timeout=30)
    code = worker.wait(timeout=60)
    assert Execution.objects.filter(key="w", kind="start").exists()
    assert WorkItem.objects.count() == 1
    assert code != 0, f"exit status {code} after the watchdog stopped the worker:\n{worker.log()}"
