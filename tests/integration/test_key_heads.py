"""PostgreSQL's key-driven keyed claim (``postgresql_keyed_sql.CLAIM_HEADS``, migration 0008).

A worker whose handlers all declare a ``concurrency_limit`` finds the pending keys by a
loose scan of ``dbworker_key_pending_idx`` and claims the free keys' first rows (their
heads): a key at its limit costs one index descent, not a read of its backlog. Past
KEYS_WALKED keys it walks the rows as before (``test_many_keys_fall_back_to_the_walk``).
The claim order and the limits are the walk's: the randomized model test in
``test_attack_s9_keyed_candidates.py`` runs both paths against the same model.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_dbworker.db import operations
from django_dbworker.db.postgresql_keyed_sql import HEADS_PLAN, KEYS_WALKED, heads_statement
from django_dbworker.models import Status, WorkItem
from tests.factories import auto_explained_json, claim, rows_read
from tests.testapp.workers import Keyed, KeyedPair, Noop

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_only,
    pytest.mark.usefixtures("fresh_key_walk"),
]

LIMITED = ["keyed", "keyed_pair"]
LIMITS = {"keyed": 1, "keyed_pair": 2}
WALK_MARK = "p.handler <> ALL("  # a text of the walk's key filter only


def heads_claim(limit: int = 10) -> list[WorkItem]:
    return claim(limit=limit, handlers=LIMITED, limited=True)


def test_the_indexes_of_migration_0008_exist() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'django_dbworker_workitem'"
            " AND indexname IN ('dbworker_key_pending_idx', 'dbworker_claim_unkeyed_idx')"
        )
        assert sorted(r[0] for r in cursor.fetchall()) == [
            "dbworker_claim_unkeyed_idx",
            "dbworker_key_pending_idx",
        ]


def test_a_hot_keys_backlog_is_not_read_while_the_key_is_at_its_limit() -> None:
    """20,000 pending rows of one key at its limit; the row of another key behind them.

    The walk reads all 20,000 to find it (test_concurrency_keys.py's strict xfail,
    "a hot key's backlog is walked"); the heads read the hot key's name once.
    """
    for _ in range(4):
        Keyed.enqueue_many([{"key": "hot"}] * 5000, concurrency_key="hot")
    assert len(heads_claim(limit=1)) == 1  # the hot key is at its limit
    other = Keyed.enqueue({"key": "other"}, concurrency_key="other")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_workitem")
    statement = heads_statement(limit=4, handlers=LIMITED, queues=None, limits=LIMITS)
    assert statement is not None
    sql, params = statement
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        (plan,) = cursor.fetchone()
        transaction.set_rollback(True)  # EXPLAIN ANALYZE locked the candidates
    plan = json.loads(plan) if isinstance(plan, str) else plan
    assert rows_read(plan[0]["Plan"]) < 100
    assert [i.pk for i in heads_claim(limit=4)] == [other.pk]


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
    """The heads are keyed rows only: merged with unkeyed rows they either locked rows they
    did not return or cut them before locking (h-attack-s10, s11). A ready unkeyed row of the
    handlers makes the statement lock nothing and the claim walk, without the WALK_FOR
    memory of many keys."""
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


@pytest.mark.parametrize("analyzed", [2000, 0])
def test_the_loose_scan_keeps_its_indexes_when_the_statistics_knew_no_keyed_row(
    analyzed: int,
) -> None:
    """ANALYZE while the table held unkeyed rows only, then 100 keys' rows: the planner took
    each step of the recursion for a seq scan of a tiny table (220 ms a claim of 100 keys,
    bench/claim_cost.py's first run), and with seq scans off for a bitmap scan of the key's
    every row and a sort (145 ms). HEADS_PLAN keeps it on the index: a descent a key. The
    same after an ANALYZE of the empty table."""
    if analyzed:
        Noop.enqueue_many([{}] * analyzed)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_workitem")
    WorkItem.objects.all().delete()
    with transaction.atomic():
        for n in range(3000):
            Keyed.enqueue({"key": n}, concurrency_key=f"k{n % 100}")
    got, plans = auto_explained_json(lambda: heads_claim(limit=500))
    assert len(got) == 100
    (heads,) = [p for p in plans if "WITH RECURSIVE unkeyed" in p.get("Query Text", "")]
    assert rows_read(heads["Plan"]) < 1000, json.dumps(heads["Plan"])[:3000]


def test_the_plan_pin_does_not_make_the_server_compile_the_statement() -> None:
    """enable_seqscan = off prices the tiny QueueState scan at 1e10, past every JIT
    threshold: with JIT on, the server compiled the statement for 1.3 s a claim."""
    with transaction.atomic():
        for n in range(500):
            Keyed.enqueue({"key": n}, concurrency_key=f"k{n % 50}")
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        if cursor.fetchone()[0] != "on":
            pytest.skip("this server runs with jit = off: nothing to compile")
    statement = heads_statement(limit=500, handlers=LIMITED, queues=None, limits=LIMITS)
    assert statement is not None
    sql, params = statement
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(HEADS_PLAN.sql)
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        (plan,) = cursor.fetchone()
        transaction.set_rollback(True)
    plan = json.loads(plan) if isinstance(plan, str) else plan
    assert "JIT" not in plan[0], plan[0].get("JIT")
