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
from tests.conftest import WorkerProcess, is_server_database, kill_other_connections, wait_until
from tests.testapp import tasks
from tests.testapp.models import Execution
from tests.testapp.workers import (
    AsyncBlocks,
    AsyncKeyed,
    AsyncRaises,
    AsyncSleep,
    AsyncSteps,
    AsyncStubborn,
    AsyncTimed,
    BatchDone,
    Sleep,
)

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


def test_a_second_sigterm_stops_at_once_past_a_coroutine_that_ignores_its_cancel(
    start_worker: StartWorker,
) -> None:
    """The second signal means now: a coroutine that swallows its cancel is not given its
    CANCEL_GRACE; its row is released and nothing of it runs after. (A shutdown timeout
    of its own: at 0 the first signal had stopped the worker already, and the second one
    could come while the interpreter shut down, which ended it with -15.)"""
    item = AsyncStubborn.enqueue({"key": "stubborn"})
    worker = start_worker("async_stubborn", "--shutdown-timeout", "60")
    wait_until(lambda: _times("stubborn", "start"), timeout=60, what="the item to start")
    worker.signal(signal.SIGTERM)
    worker.wait_for_log("SIGTERM received")
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.log()
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.PENDING and row.claim_token is None
    assert "did not stop within" not in worker.log(), "it waited the grace out"
    assert not _times("stubborn", "late")


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


def test_async_items_end_alone_when_they_fail_and_never_wait_for_a_busy_thread(
    start_worker: StartWorker,
) -> None:
    """While the one thread runs a long sync item, async items still start on the loop.
    SystemExit, KeyboardInterrupt or GeneratorExit raised by a coroutine, or a result JSON
    cannot hold, fails that item with its error; the loop goes on serving the others. An
    async item running past STALE_AFTER is heartbeated: never recovered."""
    busy = Sleep.enqueue({"key": "busy", "seconds": 60})
    worker = start_worker(
        "async_raises",
        "async_sleep",
        "sleep",
        "--concurrency",
        "1",
        "--shutdown-timeout",
        "1",
        env=FAST_STALE,
    )
    wait_until(lambda: _times("busy", "start"), timeout=60, what="the sync item to start")
    bad = {
        name: AsyncRaises.enqueue({"raise": name}, priority=5)
        for name in ("SystemExit", "KeyboardInterrupt", "GeneratorExit")
    }
    not_json = AsyncRaises.enqueue({}, priority=5)
    long = AsyncSleep.enqueue({"key": "long", "seconds": 3.0}, priority=5)
    after = AsyncSleep.enqueue_many([{"key": f"after{i}"} for i in range(3)])
    _ended([*bad.values(), not_json, long, *after], timeout=30)
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.log()
    assert WorkItem.objects.get(pk=busy.pk).status == Status.PENDING, "released at the stop"
    for name, item in bad.items():
        row = WorkItem.objects.get(pk=item.pk)
        assert row.status == Status.FAILED and name in row.last_error, (name, row.last_error)
    row = WorkItem.objects.get(pk=not_json.pk)
    assert row.status == Status.FAILED and "JSON" in row.last_error, row.last_error
    assert {WorkItem.objects.get(pk=i.pk).status for i in after} == {Status.SUCCEEDED}
    row = WorkItem.objects.get(pk=long.pk)
    assert row.status == Status.SUCCEEDED and row.attempts == 1
    assert len(_times("long", "start")) == 1


def test_async_handlers_query_again_once_the_database_dropped_their_connection(
    start_worker: StartWorker,
) -> None:
    """A connection the server dropped (a restart, a failover) costs async handlers one
    attempt, as it does sync ones: the connection their ORM calls share (Django's thread
    for sync code) is tidied after a failure, and the retry queries on a new one."""
    if not is_server_database():
        pytest.skip("SQLite has no server to drop a connection")
    first = AsyncSteps.enqueue({"key": "before"})
    worker = start_worker("async_steps", "--concurrency", "1")
    _ended([first])
    assert kill_other_connections() > 0
    after = AsyncSteps.enqueue_many([{"key": f"after{i}"} for i in range(3)])
    _ended(after, timeout=30)
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.log()
    rows = WorkItem.objects.filter(pk__in=[i.pk for i in after])
    assert {row.status for row in rows} == {Status.SUCCEEDED}, [r.last_error for r in rows]
