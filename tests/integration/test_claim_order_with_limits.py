"""The claim order across a worker's limited and plain handlers.

A worker serving a limited handler claims all its handlers' rows in one keyed claim,
so the documented claim order holds across them (priority DESC, run_after, id; SPEC:
"priority: higher runs first"): a high-priority or older plain row never waits behind
every keyed row, nor an urgent batch behind a full buffer; ``--max-items`` and burst
mode count both kinds. These guard any split of the claim cycle (keyed claim first,
then the plain claim in the room left), which breaks that order; the cost of the one
claim is documented (flow-control.md, "Cost").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction

from django_dbworker import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.worker import Worker
from django_dbworker.worker.config import WorkerConfig
from tests.conftest import wait_until
from tests.factories import wait_buffered_behind_gate
from tests.testapp.models import Execution
from tests.testapp.workers import GATE, Gate, Keyed, Record, _record

pytestmark = pytest.mark.django_db(transaction=True)


class KeyedGate(WorkItemHandler):
    """``Gate`` with a concurrency limit: records its start; with ``wait``, waits for GATE."""

    name = "keyed_gate"
    concurrency_limit = 1

    def handle(self, payload: Any) -> None:
        _record(payload, "start")
        if payload.get("wait"):
            GATE.wait(10)


def run_order() -> list[str]:
    return list(
        Execution.objects.filter(kind__in=["start", "run"])
        .order_by("pk")
        .values_list("key", flat=True)
    )


def run_burst(worker: Worker) -> None:
    """Run a burst ``worker`` in a thread of its own to its end (60 s at most)."""
    done = threading.Thread(target=worker.run, daemon=True)
    done.start()
    done.join(60)
    try:
        assert not done.is_alive(), "burst worker did not end"
    finally:
        worker.stop(immediate=True)
        done.join(10)


# -- claim order across the two parts -----------------------------------------------


def test_a_high_priority_plain_row_is_not_claimed_after_every_lower_keyed_row() -> None:
    """One plain row of priority 10, 30 keyed rows (distinct keys) of priority 0.

    The plain row should run first (priority: higher runs first). The keyed part
    comes first with the whole room, so the plain part gets room only once the
    keyed handler has nothing claimable left: the plain row runs last.
    """
    for n in range(30):
        Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n}")
    Record.enqueue({"key": "plain-high"}, priority=10)
    worker = Worker([Keyed, Record], WorkerConfig(inline=True, burst=True))
    worker.run()
    order = run_order()
    assert len(order) == 31
    assert order[0] == "plain-high", (
        f"the priority-10 row ran at position {order.index('plain-high')}"
    )


def test_an_older_plain_row_of_equal_priority_is_not_overtaken_by_every_keyed_row() -> None:
    """Same priority: claim order is run_after, id. The plain row is oldest, it runs last."""
    Record.enqueue({"key": "plain-old"})
    for n in range(30):
        Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n}")
    worker = Worker([Keyed, Record], WorkerConfig(inline=True, burst=True))
    worker.run()
    order = run_order()
    assert len(order) == 31
    assert order.index("plain-old") == 0, (
        f"the oldest row ran at position {order.index('plain-old')}"
    )


def test_a_threaded_worker_starts_the_high_priority_plain_row_among_the_first(
    background_worker: Callable[..., Worker],
) -> None:
    """A real (threaded) worker, 2 threads: 200 keyed rows, then one plain row of priority 50."""
    for n in range(200):
        Keyed.enqueue({"key": f"k{n}", "seconds": 0.005}, concurrency_key=f"k{n}")
    Record.enqueue({"key": "plain-high"}, priority=50)
    background_worker(["keyed", "record"], concurrency=2)
    wait_until(
        lambda: Execution.objects.filter(key="plain-high").exists(), timeout=30, what="plain row"
    )
    order = run_order()
    assert order.index("plain-high") < 4, (
        f"{order.index('plain-high')} lower-priority keyed rows started before the priority-50 row"
    )


# -- the urgent path ------------------------------------------------------------------


@pytest.mark.postgres_only
def test_an_urgent_batch_of_a_limited_handler_is_claimed_ahead_of_a_full_buffer_up_to_its_cap(
    background_worker: Callable[..., Worker], gate: None
) -> None:
    """A worker of a plain and a limited handler, its one thread held by a gate and its
    buffer full of the plain handler's rows. A batch of the limited handler's rows that
    outranks the buffer is claimed ahead of it (a wake-up stands for the whole
    ``enqueue_many``), but only up to the rows of limited keys this worker may hold
    (``KEYED_IN_FLIGHT`` per thread): the rest stay pending, for workers that can start
    them, instead of waiting in this buffer."""
    from django_dbworker.worker.claim import KEYED_IN_FLIGHT

    for n in range(5):
        Gate.enqueue({"key": f"fast-{n}"}, priority=10)
    for n in range(300):
        Gate.enqueue({"key": f"gated-{n}", "wait": True})
    worker = background_worker(
        ["gate", "keyed_gate"], concurrency=1, poll_interval=30.0, prefetch_horizon=5.0
    )
    wait_buffered_behind_gate(worker)
    # enqueue_many gives every row one key: each row gets its own in the same transaction
    # (keyed after the commit, the worker's wake-up could claim rows while still unkeyed).
    with transaction.atomic():
        items = KeyedGate.enqueue_many([{"key": f"hi-{n}"} for n in range(40)], priority=5)
        for n, item in enumerate(items):
            WorkItem.objects.filter(pk=item.pk).update(concurrency_key=f"hi-{n}")
    pks = [i.pk for i in items]
    rows = WorkItem.objects.filter(pk__in=pks)
    wait_until(
        lambda: rows.filter(status=Status.CLAIMED).count() >= KEYED_IN_FLIGHT,
        timeout=10,
        what="the batch's first rows to be claimed ahead of the buffer",
    )
    # The loop quiet again: the urgent claims (a wake-up's doubling included) are done.
    wait_until(lambda: worker.idle.is_set() or not worker.wake.is_set(), what="a quiet loop")
    assert rows.filter(status=Status.CLAIMED).count() == KEYED_IN_FLIGHT
    assert set(rows.filter(status=Status.PENDING).values_list("attempts", flat=True)) == {0}


# -- --max-items, burst mode ---------------------------------------------------------


@pytest.mark.parametrize("max_items", [1, 3, 7])
def test_max_items_is_never_exceeded_across_the_parts(
    background_worker: Callable[..., Worker], max_items: int
) -> None:
    for n in range(10):
        Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n}")
        Record.enqueue({"key": f"p{n}"})
    worker = background_worker(["keyed", "record"], concurrency=4, max_items=max_items)
    wait_until(lambda: worker.stopping.is_set(), timeout=20, what="the worker to stop")
    wait_until(
        lambda: not WorkItem.objects.filter(status=Status.CLAIMED).exists(),
        timeout=20,
        what="claimed rows to end",
    )
    taken = WorkItem.objects.exclude(status=Status.PENDING).count()
    assert taken == max_items


def test_burst_mode_leaves_nothing_behind_with_a_hot_key_and_plain_rows() -> None:
    for n in range(15):
        Keyed.enqueue({"key": "hot", "n": n}, concurrency_key="hot")
    for n in range(15):
        Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n}")
        Record.enqueue({"key": f"p{n}"})
    from tests.factories import worker_config

    worker = Worker([Keyed, Record], worker_config(concurrency=3, burst=True))
    run_burst(worker)
    assert not WorkItem.objects.exclude(status=Status.SUCCEEDED).exists()


# -- counters ---------------------------------------------------------------------------


def test_claims_counts_the_claim_statements_that_found_rows() -> None:
    """``Worker.claims``: "Claim statements that found rows". A cycle whose two parts
    both find rows is two statements; the calls are recorded on their way to the claim."""
    from tests.factories import worker_config

    for n in range(20):
        Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n}")
        Record.enqueue({"key": f"p{n}"})
    worker = Worker([Keyed, Record], worker_config(concurrency=4, burst=True))
    real = worker.ops.claim
    found: list[int] = []

    def recording(**kwargs: Any) -> Any:
        result = real(**kwargs)
        if result:
            found.append(len(result))
        return result

    worker.ops.claim = recording  # type: ignore[method-assign]
    try:
        worker.run()
    finally:
        del worker.ops.claim
    assert worker.outcomes == {"succeeded": 40}
    assert sum(found) == worker.claimed == 40
    assert worker.claims == len(found), (
        f"{len(found)} statements found rows, claims says {worker.claims}"
    )


def test_rated_limited_and_plain_handlers_in_one_burst_worker_all_run() -> None:
    from tests.factories import worker_config
    from tests.testapp.workers import Rated

    for n in range(10):
        Rated.enqueue({"key": f"r{n}"})
        Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n % 3}")
        Record.enqueue({"key": f"p{n}"}, priority=n)
    worker = Worker(
        [Rated, Keyed, Record], worker_config(concurrency=3, burst=True, max_items=None)
    )
    run_burst(worker)
    assert worker.outcomes == {"succeeded": 30}
    assert worker.claimed == 30
    assert not WorkItem.objects.exclude(status=Status.SUCCEEDED).exists()
