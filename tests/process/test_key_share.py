"""``run_workers`` processes of the same queues share the keys of a limited handler.

A key is handed from one of its rows to the next by the worker that ran it
(``worker/handover.py``), so without a share the first worker to claim held every key
while the others idled. Each worker now holds at most its share of the pending keys
(``worker/peers.py``), counted in the register of live workers (``WorkerProcess``).
PostgreSQL only: the other databases have no hand-over, and claim keys in turn.
"""

from __future__ import annotations

import signal
from collections import defaultdict

import pytest
from django.db import transaction

from django_dbworker.flow_models import WorkerProcess as Registered
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import assert_no_key_overlaps
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]


def keys_by_pid() -> dict[int, set[str]]:
    """The keys ``k<n>`` (``enqueue``'s) each process started a run of (the handlers' own
    records; other keys of a test left out)."""
    found: dict[int, set[str]] = defaultdict(set)
    for pid, key in Execution.objects.filter(kind="start").values_list("pid", "key"):
        if key.startswith("k"):
            found[pid].add(key)
    return found


def enqueue(keys: int, per_key: int, seconds: float) -> None:
    with transaction.atomic():
        for _ in range(per_key):
            for k in range(keys):
                Keyed.enqueue({"key": f"k{k}", "seconds": seconds}, concurrency_key=f"k{k}")


def test_a_worker_started_later_gets_its_share_of_the_keys(start_worker) -> None:
    keys, per_key = 40, 100  # 10 s of runs for one worker of 8 threads
    first = start_worker("keyed", "--concurrency", "8")
    wait_until(lambda: Registered.objects.count() == 1, what="the first worker's register row")
    enqueue(keys, per_key, seconds=0.02)
    # The first worker alone holds every key (its buffer has room for all 40)...
    wait_until(
        lambda: len(keys_by_pid().get(first.pid, ())) == keys,
        timeout=60,
        what="the first worker to start a run of every key",
    )
    second = start_worker("keyed", "--concurrency", "8")
    # ... and leaves the second one its share: ceil(40 / 2) + 1 = 21 at most of its own.
    wait_until(
        lambda: len(keys_by_pid().get(second.pid, ())) >= 15,
        timeout=60,
        what="the second worker to run items of at least 15 keys",
    )
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key,
        timeout=120,
        what="every keyed item to succeed",
    )
    for worker in (first, second):
        worker.signal(signal.SIGTERM)
    for worker in (first, second):
        assert worker.wait(timeout=60) == 0, worker.log()
    assert_no_key_overlaps()
    assert set(WorkItem.objects.values_list("attempts", flat=True)) == {1}
    # Each worker deleted its register row on the way out.
    assert not Registered.objects.exists()


def test_burst_workers_started_together_split_the_keys(start_worker) -> None:
    keys, per_key = 40, 100  # 5 s of runs for one worker of 8 threads
    enqueue(keys, per_key, seconds=0.01)
    workers = [start_worker("keyed", "--burst", "--concurrency", "8") for _ in range(2)]
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.log()
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == keys * per_key
    assert_no_key_overlaps()
    ran = keys_by_pid()
    assert len(ran) == 2 and all(len(found) >= 15 for found in ran.values()), {
        pid: len(found) for pid, found in ran.items()
    }


def test_a_killed_workers_row_is_deleted_by_a_survivors_beat(start_worker) -> None:
    env = {"DBWORKER_HEARTBEAT_INTERVAL": "0.2", "DBWORKER_STALE_AFTER": "2.0"}
    victim = start_worker("keyed", "--concurrency", "8", env=env)
    survivor = start_worker("keyed", "--concurrency", "8", env=env)
    wait_until(lambda: Registered.objects.count() == 2, what="both workers' register rows")
    victim.signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    assert Registered.objects.filter(name__contains=f":{victim.pid}:").exists()
    enqueue(30, 3, seconds=0.01)
    wait_until(
        lambda: WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 90,
        timeout=60,
        what="every keyed item to succeed beside the dead worker's row",
    )
    # The survivor's beat deletes the dead row once it is STALE_AFTER old.
    wait_until(
        lambda: not Registered.objects.filter(name__contains=f":{victim.pid}:").exists(),
        timeout=30,
        what="the dead worker's row to be deleted",
    )
    assert Registered.objects.filter(name__contains=f":{survivor.pid}:").exists()
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(timeout=60) == 0, survivor.log()
