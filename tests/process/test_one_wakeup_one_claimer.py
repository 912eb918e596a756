"""One wake-up, one claimer: an enqueue wakes one idle worker of a fleet, and always one.

Real ``run_workers`` processes on PostgreSQL, each serving the same handler:
one holds the wake-up turn and LISTENs, the others wait for it
(``worker/wakeup.py``). Claims are counted by the workers themselves
(``worker_poll_cycles_total`` on each one's metrics port), never timed.
POLL_INTERVAL is 60 s, so a poll cannot pass for a wake-up.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from django_dbworker.models import Status, WorkItem
from tests.conftest import kill_other_connections, wait_until, wake_turns
from tests.process.test_metrics_endpoint import free_port, scrape, try_scrape
from tests.testapp.models import Execution
from tests.testapp.workers import AsyncSleep, Record, Sleep

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef]

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

SLOW_POLL = {"DBWORKER_POLL_INTERVAL": "60"}
TOOK = "Took the wake-up turn"


def claims(port: int) -> float:
    """Claim statements the worker behind ``port`` ran (found rows or not)."""
    return scrape(port)[("worker_poll_cycles_total", (("worker", "workitems"),))]


def succeeded(pk: int) -> bool:
    return WorkItem.objects.get(pk=pk).status == Status.SUCCEEDED


def test_an_enqueue_of_one_item_makes_one_idle_worker_of_three_claim_also_after_a_failover(
    start_worker,
) -> None:
    ports = [free_port() for _ in range(3)]
    workers = [start_worker("record", "--metrics-port", str(port), env=SLOW_POLL) for port in ports]
    wait_until(lambda: wake_turns() == (1, 2), timeout=60, what="one turn held, two waiting")
    wait_until(lambda: all(try_scrape(port) for port in ports), what="the metrics servers")
    # A first item settles the start-up claims (each worker claims once as it subscribes,
    # the holder once more as it takes the turn).
    first = Record.enqueue({"key": "first"})
    wait_until(lambda: succeeded(first.pk), timeout=30, what="the first item")
    for n in range(3):
        before = [claims(port) for port in ports]
        item = Record.enqueue({"key": f"one-{n}"})
        wait_until(lambda pk=item.pk: succeeded(pk), timeout=30, what=f"item {n}")
        # One worker heard of it and claimed; the others stayed idle (woken, all
        # three would claim). Counted per worker: a loaded machine can delay a
        # worker's own earlier claim (its start-up claim, its turn's catch-up
        # claim) into this window, which is not a wake-up reaching it.
        after = [claims(port) for port in ports]
        assert sum(1 for b, a in zip(before, after, strict=True) if a > b) == 1, (before, after)
    assert wake_turns() == (1, 2)
    # As at a failover, every session ends, the turn's with them: the workers reconnect
    # and take turns anew, and the next wake-up reaches one of them.
    kill_other_connections()
    wait_until(lambda: wake_turns() == (1, 2), timeout=60, what="the turn taken anew")
    item = Record.enqueue({"key": "after"})
    wait_until(lambda: succeeded(item.pk), timeout=20, what="a wake-up after the failover")
    for worker in workers:
        worker.signal(signal.SIGTERM)
    assert [worker.wait() for worker in workers] == [0, 0, 0]


def test_a_worker_killed_holding_a_wake_up_leaves_it_to_the_next(start_worker) -> None:
    workers = [start_worker("record", "-v", "2", env=SLOW_POLL) for _ in range(2)]
    wait_until(lambda: wake_turns() == (1, 1), timeout=60, what="one turn held, one waiting")
    (holder,) = [worker for worker in workers if TOOK in worker.log()]
    (other,) = [worker for worker in workers if worker is not holder]
    # Frozen, the holder cannot claim what it is told; then it dies with the wake-up.
    holder.signal(signal.SIGSTOP)
    item = Record.enqueue({"key": "orphan"})
    holder.kill()
    # Its session ended with it: the other worker takes the turn and claims at once.
    wait_until(lambda: succeeded(item.pk), timeout=20, what="the other worker to claim")
    assert TOOK in other.log()
    wait_until(lambda: wake_turns() == (1, 0), what="the turn to stay with the survivor")
    other.signal(signal.SIGTERM)
    assert other.wait() == 0


@pytest.mark.parametrize(
    ("args", "handler", "timeout"),
    [
        pytest.param(("sleep", "--concurrency", "1"), Sleep, 20, id="threads busy"),
        # Free slots of the other kind are no room: counted together, the holder kept
        # the turn and the item waited in its buffer while the other worker idled.
        pytest.param(
            ("sleep", "async_sleep", "--concurrency", "1"), Sleep, 5, id="threads busy, loop free"
        ),
        pytest.param(
            ("sleep", "async_sleep", "--async-concurrency", "1"),
            AsyncSleep,
            5,
            id="loop full, threads free",
        ),
    ],
)
def test_a_holder_without_room_passes_the_wake_up_to_an_idle_worker(
    start_worker, args: tuple[str, ...], handler: type[Sleep] | type[AsyncSleep], timeout: float
) -> None:
    for _ in range(2):
        start_worker(*args, env=SLOW_POLL)
    wait_until(lambda: wake_turns() == (1, 1), timeout=60, what="one turn held, one waiting")
    handler.enqueue({"key": "long", "seconds": 60})
    wait_until(lambda: Execution.objects.filter(key="long").exists(), what="the long item")
    # Whoever runs it has no room for another of its kind; the other worker must hear of
    # the next item.
    short = handler.enqueue({"key": "short", "seconds": 0})
    wait_until(lambda: succeeded(short.pk), timeout=timeout, what="the idle worker to claim")
    pids = dict(Execution.objects.filter(kind="start").values_list("key", "pid"))
    assert pids["long"] != pids["short"]


def test_a_worker_that_left_out_its_full_kind_claims_it_once_room_frees_up(
    start_worker,
) -> None:
    """A claim that left async rows out (the loop full) and found nothing of the keyed sync
    handler is no keyed rest: the async row left out starts once the slot frees, not a poll
    interval later (no wake-up announces it again)."""
    start_worker("keyed", "async_sleep", "--async-concurrency", "1", env=SLOW_POLL)
    wait_until(lambda: wake_turns() == (1, 0), timeout=60, what="the turn held")
    AsyncSleep.enqueue({"key": "long", "seconds": 1})
    wait_until(lambda: Execution.objects.filter(key="long").exists(), what="the long item")
    short = AsyncSleep.enqueue({"key": "short", "seconds": 0})
    wait_until(lambda: succeeded(short.pk), timeout=15, what="the row left out to start")


def test_a_stopping_holder_passes_the_wake_up_turn(start_worker) -> None:
    workers = [start_worker("sleep", "--concurrency", "2", env=SLOW_POLL) for _ in range(2)]
    wait_until(lambda: wake_turns() == (1, 1), timeout=60, what="one turn held, one waiting")
    # The holder claims it, and has room for more: it keeps the turn.
    Sleep.enqueue({"key": "long", "seconds": 60})
    wait_until(lambda: Execution.objects.filter(key="long").exists(), what="the long item")
    pid = Execution.objects.get(key="long", kind="start").pid
    (holder,) = [worker for worker in workers if worker.pid == pid]
    # Stopping, it waits for its running item (SHUTDOWN_TIMEOUT: 30 s) and claims
    # nothing more: the turn goes to the other worker, which claims the next item.
    holder.signal(signal.SIGTERM)
    # Once it has heard the signal: an item enqueued before that is the holder's to run.
    holder.wait_for_log("SIGTERM received")
    late = Sleep.enqueue({"key": "late", "seconds": 0})
    wait_until(lambda: succeeded(late.pk), timeout=20, what="the other worker to claim")
    assert holder.proc.poll() is None
    assert Execution.objects.get(key="late", kind="start").pid != pid


def test_a_statement_timeout_does_not_end_the_wait_for_the_turn(start_worker) -> None:
    """A DBA's statement_timeout cancels the wait for the turn: the worker waits anew."""
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER DATABASE \"{name}\" SET statement_timeout = '300ms'")
    try:
        workers = [start_worker("record", "-v", "2", env=SLOW_POLL) for _ in range(2)]
        wait_until(lambda: wake_turns() == (1, 1), timeout=60, what="one turn held, one waiting")
        (waiter,) = [worker for worker in workers if TOOK not in worker.log()]
        waiter.wait_for_log("The wait for the wake-up turn was cancelled")
        wait_until(lambda: wake_turns() == (1, 1), what="the waiter to wait again")
        item = Record.enqueue({"key": "after"})
        wait_until(lambda: succeeded(item.pk), timeout=20, what="the holder to claim")
        assert "lost its connection" not in waiter.log()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER DATABASE "{name}" RESET statement_timeout')


