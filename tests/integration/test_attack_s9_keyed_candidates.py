"""Attacks on 6306e59: PostgreSQL's keyed candidates statement returns a key's rows up to
its limit only (the rest stay locked) and counts the rows it locked (``throttled``).

Each test compares the keyed claim with a model of the documented claim: the next
ready rows in claim order (priority DESC, run_after, id) but keys at their limit,
``limit`` of them, then the ones that fit (``flow.within_limits``, MariaDB's reference),
with the handlers' current limits.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_dbworker import pause_queue, resume_queue
from django_dbworker.db import operations
from django_dbworker.db.keys import within_limits
from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.factories import claim, handler_limits, worker_config
from tests.testapp.workers import Keyed, KeyedPair, Noop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

HANDLERS = ["keyed", "keyed_pair", "noop"]
BASE = datetime(2020, 1, 1, tzinfo=UTC)


def keyed_claim(limit: int = 10, queues: list[str] | None = None, worker: str = "t:1") -> Any:
    return claim(limit=limit, handlers=HANDLERS, queues=queues, worker=worker, limited=True)


def place(item: WorkItem, *, priority: int = 0, seconds: int = 0) -> WorkItem:
    """Pin the row's claim order: priority, then run_after (BASE + seconds), then id."""
    WorkItem.objects.filter(pk=item.pk).update(
        priority=priority, run_after=BASE + timedelta(seconds=seconds)
    )
    return item


def model(limit: int, queues: list[str] | None, limits: dict[str, int]) -> tuple[list[int], int]:
    """The ids the claim should take (claim order) and how many it should hold back.

    With every handler limited, PostgreSQL's claim takes the keys' heads
    (``postgresql_keyed_sql.CLAIM_HEADS``): a key offers its first rows up to its free
    slots, so a key's later rows take no place among the ``limit``; otherwise (an unlimited
    handler, or a ready row without a key) the walk's.
    """
    rows = WorkItem.objects.filter(
        status=Status.PENDING, handler__in=HANDLERS, run_after__lte=timezone.now()
    ).exclude(queue__in=QueueState.objects.filter(paused=True).values("name"))
    if queues:
        rows = rows.filter(queue__in=queues)
    held = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED, concurrency_key__isnull=False).values_list(
            "handler", "concurrency_key"
        )
    )

    def at_limit(h: str, k: str | None) -> bool:
        return k is not None and h in limits and held[(h, k)] >= limits[h]

    ready = sorted(
        (
            r
            for r in rows.values_list("id", "handler", "concurrency_key", "priority", "run_after")
            if not at_limit(r[1], r[2])
        ),
        key=lambda r: (-r[3], r[4], r[0]),
    )
    if set(HANDLERS) <= set(limits) and all(r[2] is not None for r in ready):
        offered: Counter[tuple[str, str]] = Counter()
        heads = []
        for r in ready:
            if r[2] is not None:
                offered[(r[1], r[2])] += 1
                if offered[(r[1], r[2])] > limits[r[1]] - held[(r[1], r[2])]:
                    continue
            heads.append(r)
        ready = heads
    ready = ready[:limit]
    candidates = [(pk, h, k, None if k is None else limits.get(h)) for pk, h, k, _, _ in ready]
    return within_limits(candidates, dict(held))


def check(limit: int, queues: list[str] | None = None) -> Any:
    limits = handler_limits(HANDLERS)
    want, held_back = model(limit, queues, limits)
    got = keyed_claim(limit=limit, queues=queues)
    assert sorted(i.pk for i in got) == sorted(want), (limit, queues, limits)
    assert getattr(got, "throttled", 0) == held_back, (limit, queues, limits)
    return got


def succeed(items: list[WorkItem]) -> None:
    if items:
        operations().succeed_many([(i.pk, i.claim_token, None) for i in items])


# -- explicit cases ---------------------------------------------------------------------


def test_a_limit_of_two_with_one_slot_held_claims_one_and_holds_back_the_rest() -> None:
    rows = [place(KeyedPair.enqueue({"n": n}, concurrency_key="P"), seconds=n) for n in range(5)]
    (first,) = keyed_claim(limit=1)
    assert first.pk == rows[0].pk
    other = place(Keyed.enqueue({"key": "o"}, concurrency_key="O"), seconds=10)
    got = keyed_claim(limit=10)
    assert sorted(i.pk for i in got) == sorted([rows[1].pk, other.pk])
    # locked: P's 4 pending rows and O's one; claimed 2
    assert got.throttled == 3


def test_a_lowered_limit_counts_the_slots_held_under_the_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = [place(KeyedPair.enqueue({"n": n}, concurrency_key="P"), seconds=n) for n in range(5)]
    held = keyed_claim(limit=10)
    assert sorted(i.pk for i in held) == [rows[0].pk, rows[1].pk]
    monkeypatch.setattr(KeyedPair, "concurrency_limit", 1)  # a deploy lowers the limit
    succeed(held[:1])  # one slot left held: still at the new limit
    got = keyed_claim(limit=10)
    assert list(got) == [] and got.throttled == 0
    monkeypatch.setattr(KeyedPair, "concurrency_limit", 3)  # raised: two more fit
    got = keyed_claim(limit=10)
    assert sorted(i.pk for i in got) == [rows[2].pk, rows[3].pk]
    assert got.throttled == 1


