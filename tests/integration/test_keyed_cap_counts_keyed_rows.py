"""The keyed cap (KEYED_IN_FLIGHT rows per thread) counts rows of limited *keys*, not every
row of a handler that declares a limit.

A handler with a ``concurrency_limit`` limits only the rows enqueued with a
``concurrency_key``; its rows without one are "not limited" (SPEC "Flow control") and are
prefetched like any unkeyed row (``worker/claim.py``). The cap on keyed rows must not count
them: a buffer of such unkeyed rows would leave no room for any keyed row, and a keyed row
of a higher priority would wait behind the whole unkeyed backlog of lower priority.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from django_dbworker.models import WorkItem
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_keyed_row_is_claimed_beside_a_buffer_of_the_handlers_unkeyed_rows(
    background_worker: Callable[..., Worker],
) -> None:
    # 400 unkeyed rows of the limited handler, 50 ms each: 10 s of work for two threads,
    # prefetched for a horizon of 2 s (some 80 rows buffered).
    Keyed.enqueue_many([{"key": f"bulk-{n}", "seconds": 0.05} for n in range(400)])
    worker = background_worker(["keyed"], concurrency=2, poll_interval=0.2, prefetch_horizon=2.0)
    wait_until(
        lambda: Execution.objects.filter(kind="end").count() >= 6,
        what="the pace to be known: a buffer of unkeyed rows behind the running ones",
    )
    loop = worker.claim_loop
    assert loop is not None
    urgent = Keyed.enqueue({"key": "urgent", "seconds": 0}, concurrency_key="K", priority=10)
    # Its key is free and it outranks every buffered row: it starts within a refill or two.
    started = Execution.objects.filter(key="urgent", kind="start")
    deadline = time.monotonic() + 3
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), (
        f"the keyed priority-10 row (key free) is still "
        f"{WorkItem.objects.get(pk=urgent.pk).status} after 3 s, while "
        f"{Execution.objects.filter(kind='end').count()} unkeyed rows of priority 0 ran and "
        f"{loop.ledger.buffered()} are buffered"
    )
