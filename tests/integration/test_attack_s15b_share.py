"""Attack s15b on the fixed key share: the keys in play, and when an idle loop recounts.

``worker/peers.py``: the keys in play are "the free keys whose next row the claim could
take and the keys held"; a resting loop with keys in play and a peer counts again every
RECOUNT_KEYS_EVERY.
"""

from __future__ import annotations

import pytest

from django_dbworker.flow_models import WorkerProcess as Registered
from django_dbworker.worker.peers import RECOUNT_KEYS_EVERY
from tests.factories import ShareClock as Clock
from tests.factories import claim, key_share
from tests.testapp.workers import Keyed

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.mark.postgres_only
def test_keys_held_in_another_queue_are_not_in_play_for_this_queue() -> None:
    """The s15 fix filtered the free keys' heads by queue, paused queues and run_after,
    but ``held`` (CLAIM_HEADS) still counts every claimed keyed row of the handler in any
    queue. Twenty keys held by a worker of queue ``other`` (another pool) are "in play"
    for the pool of ``default``: "a key ... in another pool's queue is not shared"."""
    for n in range(20):
        Keyed.enqueue({"key": f"x{n}"}, concurrency_key=f"x{n}", queue="other")
    held = claim(limit=20, handlers=["keyed"], queues=["other"], limited=True, worker="o:1:x")
    assert len(held) == 20
    for n in range(3):
        Keyed.enqueue_many([{"key": f"k{n}"}] * 2, concurrency_key=f"k{n}")
    first = claim(limit=10, handlers=["keyed"], queues=["default"], limited=True)
    assert len(first) == 3  # the three keys' heads of ``default``
    assert first.pending_keys == 3, (  # type: ignore[attr-defined]
        f"{first.pending_keys} keys in play counted for queue default, where 3 keys "  # type: ignore[attr-defined]
        "could be claimed and none is held in it"
    )


@pytest.mark.postgres_only
def test_a_loop_with_nothing_to_claim_does_not_recount_while_a_peer_holds_a_key() -> None:
    """An empty claim (every key held, by a peer, on a long item) counts K = the keys
    held (1), so ``recount_in`` answers RECOUNT_KEYS_EVERY (0.25 s): the resting loop,
    which can take nothing until that key ends here or a row comes (a NOTIFY), claims
    four times a second instead of once per POLL_INTERVAL."""
    Keyed.enqueue_many([{"key": "long"}] * 2, concurrency_key="long")
    assert len(claim(limit=10, handlers=["keyed"], limited=True, worker="peer:1:x")) == 1
    clock = Clock()
    idle, peer = (key_share(name, clock=clock, queues=["default"]) for name in ("h:1", "h:2"))
    assert idle.join() and peer.join()
    empty = claim(limit=10, handlers=["keyed"], limited=True)
    assert len(empty) == 0  # the key is held: nothing this worker could take
    idle.counted(empty.pending_keys)  # type: ignore[attr-defined]
    idle.room(0)  # the count of the pool (16 threads)
    assert Registered.objects.count() == 2
    wait = idle.recount_in(held=0)  # it holds nothing
    # Nothing it could take: no recount sooner than a poll (inf, or at least a second).
    assert wait > RECOUNT_KEYS_EVERY, (
        f"a worker with nothing it could claim recounts in {wait:.2f}s "
        f"(keys in play {idle.pending_keys}, pool threads {idle.pool_threads})"
    )
