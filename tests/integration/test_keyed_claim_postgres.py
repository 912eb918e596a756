"""PostgreSQL's keyed claim: the walk of the candidates, and the keys' heads.

A worker whose handlers all declare a ``concurrency_limit`` finds the pending keys by
a loose scan of ``dbworker_key_pending_idx`` and claims the free keys' first rows (their
heads, ``postgresql_keyed_sql.CLAIM_HEADS``): a key at its limit costs one index
descent, not a read of its backlog. Past KEYS_WALKED keys, with a ready row without a
key, or when a handler is unlimited, it walks the candidates instead
(``candidates_statement``): the next ready rows in claim order, a key's rows only up to
its limit (the rest stay locked and count as ``throttled``).

Both paths must claim what a model of the documented claim claims (claim order
priority DESC, run_after, id; the handlers' current limits); a claim beside a claim in
flight must take the next claimable rows (a short answer reads as "ran dry");
``HEADS_PLAN`` (seq scans and JIT off) applies to the claim's own transaction only; and
what a claim reads stays bounded by what it claims, not by a hot key's backlog, another
queue's or another handler's rows.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_dbworker import pause_queue, resume_queue
from django_dbworker.db import operations
from django_dbworker.db.keys import within_limits
from django_dbworker.db.postgresql_keyed_sql import (
    KEYS_WALKED,
    candidates_statement,
    heads_statement,
)
from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status, WorkItem
from django_dbworker.registry import registry
from django_dbworker.testing import run_until_empty
from django_dbworker.transitions import release
from django_dbworker.worker import Worker
from tests.factories import (
    HeldClaim,
    auto_explained_json,
    claim,
    handler_limits,
    limited_claim,
    rows_read,
    worker_config,
)
from tests.testapp.workers import Keyed, KeyedPair, Noop

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_only,
    pytest.mark.usefixtures("fresh_key_walk"),
]

LIMITED = ["keyed", "keyed_pair"]  # every handler limited: the heads
MIXED = ["keyed", "keyed_pair", "noop"]  # an unlimited handler too: the walk
LIMITS = {"keyed": 1, "keyed_pair": 2}
BASE = datetime(2020, 1, 1, tzinfo=UTC)
WALK_MARK = "p.handler <> ALL("  # a text of the walk's key filter only
BACKLOG = 5000
OTHERS = 50_000


def heads_claim(limit: int = 10) -> list[WorkItem]:
    return claim(limit=limit, handlers=LIMITED, limited=True)


def keyed_claim(limit: int = 10, queues: list[str] | None = None, worker: str = "t:1") -> Any:
    """The keyed claim of a worker of ``MIXED`` (the walk, unless every one is limited)."""
    return claim(limit=limit, handlers=MIXED, queues=queues, worker=worker, limited=True)


def place(item: WorkItem, *, priority: int = 0, seconds: int = 0) -> WorkItem:
    """Pin the row's claim order: priority, then run_after (BASE + seconds), then id."""
    WorkItem.objects.filter(pk=item.pk).update(
        priority=priority, run_after=BASE + timedelta(seconds=seconds)
    )
    return item


def best_rows(handlers: list[str]) -> dict[tuple[str, str], Any]:
    """Each key's best ready row, in any queue that is not paused: claim order's first."""
    paused = QueueState.objects.filter(paused=True).values("name")
    rows = (
        WorkItem.objects.filter(
            status=Status.PENDING,
            handler__in=handlers,
            concurrency_key__isnull=False,
            run_after__lte=timezone.now(),
        )
        .exclude(queue__in=paused)
        .values_list("id", "handler", "concurrency_key", "priority", "run_after", "queue")
    )
    best: dict[tuple[str, str], Any] = {}
    for r in sorted(rows, key=lambda r: (-r[3], r[4], r[0])):
        best.setdefault((r[1], r[2]), r)
    return best


def blocked(r: Any, best: dict[tuple[str, str], Any], queues: list[str], paused: set[str]) -> bool:
    """Whether the keyed row ``r`` waits: its key's best row (of the queues not paused) is
    in another queue."""
    b = best[(r[1], r[2])]
    return b[0] != r[0] and b[5] not in queues


