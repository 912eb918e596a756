"""Attack s15b on the fixed key share (``worker/peers.py``), with real ``run_workers``.

Second round: the register under a lock, idle workers beside held keys, keys held in
another pool's queue. PostgreSQL only: the other databases have no hand-over, no share.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from django.db import connection, transaction

from django_dbworker.flow_models import WorkerProcess as Registered
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import assert_no_key_overlaps
from tests.process.test_attack_s15_share import free_port, poll_cycles, registered
from tests.process.test_key_share import enqueue, keys_by_pid
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


def _measure(seconds: float) -> None:
    """A measured window (the assertion after it has a wide margin)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)


# -- idle workers poll 4x a second while any key is held ---------------------------------


def test_idle_workers_poll_at_their_poll_interval_while_a_key_is_held(start_worker) -> None:
    """The fix of s15 made an empty claim count 0 keys in play (no recount). But the
    keys in play include the keys *held* (``held`` in CLAIM_HEADS: any claimed keyed row
    of the handler, whoever holds it). One long item of one key running anywhere makes
    K = 1 for every worker of the pool, so ``recount_in`` is 0.25 s and each worker
    with nothing to claim runs the key-driven claim four times a second for as long as
    the item runs: "idle workers poll at POLL_INTERVAL (not faster)"."""
    env = {"DBWORKER_POLL_INTERVAL": "2.0"}
    ports = [free_port(), free_port()]
    workers = [
        start_worker("keyed", "--concurrency", "2", "--metrics-port", str(port), env=env)
        for port in ports
    ]
    wait_until(lambda: Registered.objects.count() == 2, what="both workers' register rows")
    for port in ports:
        wait_until(lambda p=port: poll_cycles(p) is not None, what="the metrics servers")
    Keyed.enqueue({"key": "long", "seconds": 20}, concurrency_key="long")
    wait_until(
        lambda: Execution.objects.filter(key="long", kind="start").exists(),
        what="the long item to start",
    )
    _measure(1.0)  # the enqueue's wake-ups and the hand-over's end pass
    before = [poll_cycles(port) for port in ports]
    _measure(4.0)  # two poll intervals
    after = [poll_cycles(port) for port in ports]
    for worker in workers:
        assert worker.proc.poll() is None, worker.log()
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 1
    assert WorkItem.objects.count() == 1  # nothing else to claim, for either worker
    claims = [int(a - b) for a, b in zip(after, before, strict=True)]  # type: ignore[operator]
    # Two poll intervals: about 2 claims each (a margin for a wake-up), not 16.
    assert max(claims) <= 4, f"claims in 4 s by workers with nothing to claim: {claims}"


# -- a lock on the register stalls the heartbeat: a running item runs twice ---------------


@pytest.mark.parametrize("lock", [False, True], ids=["unlocked", "locked"])
def test_a_locked_register_row_does_not_stop_the_heartbeat_of_running_items(
    start_worker, lock: bool
) -> None:
    """The heartbeat thread refreshes the register row (``KeyShare.beat`` runs as the
    heartbeat's ``also``) with an UPDATE that waits for any lock on the row, with no lock
    or statement timeout. While an operator's transaction holds the row (an UPDATE left
    open in psql, a VACUUM FULL or migration of the table), the heartbeat thread hangs in
    it: no heartbeat reaches the worker's claimed rows, the thread is alive so the
    watchdog sees nothing, and after STALE_AFTER a peer recovers the running item and
    runs it a second time. Before the register the heartbeat touched only WorkItem."""
    env = {"DBWORKER_HEARTBEAT_INTERVAL": "0.2", "DBWORKER_STALE_AFTER": "2.0"}
    first = start_worker("keyed", "--concurrency", "2", env=env)
    wait_until(lambda: registered(first) is not None, what="the first worker's register row")
    Keyed.enqueue({"key": "long", "first_seconds": 10, "seconds": 0}, concurrency_key="long")
    wait_until(
        lambda: Execution.objects.filter(key="long", kind="start", pid=first.pid).exists(),
        what="the long item to start on the first worker",
    )
    name = registered(first).name  # type: ignore[union-attr]
    locked, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                if lock:  # else the control: the same steps without the lock
                    list(Registered.objects.select_for_update().filter(name=name))
                locked.set()
                release.wait(15)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_row, daemon=True)
    holder.start()
    try:
        assert locked.wait(10)
        second = start_worker("keyed", "--concurrency", "2", env=env)
        wait_until(lambda: registered(second) is not None, what="the second worker's row")
        # Six seconds: three times STALE_AFTER, while the first item runs (10 s).
        deadline = time.monotonic() + 6.0
        twice = False
        while time.monotonic() < deadline and not twice:
            twice = Execution.objects.filter(key="long", kind="start").count() > 1
            time.sleep(0.1)
        item = WorkItem.objects.get()
    finally:
        release.set()
        holder.join(10)
    starts = list(Execution.objects.filter(key="long", kind="start").values_list("pid", flat=True))
    assert first.proc.poll() is None, first.log()
    assert len(starts) == 1, (
        f"the running item started {len(starts)} times (pids {starts}; first {first.pid}, "
        f"second {second.pid}); its heartbeat_at {item.heartbeat_at}, attempts {item.attempts}"
    )


