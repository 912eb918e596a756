"""A rate limit refuses only starts beyond it (SPEC "Flow control": "starts beyond the limit
wait pending"), also on a busy worker process.

A start is taken in the window just before the handler runs (``flow/rates.py``). In a
worker whose other threads run Python code (CPU-bound handlers), each return from the
database waits for Python's lock, and a take's return took 100-500 ms here: a start that
is taken must run, however late, never be refused for it (refusing such starts livelocked
a busy process: none of 10 ran in 15 s).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from django_dbworker.handlers import WorkItemHandler
from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from tests.factories import worker_config

pytestmark = pytest.mark.django_db(transaction=True)

STOP = threading.Event()


class GenerousRate(WorkItemHandler):
    """Rate-limited far above what the test asks of it: its window never fills."""

    name = "attack_generous_rate"
    rate_limit = "1000/s"

    def handle(self, payload: Any) -> None:
        return None


class Crunch(WorkItemHandler):
    """CPU-bound Python (a parser, a report): holds the GIL between switch intervals."""

    name = "attack_crunch"

    def handle(self, payload: Any) -> None:
        deadline = time.monotonic() + float(payload["seconds"])
        while time.monotonic() < deadline and not STOP.is_set():
            sum(range(2000))


@pytest.fixture
def stopped_crunch() -> Any:
    STOP.clear()
    yield
    STOP.set()


def test_a_rated_handler_with_room_in_its_window_starts_beside_cpu_bound_neighbours(
    stopped_crunch: None,
) -> None:
    Crunch.enqueue_many([{"seconds": 30} for _ in range(3)], priority=10)
    GenerousRate.enqueue_many([{} for _ in range(10)])
    reg = CollectorRegistry()
    worker = Worker(
        [Crunch, GenerousRate], worker_config(concurrency=4), metrics=WorkerMetrics(reg)
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        done = WorkItem.objects.filter(handler=GenerousRate.name, status=Status.SUCCEEDED)

        def refused() -> float:
            return (
                reg.get_sample_value(
                    "worker_throttled_total", {"worker": GenerousRate.name, "reason": "rate"}
                )
                or 0.0
            )

        deadline = time.monotonic() + 15
        while done.count() < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.count() == 10, (
            f"{done.count()} of 10 rated items (1000/s: room to spare) ran in 15 s beside "
            f"CPU-bound ones; {refused():.0f} starts refused"
        )
        # Not one start was beyond the limit: none may be refused.
        assert not refused(), f"{refused():.0f} starts refused although the window had room"
    finally:
        STOP.set()
        worker.stop(immediate=True)
        thread.join(15)
