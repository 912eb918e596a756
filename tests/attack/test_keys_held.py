"""Attacks on per-key concurrency limits (issue 21) that the change withstood on h-keys.

Kept so that the claims they back can be cited and stay true: races of
many claimers on their own connections never exceed a key's limit (limits
1, 2 and 3, keys used for the first time, so their FlowLock rows are
created in the race), awkward key strings round-trip through every enqueue
path (PostgreSQL's COPY included) and are counted per key, bad keys are
refused, and a hot key does not hold the other keys back for a poll
interval.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any

import pytest
from django.db import connection, connections

from django_dbworker import EnqueueError, WorkItemHandler
from django_dbworker.db import operations
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import claim
from tests.testapp.models import Execution
from tests.testapp.workers import Keyed, KeyedPair

pytestmark = pytest.mark.django_db(transaction=True)


class KeyedThree(WorkItemHandler):
    """Three items per concurrency key at once; does nothing."""

    name = "attack_keyed3"
    concurrency_limit = 3

    def handle(self, payload: Any) -> None:
        return None


LIMITS = {"keyed": 1, "keyed_pair": 2, "attack_keyed3": 3}
HANDLERS = [*LIMITS, "noop"]


def over_limit() -> list[str]:
    """(handler, key) pairs with more claimed rows than their limit, keys compared exactly."""
    counts = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED, handler__in=list(LIMITS)).values_list(
            "handler", "concurrency_key"
        )
    )
    return [f"{h} {k!r}: {n}" for (h, k), n in counts.items() if n > LIMITS[h]]


def test_many_claimers_and_finishers_never_exceed_a_keys_limit() -> None:
    """7 claimers on their own connections claim 1-6 rows at a time and finish some, 6 rounds.

    Each round uses new keys (their FlowLock rows are created by the racing
    claimers); the main thread checks the claimed rows per key all along.
    """
    seen: list[str] = []
    errors: list[str] = []
    for r in range(6):
        keys = [f"r{r}k{i}" for i in range(4)]
        for key in keys:
            for cls in (Keyed, KeyedPair, KeyedThree):
                cls.enqueue_many([{"key": key}] * 8, concurrency_key=key)
        barrier = threading.Barrier(7)

        def run(n: int, r: int = r, barrier: threading.Barrier = barrier) -> None:
            rnd = random.Random(n * 1000 + r)
            held: list[WorkItem] = []
            try:
                connection.ensure_connection()
                barrier.wait(10)
                for _ in range(30):
                    got = claim(
                        limit=rnd.randint(1, 6), handlers=HANDLERS, worker=f"s:{n}", limited=True
                    )
                    held.extend(got)
                    rnd.shuffle(held)
                    k = rnd.randint(0, len(held))
                    done, held = held[:k], held[k:]
                    if done:
                        operations().succeed_many([(i.pk, i.claim_token, None) for i in done])
                if held:
                    operations().succeed_many([(i.pk, i.claim_token, None) for i in held])
            except Exception as exc:
                errors.append(repr(exc))
            finally:
                connections.close_all()

        threads = [threading.Thread(target=run, args=(n,)) for n in range(7)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            seen += over_limit()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert not seen, seen
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 6 * 4 * 3 * 8


KEYS = ["a\tb\\c\nd\re", "\\N", "emoji😀x", "😀" * 200, "x" * 200, "naïve", "%s", "%(x)s", "'\""]


@pytest.mark.parametrize("count", [1, 3, 150])  # 150: PostgreSQL's COPY path
def test_awkward_keys_round_trip_and_are_counted_per_key(count: int) -> None:
    for key in KEYS:
        items = KeyedPair.enqueue_many([{"n": i} for i in range(count)], concurrency_key=key)
        stored = set(
            WorkItem.objects.filter(pk__in=[i.pk for i in items]).values_list(
                "concurrency_key", flat=True
            )
        )
        assert stored == {key}
        one = Keyed.enqueue({"key": key}, concurrency_key=key)
        assert WorkItem.objects.get(pk=one.pk).concurrency_key == key
    claim(limit=5000, handlers=HANDLERS, limited=True)
    assert not over_limit()
    per_key = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED).values_list("handler", "concurrency_key")
    )
    assert per_key == {
        **{("keyed", k): 1 for k in KEYS},
        **{("keyed_pair", k): min(count, 2) for k in KEYS},
    }


@pytest.mark.parametrize("key", ["a\x00b", "\x00", "\ud800"])
def test_unstorable_keys_are_refused_writing_nothing(key: str) -> None:
    with pytest.raises(EnqueueError):
        Keyed.enqueue({"key": "x"}, concurrency_key=key)
    with pytest.raises(EnqueueError):
        Keyed.enqueue_many([{"key": "x"}] * 150, concurrency_key=key)
    assert not WorkItem.objects.exists()


# -- hot keys ---------------------------------------------------------------------


def test_a_hot_key_at_the_head_does_not_delay_other_keys_until_the_next_poll(
    background_worker: Any,
) -> None:
    """SQLite: a claim cut short by a hot key looks like an empty queue.

    40 rows of one key (limit 1) at the head of the claim order, 3 rows of
    other keys behind them, 4 free threads. A claim while the hot key's slot
    is free finds 4 candidates of the hot key and takes 1. PostgreSQL and
    MariaDB report the other 3 as throttled, so the claim loop claims again
    at once and finds the other keys; SQLite's statement reports nothing
    (``throttled`` is 0), the loop thinks it ran dry and sleeps a poll
    interval, and every retirement wake-up claims the hot key's next row
    only: the other keys wait for the poll interval (30 s here).
    """
    for n in range(40):
        Keyed.enqueue({"key": "hot", "seconds": 0.2, "n": n}, concurrency_key="hot")
    others = [Keyed.enqueue({"key": f"o{i}"}, concurrency_key=f"o{i}") for i in range(3)]
    background_worker(["keyed"], concurrency=4, poll_interval=30.0)
    wait_until(
        lambda: (
            WorkItem.objects.filter(pk__in=[o.pk for o in others], status=Status.SUCCEEDED).count()
            == 3
        ),
        timeout=8,
        what="the other keys' rows to succeed while the hot key runs",
    )
    assert Execution.objects.filter(key="hot", kind="end").count() < 40