@task
def found_after_start(key: str) -> str:
    """A ``@task`` of a module no worker imports at start: each finds it (task discovery)."""
    Execution.objects.create(key=key, pid=os.getpid())
    return key


def test_workers_that_found_a_task_after_start_still_take_turns(start_worker) -> None:
    """A worker's group changes when it finds a task: the turn it holds is its old group's.

    It must give that one back, not the new group's (which it does not hold):
    else the other worker waits for the old turn for ever, not listening, and
    a wake-up the busy holder cannot take reaches no one.
    """
    # Every handler (task discovery is on then), on a queue of their own: the test app's
    # periodic handlers run on others.
    workers = [
        start_worker("--queue", "other", "--concurrency", "1", "-v", "2", env=SLOW_POLL)
        for _ in range(2)
    ]
    wait_until(lambda: wake_turns() == (1, 1), timeout=60, what="one turn held, one waiting")
    # Due in an hour: pending, so that both workers find it.
    found_after_start.using(
        queue_name="other", run_after=timezone.now() + timedelta(hours=1)
    ).enqueue("found")
    for worker in workers:
        worker.wait_for_log("Now running task(s) enqueued since start", timeout=30)
    wait_until(lambda: wake_turns() == (1, 1), timeout=20, what="the turns of the new group")
    # More items than the holder takes at once: it passes the turn on, and both take
    # turns again once they are done, one holding it and one waiting for it.
    Record.enqueue_many([{"key": f"r{n}"} for n in range(300)], queue="other")
    wait_until(
        lambda: Execution.objects.filter(key__startswith="r").count() == 300,
        timeout=60,
        what="the items",
    )
    wait_until(lambda: wake_turns() == (1, 1), timeout=20, what="the turns of the new group")
