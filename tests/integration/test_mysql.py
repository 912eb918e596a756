"""MySQL/MariaDB-only behaviour: SKIP LOCKED across connections, query plans, the
unique generated column, lock-conflict retries, the session time zone.

The plans are EXPLAINed on a table of 100,000 mostly finished rows with
fresh statistics: each hot statement must read an index in the order it
needs (no filesort, which would lock every row it read), never the table.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from django_dbworker import EnqueueError, batch
from django_dbworker.batches.models import Batch
from django_dbworker.db import mysql, operations
from django_dbworker.models import Status, WorkItem
from tests.conftest import wait_until
from tests.factories import claim, make_item
from tests.testapp.workers import BatchDone, Noop

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]

TABLE = "django_dbworker_workitem"


def _second_connection() -> Any:
    """A raw connection of its own (not Django's), in a transaction."""
    conn = connection.get_new_connection(connection.get_connection_params())
    conn.autocommit(False)
    return conn


# -- SKIP LOCKED ---------------------------------------------------------------------


def test_claim_skips_a_row_locked_by_another_transaction() -> None:
    first = make_item()
    second = make_item()
    other = _second_connection()
    try:
        other.cursor().execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", (first.pk,))
        started = time.monotonic()
        items = claim(limit=2)
        assert time.monotonic() - started < 2.0, "the claim waited for the lock"
        assert [i.pk for i in items] == [second.pk]
        other.rollback()
    finally:
        other.close()
    assert [i.pk for i in claim(limit=2)] == [first.pk]


def test_concurrent_claimers_take_disjoint_rows() -> None:
    for _ in range(200):
        make_item()
    taken: list[list[int]] = []
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            mine: list[int] = []
            while batch := claim(limit=7):
                mine += [i.pk for i in batch]
            taken.append(mine)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=claimer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    everything = [pk for mine in taken for pk in mine]
    assert len(everything) == len(set(everything)) == 200


# -- a lock wait timeout is retried, not surfaced --------------------------------------


def test_a_success_write_that_times_out_on_a_lock_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    make_item()
    (item,) = claim()
    other = _second_connection()
    answer: list[set[tuple[int, uuid.UUID]]] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
            answer.append(operations().succeed_many([(item.pk, item.claim_token, '"ok"')]))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    try:
        other.cursor().execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", (item.pk,))
        caplog.set_level(logging.INFO, logger="django_dbworker.db")
        writer = threading.Thread(target=write)
        writer.start()
        wait_until(
            lambda: "Lock wait timeout exceeded" in caplog.text,
            timeout=20,
            what="the success write to time out on the lock and retry",
        )
        other.rollback()
        writer.join(30)
    finally:
        other.close()
    assert not errors, errors
    assert answer == [{(item.pk, item.claim_token)}]
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.SUCCEEDED and row.result == "ok"


def _lock_waits() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT trx_state, trx_query FROM information_schema.innodb_trx")
        rows = cursor.fetchall()
    print(rows)
    return sum(1 for state, _ in rows if state == "LOCK WAIT")


def test_a_success_write_chosen_as_a_deadlock_victim_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The success write locks rows a, b in id order. Another transaction,
    # made heavier by changing other rows (InnoDB rolls back the lighter one),
    # holds b and then asks for a: a deadlock, and the success write is the
    # victim. It runs again, waits for the other transaction, and records
    # both successes: the deadlock never reaches its caller.
    for _ in range(12):
        make_item()
    a, b = sorted(claim(limit=2), key=lambda i: i.pk)
    other = _second_connection()
    answer: list[set[tuple[int, uuid.UUID]]] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            outcomes = [(a.pk, a.claim_token, "1"), (b.pk, b.claim_token, "2")]
            answer.append(operations().succeed_many(outcomes))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    caplog.set_level(logging.INFO, logger="django_dbworker.db")
    try:
        cursor = other.cursor()
        cursor.execute(
            f"UPDATE {TABLE} SET priority = 5 WHERE status = 'pending' ORDER BY id LIMIT 10"
        )
        cursor.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", (b.pk,))
        writer = threading.Thread(target=write)
        writer.start()
        wait_until(
            lambda: _lock_waits() == 1 or errors or answer,
            interval=0.3,
            what="the success write to wait for row b",
        )
        assert not errors and not answer, (errors, answer)
        try:
            cursor.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", (a.pk,))
        except Exception as exc:  # InnoDB chose the other one after all
            pytest.fail(f"the heavier transaction was the deadlock victim: {exc}")
        wait_until(
            lambda: "Deadlock found" in caplog.text,
            what="the success write to be rolled back by the deadlock and retried",
        )
        other.rollback()
        writer.join(30)
    finally:
        other.close()
    assert not errors, errors
    assert answer == [{(a.pk, a.claim_token), (b.pk, b.claim_token)}]
    assert {r.status for r in WorkItem.objects.filter(pk__in=[a.pk, b.pk])} == {Status.SUCCEEDED}


# -- unique_key: a generated column with a unique index ----------------------------------


def test_the_database_refuses_a_second_live_row_with_the_same_key() -> None:
    first = make_item(unique_key="k")
    with pytest.raises(IntegrityError), transaction.atomic():
        make_item(unique_key="k")
    # Another handler, another key, or a finished twin: all allowed.
    make_item(handler="echo", unique_key="k")
    make_item(unique_key="K")  # keys compare byte for byte, as on PostgreSQL
    WorkItem.objects.filter(pk=first.pk).update(status=Status.SUCCEEDED)
    make_item(unique_key="k")
    with pytest.raises(IntegrityError), transaction.atomic():
        WorkItem.objects.filter(pk=first.pk).update(status=Status.PENDING)
    assert WorkItem.objects.filter(unique_key="k").count() == 3
    assert WorkItem.objects.filter(unique_key="K").count() == 1


def test_names_and_keys_compare_byte_for_byte() -> None:
    # As on PostgreSQL: a handler, queue or key differing only in case is another one.
    make_item(handler="Noop", queue="Q", unique_key="Key")
    assert claim(handlers=["noop"]) == []
    assert not WorkItem.objects.filter(queue="q").exists()
    assert not WorkItem.objects.filter(unique_key="key").exists()


# -- enqueue: one statement outside a transaction ---------------------------------------


def _session_counter(name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SHOW SESSION STATUS LIKE %s", [name])
        return int(cursor.fetchone()[1])


def test_a_lone_enqueue_is_one_autocommit_insert() -> None:
    """Outside a transaction an enqueue is one INSERT, no explicit COMMIT.

    Django's ``atomic()`` on MySQL costs four round trips (autocommit off,
    INSERT, COMMIT, autocommit on): half the enqueue rate of a plain INSERT.
    """
    from django_dbworker.enqueuing import enqueue

    connection.ensure_connection()
    commits, inserts = _session_counter("Com_commit"), _session_counter("Com_insert")
    enqueue("noop", {"n": 1})
    first = enqueue("noop", {"n": 2}, unique_key="once")
    again = enqueue("noop", {"n": 3}, unique_key="once")
    assert again.pk == first.pk
    assert _session_counter("Com_insert") - inserts == 3
    assert _session_counter("Com_commit") - commits == 0
    # Inside the caller's transaction it stays the caller's: rolled back, gone.
    with transaction.atomic():
        enqueue("noop", {"n": 4})
        enqueue("noop", {"n": 5}, unique_key="twice")
        assert enqueue("noop", {"n": 6}, unique_key="twice").payload == {"n": 5}
        transaction.set_rollback(True)
    assert sorted(WorkItem.objects.values_list("payload__n", flat=True)) == [1, 2]


def test_a_batch_goes_in_by_statements_that_fit_the_packet_and_comes_back_in_order() -> None:
    """MariaDB: ``enqueue_many`` is INSERT ... RETURNING in runs of rows and bytes.

    2,500 small payloads and six of 900 KiB: several statements, each
    within the server's ``max_allowed_packet``; the items come back in the
    order given, with the ids and database times the rows have.
    """
    from django_dbworker.enqueuing import enqueue_many

    if not connection.mysql_is_mariadb:  # type: ignore[attr-defined]
        pytest.skip("MySQL 8 has no INSERT ... RETURNING: its batches go by bulk_create")
    big = "x" * (900 * 1024)
    payloads: list[Any] = [{"n": n} for n in range(2500)]
    payloads[10:10] = [{"big": big, "n": -b} for b in range(5)] + [None]
    with CaptureQueriesContext(connection) as ctx:
        items = enqueue_many("noop", payloads, priority=4, run_after=timedelta(seconds=90))
    inserts = [q for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("INSERT")]
    # About 4 MiB at most: four big ones fit, the fifth starts a run; then
    # 1,000 rows at most: [0:14], [14:1014], [1014:2014], [2014:2506].
    assert len(inserts) == 4, [len(q["sql"]) for q in inserts]
    assert [i.pk for i in items] == sorted(i.pk for i in items)
    stored = {r.pk: r for r in WorkItem.objects.all()}
    assert len(stored) == len(payloads)
    assert [stored[i.pk].payload for i in items] == payloads
    for item in items:
        row = stored[item.pk]
        assert (item.run_after, item.created_at, item.updated_at) == (
            row.run_after,
            row.created_at,
            row.updated_at,
        )
        assert (row.status, row.priority, row.attempts, row.handler) == ("pending", 4, 0, "noop")
        assert row.run_after == row.created_at + timedelta(seconds=90)
        assert item.created_at.tzinfo is not None and not item._state.adding


def test_a_batch_whose_last_statement_fails_leaves_nothing() -> None:
    """All or nothing across the statements of one batch, in autocommit and inside a transaction."""
    from django_dbworker.enqueuing import enqueue_many

    payloads: list[Any] = [{"n": n} for n in range(2500)] + ["refuse me"]
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TRIGGER dbworker_test_refuse BEFORE INSERT ON {TABLE} FOR EACH ROW "
            "IF NEW.payload = '\"refuse me\"' THEN "
            "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused'; END IF"
        )
    try:
        with pytest.raises(DatabaseError, match="refused"):
            enqueue_many("noop", payloads)
        assert not WorkItem.objects.exists()
        with pytest.raises(DatabaseError, match="refused"), transaction.atomic():
            enqueue_many("noop", payloads)
        assert not WorkItem.objects.exists()
        # The connection is fine afterwards.
        assert len(enqueue_many("noop", payloads[:-1])) == 2500
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS dbworker_test_refuse")


# -- the clock -------------------------------------------------------------------------


def test_sessions_are_in_utc_whatever_the_server_says() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@session.time_zone, @@global.time_zone")
        session, server = cursor.fetchone()
    assert session == "+00:00"
    if server in ("+00:00", "UTC", "SYSTEM"):
        pytest.skip(f"the server's own time zone is {server}: nothing to prove")
    item = make_item()
    row = WorkItem.objects.get(pk=item.pk)
    assert abs((row.created_at - datetime.now(UTC)).total_seconds()) < 60


# -- plans on a big table ------------------------------------------------------------------

DIGITS = "(SELECT 0 AS d UNION ALL " + " UNION ALL ".join(f"SELECT {i}" for i in range(1, 10)) + ")"

FILL_SQL = f"""
INSERT INTO {TABLE} (
    handler, queue, payload, status, priority, run_after, attempts, max_attempts,
    claimed_at, heartbeat_at, claimed_by, claim_token, finished_at, last_error, result,
    unique_key, trace_context, created_at, updated_at)
SELECT
    ELT(1 + g.n % 4, 'noop', 'echo', 'record', 'urgent'),
    ELT(1 + g.n % 5, 'default', 'echoes', 'urgent', 'emails', 'images'),
    JSON_OBJECT('n', g.n),
    CASE WHEN g.n % 100 < 94 THEN 'succeeded'
         WHEN g.n % 100 < 97 THEN 'failed'
         WHEN g.n % 100 < 99 THEN 'pending'
         WHEN g.n % 1000 = 999 THEN 'claimed'
         ELSE 'cancelled' END,
    (g.n % 7) - 3,
    UTC_TIMESTAMP(6) - INTERVAL (100000 - g.n) SECOND,
    1, 3,
    UTC_TIMESTAMP(6) - INTERVAL (100000 - g.n) SECOND,
    UTC_TIMESTAMP(6) - INTERVAL (100000 - g.n) SECOND,
    CONCAT('bighost:', g.n % 10, ':MainThread'),
    NULL,
    CASE WHEN g.n % 100 < 97 THEN UTC_TIMESTAMP(6) - INTERVAL (99999 - g.n) SECOND END,
    '', NULL, NULL, '{{}}',
    UTC_TIMESTAMP(6) - INTERVAL (100000 - g.n) SECOND,
    UTC_TIMESTAMP(6) - INTERVAL (100000 - g.n) SECOND
FROM (
    SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n
    FROM {DIGITS} a, {DIGITS} b, {DIGITS} c, {DIGITS} e, {DIGITS} f
) AS g
"""


@pytest.fixture
def big_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL)  # no parameters: its % signs are modulo
        cursor.execute(f"ANALYZE TABLE {TABLE}")


