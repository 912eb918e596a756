"""The register of live workers and a worker's share of the keys (``worker/peers.py``).

Workers of the same queues and handlers count each other in ``WorkerProcess`` and hold
at most ``ceil(pending keys / workers) + 1`` keyed rows each; the key-driven claim counts
the pending keys (``Claimed.pending_keys``), also when no key is free.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import F

from django_dbworker.flow_models import WorkerProcess as Registered
from django_dbworker.worker.peers import LIVE_FOR_BEATS, pool_of
from tests.factories import ShareClock as Clock
from tests.factories import claim
from tests.factories import key_share as share
from tests.testapp.workers import Keyed

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_workers_of_one_pool_count_each_other_and_leave_at_exit() -> None:
    clock = Clock()
    first, second = share("h:1", clock=clock), share("h:2", clock=clock)
    other_queue = share("h:3", clock=clock, queues=["mail"])
    other_handlers = share("h:4", clock=clock, handlers={"keyed": 1, "noop": 2})
    for worker in (first, second, other_queue, other_handlers):
        assert worker.join()
    assert first.count() == 16  # the threads of the pool's two workers
    assert other_queue.count() == 8 and other_handlers.count() == 8
    assert Registered.objects.get(name="h:3").queues == ["mail"]
    second.leave().join(5)  # the delete runs on a thread of its own
    clock.now += 1  # counts are kept for COUNT_EVERY
    assert first.count() == 8
    assert not Registered.objects.filter(name="h:2").exists()


def test_a_row_not_refreshed_for_three_beats_is_not_counted_and_is_deleted_when_stale() -> None:
    clock = Clock()
    live, dead = share("h:1", clock=clock), share("h:2", clock=clock)
    live.join(), dead.join()
    assert live.count() == 16
    Registered.objects.filter(name="h:2").update(
        seen_at=F("seen_at") - timedelta(seconds=LIVE_FOR_BEATS * 5.0 + 1)
    )
    clock.now += 1
    assert live.count() == 8  # the dead one no longer shrinks the share
    assert Registered.objects.filter(name="h:2").exists()  # kept until STALE_AFTER
    Registered.objects.filter(name="h:2").update(seen_at=F("seen_at") - timedelta(seconds=60))
    clock.now += 5
    live.beat()
    assert list(Registered.objects.values_list("name", flat=True)) == ["h:1"]


def test_a_worker_taken_for_dead_registers_again_at_its_next_beat() -> None:
    clock = Clock()
    worker = share("h:1", clock=clock)
    worker.join()
    Registered.objects.all().delete()
    clock.now += 5
    worker.beat()
    assert Registered.objects.filter(name="h:1", pool=worker.pool).exists()


def test_the_share_is_the_keys_in_play_by_threads_plus_one() -> None:
    clock = Clock()
    first, second = share("h:1", clock=clock), share("h:2", clock=clock)
    first.join(), second.join()
    assert first.room(held=0) is None  # no count of the keys yet: no cap
    first.counted(0)
    assert first.room(held=0) is None  # no key in play: nothing to share
    first.counted(100)
    assert first.room(held=0) == 51
    assert first.room(held=51) == 0
    assert first.room(held=80) == 0
    big = share("h:3", clock=clock, threads=30)
    big.join()
    big.counted(31)
    clock.now += 1
    assert big.room(held=0) == 22  # 30 of 46 threads: ceil(31 * 30 / 46) + 1
    second.leave().join(5)  # the delete runs on a thread of its own
    clock.now += 1
    assert big.room(held=0) == 26  # 30 of 38 threads: ceil(31 * 30 / 38) + 1
    first.leave().join(5)  # the delete runs on a thread of its own
    clock.now += 1
    assert big.room(held=80) is None  # alone: no cap


def test_a_claim_is_cut_to_the_share_only_for_keys_of_limit_1() -> None:
    clock = Clock()
    first, second = share("h:1", clock=clock), share("h:2", clock=clock)
    first.join(), second.join()
    first.counted(10)
    assert first.cap(100, held=0, limits={"keyed": 1}) == (6, True)
    assert first.cap(3, held=0, limits={"keyed": 1}) == (3, False)
    # A key of limit 5 is never handed over: it sticks to no worker, no share.
    assert first.cap(100, held=0, limits={"keyed": 1, "five": 5}) == (100, False)
    assert first.handover_room(100, held=0) == (100, False)
    # At its share a worker claims one row now and then, for a new count of the keys.
    assert first.cap(100, held=6, limits={"keyed": 1}) == (0, True)
    clock.now += 1
    assert first.cap(100, held=6, limits={"keyed": 1}) == (1, True)
    assert first.handover_room(100, held=4) == (2, True)


def test_a_pool_is_its_queues_and_handlers_whatever_their_order() -> None:
    assert pool_of(["b", "a", "a"], ["y", "x"]) == pool_of(["a", "b"], ["x", "y"])
    assert pool_of(None, ["x"]) != pool_of(["default"], ["x"])
    assert pool_of(None, ["x"]) != pool_of(None, ["x", "y"])


@pytest.mark.postgres_only
def test_the_key_driven_claim_counts_the_keys_in_play_also_when_none_is_free() -> None:
    """The free keys it could take and the keys held: 6 keys, however many are claimed."""
    for n in range(6):
        Keyed.enqueue_many([{"key": f"k{n}"}] * 3, concurrency_key=f"k{n}")
    first = claim(limit=4, handlers=["keyed"], limited=True)
    assert len(first) == 4 and first.pending_keys == 6  # type: ignore[attr-defined]
    second = claim(limit=10, handlers=["keyed"], limited=True)
    assert len(second) == 2 and second.pending_keys == 6  # type: ignore[attr-defined]
    third = claim(limit=10, handlers=["keyed"], limited=True)
    assert third == [] and third.pending_keys == 6  # type: ignore[attr-defined]
