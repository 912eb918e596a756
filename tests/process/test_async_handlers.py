"""Async handlers (``async def handle``) on the worker's event loop, through real
``run_workers`` processes on every database of the run (SPEC "Async handlers").

The handlers (``tests/testapp/workers.py``: ``AsyncSleep`` and its kin) write
an Execution row at their start and at their end, through Django's thread for
sync code; the rows' ``created_at`` (the worker's clock) shows what overlapped
and what never ran. Waits are on conditions; no test asserts a duration.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from datetime import timedelta

import pytest

from django_dbworker import batch
from django_dbworker.models import Status, WorkItem
from tests.conftest import WorkerProcess, wait_until
from tests.testapp import tasks
from tests.testapp.models import Execution
from tests.testapp.workers import AsyncBlocks, AsyncKeyed, AsyncSleep, AsyncTimed, BatchDone, Sleep

pytestmark = pytest.mark.django_db(transaction=True)

StartWorker = Callable[..., WorkerProcess]
FINAL = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
FAST_STALE = {"DBWORKER_STALE_AFTER": "1.0", "DBWORKER_HEARTBEAT_INTERVAL": "0.2"}


def _times(key: str, kind: str) -> list:
    return list(
        Execution.objects.filter(key=key, kind=kind)
        .order_by("created_at")
        .values_list("created_at", flat=True)
    )


def _ended(items: list[WorkItem], timeout: float = 60) -> None:
    ids = [item.pk for item in items]
    wait_until(
        lambda: WorkItem.objects.filter(pk__in=ids, status__in=FINAL).count() == len(ids),
        timeout=timeout,
        what=f"{len(ids)} items to end",
    )


def test_async_items_overlap_beside_sync_ones_within_limits_order_and_timeouts(
    start_worker: StartWorker,
) -> None:
    """One worker, two threads: 20 async items run at once on its loop (every start before
    the first end) while sync items run on the threads; a timed-out coroutine is cancelled
    (its end never runs) and recorded TimeoutError; ``after=`` and a batch order and
    complete async items; a concurrency key runs one at a time; a rate limit spaces
    starts; an ``async def`` Django task is awaited on the loop too."""
    many = AsyncSleep.enqueue_many([{"key": f"m{i}", "seconds": 1.0} for i in range(20)])
    timed = AsyncTimed.enqueue({"key": "timed", "seconds": 2.5})
    sync = Sleep.enqueue_many([{"key": f"s{i}", "seconds": 0.3} for i in range(2)])
    # Outlives the timed item's would-be end: once it ended, that end is past.
    witness = Sleep.enqueue({"key": "witness", "seconds": 3.0})
    with batch(on_complete=BatchDone, payload={"run": "async"}) as b:
        parent = AsyncSleep.enqueue({"key": "parent", "seconds": 0.3})
        child = AsyncSleep.enqueue({"key": "child"}, after=[parent])
    keyed = [
        AsyncKeyed.enqueue({"key": "k", "seconds": 0.3}, concurrency_key="k") for _ in range(3)
    ]
    rated = AsyncKeyed.enqueue_many([{"key": "r", "seconds": 0} for _ in range(5)])
    on_loop = tasks.loop_thread.enqueue()
    worker = start_worker(
        "async_sleep",
        "async_timed",
        "async_keyed",
        "sleep",
        "batch_done",
        "tests.testapp.tasks.loop_thread",
        "--concurrency",
        "2",
    )
    task_row = WorkItem.objects.get(pk=int(on_loop.id))
    _ended([*many, timed, *sync, witness, parent, child, *keyed, *rated, task_row])
    wait_until(
        lambda: Execution.objects.filter(key=f"batch:{b.id}", kind="callback").exists(),
        timeout=30,
        what="the batch callback",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.log()

    on_loop.refresh()
    assert on_loop.return_value == "dbworker-loop", "an async @task is awaited on the loop"
    rows = WorkItem.objects.filter(
        pk__in=[i.pk for i in [*many, *sync, parent, child, *keyed, *rated]]
    )
    assert {row.status for row in rows} == {Status.SUCCEEDED}
    assert WorkItem.objects.get(pk=many[0].pk).result == {"slept": 1.0}
    starts = [_times(f"m{i}", "start")[0] for i in range(20)]
    ends = [_times(f"m{i}", "end")[0] for i in range(20)]
    assert max(starts) < min(ends), "20 async items on 2 threads ran at once"

    row = WorkItem.objects.get(pk=timed.pk)
    assert row.status == Status.FAILED and "TimeoutError" in row.last_error
    assert _times("witness", "end"), "the witness outlived the timed item's sleep"
    assert _times("timed", "start") and not _times("timed", "end")

    assert _times("child", "start")[0] >= _times("parent", "end")[0]
    k_starts, k_ends = _times("k", "start"), _times("k", "end")
    assert all(k_starts[i + 1] >= k_ends[i] for i in range(2)), "one item of key k at a time"
    r_starts = _times("r", "start")
    assert r_starts[4] - r_starts[0] >= timedelta(seconds=0.5), "4 starts a second at most"


def test_a_cancel_stops_a_running_coroutine_and_sigterm_drains_then_releases(
    start_worker: StartWorker,
) -> None:
    """A cancel request cancels the coroutine (its end never runs; ``cancelled``, one
    attempt). SIGTERM lets a short item finish, then cancels and releases a long one; an
    item that waited for a slot of the loop is released without starting."""
    long = AsyncSleep.enqueue({"key": "long", "seconds": 60})
    worker = start_worker(
        "async_sleep",
        "--concurrency",
        "1",
        "--async-concurrency",
        "2",
        "--shutdown-timeout",
        "3",
        env={"DBWORKER_HEARTBEAT_INTERVAL": "0.2"},
    )
    wait_until(lambda: _times("long", "start"), timeout=60, what="the long item to start")
    assert WorkItem.objects.get(pk=long.pk).cancel() is True
    wait_until(
        lambda: WorkItem.objects.get(pk=long.pk).status == Status.CANCELLED,
        timeout=30,
        what="the item to end cancelled",
    )
    row = WorkItem.objects.get(pk=long.pk)
    assert row.attempts == 1 and "cancelled by request" in row.last_error

    held, short = AsyncSleep.enqueue_many(
        [{"key": "held", "seconds": 60}, {"key": "short", "seconds": 1.5}], priority=2
    )
    waiting = AsyncSleep.enqueue({"key": "waiting"})
    wait_until(
        lambda: (
            _times("held", "start")
            and _times("short", "start")
            and WorkItem.objects.get(pk=waiting.pk).status == Status.CLAIMED
        ),
        timeout=60,
        what="two items to start and the third to wait for a slot",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.log()
    assert WorkItem.objects.get(pk=short.pk).status == Status.SUCCEEDED
    for item in (held, waiting):
        released = WorkItem.objects.get(pk=item.pk)
        assert released.status == Status.PENDING and released.claim_token is None
    assert "Released 2 unfinished" in worker.log()
    assert not _times("held", "end") and not _times("long", "end")
    assert not _times("waiting", "start"), "it waited for a slot: it never started"


def test_an_async_item_of_a_killed_worker_is_recovered_and_a_blocked_loop_is_reported(
    start_worker: StartWorker,
) -> None:
    """SIGKILL mid-coroutine: stale recovery returns the row and another worker runs it. A
    handler that blocks the loop (``time.sleep``) is logged with the stack it blocks in."""
    item = AsyncSleep.enqueue({"key": "victim", "seconds": 1.0})
    first = start_worker("async_sleep", env=FAST_STALE)
    wait_until(lambda: _times("victim", "start"), timeout=60, what="the item to start")
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    blocks = AsyncBlocks.enqueue({"seconds": 1.5})
    second = start_worker("async_sleep", "async_blocks", env=FAST_STALE)
    _ended([item, blocks])
    second.wait_for_log("answered again")
    second.signal(signal.SIGTERM)
    assert second.wait() == 0, second.log()
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.SUCCEEDED and row.attempts == 2
    assert len(_times("victim", "start")) == 2 and len(_times("victim", "end")) == 1
    log = second.log()
    assert "event loop was blocked" in log and "time.sleep(" in log, log
