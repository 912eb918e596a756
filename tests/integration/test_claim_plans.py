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
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext
from psycopg.pq import TransactionStatus

from bench.bigtable import fill
from django_dbworker.db import operations, postgresql, postgresql_keyed_sql
from django_dbworker.db.sql import CLAIM_COLUMNS
from django_dbworker.models import WorkItem
from tests.factories import auto_explained, claim, make_item

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]
transactional = pytest.mark.django_db(transaction=True)

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
    # The claimed rows by their ids: a join with the chosen ids was planned as a walk of the
    # whole primary key, the ids scanned for each of its rows.
    assert "Nested Loop" not in plan and "(id = ANY" in plan, plan


@pytest.mark.django_db(transaction=True)
def test_heartbeats_and_success_writes_read_their_rows_only_whatever_the_statistics() -> None:
    """After an ANALYZE that counted the table's pages but none of its rows (autovacuum
    during an uncommitted enqueue_many), a heartbeat's join with its locked ids was
    planned as a walk of the whole primary key: 40,010 rows read for 5 attempts."""
    from django.db import transaction

    from django_dbworker.db import operations
    from django_dbworker.models import WorkItem
    from tests.factories import auto_explained_json, rows_read

    columns = ", ".join(f.column for f in WorkItem._meta.concrete_fields if not f.primary_key)
    with connection.cursor() as cursor:  # no column statistics either: a first backlog
        cursor.execute(f"DELETE FROM pg_statistic WHERE starelid = '{TABLE}'::regclass")
    with transaction.atomic():
        WorkItem.objects.create(handler="noop", queue="default", payload={}, max_attempts=3)
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {TABLE} ({columns}) SELECT {columns} FROM {TABLE}, "
                "generate_series(1, 39999)"
            )
        with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
            other.execute(f"ANALYZE {TABLE}")
    ops = operations("default")
    got = ops.claim(limit=5, handlers=["noop"], queues=None, worker="w")
    attempts = [(item.pk, item.claim_token) for item in got]
    _, beats = auto_explained_json(lambda: ops.heartbeat(attempts))
    _, writes = auto_explained_json(
        lambda: ops.succeed_rows([(pk, token, None) for pk, token in attempts])
    )
    assert [rows_read(plan["Plan"]) < 100 for plan in beats + writes] == [True, True], (
        beats + writes
    )


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


# -- the claim sent with CLAIM_PLAN in one message: settings, quoting, rows, errors ------
#
# In autocommit and outside ``atomic()``, ``claim`` sends ``SET LOCAL enable_sort = off;
# SET LOCAL enable_incremental_sort = off;`` and the claim as one simple-protocol message on
# a ``psycopg.ClientCursor`` (parameters quoted on the client). The settings end with the
# claim; the quoting is exact for any name; the rows read back as on the bound path; a
# claim that fails leaves the connection idle and usable; Django's wrappers see it; and
# the plan is the claim index's, fresh statistics or stale.


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        return str(cursor.fetchone()[0])


def _claim(handlers: list[str], queues: list[str] | None = None, **kw: Any) -> list[WorkItem]:
    return operations().claim(
        limit=kw.pop("limit", 10),
        handlers=handlers,
        queues=queues,
        worker=kw.pop("worker", "test:1:main"),
        limits=None,
    )


@transactional
def test_the_settings_end_with_the_claim() -> None:
    make_item("noop")
    connection.ensure_connection()
    with CaptureQueriesContext(connection) as queries:
        assert len(_claim(["noop"])) == 1
    assert any("SET LOCAL enable_sort = off" in q["sql"] for q in queries.captured_queries)
    assert connection.connection.info.transaction_status == TransactionStatus.IDLE
    assert _show("enable_sort") == "on" and _show("enable_incremental_sort") == "on"


@transactional
def test_inside_a_callers_transaction_the_settings_never_apply() -> None:
    make_item("noop")
    with transaction.atomic():
        assert len(_claim(["noop"])) == 1
        assert _show("enable_sort") == "on" and _show("enable_incremental_sort") == "on"
    assert _show("enable_sort") == "on"


@transactional
def test_manual_autocommit_off_never_sends_the_settings() -> None:
    make_item("noop")
    transaction.set_autocommit(False)
    try:
        with CaptureQueriesContext(connection) as queries:
            assert len(_claim(["noop"])) == 1
        assert not any("SET LOCAL" in q["sql"] for q in queries.captured_queries)
        assert _show("enable_sort") == "on"
        transaction.commit()
    finally:
        transaction.set_autocommit(True)


NAMES = [
    "o'k",
    'q"x',
    "back\\slash",
    "NULL",
    "null",
    "a,b",
    "{x}",
    " spaced ",
    "é☃ 日本 🙂",
    "%(limit)s",
    "%s",
    "semi; DROP TABLE x; --",
    "x" * 200,
]


@transactional
def test_any_handler_name_is_quoted_exactly() -> None:
    items = {name: make_item(name) for name in NAMES}
    make_item("other")  # not asked for
    claimed = _claim(NAMES, limit=50)
    assert sorted(i.handler for i in claimed) == sorted(NAMES)
    assert {i.pk for i in claimed} == {i.pk for i in items.values()}


@transactional
@pytest.mark.parametrize("queue", ["a:b.c-d_e", "q" * 100])
def test_queue_and_worker_names_are_quoted_exactly(queue: str) -> None:
    item = make_item("noop", queue=queue)
    make_item("noop", queue="elsewhere")
    worker = 'h\'o\\st é "x":12345:Thread-1 %(worker)s ' + "w" * 200
    worker = worker[:255]
    [claimed] = _claim(["noop"], [queue], worker=worker)
    assert claimed.pk == item.pk
    assert claimed.claimed_by == worker
    assert WorkItem.objects.get(pk=item.pk).claimed_by == worker