#: The claim SELECTs of test_hot_statements_read_their_index_in_order.
CLAIMS = {"claim", "claim, two handlers", "claim in one queue", "claim in two queues"}


def _explain(sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        names = [col[0].lower() for col in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _show(plan: list[dict[str, Any]]) -> str:
    return "\n".join(str(row) for row in plan)


def _handlers(names: list[str]) -> dict[str, str]:
    return mysql.numbered_params("handler", names)


def _claim_select(handlers: list[str], queues: list[str]) -> tuple[str, dict[str, Any]]:
    params: dict[str, Any] = {"limit": 8, **_handlers(handlers)}
    if len(queues) == 1:
        params["queue"] = queues[0]
    else:
        params.update(mysql.numbered_params("queue", queues))
    return mysql.claim_select_sql(len(handlers), len(queues)), params


def test_hot_statements_read_their_index_in_order(big_table: None) -> None:
    """One table fill (100,000 rows, fresh statistics) for every plan: it takes seconds."""
    from datetime import timedelta

    ids = mysql.numbered_params("id", [10, 20, 30])
    tokens = mysql.numbered_params("token", [uuid.uuid4().hex for _ in range(3)])
    results = mysql.numbered_params("result", ["1", None, '{"a": 1}'])
    stale = WorkItem.objects.stale(timedelta(seconds=60)).order_by("heartbeat_at")
    stale_sql, stale_params = stale.values_list("pk", "handler")[:500].query.sql_with_params()
    # (what, statement, parameters, the index it must read, the access types allowed)
    cases: list[tuple[str, str, Any, str, tuple[str, ...]]] = [
        ("claim", *_claim_select(["noop"], []), "dbworker_my_claim_idx", ("ref", "range")),
        (
            "claim, two handlers",
            *_claim_select(["noop", "echo"], []),
            "dbworker_my_claim_idx",
            ("ref", "range"),
        ),
        (
            "claim in one queue",
            *_claim_select(["noop", "echo"], ["urgent"]),
            "dbworker_my_claim_queue_idx",
            ("ref", "range"),
        ),
        (
            "claim in two queues",
            *_claim_select(["noop"], ["urgent", "emails"]),
            "dbworker_my_claim_idx",
            ("ref", "range"),
        ),
        (
            "claim update",
            mysql.claim_update_sql(3),
            {"worker": "host:1:Main", **ids},
            "PRIMARY",
            ("range",),
        ),
        ("claim read-back", mysql.claim_read_sql(3), ids, "PRIMARY", ("range",)),
        ("success lock", mysql.succeed_lock_sql(3), ids, "PRIMARY", ("range",)),
        (
            "success update",
            mysql.succeed_update_sql(3),
            {**ids, **tokens, **results},
            "PRIMARY",
            ("range",),
        ),
        # Heartbeats, releases and recovery batches lock their rows by id first.
        ("bulk lock", mysql.lock_rows_sql(3), ids, "PRIMARY", ("range",)),
        ("stale scan (ORM)", stale_sql, stale_params, "dbworker_my_stale_idx", ("ref", "range")),
        ("distinct queues", mysql.DISTINCT_QUEUES.sql, {}, "dbworker_my_queue_idx", ("range",)),
    ]
    for what, sql, params, index, types in cases:
        plan = _explain(sql, params)
        print(f"-- {what}\n{_show(plan)}")
        # The claims' pause filter adds one read of QueueState: a probe of its
        # primary key per candidate row, or (names of one collation since 0009)
        # its few rows materialized once; the work table is read as before.
        row, *pause = plan
        expected = ["django_dbworker_queuestate"] if what in CLAIMS else []
        assert [p["table"] for p in pause] == expected, (what, _show(plan))
        for p in pause:
            assert p["key"] == "PRIMARY" or p["select_type"] == "MATERIALIZED", (what, _show(plan))
        assert row["key"] == index, (what, _show(plan))
        assert row["type"] in types, (what, _show(plan))
        # A filesort would read (and, for a claim, lock) every matching row.
        assert "filesort" not in (row["extra"] or ""), (what, _show(plan))
    (row,) = _explain(mysql.DISTINCT_QUEUES.sql, {})
    assert "Using index for group-by" in row["extra"], row
    assert operations().distinct_queues() == sorted(
        ["default", "echoes", "urgent", "emails", "images"]
    )
    estimate = operations().estimate_count(WorkItem.objects.filter(status="succeeded"))
    assert estimate is not None and 30_000 < estimate < 200_000, estimate


# -- system checks -------------------------------------------------------------------------


def test_the_database_checks_pass_on_this_server() -> None:
    from django_dbworker.checks import check_database_servers as check_mysql_server
    from django_dbworker.db.mysql import MIN_MARIADB_VERSION

    assert tuple(connection.mysql_version) >= MIN_MARIADB_VERSION
    assert check_mysql_server(databases=["default"]) == []
    # Not asked about any database: nothing is checked, nothing connects.
    assert check_mysql_server(databases=None) == []


def test_a_payload_nested_deeper_than_the_database_stores_is_an_enqueue_error() -> None:
    """MariaDB stores JSON nested at most 31 levels (MySQL 100): a deeper payload is refused
    with a message that names the limit, and nothing is written."""
    from django_dbworker.db import operations
    from django_dbworker.errors import EnqueueError
    from tests.testapp.workers import Noop

    limit = operations().max_json_depth
    assert limit in (31, 100)

    def nested(levels: int) -> object:
        value: object = "leaf"
        for level in range(levels):
            value = {"k": value} if level % 2 else [value]
        return value

    Noop.enqueue(nested(limit))
    Noop.enqueue_many([nested(limit)])
    with pytest.raises(EnqueueError, match=f"nested at most {limit} levels"):
        Noop.enqueue(nested(limit + 1))
    with pytest.raises(EnqueueError, match=f"Payload #1: .*nested at most {limit} levels"):
        Noop.enqueue_many([{}, nested(limit + 1)])
    assert WorkItem.objects.count() == 2


# -- payload depth in a batch --------------------------------------------------------------
# A payload nested deeper than the database stores is an EnqueueError that names the limit,
# on every path that stores a user's payload (MariaDB: 31 levels; docs: "payload depth on
# MariaDB"): ``batch(payload=...)`` too, whose payload is stored on the Batch row at the block
# and becomes the callback's payload.


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_a_batch_payload_too_deep_for_the_database_is_an_enqueue_error() -> None:
    depth = operations().max_json_depth
    assert depth is not None
    # A dict at the top (batch payloads are dicts): one level, plus the nested list.
    payload = {"tree": _nested(depth)}
    with pytest.raises(EnqueueError, match="nest"):
        Noop.enqueue(payload)  # the enqueue path says so
    with pytest.raises(EnqueueError, match="nest"), batch(on_complete=BatchDone, payload=payload):
        Noop.enqueue({})
    assert not Batch.objects.exists()
