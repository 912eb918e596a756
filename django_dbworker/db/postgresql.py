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

from django.db.models import QuerySet

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

try:  # psycopg 3 binds parameters on the server with its plain cursor
    from psycopg import Connection as Psycopg3Connection
    from psycopg import Cursor as ServerBindingCursor
except ImportError:  # psycopg2: client-side binding only
    Psycopg3Connection = ServerBindingCursor = None  # type: ignore[assignment,misc]

#: ``server_version_num`` of PostgreSQL 13 (gen_random_uuid() in core).
MIN_VERSION = 130000

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
INSERT_ITEM = Statement(
    "insert_item",
    "Insert one pending row and notify its queue, in one round trip.",
    """
WITH ins AS (
    INSERT INTO django_dbworker_workitem (
        handler, queue, payload, status, priority, run_after, attempts, max_attempts,
        claimed_by, last_error, trace_context, created_at, updated_at)
    VALUES (
        %(handler)s, %(queue)s, %(payload)s::jsonb, 'pending', %(priority)s,
        coalesce(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
        0, %(max_attempts)s, '', '', %(trace_context)s::jsonb,
        statement_timestamp(), statement_timestamp())
    RETURNING id, run_after, created_at, updated_at
)
SELECT ins.id, ins.run_after, ins.created_at, ins.updated_at
FROM ins, (SELECT pg_notify('django_dbworker', %(queue)s)) AS wake
ORDER BY ins.id
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
        is wrapped by Django as usual: its errors, debug log and
        ``CaptureQueriesContext`` see it like any other.
        """
        conn = self.connection
        conn.ensure_connection()
        if Psycopg3Connection is None or not isinstance(conn.connection, Psycopg3Connection):
            return self._fetch(sql, params)
        with conn.wrap_database_errors:
            raw = ServerBindingCursor(conn.connection)
        # What conn.cursor() does with the cursor it creates: thread-sharing
        # check, and the wrapper that logs queries and translates errors.
        with conn._prepare_cursor(raw) as cursor:  # type: ignore[attr-defined]
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def insert_item(
        self,
        item: WorkItem,
        *,
        run_after: datetime | timedelta | None,
        payload_json: str | None = None,
    ) -> bool:
        # One round trip and, in autocommit, one commit: the INSERT and the
        # NOTIFY run as one statement.
        if payload_json is None and item.payload is not None:
            payload_json = json.dumps(item.payload)
        params = self._insert_params(item, run_after)
        params["payload"] = None if item.payload is None else payload_json
        self._assign(self._fetch(INSERT_ITEM.sql, params), [item])
        return True

    def insert_items(
        self,
        items: Sequence[WorkItem],
        *,
        run_after: datetime | timedelta | None,
        payloads_json: Sequence[str | None],
    ) -> bool:
        params = self._insert_params(items[0], run_after)
        params["payloads"] = list(payloads_json)
        self._assign(self._fetch(INSERT_ITEMS.sql, params), items)
        return True

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

    def _assign(self, rows: list[tuple[Any, ...]], items: Sequence[WorkItem]) -> None:
        """Give inserted items their ids and database-set times, as ``save()`` would."""
        if len(rows) != len(items):
            raise RuntimeError(f"inserted {len(rows)} rows for {len(items)} items")
        for item, (pk, run_after_value, created_at, updated_at) in zip(items, rows, strict=True):
            item.pk = pk
            item.run_after = run_after_value
            item.created_at = created_at
            item.updated_at = updated_at
            item._state.adding = False
            item._state.db = self.using

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


def _parse_text_array(text: str) -> list[str]:
    """Parse PostgreSQL's text form of a one-dimensional text array."""
    import csv

    inner = text[1:-1] if text.startswith("{") and text.endswith("}") else text
    if not inner:
        return []
    reader = csv.reader([inner], delimiter=",", quotechar='"', escapechar="\\")
    return next(reader)