def test_a_raised_limit_returns_more_rows_of_a_key_than_it_was_enqueued_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = [place(Keyed.enqueue({"key": "R"}, concurrency_key="R"), seconds=n) for n in range(6)]
    assert {r for r in WorkItem.objects.values_list("concurrency_limit", flat=True)} == {1}
    monkeypatch.setattr(Keyed, "concurrency_limit", 4)
    got = keyed_claim(limit=5)
    assert sorted(i.pk for i in got) == [r.pk for r in rows[:4]]
    assert got.throttled == 1


def test_rows_without_a_key_of_a_limited_handler_are_not_cut() -> None:
    free = [place(Keyed.enqueue({"key": "-"}), seconds=2 * n) for n in range(5)]
    keyed = [
        place(Keyed.enqueue({"key": "A"}, concurrency_key="A"), seconds=2 * n + 1) for n in range(3)
    ]
    got = keyed_claim(limit=8)
    assert sorted(i.pk for i in got) == sorted([*(f.pk for f in free), keyed[0].pk])
    assert got.throttled == 2


def test_keyed_rows_of_an_unlimited_handler_are_not_cut() -> None:
    rows = [place(Noop.enqueue(concurrency_key="k"), seconds=n) for n in range(4)]
    Keyed.enqueue({"key": "x"}, concurrency_key="x")  # a limited handler: the keyed claim
    got = keyed_claim(limit=4)
    assert sorted(i.pk for i in got) == [r.pk for r in rows]
    assert got.throttled == 0


def test_the_cut_follows_priority_then_run_after_then_id_within_a_key() -> None:
    # Key A: the highest priority is the newest row, then two rows of equal run_after.
    low = place(KeyedPair.enqueue({"n": 0}, concurrency_key="A"), priority=0, seconds=0)
    tie1 = place(KeyedPair.enqueue({"n": 1}, concurrency_key="A"), priority=1, seconds=5)
    tie2 = place(KeyedPair.enqueue({"n": 2}, concurrency_key="A"), priority=1, seconds=5)
    top = place(KeyedPair.enqueue({"n": 3}, concurrency_key="A"), priority=9, seconds=9)
    got = keyed_claim(limit=10)
    assert sorted(i.pk for i in got) == sorted([top.pk, tie1.pk])
    assert got.throttled == 2
    assert low.pk and tie2.pk


def test_a_hot_key_at_the_head_of_a_batch_counts_as_held_back_not_dry() -> None:
    hot = [
        place(Keyed.enqueue({"key": "h"}, concurrency_key="hot"), priority=5, seconds=n)
        for n in range(4)
    ]
    others = [
        place(Keyed.enqueue({"key": f"o{n}"}, concurrency_key=f"o{n}"), seconds=n) for n in range(3)
    ]
    got = keyed_claim(limit=4)
    assert [i.pk for i in got] == [hot[0].pk]
    assert got.throttled == 3  # len + throttled == limit: not dry
    got = keyed_claim(limit=4)
    assert sorted(i.pk for i in got) == [o.pk for o in others]
    assert got.throttled == 0


def test_queue_filters_and_slots_held_in_another_queue() -> None:
    q1 = [
        place(KeyedPair.enqueue({"n": n}, concurrency_key="K", queue="q1"), seconds=n)
        for n in range(3)
    ]
    q2 = [
        place(KeyedPair.enqueue({"n": n}, concurrency_key="K", queue="q2"), seconds=10 + n)
        for n in range(3)
    ]
    got = keyed_claim(limit=10, queues=["q2"])
    assert sorted(i.pk for i in got) == [q2[0].pk, q2[1].pk]
    assert got.throttled == 1
    got = keyed_claim(limit=10, queues=["q1"])  # the key is at its limit: nothing
    assert list(got) == [] and got.throttled == 0
    succeed(list(WorkItem.objects.filter(pk=q2[0].pk)))
    got = keyed_claim(limit=10, queues=["q1", "q2"])
    assert [i.pk for i in got] == [q1[0].pk]
    assert got.throttled == 3


def test_empty_claims() -> None:
    got = keyed_claim()
    assert list(got) == [] and getattr(got, "throttled", 0) == 0
    Keyed.enqueue({"key": "a"}, concurrency_key="A")
    Keyed.enqueue({"key": "a"}, concurrency_key="A")
    assert len(keyed_claim()) == 1
    got = keyed_claim()
    assert list(got) == [] and getattr(got, "throttled", 0) == 0


