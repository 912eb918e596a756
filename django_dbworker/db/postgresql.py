"""PostgreSQL: its statements, and the operations that run them.

One-statement ``FOR UPDATE SKIP LOCKED`` claims, batched fenced successes,
inserts that carry their own NOTIFY, LISTEN wake-ups and planner estimates.
Every statement is fixed text: lists travel as array parameters
(``= ANY(%(handlers)s)``, ``unnest(%(payloads)s::jsonb[])``), so a reader
sees exactly what runs and the server parses a handful of distinct texts.
Django's psycopg backend binds parameters on the client by default, so the
planner sees the arrays as constants, as it did the IN lists they replace.

The claim statements must keep their plans on a table of millions of
finished rows: an index scan of the partial claim index
``dbworker_claim_idx`` (or ``dbworker_claim_queue_idx`` for one queue) in
claim order, stopped by the LIMIT; the status and handler indexes leave
pending rows out so that nothing else can be chosen (see models.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from django.db import transaction
from django.db.backends.postgresql.psycopg_any import register_tzloader
from django.db.backends.utils import CursorWrapper
from django.db.models import QuerySet
from psycopg.pq import Format

from django_dbworker.db.base import (
    ColumnStats,
    RunTimes,
    Statement,
    TableEstimate,
    UnsupportedDatabase,
    VendorOperations,
    as_uuid,
)
from django_dbworker.models import WorkItem

#: ``server_version_num`` of PostgreSQL 13 (gen_random_uuid() in core).
MIN_VERSION = 130000

#: Batches of at least this many items go in by COPY (``insert_items``). The
#: COPY path costs four more round trips (a transaction, the id reservation,
#: the NOTIFY); measured, it breaks even at 20 to 50 rows, takes about 80% of
#: the one-statement insert's time at 100 to 200 rows and 55% at 1,000 and
#: more (docs/benchmarks.md, W2).
COPY_THRESHOLD = 100

#: Rows per chunk of COPY data.
COPY_CHUNK = 1000

#: The type whose loader Django sets to its time zone (``create_cursor``).
TIMESTAMPTZ_OID = psycopg.adapters.types["timestamptz"].oid

# -- statements ---------------------------------------------------------------------
#
# The claim is one UPDATE around a LIMITed subquery: the LIMIT keeps the
# subquery from being pulled up (it runs once), and SKIP LOCKED lets
# concurrent claimers take disjoint rows instead of queueing behind each
# other's locks. Its WHERE and ORDER BY are WorkItem.objects.ready().in_order().
# The wake-up channel is "django_dbworker"; the payload is the queue name.

CLAIM = Statement(
    "claim",
    "Claim the next ready rows of some handlers, in any queue.",
    """
UPDATE django_dbworker_workitem AS w
SET status = 'claimed',
    attempts = w.attempts + 1,
    claimed_at = statement_timestamp(),
    heartbeat_at = statement_timestamp(),
    updated_at = statement_timestamp(),
    claimed_by = %(worker)s,
    claim_token = gen_random_uuid()
FROM (
    SELECT id FROM django_dbworker_workitem
    WHERE status = 'pending'
      AND run_after <= statement_timestamp()
      AND handler = ANY(%(handlers)s::text[])
    ORDER BY priority DESC, run_after, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) AS c
WHERE w.id = c.id
RETURNING w.id, w.handler, w.queue, w.payload, w.priority, w.run_after, w.attempts,
          w.max_attempts, w.claimed_by, w.claim_token, w.trace_context
""",
)

# A plain equality, not "= ANY" of one queue: only an equality on the
# index's leading column lets dbworker_claim_queue_idx return rows in claim
# order, so the LIMIT stops the scan instead of a sort reading them all.
CLAIM_IN_QUEUE = Statement(
    "claim_in_queue",
    "Claim the next ready rows of some handlers in one queue.",
    """
UPDATE django_dbworker_workitem AS w
SET status = 'claimed',
    attempts = w.attempts + 1,
    claimed_at = statement_timestamp(),
    heartbeat_at = statement_timestamp(),
    updated_at = statement_timestamp(),
    claimed_by = %(worker)s,
    claim_token = gen_random_uuid()
