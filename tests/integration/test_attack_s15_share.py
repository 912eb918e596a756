"""Attack s15 on the key share: the register of live workers and the pending-key count.

``worker/peers.py``: a worker holds at most ``ceil(pending keys / live workers) + 1``
keyed rows; the pending keys come from the key-driven claim (``Claimed.pending_keys``),
the live workers from ``WorkerProcess``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from django_dbworker import pause_queue
from django_dbworker.flow_models import WorkerProcess as Registered
from tests.factories import ShareClock as Clock
from tests.factories import claim
from tests.factories import key_share as share
from tests.testapp.workers import Keyed

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_a_worker_that_left_is_not_registered_again_by_its_heartbeat() -> None:
    """``Worker.run`` calls ``leave()`` as soon as the claim loop ends ("claims no more: the
    others' shares grow now"), then drains for up to SHUTDOWN_TIMEOUT with the heartbeat
    still beating. The next ``beat()`` finds no row, takes it for "deleted meanwhile (taken
    for dead)" and joins again: the worker that left is a live peer once more, for the
    whole drain (and for good if that beat lands after the final ``leave()``)."""
    clock = Clock()
    leaving, peer = share("h:1", clock=clock), share("h:2", clock=clock)
    assert leaving.join() and peer.join()
    assert peer.count() == 16
    leaving.leave().join(5)  # the delete runs on a thread of its own
    clock.now += 1
    assert peer.count() == 8  # its share grew at once
    clock.now += 5  # the leaving worker's heartbeat beats on while it drains
    leaving.beat()
    clock.now += 1
    assert not Registered.objects.filter(name="h:1").exists(), "registered again after leave()"
    assert peer.count() == 8


@pytest.mark.postgres_only
@pytest.mark.parametrize("elsewhere", ["scheduled", "paused", "other_queue"])
def test_the_pending_keys_are_the_keys_a_claim_could_take(elsewhere: str) -> None:
    """The share divides the keys a worker of the pool could run. The count counts every
    key of the handler with a pending row: rows due in an hour, rows of a paused queue and
    rows of queues the claim does not serve as well (``keys`` in CLAIM_HEADS filters on
    neither run_after nor the queue). A few such keys (retries waiting for their backoff, a
    paused tenant's queue, another pool's queue) inflate every share until no cap is left."""
    for n in range(3):
        Keyed.enqueue_many([{"key": f"k{n}"}] * 2, concurrency_key=f"k{n}")
    if elsewhere == "paused":
        pause_queue("pausable", by="test")
    for n in range(20):
        if elsewhere == "scheduled":
            Keyed.enqueue({"key": f"x{n}"}, concurrency_key=f"x{n}", run_after=timedelta(hours=1))
        elif elsewhere == "paused":
            Keyed.enqueue({"key": f"x{n}"}, concurrency_key=f"x{n}", queue="pausable")
        else:
            Keyed.enqueue({"key": f"x{n}"}, concurrency_key=f"x{n}", queue="other")
    queues = ["default"] if elsewhere == "other_queue" else None
    first = claim(limit=10, handlers=["keyed"], queues=queues, limited=True)
    assert len(first) == 3  # the three keys' heads: nothing else is claimable
    assert first.pending_keys == 3, (  # type: ignore[attr-defined]
        f"{first.pending_keys} pending keys counted where 3 keys could be claimed"  # type: ignore[attr-defined]
    )


def test_two_live_processes_of_the_same_host_and_pid_are_two_workers() -> None:
    """The register's key was ``host:pid``. Two containers with the host's name (host
    networking: Docker ``--network host``, Kubernetes ``hostNetwork``) each run their
    worker as the same pid (1, or the same small number): both wrote one row, each
    counted one live worker (no cap at all, the first to claim kept every key), and the
    first to exit deleted the other's row. Two shares of this one process stand for them:
    same host, same pid."""
    clock = Clock()
    first, second = share(None, clock=clock), share(None, clock=clock)
    assert first.join() and second.join()
    assert first.count() == 16, "two live workers of one pool counted as one"
    first.leave().join(5)  # the delete runs on a thread of its own
    assert Registered.objects.filter(name=second.name).exists()