def model(limit: int, queues: list[str] | None, limits: dict[str, int]) -> tuple[list[int], int]:
    """The ids the claim should take (claim order) and how many it should hold back.

    With every handler limited, PostgreSQL's claim takes the keys' heads
    (``postgresql_keyed_sql.CLAIM_HEADS``): a key offers its first rows up to its free
    slots, so a key's later rows take no place among the ``limit``; otherwise (an unlimited
    handler, or a ready row without a key) the walk's. Either way a worker of some queues
    leaves a key's row while a better row of the key waits in a queue it does not serve
    (and is not paused).
    """
    paused = set(QueueState.objects.filter(paused=True).values_list("name", flat=True))
    everywhere = [
        r
        for r in WorkItem.objects.filter(
            status=Status.PENDING, handler__in=MIXED, run_after__lte=timezone.now()
        ).values_list("id", "handler", "concurrency_key", "priority", "run_after", "queue")
        if r[5] not in paused
    ]
    everywhere.sort(key=lambda r: (-r[3], r[4], r[0]))
    held = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED, concurrency_key__isnull=False).values_list(
            "handler", "concurrency_key"
        )
    )

    def served(r: Any) -> bool:
        return not queues or r[5] in queues

    def at_limit(h: str, k: str | None) -> bool:
        return k is not None and h in limits and held[(h, k)] >= limits[h]

    def limited(r: Any) -> bool:
        return r[2] is not None and r[1] in limits

    # A limited key's row is claimable here unless the key's best ready row (in any queue)
    # waits in a queue this worker does not serve, and that is not paused.
    best = best_rows(MIXED)
    ready = [
        r
        for r in everywhere
        if served(r)
        and not at_limit(r[1], r[2])
        and not (limited(r) and queues and blocked(r, best, queues, paused))
    ]
    if set(MIXED) <= set(limits) and all(r[2] is not None for r in ready):
        offered: Counter[tuple[str, str]] = Counter()
        heads = []
        for r in ready:
            offered[(r[1], r[2])] += 1
            if offered[(r[1], r[2])] <= limits[r[1]] - held[(r[1], r[2])]:
                heads.append(r)
        ready = heads
    ready = ready[:limit]
    candidates = [(pk, h, k, None if k is None else limits.get(h)) for pk, h, k, *_ in ready]
    return within_limits(candidates, dict(held))


def check(limit: int, queues: list[str] | None = None) -> Any:
    limits = handler_limits(MIXED)
    want, held_back = model(limit, queues, limits)
    got = keyed_claim(limit=limit, queues=queues)
    assert sorted(i.pk for i in got) == sorted(want), (limit, queues, limits)
    assert getattr(got, "throttled", 0) == held_back, (limit, queues, limits)
    return got


def succeed(items: list[WorkItem]) -> None:
    if items:
        operations().succeed_many([(i.pk, i.claim_token, None) for i in items])


def heads_model(limit: int, queues: list[str] | None, limits: dict[str, int]) -> list[int]:
    """What the heads claim should take: the ready rows in claim order, a key offering its
    first rows up to its free slots (current limits); ``limit``. With a ready row without a
    key the claim walks instead: the heads are keyed rows only. Either way a keyed row waits
    while a better row of its key waits in a queue this worker does not serve.
    """
    now = timezone.now()
    paused = set(QueueState.objects.filter(paused=True).values_list("name", flat=True))
    held = Counter(
        WorkItem.objects.filter(status=Status.CLAIMED, concurrency_key__isnull=False).values_list(
            "handler", "concurrency_key"
        )
    )
    everywhere = [
        r
        for r in WorkItem.objects.filter(status=Status.PENDING, handler__in=LIMITED).values_list(
            "id", "handler", "concurrency_key", "priority", "run_after", "queue"
        )
        if r[4] <= now and r[5] not in paused
    ]
    everywhere.sort(key=lambda r: (-r[3], r[4], r[0]))
    rows = [r for r in everywhere if not queues or r[5] in queues]
    best = best_rows(LIMITED)
    offered: Counter[tuple[str, str]] = Counter()
    out = []
    if any(r[2] is None for r in rows):
        # A ready row without a key: the claim walks (the next ``limit`` ready rows but
        # keys at their limit or with a better row elsewhere, then those that fit).
        walked = [
            r
            for r in rows
            if r[2] is None
            or (
                held[(r[1], r[2])] < limits[r[1]]
                and not (queues and blocked(r, best, queues, paused))
            )
        ]
        for pk, handler, key, *_ in walked[:limit]:
            if key is not None:
                offered[(handler, key)] += 1
                if offered[(handler, key)] > limits[handler] - held[(handler, key)]:
                    continue
            out.append(pk)
        return out
    for r in rows:
        pk, handler, key = r[0], r[1], r[2]
        offered[(handler, key)] += 1
        if offered[(handler, key)] > limits[handler] - held[(handler, key)]:
            continue
        if queues and blocked(r, best, queues, paused):
            continue
        out.append(pk)
    return out[:limit]