FROM (
    SELECT id FROM django_dbworker_workitem
    WHERE status = 'pending'
      AND run_after <= statement_timestamp()
      AND handler = ANY(%(handlers)s::text[])
      AND queue = %(queue)s
    ORDER BY priority DESC, run_after, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) AS c
WHERE w.id = c.id
RETURNING w.id, w.handler, w.queue, w.payload, w.priority, w.run_after, w.attempts,
          w.max_attempts, w.claimed_by, w.claim_token, w.trace_context
""",
)

CLAIM_IN_QUEUES = Statement(
    "claim_in_queues",
    "Claim the next ready rows of some handlers in several queues.",
    """
UPDATE django_dbworker_workitem AS w
SET status = 'claimed',
    attempts = w.attempts + 1,
    claimed_at = statement_timestamp(),
    heartbeat_at = statement_timestamp(),
    updated_at = statement_timestamp(),
    claimed_by = %(worker)s,
    claim_token = gen_random_uuid()
FROM (
    SELECT id FROM django_dbworker_workitem
    WHERE status = 'pending'
      AND run_after <= statement_timestamp()
      AND handler = ANY(%(handlers)s::text[])
      AND queue = ANY(%(queues)s::text[])
    ORDER BY priority DESC, run_after, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) AS c
WHERE w.id = c.id
RETURNING w.id, w.handler, w.queue, w.payload, w.priority, w.run_after, w.attempts,
          w.max_attempts, w.claimed_by, w.claim_token, w.trace_context
""",
)

# The separate "w.id = ANY(ids)" pins the plan to primary-key lookups,
# whatever the planner thinks of the join with the unnested arrays.
SUCCEED_MANY = Statement(
    "succeed_many",
    "Record the successes of several attempts, each fenced by its own id, token and status.",
    """
UPDATE django_dbworker_workitem AS w
SET status = 'succeeded',
    result = v.result,
    finished_at = statement_timestamp(),
    updated_at = statement_timestamp(),
    last_error = ''
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::jsonb[]) AS v(id, token, result)
WHERE w.id = ANY(%(ids)s::bigint[])
  AND w.id = v.id
  AND w.claim_token = v.token
  AND w.status = 'claimed'
RETURNING w.id, w.claim_token
""",
)

# NOTIFY is transactional: the wake-up is delivered when (and only if) the
# insert commits. run_at is an absolute time, or NULL for "delay after now".
# The pg_notify() call in RETURNING runs once, for the one row; a plain
# INSERT ... RETURNING costs the server less to parse and plan than the same
# insert in a WITH around a join to the NOTIFY (Django does not prepare
# statements by default, so that cost is paid on every call).
INSERT_ITEM = Statement(
    "insert_item",
    "Insert one pending row and notify its queue, in one round trip.",
    """
INSERT INTO django_dbworker_workitem (
    handler, queue, payload, status, priority, run_after, attempts, max_attempts,
    claimed_by, last_error, trace_context, created_at, updated_at)