# -- keys held in another pool's queue count in this pool's share -------------------------


def test_keys_held_in_another_queue_do_not_keep_the_share_from_a_later_worker(
    start_worker,
) -> None:
    """s15 fixed the *free* keys counted in play (their heads filter the queues, paused
    queues and run_after) but ``held`` in CLAIM_HEADS still counts every claimed keyed row
    of the handler, in any queue: a worker of another queue (another pool) running 30
    long keys adds 30 to K for the pool of ``default``. The first worker's share is
    ceil((40 + 30) * 8 / 16) + 1 = 36 of 40 keys, and it keeps them by the hand-over while
    the second worker's threads idle ("a key ... in another pool's queue is not shared")."""
    other = start_worker("keyed", "--queue", "other", "--concurrency", "30")
    with transaction.atomic():
        for k in range(30):
            Keyed.enqueue({"key": f"x{k}", "seconds": 40}, concurrency_key=f"x{k}", queue="other")
    wait_until(
        lambda: Execution.objects.filter(kind="start", key__startswith="x").count() == 30,
        timeout=30,
        what="the other queue's 30 long keys to start",
    )
    first = start_worker("keyed", "--queue", "default", "--concurrency", "8")
    wait_until(lambda: registered(first) is not None, what="the first worker's register row")
    keys, per_key = 40, 60
    enqueue(keys, per_key, seconds=0.02)
    wait_until(
        lambda: len(keys_by_pid().get(first.pid, ())) == keys,
        timeout=60,
        what="the first worker to start a run of every key",
    )
    second = start_worker("keyed", "--queue", "default", "--concurrency", "8")
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=60,
        what="every item of queue default to succeed",
    )
    for worker in (first, second):
        worker.signal(signal.SIGTERM)
    for worker in (first, second):
        assert worker.wait(timeout=30) == 0, worker.log()
    other.kill()
    Execution.objects.filter(key__startswith="x").delete()  # killed mid-run
    assert_no_key_overlaps()
    ran = {pid: len(found) for pid, found in keys_by_pid().items()}
    # As with no keys held elsewhere: ceil(40 / 2) + 1 = 21 for the first at most.
    assert ran.get(second.pid, 0) >= 15, (
        f"the second worker ran items of {ran.get(second.pid, 0)} of {keys} keys ({ran})"
    )


# -- a lock on the register table stops the claims and the success writes -----------------


def test_a_locked_register_table_does_not_stop_a_worker_from_running_its_keys(
    start_worker,
) -> None:
    """``KeyShare.count`` reads the register (``SUM(threads)``) with no lock or statement
    timeout, from the claim loop (``cap``) and from the success writer (``handover_room``).
    While the table is locked ACCESS EXCLUSIVE (a migration adding a column, a VACUUM FULL,
    ``LOCK TABLE`` by an operator) both hang: no keyed row is claimed or recorded as a
    success, though the work table is free. "A row that cannot be written or read leaves
    the count where it was" (``peers.py``) holds for errors, not for waits."""
    worker = start_worker("keyed", "--concurrency", "2")
    wait_until(lambda: registered(worker) is not None, what="the worker's register row")
    locked, release = threading.Event(), threading.Event()

    def lock_the_table() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"LOCK TABLE {Registered._meta.db_table} IN ACCESS EXCLUSIVE MODE")
                locked.set()
                release.wait(20)
        finally:
            connection.close()

    holder = threading.Thread(target=lock_the_table, daemon=True)
    holder.start()
    try:
        assert locked.wait(10)
        with transaction.atomic():
            for _ in range(5):
                for key in ("a", "b"):
                    Keyed.enqueue({"key": key, "seconds": 0.05}, concurrency_key=key)
        # Ten items of 0.05 s on two keys and two threads: well within 8 s (a poll
        # interval and a lot of margin), with the work table free all along.
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:
            if WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 10:
                break
            time.sleep(0.1)
        done = WorkItem.objects.filter(status=Status.SUCCEEDED).count()
        states = sorted(WorkItem.objects.values_list("status", flat=True))
    finally:
        release.set()
        holder.join(10)
    assert worker.proc.poll() is None, worker.log()
    assert done == 10, (
        f"{done} of 10 items succeeded in 8 s while the register was locked ({states})"
    )
