"""Attack s14 on flow control, with real ``run_workers`` processes.

``--burst``: "process until nothing is claimable ... then exit 0". A paused
queue's rows are claimed by no worker, so they are not claimable: a burst
run leaves them pending and exits, whether or not the handler has a
``concurrency_limit``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from django_dbworker import pause_queue
from django_dbworker.models import Status, WorkItem
from tests.conftest import WorkerProcess
from tests.testapp.workers import Keyed, Paused

pytestmark = pytest.mark.django_db(transaction=True)


def test_burst_exits_with_a_paused_queue_with_or_without_concurrency_keys(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    Paused.enqueue({"key": "plain"})
    pause_queue("pausable", by="test")
    plain = start_worker("pausable", "--burst", "--interval", "0.2")
    assert plain.wait(60) == 0

    Keyed.enqueue({"key": "k"}, concurrency_key="k", queue="pausable")
    keyed = start_worker("keyed", "--burst", "--interval", "0.2")
    # Killed and failed after 30 s if it is still running.
    assert keyed.wait(30) == 0
    assert WorkItem.objects.filter(status=Status.PENDING, attempts=0).count() == 2
