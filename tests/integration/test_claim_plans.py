"""The PostgreSQL claim and success statements keep index-driven plans on a big table.

With 100,000 mostly finished rows and fresh statistics, each claim variant
must read the partial claim index in claim order (so the LIMIT stops the
scan), never the table; the success statement must find its rows by
primary key. The statements are db/postgresql_sql.py's, with the parameters
the worker passes.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from django.db import connection

from bench.bigtable import fill
from django_dbworker.db import postgresql, postgresql_keyed_sql
from tests.factories import auto_explained, claim, make_item

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

TABLE = "django_dbworker_workitem"


def _plan(sql: str, params: dict[str, Any]) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.fixture
def big_table() -> None:
    fill(100_000)


@pytest.mark.parametrize(
    ("handlers", "queues", "index", "sorted_by_index"),
    [
        (["noop"], None, "dbworker_claim_idx", True),
        (["noop", "echo"], None, "dbworker_claim_idx", True),
        (["noop", "echo"], ["urgent"], "dbworker_claim_queue_idx", True),
        # Several queues: the index finds the rows, a top-N sort orders them.
        (["noop"], ["urgent", "emails"], "dbworker_claim", False),
    ],
)
def test_claims_read_the_claim_index(
    big_table: None,
    handlers: list[str],
    queues: list[str] | None,
    index: str,
    sorted_by_index: bool,
) -> None:
    sql, params = postgresql.claim_statement(
        limit=8, handlers=handlers, queues=queues, worker="host:1:Main"
    )
    plan = _plan(sql, params)
    assert f"Seq Scan on {TABLE}" not in plan, plan
    assert f"using {index}" in plan, plan
    if sorted_by_index:
        assert "Sort" not in plan, plan


@pytest.mark.parametrize("queues", [None, ["urgent"], ["urgent", "emails"]])
def test_a_claim_selects_its_rows_once_whatever_the_tables_statistics(
    queues: list[str] | None,
) -> None:
    """The rows to claim are a materialized CTE, read once, with the table's statistics
    those of an emptied table (as a test suite, or a drained queue, leaves them). A FROM
    subquery planned as a nested loop's inner side runs again per outer row, each run
    locking the next rows past SKIP LOCKED: once, a claim of 1 took 3 rows (the
    PostgreSQL leg's admin batch tests, after earlier tests emptied the table)."""
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}")  # empty: the planner's worst guess
    sql, params = postgresql.claim_statement(
        limit=1, handlers=["noop"], queues=queues, worker="host:1:Main"
    )
    plan = _plan(sql, params)
    assert "CTE Scan on c" in plan, plan
    for _ in range(3):
        make_item("noop", queue=queues[0] if queues else "default")
    assert len(claim(limit=1, handlers=["noop"], queues=queues)) == 1