def test_two_claims_in_a_callers_transaction_and_a_rival_meanwhile() -> None:
    rows = [place(KeyedPair.enqueue({"n": n}, concurrency_key="P"), seconds=n) for n in range(5)]
    free = place(Noop.enqueue(), seconds=20)
    rival: list[Any] = []

    def other() -> None:
        try:
            rival.append(keyed_claim(limit=10, worker="rival"))
        finally:
            connections.close_all()

    with transaction.atomic():
        first = keyed_claim(limit=3)
        assert sorted(i.pk for i in first) == [rows[0].pk, rows[1].pk]
        assert first.throttled == 1
        second = keyed_claim(limit=10)  # the same transaction: P is at its limit
        assert [i.pk for i in second] == [free.pk]
        # A rival on its own connection skips the rows locked here and waits for P's
        # advisory lock (held until this transaction ends).
        t = threading.Thread(target=other)
        t.start()
        t.join(1)
        assert t.is_alive()
    t.join(30)
    assert not t.is_alive()
    assert list(rival[0]) == []
    assert rival[0].throttled == 2  # rows 3 and 4: row 2 stayed locked by the first claim
    assert WorkItem.objects.filter(status=Status.CLAIMED).count() == 3


def test_run_until_empty_runs_every_row_of_limited_keys() -> None:
    for n in range(4):
        KeyedPair.enqueue({"n": n}, concurrency_key="P")
        Keyed.enqueue({"key": "A"}, concurrency_key="A")
        Keyed.enqueue({"key": "-"})
    with transaction.atomic():
        counts = run_until_empty(["keyed", "keyed_pair"])
    assert counts.get("succeeded") == 12, counts
    assert not WorkItem.objects.filter(status=Status.PENDING).exists()


def test_a_burst_worker_leaves_no_row_of_a_hot_key_behind() -> None:
    for n in range(12):
        Keyed.enqueue({"key": "hot", "n": n}, concurrency_key="hot", priority=5)
    for n in range(6):
        KeyedPair.enqueue({"n": n}, concurrency_key="pair")
    for _ in range(4):
        Noop.enqueue()
    worker = Worker(
        [registry[n] for n in HANDLERS], worker_config(burst=True, concurrency=3, batch_size=4)
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        worker.stop(immediate=True)
        thread.join(10)
        pytest.fail("the burst worker did not finish")
    assert WorkItem.objects.filter(status=Status.SUCCEEDED).count() == 22
    assert not WorkItem.objects.exclude(status=Status.SUCCEEDED).exists()


# -- against the model ------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_random_claims_match_the_model(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rnd = random.Random(seed)
    held: list[WorkItem] = []
    for _ in range(40):
        for _ in range(rnd.randint(0, 10)):
            cls = rnd.choice([Keyed, KeyedPair, Noop])
            key = rnd.choice([None, "A", "B", "C", "D"])
            queue = rnd.choice(["q1", "q2", "q3"])
            item = (
                Noop.enqueue(concurrency_key=key, queue=queue)
                if cls is Noop
                else cls.enqueue({"key": key or "-"}, concurrency_key=key, queue=queue)
            )
            # a few rows not due yet (run_after in 2999)
            seconds = rnd.choice([0, 1, 2, 3, 4, 5, 30_000_000_000])
            place(item, priority=rnd.choice([0, 0, 1, 3, -2]), seconds=seconds)
        monkeypatch.setattr(Keyed, "concurrency_limit", rnd.choice([1, 1, 2, 3]))
        monkeypatch.setattr(KeyedPair, "concurrency_limit", rnd.choice([1, 2, 2, 4, None]))
        monkeypatch.setattr(Noop, "concurrency_limit", rnd.choice([None, None, None, 1, 2]))
        if WorkItem.objects.filter(queue="q3").exists():
            (pause_queue if rnd.random() < 0.3 else resume_queue)("q3")
        queues = rnd.choice([None, None, ["q1"], ["q2"], ["q1", "q2"], ["q3", "q2"]])
        got = check(rnd.choice([1, 2, 3, 5, 8, 13, 40]), queues)
        held.extend(got)
        rnd.shuffle(held)
        k = rnd.randint(0, len(held))
        done, held = held[:k], held[k:]
        succeed(done)


# -- racing claimers --------------------------------------------------------------------


def test_racing_claimers_with_slots_held_never_exceed_a_limit_of_two() -> None:
    for r in range(15):
        key = f"race{r}"
        rows = [KeyedPair.enqueue({"n": n}, concurrency_key=key) for n in range(8)]
        place(rows[0], priority=9)
        (pre,) = keyed_claim(limit=1)  # one of two slots held
        assert pre.pk == rows[0].pk
        barrier = threading.Barrier(3)
        out: list[Any] = []
        errors: list[str] = []

        def run(
            n: int,
            barrier: threading.Barrier = barrier,
            out: list[Any] = out,
            errors: list[str] = errors,
        ) -> None:
            try:
                connection.ensure_connection()
                barrier.wait(10)
                out.append(keyed_claim(limit=1 + n, worker=f"racer:{n}"))
            except Exception as exc:
                errors.append(repr(exc))
            finally:
                connections.close_all()

        threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        claimed = WorkItem.objects.filter(status=Status.CLAIMED, concurrency_key=key).count()
        assert claimed == 2, f"round {r}: {claimed} claimed rows of a key with limit 2"
        assert sum(len(o) for o in out) == 1
        WorkItem.objects.filter(concurrency_key=key).delete()