def _copies(item: WorkItem, n: int, **changes: Any) -> None:
    """``n`` copies of ``item``'s row (new ids), in one statement, then ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'django_dbworker_workitem' AND column_name <> 'id'"
        )
        columns = [c for (c,) in cursor.fetchall()]
        values = [f"%({c})s" if c in changes else f"w.{c}" for c in columns]
        cursor.execute(
            f"INSERT INTO django_dbworker_workitem ({', '.join(columns)}) "
            f"SELECT {', '.join(values)} FROM django_dbworker_workitem AS w, "
            f"generate_series(1, %(n)s) AS g WHERE w.id = %(pk)s",
            {**changes, "n": n, "pk": item.pk},
        )
        cursor.execute("ANALYZE django_dbworker_workitem")


def explained_rows(sql: str, params: dict[str, Any], *, heads_plan: bool = False) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        if heads_plan:  # as the worker's claim runs it (its own transaction)
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("SET LOCAL jit = off")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        (plan,) = cursor.fetchone()
        transaction.set_rollback(True)
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return rows_read(plan[0]["Plan"])


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        return cursor.fetchone()[0]


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _keys_ahead_of_unkeyed(n: int) -> tuple[list[WorkItem], list[WorkItem]]:
    keyed = [
        place(Keyed.enqueue({"key": f"k{i}"}, concurrency_key=f"k{i}"), priority=5, seconds=i)
        for i in range(n)
    ]
    free = [place(Keyed.enqueue({"key": "-"}), priority=0, seconds=i) for i in range(n)]
    return keyed, free


def _fill(cls: Any, n: int, **kw: Any) -> None:
    with transaction.atomic():
        for start in range(0, n, 1000):
            cls.enqueue_many([{"key": "b"}] * min(1000, n - start), **kw)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_workitem")


def _reads(handlers: list[str], queues: list[str] | None, limit: int = 4) -> tuple[int, int]:
    limits = {h: LIMITS[h] for h in handlers if h in LIMITS}
    heads = heads_statement(limit=limit, handlers=handlers, queues=queues, limits=limits)
    assert heads is not None
    walk = candidates_statement(limit=limit, handlers=handlers, queues=queues, limits=limits)
    return explained_rows(*heads), explained_rows(*walk)


def heads_rows_read(run: Callable[[], Any]) -> tuple[Any, int]:
    result, plans = auto_explained_json(run)
    heads = [p for p in plans if "WITH RECURSIVE unkeyed" in p.get("Query Text", "")]
    assert len(heads) == 1, [p.get("Query Text", "")[:80] for p in plans]
    return result, rows_read(heads[0]["Plan"])


def _texts(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    with CaptureQueriesContext(connection) as queries:
        result = run()
    return result, [q["sql"] for q in queries.captured_queries]


def _walked(texts: list[str]) -> bool:
    return any("r.rank <= l.lim" in t for t in texts)


# -- the heads ---------------------------------------------------------------------


def test_the_keyed_claims_indexes_exist() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'django_dbworker_workitem'"
            " AND indexname IN ('dbworker_key_pending_idx', 'dbworker_claim_unkeyed_idx')"
        )
        assert sorted(r[0] for r in cursor.fetchall()) == [
            "dbworker_claim_unkeyed_idx",
            "dbworker_key_pending_idx",
        ]


def test_a_full_claim_of_heads_is_not_cut_short_by_a_keys_later_rows() -> None:
    """The walk's LIMIT counts the rows it locked, a key's later rows too: 3 rows of A ahead
    of B's row fill a claim of 3 and return A's first only. The heads fill it with A and B."""
    a = [Keyed.enqueue({"key": "A"}, concurrency_key="A") for _ in range(3)]
    b = Keyed.enqueue({"key": "B"}, concurrency_key="B")
    got = heads_claim(limit=3)
    assert sorted(i.pk for i in got) == sorted([a[0].pk, b.pk])
    assert getattr(got, "throttled", None) == 0


def test_a_key_offers_its_free_slots_only() -> None:
    """Limit 2, one slot held: the key offers one row (not two, of which one is then held
    back), so ``throttled`` counts only rows over the limit by a race."""
    rows = [KeyedPair.enqueue({"n": n}, concurrency_key="P") for n in range(4)]
    (first,) = heads_claim(limit=1)
    assert first.pk == rows[0].pk
    got = heads_claim(limit=10)
    assert [i.pk for i in got] == [rows[1].pk]
    assert getattr(got, "throttled", None) == 0
    assert heads_claim(limit=10) == []


def test_a_ready_row_without_a_key_sends_the_claim_to_the_walk_for_this_claim_only() -> None:
    """The heads are keyed rows only: merged with unkeyed rows they would lock rows they do
    not return, or cut them before locking. A ready unkeyed row of the handlers makes the
    statement lock nothing and the claim walk, without the WALK_FOR memory of many keys.
    """
    plain = [Keyed.enqueue({"key": "-"}) for _ in range(3)]
    keyed = [Keyed.enqueue({"key": "K"}, concurrency_key="K") for _ in range(2)]
    with CaptureQueriesContext(connection) as queries:
        got = heads_claim(limit=10)
    assert sorted(i.pk for i in got) == sorted([p.pk for p in plain] + [keyed[0].pk])
    texts = [q["sql"] for q in queries.captured_queries]
    assert any("WITH RECURSIVE unkeyed" in t for t in texts)
    assert any(WALK_MARK in t for t in texts)
    assert operations()._walk_keys_until == 0.0  # type: ignore[attr-defined]
    succeed = operations().succeed_many
    succeed([(i.pk, i.claim_token, None) for i in got])
    with CaptureQueriesContext(connection) as queries:
        (second,) = heads_claim(limit=10)
    assert second.pk == keyed[1].pk
    assert not any(WALK_MARK in q["sql"] for q in queries.captured_queries)


def test_many_keys_fall_back_to_the_walk_and_it_is_remembered() -> None:
    with transaction.atomic():
        for n in range(KEYS_WALKED + 5):
            Keyed.enqueue({"key": n}, concurrency_key=f"k{n}")
    with CaptureQueriesContext(connection) as first:
        got = heads_claim(limit=20)
    assert len(got) == 20
    assert len({i.concurrency_key for i in WorkItem.objects.filter(status=Status.CLAIMED)}) == 20
    texts = [q["sql"] for q in first.captured_queries]
    assert sum("WITH RECURSIVE unkeyed" in t for t in texts) == 1  # tried, then walked
    with CaptureQueriesContext(connection) as second:
        assert len(heads_claim(limit=20)) == 20
    assert not any("WITH RECURSIVE unkeyed" in q["sql"] for q in second.captured_queries)


@pytest.mark.parametrize(
    ("spread", "walks"),
    [
        ((KEYS_WALKED, 0), False),
        ((KEYS_WALKED + 1, 0), True),
        ((KEYS_WALKED // 2, KEYS_WALKED // 2 + 1), True),
    ],
    ids=["exactly", "one_more", "two_handlers"],
)
def test_the_fallback_at_keys_walked(spread: tuple[int, int], walks: bool) -> None:
    """KEYS_WALKED pending keys: the heads; one more (also over two handlers): the walk.
    Either way the claim takes the first keys' rows in claim order, one a key of limit 1
    (the second row of each key is behind every key's first)."""
    keyed, pair = spread
    with transaction.atomic():
        for n in range(keyed):
            Keyed.enqueue({"n": n}, concurrency_key=f"k{n:05}", priority=1)
        for n in range(pair):
            KeyedPair.enqueue({"n": n}, concurrency_key=f"p{n:05}")
        Keyed.enqueue_many([{"n": -1}] * 3, concurrency_key="k00000")
    first = sorted(WorkItem.objects.filter(status=Status.PENDING).values_list("id", flat=True))
    got, texts = _texts(lambda: limited_claim(LIMITED, 12))
    assert _walked(texts) is walks
    assert sorted(i.pk for i in got) == first[:12]
    assert getattr(got, "throttled", 0) == 0


def test_odd_keys_are_distinct_keys_on_the_heads_path() -> None:
    """Keys compare byte for byte: case, accents, spaces, quotes, 200 characters."""
    odd = [
        "a",
        "A",
        "Ä",
        "A ",
        " A",
        "a\u0308",
        "ä",
        "'",
        "%",
        "_",
        "\\",
        "x" * 200,
        "x" * 199,
        "日本",
        "k:1",
        "k",
        "k:",
        "ß",
        "ss",
        "\t",
    ]
    rows = {}
    for key in odd:
        rows[key] = [Keyed.enqueue({"key": key}, concurrency_key=key) for _ in range(2)]
    got = limited_claim(LIMITED, 50)
    assert sorted(i.pk for i in got) == sorted(r[0].pk for r in rows.values())
    assert getattr(got, "throttled", 0) == 0
    assert list(limited_claim(LIMITED, 50)) == []


# -- the walk: a key's rows up to its limit, the rest held back ------------------------


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
    for n in range(3):
        place(KeyedPair.enqueue({"n": n}, concurrency_key="K", queue="q2"), seconds=10 + n)
    # K's best rows wait in q1: a worker of q2 leaves the key to q1's workers.
    got = keyed_claim(limit=10, queues=["q2"])
    assert list(got) == [] and got.throttled == 0
    got = keyed_claim(limit=10, queues=["q1"])
    assert sorted(i.pk for i in got) == [q1[0].pk, q1[1].pk]
    assert got.throttled == 1
    got = keyed_claim(limit=10, queues=["q2"])  # the key is at its limit: nothing
    assert list(got) == [] and got.throttled == 0
    succeed(list(WorkItem.objects.filter(pk=q1[0].pk)))
    got = keyed_claim(limit=10, queues=["q1", "q2"])
    assert [i.pk for i in got] == [q1[2].pk]
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
        [registry[n] for n in MIXED], worker_config(burst=True, concurrency=3, batch_size=4)
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


# -- both paths against a model ------------------------------------------------------


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


def test_the_heads_claim_what_a_brute_force_model_claims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random tables (two limited handlers, four keys and none, priorities and run_after
    with ties, rows not yet due, three queues, one paused at times, slots held, limits
    raised and lowered below the slots held); random claims (limit, queues) on the heads
    path against the model, then the limits never exceeded."""
    rnd = random.Random(11)
    taken = 0
    for round_ in range(25):
        WorkItem.objects.all().delete()
        QueueState.objects.all().delete()
        monkeypatch.setattr(Keyed, "concurrency_limit", 1)
        monkeypatch.setattr(KeyedPair, "concurrency_limit", 2)
        for _ in range(rnd.randint(5, 30)):
            cls = rnd.choice([Keyed, KeyedPair])
            key = rnd.choice([None, "A", "B", "C", "D"])
            queue = rnd.choice(["q1", "q2", "q3"])
            item = cls.enqueue({"key": key or "-"}, concurrency_key=key, queue=queue)
            place(item, priority=rnd.randint(0, 2), seconds=rnd.randint(0, 5))
            if rnd.random() < 0.15:
                WorkItem.objects.filter(pk=item.pk).update(
                    run_after=timezone.now() + timedelta(hours=1)
                )
        for _ in range(rnd.randint(0, 2)):
            limited_claim(LIMITED, rnd.randint(1, 4), worker="pre")
        monkeypatch.setattr(Keyed, "concurrency_limit", rnd.choice([1, 1, 2, 3]))
        monkeypatch.setattr(KeyedPair, "concurrency_limit", rnd.choice([1, 2, 2, 3]))
        if rnd.random() < 0.3:
            pause_queue("q3")
        for _ in range(3):
            queues = rnd.choice([None, ["q1"], ["q1", "q2"], ["q3"], ["q2", "q3"]])
            limit = rnd.randint(1, 8)
            limits = handler_limits(LIMITED)
            want = heads_model(limit, queues, limits)
            unkeyed = WorkItem.objects.filter(
                status=Status.PENDING, handler__in=LIMITED, concurrency_key__isnull=True
            ).exists()
            got = limited_claim(LIMITED, limit, queues=queues)
            assert sorted(i.pk for i in got) == sorted(want), (round_, limit, queues, limits)
            if not unkeyed:  # the heads: a key offers its free slots, nothing is held back
                assert getattr(got, "throttled", 0) == 0, (round_, limit, queues, limits)
            taken += len(got)
        resume_queue("q3")
    assert taken > 50, taken


# -- a claim beside a claim in flight --------------------------------------------------


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_a_claim_beside_a_claim_in_flight_takes_the_next_keys(handlers: list[str]) -> None:
    """Six keys of one row each; a claim of 3 is in flight (rows of A, B, C locked, not yet
    committed). A second claimer of 3 takes D, E, F: "keys of other items flow freely".
    The heads lock below their LIMIT with SKIP LOCKED, so they do not pick the held rows
    and answer short (which the claim loop would read as "ran dry").
    """
    rows = [Keyed.enqueue({"key": k}, concurrency_key=k) for k in "ABCDEF"]
    with HeldClaim(lambda: limited_claim(handlers, 3, worker="first")) as first:
        assert sorted(i.pk for i in first.out[0]) == [r.pk for r in rows[:3]]
        got = limited_claim(handlers, 3, worker="second")
        taken = sorted(i.pk for i in got)
        throttled = getattr(got, "throttled", 0)
    assert taken == [r.pk for r in rows[3:]], (
        f"second claim of 3 beside a claim in flight took {taken} (throttled {throttled}); "
        f"claimable: {[r.pk for r in rows[3:]]}"
    )


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_unkeyed_rows_beside_a_claim_in_flight(handlers: list[str]) -> None:
    """The same with rows without a key of a limited handler (the heads' unkeyed branch)."""
    rows = [Keyed.enqueue({"key": "-"}) for _ in range(8)]
    with HeldClaim(lambda: limited_claim(handlers, 4, worker="first")):
        got = limited_claim(handlers, 4, worker="second")
        taken = sorted(i.pk for i in got)
    assert taken == [r.pk for r in rows[4:]], taken


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_a_burst_worker_beside_a_claim_in_flight_runs_the_rows_it_can_claim(
    handlers: list[str],
) -> None:
    """20 rows without a key of a limited handler; another claimer holds the first 10 in a
    claim in flight. A burst worker ("process until nothing is claimable") runs the other
    10 before it exits.
    """
    for n in range(20):
        Keyed.enqueue({"key": "-", "n": n})
    worker = Worker(
        [registry[n] for n in handlers], worker_config(burst=True, concurrency=2, batch_size=4)
    )
    with HeldClaim(lambda: limited_claim(handlers, 10, worker="holder")):
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        thread.join(30)
        if thread.is_alive():
            worker.stop(immediate=True)
            thread.join(10)
            pytest.fail("the burst worker did not finish")
        ran = WorkItem.objects.filter(status=Status.SUCCEEDED).count()
    assert ran == 10, f"the burst worker ran {ran} of the 10 rows it could claim, then exited"


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_unkeyed_rows_behind_keyed_heads_are_claimable_beside_a_claim_in_flight(
    handlers: list[str],
) -> None:
    """Four keys of one row each at priority 5, four rows without a key at priority 0, all of
    the limited handler ``keyed``. A claim of 4 in flight takes the keyed rows; a second
    claim of 4 takes the four unkeyed rows: the first claim locked only the rows it returns.
    """
    keyed, free = _keys_ahead_of_unkeyed(4)
    with HeldClaim(lambda: limited_claim(handlers, 4, worker="first")) as first:
        assert sorted(i.pk for i in first.out[0]) == [r.pk for r in keyed]
        got = limited_claim(handlers, 4, worker="second")
        taken = sorted(i.pk for i in got)
        throttled = getattr(got, "throttled", 0)
    assert taken == [r.pk for r in free], (
        f"second claim of 4 beside a claim in flight took {taken} (throttled {throttled}); "
        f"claimable: {[r.pk for r in free]}"
    )


@pytest.mark.parametrize("handlers", [MIXED, LIMITED], ids=["walk", "heads"])
def test_a_worker_runs_the_unkeyed_rows_a_claim_in_flight_passed_over(
    handlers: list[str],
) -> None:
    """The same with a real worker (poll interval 30 s, LISTEN wakes it): while the claim of
    the keyed rows is in flight it runs the four unkeyed rows, not an empty claim read as
    "ran dry" and a sleep of the poll interval.
    """
    _keyed, free = _keys_ahead_of_unkeyed(4)
    worker = Worker(
        [registry[n] for n in handlers],
        worker_config(concurrency=2, batch_size=4, poll_interval=30.0),
    )

    def ran() -> list[int]:
        return sorted(WorkItem.objects.filter(status=Status.SUCCEEDED).values_list("pk", flat=True))

    with HeldClaim(lambda: limited_claim(handlers, 4, worker="holder")):
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: len(ran()) >= len(free), 6.0)
            done = ran()
        finally:
            worker.stop(immediate=True)
            thread.join(20)
    assert not thread.is_alive()
    assert done == [r.pk for r in free], (
        f"in 6 s the worker ran {done}; claimable all along: {[r.pk for r in free]}"
    )


# -- racing claimers never exceed a key's limit ------------------------------------------


def test_racing_heads_and_walk_claimers_never_exceed_a_keys_limit() -> None:
    """Two heads claimers and a walk claimer on their own connections, the same keys of
    limits 1 and 2, while a fourth thread frees slots (succeeds held rows); many rounds.
    At the end of each round no key holds more claimed rows than its limit."""
    rnd = random.Random(10)
    keys = ["r0", "r1", "r2"]
    with transaction.atomic():
        for key in keys:
            Keyed.enqueue_many([{"key": key}] * 40, concurrency_key=key)
            KeyedPair.enqueue_many([{"n": 0}] * 40, concurrency_key=key)
        Noop.enqueue_many([{}] * 10)
    limits = {"keyed": 1, "keyed_pair": 2}
    for r in range(12):
        held = list(WorkItem.objects.filter(status=Status.CLAIMED))
        freeing = rnd.sample(held, k=rnd.randint(0, len(held)))
        barrier = threading.Barrier(4)
        errors: list[str] = []

        def run(
            job: Callable[[], Any],
            barrier: threading.Barrier = barrier,
            errors: list[str] = errors,
        ) -> None:
            try:
                connection.ensure_connection()
                barrier.wait(10)
                job()
            except Exception as exc:
                errors.append(repr(exc))
            finally:
                connections.close_all()

        def free(rows: list[WorkItem] = freeing) -> None:
            for row in rows:
                operations().succeed_many([(row.pk, row.claim_token, None)])

        jobs = [
            lambda r=r: limited_claim(LIMITED, rnd.randint(1, 5), worker=f"h1:{r}"),
            lambda r=r: limited_claim(LIMITED, rnd.randint(1, 5), worker=f"h2:{r}"),
            lambda r=r: limited_claim(MIXED, rnd.randint(1, 5), worker=f"w:{r}"),
            free,
        ]
        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        counts = Counter(
            WorkItem.objects.filter(
                status=Status.CLAIMED, concurrency_key__isnull=False
            ).values_list("handler", "concurrency_key")
        )
        over = {hk: n for hk, n in counts.items() if n > limits[hk[0]]}
        assert not over, f"round {r}: keys over their limit {over}"


def test_racing_claimers_with_releases_and_recovery_never_exceed_a_keys_limit() -> None:
    """Two heads claimers and a walk claimer claim without pause while a churner succeeds,
    releases and (heartbeat aged) recovers claimed rows; a monitor counts each key's
    claimed rows in every snapshot it takes. No snapshot may show a key over its limit."""
    from django_dbworker.stale import recover_stale

    keys = [f"r{n}" for n in range(5)]
    with transaction.atomic():
        for key in keys:
            Keyed.enqueue_many([{"key": key}] * 30, concurrency_key=key)
            KeyedPair.enqueue_many([{"n": 0}] * 30, concurrency_key=key)
        Keyed.enqueue_many([{"key": "-"}] * 30)
        Noop.enqueue_many([{}] * 20)
    limits = {"keyed": 1, "keyed_pair": 2}
    stop = threading.Event()
    errors: list[str] = []
    over: list[Any] = []
    snapshots = [0]
    claims = Counter[str]()

    def loop(body: Callable[[random.Random], None], seed: int) -> None:
        rnd = random.Random(seed)
        try:
            while not stop.is_set():
                body(rnd)
        except Exception as exc:
            errors.append(repr(exc))
            stop.set()
        finally:
            connections.close_all()

    def claimer(handlers: list[str], name: str) -> Callable[[random.Random], None]:
        def body(rnd: random.Random) -> None:
            got = limited_claim(handlers, rnd.randint(1, 3), worker=name)
            claims[name] += len(got)

        return body

    def churn(rnd: random.Random) -> None:
        held = list(WorkItem.objects.filter(status=Status.CLAIMED).order_by("?")[:3])
        for item in held:
            what = rnd.random()
            if what < 0.4:
                operations().succeed_many([(item.pk, item.claim_token, None)])
            elif what < 0.7:
                release([item])
            else:
                WorkItem.objects.filter(pk=item.pk).update(heartbeat_at=Now() - timedelta(hours=1))
                recover_stale(stale_after=60, log=False)

    def monitor(rnd: random.Random) -> None:
        counts = Counter(
            WorkItem.objects.filter(
                status=Status.CLAIMED, concurrency_key__isnull=False
            ).values_list("handler", "concurrency_key")
        )
        snapshots[0] += 1
        bad = {hk: n for hk, n in counts.items() if n > limits[hk[0]]}
        if bad:
            over.append(bad)
            stop.set()

    bodies = [
        claimer(LIMITED, "h1"),
        claimer(LIMITED, "h2"),
        claimer(MIXED, "w"),
        churn,
        monitor,
    ]
    threads = [
        threading.Thread(target=loop, args=(b, n), daemon=True) for n, b in enumerate(bodies)
    ]
    for t in threads:
        t.start()
    stop.wait(5.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert not over, f"keys over their limit: {over[:3]}"
    assert claims["h1"] and claims["h2"] and claims["w"] and snapshots[0] > 10, (claims, snapshots)


# -- HEADS_PLAN: the claim's own transaction only, no JIT ---------------------------------


def test_manual_autocommit_off_keeps_the_callers_planner_settings() -> None:
    """AUTOCOMMIT off, outside atomic(): the keyed claim runs in the caller's transaction,
    which it does not commit. Its SET LOCALs must not change how the caller's next
    statements are planned (the plain claim sends no CLAIM_PLAN there)."""
    Keyed.enqueue({"key": "a"}, concurrency_key="a")
    before = (_show("enable_seqscan"), _show("jit"))
    transaction.set_autocommit(False)
    try:
        got = limited_claim(LIMITED, 4)
        after = (_show("enable_seqscan"), _show("jit"))
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert len(got) == 1
    assert after == before, (
        f"after the keyed claim the caller's transaction runs with (enable_seqscan, jit) = "
        f"{after}, was {before}"
    )


def test_the_settings_end_with_the_claims_own_transaction() -> None:
    """Autocommit (a worker): the next statement on the connection plans as before, and
    a caller's atomic() block gets no settings either."""
    Keyed.enqueue({"key": "a"}, concurrency_key="a")
    Keyed.enqueue({"key": "b"}, concurrency_key="b")
    before = (_show("enable_seqscan"), _show("jit"))
    assert len(limited_claim(LIMITED, 1)) == 1
    assert (_show("enable_seqscan"), _show("jit")) == before
    with transaction.atomic():
        assert len(limited_claim(LIMITED, 1)) == 1
        assert (_show("enable_seqscan"), _show("jit")) == before
    assert list(limited_claim(LIMITED, 1)) == []  # empty claim: still its own transaction
    assert (_show("enable_seqscan"), _show("jit")) == before


def test_a_workers_claim_of_a_few_rows_is_not_jit_compiled() -> None:
    """``enable_seqscan = off`` prices the seq scan of django_dbworker_queuestate at 1e10,
    past every jit_*_above_cost: HEADS_PLAN turns JIT off too, so a claim of a few rows is
    not compiled with LLVM (about 0.6 s a claim with the server's default ``jit = on``).
    """
    for n in range(10):
        Keyed.enqueue({"key": n}, concurrency_key=f"k{n}")
    got, plans = auto_explained_json(lambda: limited_claim(LIMITED, 4))
    assert len(got) == 4
    (heads,) = [p for p in plans if "WITH RECURSIVE unkeyed" in p.get("Query Text", "")]
    cost = heads["Plan"].get("Total Cost")
    jit = heads.get("JIT", {}).get("Timing", {}).get("Total")
    assert jit is None, (
        f"the heads statement was JIT-compiled: {jit} ms of {heads['Plan']['Actual Total Time']}"
        f" ms (estimated cost {cost})"
    )


# -- what a claim reads -------------------------------------------------------------------


@pytest.mark.parametrize("inside", [True, False], ids=["callers_transaction", "own_transaction"])
def test_a_hot_keys_backlog_is_not_read_by_the_claim_a_worker_runs(inside: bool) -> None:
    """BACKLOG pending rows of one key at its limit, one row of another key: the heads read
    the hot key's name once, measured on the statement as the claim runs it, in a caller's
    transaction and in its own (where HEADS_PLAN turns seq scans off: the disabled scan of
    django_dbworker_queuestate must not make the planner read every pending row in claim
    order instead).
    """
    with transaction.atomic():
        for _ in range(BACKLOG // 1000):
            Keyed.enqueue_many([{"key": "hot"}] * 1000, concurrency_key="hot")
    assert len(limited_claim(LIMITED, 1)) == 1  # the hot key is at its limit
    other = Keyed.enqueue({"key": "other"}, concurrency_key="other")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_workitem")

    def run() -> Any:
        if inside:
            with transaction.atomic():
                return limited_claim(LIMITED, 4)
        return limited_claim(LIMITED, 4)

    got, read = heads_rows_read(run)
    assert [i.pk for i in got] == [other.pk]
    assert read < 100, f"the heads statement read {read} rows behind a hot key of {BACKLOG}"


def test_a_free_keys_backlog_in_another_queue_is_not_read_by_a_queue_worker() -> None:
    """A worker of queue q2; a key with BACKLOG rows in q1 (not at its limit: q1 has no
    worker now). The walk of q2 reads q2's index only; the heads descend into the key and
    filter its whole q1 backlog out, every claim."""
    _fill(Keyed, BACKLOG, concurrency_key="hot", queue="q1")
    mine = Keyed.enqueue({"key": "x"}, concurrency_key="x", queue="q2")
    heads, walk = _reads(["keyed"], ["q2"])
    assert walk < 100
    assert heads < 100, f"heads read {heads} rows for a claim of queue q2 (walk: {walk})"
    assert [i.pk for i in limited_claim(["keyed"], 4, queues=["q2"])] == [mine.pk]


def test_a_paused_queues_key_does_not_hide_the_rows_behind_it() -> None:
    """A free key whose rows all sit in a paused queue offers no head; the rows behind
    it are claimed (the heads read the paused backlog, as the walk does: not asserted)."""
    _fill(Keyed, 500, concurrency_key="hot", queue="q1")
    pause_queue("q1")
    mine = Keyed.enqueue({"key": "x"}, concurrency_key="x", queue="q2")
    assert [i.pk for i in limited_claim(["keyed"], 4)] == [mine.pk]


def test_other_queues_unkeyed_rows_are_not_read_by_a_queue_worker() -> None:
    _fill(Keyed, BACKLOG, queue="q1")
    mine = Keyed.enqueue({"key": "x"}, queue="q2")
    heads, walk = _reads(["keyed"], ["q2"])
    assert walk < 100
    assert heads < 100, f"heads read {heads} rows for a claim of queue q2 (walk: {walk})"
    assert [i.pk for i in limited_claim(["keyed"], 4, queues=["q2"])] == [mine.pk]


@pytest.mark.parametrize(
    ("analyzed", "vacuumed"),
    [
        (2000, False),
        (0, False),
        pytest.param(
            2000,
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="a VACUUM (autovacuum's) after the unkeyed rows went: each step of the "
                "recursion scans dbworker_claim_queue_idx and sorts (150,215 rows read a claim)",
            ),
        ),
    ],
    ids=["2000", "0", "2000-vacuumed"],
)
def test_the_loose_scan_keeps_its_indexes_when_the_statistics_knew_no_keyed_row(
    analyzed: int, vacuumed: bool
) -> None:
    """ANALYZE while the table held unkeyed rows only, then 100 keys' rows: the planner took
    each step of the recursion for a seq scan of a tiny table (220 ms a claim of 100 keys,
    bench/claim_cost.py's first run), and with seq scans off for a bitmap scan of the key's
    every row and a sort (145 ms). HEADS_PLAN keeps it on the index: a descent a key. The
    same after an ANALYZE of the empty table.

    The statistics are the test's own: autovacuum is off for the table meanwhile (on a
    loaded host this test ran 54 s, time for autovacuum to change them halfway, which
    the vacuumed case does on purpose)."""
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE django_dbworker_workitem SET (autovacuum_enabled = off)")
    try:
        if analyzed:
            Noop.enqueue_many([{}] * analyzed)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE django_dbworker_workitem")
        WorkItem.objects.all().delete()
        if vacuumed:
            with connection.cursor() as cursor:
                cursor.execute("VACUUM django_dbworker_workitem")
        with transaction.atomic():
            for n in range(3000):
                Keyed.enqueue({"key": n}, concurrency_key=f"k{n % 100}")
        got, plans = auto_explained_json(lambda: heads_claim(limit=500))
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE django_dbworker_workitem RESET (autovacuum_enabled)")
    assert len(got) == 100
    (heads,) = [p for p in plans if "WITH RECURSIVE unkeyed" in p.get("Query Text", "")]
    assert rows_read(heads["Plan"]) < 1000, json.dumps(heads["Plan"])[:3000]


@pytest.mark.parametrize("ahead", [False, True], ids=["behind", "ahead"])
def test_another_handlers_unkeyed_backlog_costs_the_heads_no_more_than_the_walk(
    ahead: bool,
) -> None:
    """A worker of the limited handler ``keyed``, whose 20 ready rows all have keys; beside it
    OTHERS pending rows without a key of ``noop`` (another worker's), behind or ahead in
    claim order. A claim of 4 by the heads reads no more than the walk's: the unkeyed probe
    is per handler (dbworker_claim_unkeyed_idx leads with it).
    """
    for n in range(20):
        place(Keyed.enqueue({"key": f"k{n}"}, concurrency_key=f"k{n}"), priority=5, seconds=n)
    template = Noop.enqueue()
    _copies(template, OTHERS - 1, priority=9 if ahead else 0)
    WorkItem.objects.filter(pk=template.pk).update(priority=9 if ahead else 0)
    limits = handler_limits(["keyed"])
    heads = heads_statement(limit=4, handlers=["keyed"], queues=None, limits=limits)
    assert heads is not None
    walk = candidates_statement(limit=4, handlers=["keyed"], queues=None, limits=limits)
    heads_read = explained_rows(*heads, heads_plan=True)
    walk_read = explained_rows(*walk, heads_plan=False)
    got = limited_claim(["keyed"], 4)
    assert len(got) == 4
    assert heads_read <= max(200, 2 * walk_read), (
        f"the heads read {heads_read} rows for a claim of 4; the walk {walk_read}"
    )


def test_the_fallback_walk_under_heads_plan_reads_no_more_than_the_walk() -> None:
    """Past KEYS_WALKED keys the walk runs in the transaction where HEADS_PLAN turned seq
    scans off; with a hot key's backlog and 5,000 rows of another handler it must read no
    more than the walk as planned normally."""
    with transaction.atomic():
        for n in range(1100):
            Keyed.enqueue({"n": n}, concurrency_key=f"k{n:05}")
    template = Noop.enqueue()
    _copies(template, 4999)
    limits = handler_limits(["keyed"])
    walk = candidates_statement(limit=4, handlers=["keyed"], queues=None, limits=limits)
    plain = explained_rows(*walk, heads_plan=False)
    pinned = explained_rows(*walk, heads_plan=True)
    assert pinned <= max(200, 2 * plain), (pinned, plain)
    assert len(limited_claim(["keyed"], 4)) == 4
    assert operations()._walk_keys_until > time.monotonic()