def _claim_plans(queues: list[str] | None, limit: int) -> list[str]:
    """The plans of the statements one ``operations().claim`` ran, as the server chose them.

    auto_explain (a contrib module of the server) reports each statement's plan as a
    notice to this session; its settings are reset before the session is reused.
    """
    claimed, notices = auto_explained(lambda: claim(limit=limit, handlers=["noop"], queues=queues))
    assert len(claimed) == limit
    return [n for n in notices if "Update on" in n]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("queues", "index"), [(None, "dbworker_claim_idx"), (["urgent"], "dbworker_claim_queue_idx")]
)
def test_a_backlog_the_statistics_do_not_know_is_still_claimed_from_the_index(
    queues: list[str] | None, index: str
) -> None:
    """The table's statistics say it holds no row while a backlog waits: an ANALYZE that
    ran while the backlog's enqueue_many was uncommitted (autovacuum does, at any time)
    counts its pages but not its rows, and the planner then expects one pending row.
    Expecting one row, it chose a bitmap scan of every pending row and a sort (6 ms for
    20,000 rows here, 15-20 ms in the benchmarks' W6, every urgent claim until autovacuum
    analyzed again) over the claim index read in claim order, stopped by the LIMIT."""
    from django.db import transaction

    from django_dbworker.models import WorkItem

    queue = queues[0] if queues else "default"

    columns = ", ".join(f.column for f in WorkItem._meta.concrete_fields if not f.primary_key)

    def backlog() -> None:
        # One row through the ORM, then 19,999 copies of it in one statement
        # (two ORM bulk inserts of 20,000 rows took most of this test's 20 s).
        WorkItem.objects.bulk_create(
            [WorkItem(handler="noop", queue=queue, payload={}, max_attempts=3)]
        )
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {TABLE} ({columns}) SELECT {columns} FROM {TABLE}, "
                "generate_series(1, 19999)"
            )

    # The columns' statistics of an earlier backlog; then the table emptied (the
    # benchmarks' TRUNCATE, or a drained queue, pruned) and a backlog arriving.
    backlog()
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}")
        cursor.execute(f"TRUNCATE {TABLE}")
    with transaction.atomic():
        backlog()
        with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
            other.execute(f"ANALYZE {TABLE}")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT relpages > 0, reltuples FROM pg_class WHERE relname = '{TABLE}'")
        assert cursor.fetchone() == (True, 0.0), "the statistics were meant to say: no row"
    (plan,) = _claim_plans(queues, limit=1)
    assert f"Index Scan using {index}" in plan, plan
    assert "Sort" not in plan, plan


def test_success_writes_are_primary_key_lookups(big_table: None) -> None:
    ids = [1, 2, 3]
    params = {
        "ids": ids,
        "tokens": [uuid.uuid4() for _ in ids],
        "results": ["1", None, '{"a": 1}'],
    }
    plan = _plan(postgresql.SUCCEED_MANY.sql, params)
    assert f"Seq Scan on {TABLE}" not in plan, plan
    assert f"Index Scan using {TABLE}_pkey" in plan, plan


@pytest.mark.parametrize("queues", [None, ["urgent"], ["urgent", "emails"]])
def test_the_pause_filter_is_one_hashed_subplan_on_the_claim_index_path(
    big_table: None, queues: list[str] | None
) -> None:
    # Paused queues are a hashed set, read once per statement and probed per
    # candidate row: the claim index still drives the scan.
    from django_dbworker.flow.models import QueueState

    QueueState.objects.bulk_create([QueueState(name=f"q{i}", paused=i % 2 == 0) for i in range(20)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_dbworker_queuestate")
    sql, params = postgresql.claim_statement(
        limit=8, handlers=["noop"], queues=queues, worker="host:1:Main"
    )
    plan = _plan(sql, params)
    assert f"Seq Scan on {TABLE}" not in plan, plan
    assert "using dbworker_claim" in plan, plan
    assert "hashed SubPlan" in plan, plan


@pytest.mark.parametrize(
    ("queues", "index"),
    [(None, "dbworker_claim_idx"), (["urgent"], "dbworker_claim_queue_idx")],
)
def test_the_keyed_claims_candidates_read_the_claim_index_and_count_slots_by_index(
    big_table: None, queues: list[str] | None, index: str
) -> None:
    """Keys at their limit are skipped by a probe of the slot index, not a scan."""
    from django_dbworker.models import WorkItem

    WorkItem.objects.bulk_create(
        WorkItem(handler="noop", queue="urgent", payload={}, max_attempts=3, status=s, **k)
        for s in ("claimed", "pending")
        for k in ({"concurrency_key": f"k{i}", "concurrency_limit": 1} for i in range(50))
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TABLE}")
    sql, params = postgresql_keyed_sql.candidates_statement(
        limit=8, handlers=["noop"], queues=queues, limits={"noop": 1}
    )
    plan = _plan(sql, params)
    assert f"Seq Scan on {TABLE}" not in plan, plan
    assert f"using {index}" in plan, plan
    assert "using dbworker_key_slots_idx" in plan, plan
    # The table's rows come in claim order from the index (the LIMIT stops
    # the scan); only the few candidates and their lock numbers are sorted.
    assert "Sort Key: p." not in plan, plan