VALUES (
    %(handler)s, %(queue)s, %(payload)s::jsonb, 'pending', %(priority)s,
    coalesce(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    0, %(max_attempts)s, '', '', %(trace_context)s::jsonb,
    statement_timestamp(), statement_timestamp())
RETURNING id, run_after, created_at, updated_at, pg_notify('django_dbworker', %(queue)s)
""",
)

# All payloads travel as one jsonb[] parameter: one statement whatever the
# batch size (no 65,535-parameter ceiling). Ids come from the sequence in
# insertion order, which follows ORDER BY u.n; the outer ORDER BY id lines
# the returned rows up with the payloads.
INSERT_ITEMS = Statement(
    "insert_items",
    "Insert pending rows sharing all but their payloads, and notify their queue.",
    """
WITH ins AS (
    INSERT INTO django_dbworker_workitem (
        handler, queue, payload, status, priority, run_after, attempts, max_attempts,
        claimed_by, last_error, trace_context, created_at, updated_at)
    SELECT
        %(handler)s, %(queue)s, u.payload, 'pending', %(priority)s,
        coalesce(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
        0, %(max_attempts)s, '', '', %(trace_context)s::jsonb,
        statement_timestamp(), statement_timestamp()
    FROM unnest(%(payloads)s::jsonb[]) WITH ORDINALITY AS u(payload, n)
    ORDER BY u.n
    RETURNING id, run_after, created_at, updated_at
)
SELECT ins.id, ins.run_after, ins.created_at, ins.updated_at
FROM ins, (SELECT pg_notify('django_dbworker', %(queue)s)) AS wake
ORDER BY ins.id
""",
)

# A large batch goes in by COPY, which skips the per-row work of the
# executor and of a giant array parameter. COPY cannot return anything, so
# the ids are taken from the table's own sequence first: nextval() hands
# every caller distinct values, whoever else inserts meanwhile, and one
# session's values increase, so the batch's ids follow its payloads. The
# times every row shares (created_at, updated_at, run_after) are read from
# the database clock by the same statement and written into the rows, so
# the returned items hold exactly what is stored.
RESERVE_IDS = Statement(
    "reserve_ids",
    "Take ids for a batch from the table's sequence, and the database times its rows get.",
    """
SELECT statement_timestamp(),
       coalesce(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
       array(
           SELECT nextval(s.seq)
           FROM (SELECT pg_get_serial_sequence('django_dbworker_workitem', 'id')::regclass
                 AS seq) AS s,
                generate_series(1, %(count)s)
       )
""",
)

# Text format; the column order puts the two that vary (id, payload) first.
COPY_ITEMS = Statement(
    "copy_items",
    "Write pending rows with reserved ids, as COPY text (their wake-up is a NOTIFY).",
    """
COPY django_dbworker_workitem (
    id, payload, handler, queue, status, priority, run_after, attempts, max_attempts,
    claimed_by, last_error, trace_context, created_at, updated_at)
FROM STDIN
""",
)

NOTIFY = Statement(
    "notify",
    "Wake idle workers of a queue when the current transaction commits.",
    """
SELECT pg_notify('django_dbworker', %(queue)s)
""",
)

LISTEN = Statement(
    "listen",
    "Receive the wake-ups that NOTIFY and the inserts send (on a connection of its own).",
    """
LISTEN django_dbworker
""",
)

# SELECT DISTINCT queue reads every row (or index entry); this recursive
# query jumps from one queue to the next through dbworker_queue_idx.
DISTINCT_QUEUES = Statement(
    "distinct_queues",
    "Every queue name in the table, by a loose index scan (one index probe per queue).",
    """
WITH RECURSIVE queues(name) AS (
    SELECT (SELECT queue FROM django_dbworker_workitem ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT queue FROM django_dbworker_workitem
            WHERE queue > queues.name ORDER BY queue LIMIT 1)
    FROM queues WHERE queues.name IS NOT NULL
)
SELECT name FROM queues WHERE name IS NOT NULL
""",
)

# {query} is the ORM's SQL for the queryset being paged (the admin's filters).
ESTIMATE_COUNT = Statement(
    "estimate_count",
    "The planner's row estimate for a query, without running it.",
    """
EXPLAIN (FORMAT JSON) {query}
""",
)

# reltuples and pg_stats are what ANALYZE (and autovacuum) keep; reading
# them costs nothing however large the table is.
TABLE_ESTIMATE = Statement(
    "table_estimate",
    "The work table's planner row count and value frequencies of some columns.",
    """
SELECT c.reltuples, s.attname, s.most_common_vals::text, s.most_common_freqs, s.n_distinct
FROM pg_class c
LEFT JOIN pg_stats s
  ON s.tablename = c.relname AND s.schemaname = current_schema()
 AND s.attname = ANY(%(columns)s::text[])
WHERE c.oid = to_regclass('django_dbworker_workitem')
""",
)


# Both percentiles from one sort per handler (an array of fractions). The
# finished_at range is a scan of the partial dbworker_finished_idx; status
# and claimed_at are checked on the rows it finds (one hour of them).
RUN_TIMES = Statement(
    "run_times",
    "p50 and p95 run time per handler of the rows that succeeded in the last N seconds.",
    """
SELECT handler,
       count(*),
       percentile_cont(ARRAY[0.5, 0.95]::float8[]) WITHIN GROUP (ORDER BY seconds)
FROM (
    SELECT handler, EXTRACT(EPOCH FROM finished_at - claimed_at)::float8 AS seconds
    FROM django_dbworker_workitem
    WHERE finished_at >= now() - make_interval(secs => %(seconds)s)
      AND status = 'succeeded'
      AND claimed_at IS NOT NULL
) AS runs
GROUP BY handler
ORDER BY handler
""",
)


# -- operations ---------------------------------------------------------------------


class PostgresOperations(VendorOperations):
    vendor = "postgresql"
    supports_notify = True
    supports_skip_locked = True
    # LISTEN wakes the workers: nothing to poll for.
    poll_adaptively = False

    def check_version(self) -> None:
        self.connection.ensure_connection()
        version = self.connection.pg_version  # type: ignore[attr-defined]
        if version < MIN_VERSION:
            raise UnsupportedDatabase(
                f"django-dbworker needs PostgreSQL 13 or newer; this server is {version}."
            )

    def claim(
        self,
        *,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        worker: str,
    ) -> list[WorkItem]:
        if limit <= 0 or not handlers:
            return []
        sql, params = claim_statement(limit=limit, handlers=handlers, queues=queues, worker=worker)
        return self._rows_to_items(self._fetch_bound(sql, params))

    def succeed_many(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> set[tuple[int, UUID]]:
        if not outcomes:
            return set()
        params = {
            "ids": [pk for pk, _, _ in outcomes],
            "tokens": [token for _, token, _ in outcomes],
            "results": [result for _, _, result in outcomes],
        }
        rows = self._fetch_bound(SUCCEED_MANY.sql, params)
        return {(pk, as_uuid(token)) for pk, token in rows}

    def _fetch_bound(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """``_fetch`` with server-side binding, for the hot statements.

        Django's psycopg backend binds parameters on the client unless
        OPTIONS has ``server_side_binding``: every claim and success write
        would quote its arrays of ids, tokens and results into SQL text in
        Python, and the server would parse that text again each time. Here
        they travel as binary parameters of one fixed statement text (which
        psycopg also prepares once if the project enabled prepared
        statements with OPTIONS ``prepare_threshold``; Django disables them by
        default for the sake of connection poolers, and so do we). The cursor
        is wrapped by Django as usual (``_binding_cursor``).
        """
        with self._binding_cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def insert_item(
        self,
        item: WorkItem,
        *,
        run_after: datetime | timedelta | None,
        payload_json: str | None,
    ) -> bool:
        # One round trip and, in autocommit, one commit: the INSERT and the
        # NOTIFY run as one statement.
        params = self._insert_params(item, run_after)
        params["payload"] = payload_json
        with self._insert_cursor() as cursor:
            cursor.execute(INSERT_ITEM.sql, params)
            rows = cursor.fetchall()
        self._assign(rows, [item])
        return True

    def insert_items(
        self,
        items: Sequence[WorkItem],
        *,
        run_after: datetime | timedelta | None,
        payloads_json: Sequence[str | None],
    ) -> bool:
        params = self._insert_params(items[0], run_after)
        if len(items) >= COPY_THRESHOLD:
            self._copy_items(items, params, payloads_json)
            return True
        params["payloads"] = list(payloads_json)
        with self._insert_cursor() as cursor:
            cursor.execute(INSERT_ITEMS.sql, params)
            rows = cursor.fetchall()
        self._assign(rows, items)
        return True

    def _copy_items(
        self,
        items: Sequence[WorkItem],
        params: dict[str, Any],
        payloads_json: Sequence[str | None],
    ) -> None:
        """``insert_items`` by COPY: reserve ids, write the rows, notify; all or nothing.

        One transaction in autocommit; inside the caller's, no savepoint: as
        with the one-statement insert, an error breaks the caller's
        transaction, and nothing of the batch stays.
        """
        connection = self.connection
        with (
            transaction.atomic(using=self.using, savepoint=False),
            self._insert_cursor() as cursor,
        ):
            cursor.execute(RESERVE_IDS.sql, {**params, "count": len(items)})
            ((now, run_after_value, ids),) = cursor.fetchall()
            ids.sort()
            if len(ids) != len(items):
                raise RuntimeError(f"reserved {len(ids)} ids for {len(items)} items")
            # Every column but id and payload, as one piece of COPY text.
            shared = "\t".join(
                [
                    _copy_text(params["handler"]),
                    _copy_text(params["queue"]),
                    "pending",
                    str(params["priority"]),
                    run_after_value.isoformat(),
                    "0",
                    str(params["max_attempts"]),
                    "",
                    "",
                    _copy_text(params["trace_context"]),
                    now.isoformat(),
                    now.isoformat(),
                ]
            )
            with connection.wrap_database_errors, cursor.copy(COPY_ITEMS.sql) as copy:
                for start in range(0, len(ids), COPY_CHUNK):
                    rows = zip(
                        ids[start : start + COPY_CHUNK],
                        payloads_json[start : start + COPY_CHUNK],
                        strict=True,
                    )
                    copy.write(
                        "".join(
                            [f"{pk}\t{_copy_payload(payload)}\t{shared}\n" for pk, payload in rows]
                        )
                    )
            cursor.execute(NOTIFY.sql, {"queue": params["queue"]})
        self._assign([(pk, run_after_value, now, now) for pk in ids], items)

    def _insert_cursor(self) -> CursorWrapper:
        """A cursor for the enqueue statements: prepared where the connection allows it.

        Django's psycopg backend uses a ``ClientCursor`` unless told otherwise:
        parameters are quoted into the text, the server parses and plans it
        on every call, and such a cursor is never prepared. Parsing and
        planning are a good part of a single enqueue's cost (about 80 µs of
        450 on the development machine, docs/benchmarks.md, W2). Where the
        database's OPTIONS set ``prepare_threshold`` (Django leaves it off by
        default, for poolers such as PgBouncer before 1.21; we follow that
        setting rather than override it), the statements run on a plain
        ``psycopg.Cursor`` of the same connection, so in the same
        transaction, which psycopg prepares. Without it, binding on the
        server does not pay (one more message, the same parse), and Django's
        own cursor is used. The plain cursor is wrapped as Django wraps its
        own: query logging, execute wrappers, error translation and the
        broken-transaction check still apply, and timestamps load in the
        connection's time zone as ``DatabaseWrapper.create_cursor`` arranges.
        """
        connection = self.connection
        connection.close_if_health_check_failed()
        connection.ensure_connection()
        if connection.connection.prepare_threshold is None:
            return connection.cursor()
        return self._binding_cursor()

    def _binding_cursor(self) -> CursorWrapper:
        """A plain ``psycopg.Cursor`` of this alias's connection, wrapped as Django wraps its own.

        Parameters are bound on the server (and the statement prepared if
        the connection's ``prepare_threshold`` allows). Query logging,
        execute wrappers, error translation and the broken-transaction check
        apply as to Django's cursors, and timestamps load in the
        connection's time zone as ``DatabaseWrapper.create_cursor`` arranges.
        """
        connection = self.connection
        connection.ensure_connection()
        raw = connection.connection
        with connection.wrap_database_errors:
            # Any: django-stubs types make_cursor's argument as a CursorWrapper.
            cursor: Any = psycopg.Cursor(raw)
            loader = raw.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT)
            if connection.timezone != getattr(loader, "timezone", None):
                register_tzloader(connection.timezone, cursor)
        connection.validate_thread_sharing()
        if connection.queries_logged:
            return connection.make_debug_cursor(cursor)
        return connection.make_cursor(cursor)

    def _insert_params(
        self, first: WorkItem, run_after: datetime | timedelta | None
    ) -> dict[str, Any]:
        """The parameters the inserted rows share (all but the payload)."""
        return {
            "handler": first.handler,
            "queue": first.queue,
            "priority": first.priority,
            "run_at": run_after if isinstance(run_after, datetime) else None,
            "delay": run_after if isinstance(run_after, timedelta) else timedelta(0),
            "max_attempts": first.max_attempts,
            "trace_context": json.dumps(first.trace_context or {}),
        }

    def notify(self, queues: Sequence[str]) -> None:
        # Delivered only if (and when) the enclosing transaction commits,
        # savepoint rollbacks included.
        with self.connection.cursor() as cursor:
            for queue in sorted(set(queues)):
                cursor.execute(NOTIFY.sql, {"queue": queue})

    def listen(self) -> PostgresSubscription:
        return PostgresSubscription(self.connection)

    def distinct_queues(self) -> list[str]:
        return [name for (name,) in self._fetch(DISTINCT_QUEUES.sql)]

    def estimate_count(self, queryset: QuerySet[Any]) -> int | None:
        sql, params = queryset.order_by().query.get_compiler(using=self.using).as_sql()
        ((plan,),) = self._fetch(ESTIMATE_COUNT.render(query=sql), params)
        # Django's psycopg setup loads json as text on some versions, as objects on others.
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])

    def run_times(self, since: timedelta, sample: int) -> list[RunTimes]:
        # All the rows of the window: the database sorts them, nothing is sampled.
        rows = self._fetch(RUN_TIMES.sql, {"seconds": since.total_seconds()})
        return [
            RunTimes(handler, count, max(0.0, p50), max(0.0, p95))
            for handler, count, (p50, p95) in rows
        ]

    def table_estimate(self, columns: Sequence[str]) -> TableEstimate | None:
        rows = self._fetch(TABLE_ESTIMATE.sql, {"columns": list(columns)})
        # reltuples is -1 (or 0) before the first ANALYZE: nothing to estimate from.
        if not rows or rows[0][0] is None or rows[0][0] <= 0:
            return None
        reltuples = float(rows[0][0])
        stats: dict[str, ColumnStats] = {}
        for _, name, values, freqs, n_distinct in rows:
            if name is None:
                continue
            parsed = _parse_text_array(values) if values else []
            distinct = float(n_distinct or 0)
            if distinct < 0:  # a negative n_distinct is a fraction of the rows
                distinct = -distinct * reltuples
            stats[name] = ColumnStats(dict(zip(parsed, freqs or [], strict=False)), distinct)
        if set(stats) != set(columns):
            return None
        return TableEstimate(reltuples, stats)


def claim_statement(
    *, limit: int, handlers: Sequence[str], queues: Sequence[str] | None, worker: str
) -> tuple[str, dict[str, Any]]:
    """The claim statement for these filters, and its parameters."""
    params: dict[str, Any] = {"worker": worker, "handlers": list(handlers), "limit": limit}
    if not queues:
        return CLAIM.sql, params
    if len(queues) == 1:
        return CLAIM_IN_QUEUE.sql, {**params, "queue": queues[0]}
    return CLAIM_IN_QUEUES.sql, {**params, "queues": list(queues)}


class PostgresSubscription:
    """A dedicated autocommit connection LISTENing for wake-ups.

    Outside Django's per-thread connections: it lives as long as the
    listener thread, and LISTEN only works outside a transaction block.
    """

    def __init__(self, wrapper: Any) -> None:
        self._conn = wrapper.get_new_connection(wrapper.get_connection_params())
        try:
            self._conn.autocommit = True
            self._conn.execute(LISTEN.sql)
        except BaseException:
            self._conn.close()
            raise

    def receive(self, timeout: float) -> Iterator[str]:
        # psycopg 3's notifies() yields each notification as it arrives and
        # returns after ``timeout`` seconds in all.
        for note in self._conn.notifies(timeout=timeout):
            yield note.payload

    def close(self) -> None:
        self._conn.close()


def _copy_text(value: str) -> str:
    """``value`` as a field of COPY's text format (backslash escapes)."""
    return (
        value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    )


def _copy_payload(payload_json: str | None) -> str:
    """A payload's JSON text as a COPY field; None (a JSON null payload) is SQL NULL."""
    # JSON from json.dumps holds no raw control characters, only backslashes
    # need doubling; _copy_text escapes all four anyway, so any text stays exact.
    if payload_json is None:
        return "\\N"
    return _copy_text(payload_json)


def _parse_text_array(text: str) -> list[str]:
    """Parse PostgreSQL's text form of a one-dimensional text array."""
    import csv

    inner = text[1:-1] if text.startswith("{") and text.endswith("}") else text
    if not inner:
        return []
    reader = csv.reader([inner], delimiter=",", quotechar='"', escapechar="\\")
    return next(reader)