@transactional
def test_claimed_rows_read_back_as_the_table_holds_them() -> None:
    item = make_item("noop", payload={"s": "é\\'\"", "n": [1, None]}, priority=5)
    [claimed] = _claim(["noop"])
    stored = WorkItem.objects.get(pk=item.pk)
    for field in ("run_after", "priority", "payload", "attempts", "claimed_by", "claim_token"):
        assert getattr(claimed, field) == getattr(stored, field), field
    assert claimed.run_after.utcoffset() is not None
    assert claimed.run_after.utcoffset().total_seconds() == 0
    assert claimed.run_after == stored.run_after


@transactional
def test_a_claim_that_fails_leaves_the_connection_idle_and_usable() -> None:
    make_item("noop")
    connection.ensure_connection()
    params = connection.get_connection_params()
    with psycopg.connect(**params) as holder:
        holder.execute("LOCK TABLE django_dbworker_queuestate IN ACCESS EXCLUSIVE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")
        try:
            with pytest.raises(OperationalError, match="lock timeout"):
                _claim(["noop"])
            assert connection.connection.info.transaction_status == TransactionStatus.IDLE
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        holder.rollback()
    assert _show("enable_sort") == "on"
    assert len(_claim(["noop"])) == 1


@transactional
def test_execute_wrappers_see_the_claim() -> None:
    make_item("noop")
    connection.ensure_connection()
    seen: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        assert len(_claim(["noop"])) == 1
    assert any("UPDATE django_dbworker_workitem" in sql for sql in seen), seen


def _plans_of_a_claim(queues: list[str] | None, limit: int) -> list[str]:
    """The plans the server chose for the statements of one claim (auto_explain notices)."""
    # The fill's pending rows are of these two handlers.
    claimed, notices = auto_explained(lambda: _claim(["echo", "record"], queues, limit=limit))
    assert len(claimed) == limit
    return [n for n in notices if "Update on" in n]


@transactional
@pytest.mark.parametrize(
    ("queues", "index"), [(None, "dbworker_claim_idx"), (["urgent"], "dbworker_claim_queue_idx")]
)
def test_fresh_statistics_on_a_big_table_keep_the_index_path(
    queues: list[str] | None, index: str
) -> None:
    fill(100_000)
    (plan,) = _plans_of_a_claim(queues, limit=8)
    assert f"Index Scan using {index}" in plan, plan
    assert "Sort" not in plan and f"Seq Scan on {TABLE}" not in plan, plan


#: The claimed columns, as the ORM names them (``id`` is ``pk``).
FIELDS = ("pk", *CLAIM_COLUMNS[1:])


def _fields(item: WorkItem) -> dict[str, tuple[type, Any]]:
    return {f: (type(getattr(item, f)), getattr(item, f)) for f in FIELDS}


@transactional
@pytest.mark.parametrize("time_zone", ["UTC", "America/New_York", "Asia/Kolkata"])
def test_both_paths_read_rows_alike_whatever_the_time_zone(time_zone: str) -> None:
    from django.test import override_settings

    with override_settings(TIME_ZONE=time_zone):
        connection.close()  # a new session, in the new setting's time zone
        try:
            a = make_item("noop", payload={"k": "é"}, trace_context={"traceparent": "x"})
            [one_message] = _claim(["noop"])  # CLAIM_PLAN, ClientCursor
            b = make_item("noop", payload={"k": "é"}, trace_context={"traceparent": "x"})
            with transaction.atomic():
                [bound] = _claim(["noop"])  # server-side binding
        finally:
            connection.close()
    got_a, got_b = _fields(one_message), _fields(bound)
    for field in FIELDS:
        assert got_a[field][0] is got_b[field][0], (field, got_a[field], got_b[field])
    for item, stored in ((one_message, a), (bound, b)):
        stored.refresh_from_db()
        assert item.run_after == stored.run_after
        assert item.run_after.utcoffset() is not None
        assert item.run_after.tzinfo == stored.run_after.tzinfo


@transactional
@pytest.mark.parametrize(
    "options",
    [{"server_side_binding": True}, {"prepare_threshold": 0}, {"isolation_level": 3}],
    ids=["server_side_binding", "prepare_threshold", "serializable"],
)
def test_connection_options_keep_the_claim_and_its_settings_to_itself(
    options: dict[str, Any],
) -> None:
    """OPTIONS that change Django's cursors or transactions (set on a new session)."""
    saved = dict(connection.settings_dict["OPTIONS"])
    connection.close()
    connection.settings_dict["OPTIONS"] = {**saved, **options}
    try:
        make_item("noop")
        make_item("noop")
        raw = connection.connection
        if "prepare_threshold" in options:
            assert raw.prepare_threshold == 0
        if "isolation_level" in options:
            assert int(raw.isolation_level) == 3
        if "server_side_binding" in options:
            assert raw.cursor_factory is not psycopg.ClientCursor
        for _ in range(2):  # twice: a prepared statement would be used the second time
            with CaptureQueriesContext(connection) as queries:
                assert len(_claim(["noop"], limit=1)) == 1
            assert any("SET LOCAL" in q["sql"] for q in queries.captured_queries)
            assert _show("enable_sort") == "on"
            assert connection.connection.info.transaction_status == TransactionStatus.IDLE
        with transaction.atomic():
            assert _show("enable_sort") == "on"
    finally:
        connection.close()
        connection.settings_dict["OPTIONS"] = saved
