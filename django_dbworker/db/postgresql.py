"""PostgreSQL: one-statement SKIP LOCKED claims and LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django_dbworker.db.base import (
    NOTIFY_CHANNEL,
    ColumnStats,
    TableEstimate,
    UnsupportedDatabase,
    VendorOperations,
)
from django_dbworker.models import WorkItem

MIN_VERSION = 130000


class PostgresOperations(VendorOperations):
    vendor = "postgresql"
    supports_notify = True

    def __init__(self, using: str) -> None:
        super().__init__(using)
        self._insert_cache: dict[str, str] = {}

    def check_version(self) -> None:
        self.connection.ensure_connection()
        version = self.connection.pg_version  # type: ignore[attr-defined]
        if version < MIN_VERSION:
            raise UnsupportedDatabase(
                f"django-dbworker needs PostgreSQL 13 or newer; this server is {version}."
            )

    def _claim_sql(self, ready_ids_sql: str) -> str:
        q = self.connection.ops.quote_name
        table = q(WorkItem._meta.db_table)
        # The LIMIT subquery in FROM is evaluated once (LIMIT blocks pull-up),
        # and SKIP LOCKED lets concurrent claimers take disjoint rows instead
        # of queueing behind each other's locks.
        return (
            f"UPDATE {table} AS w SET {self._claim_set_clause('gen_random_uuid()')} "
            f"FROM ({ready_ids_sql} FOR UPDATE SKIP LOCKED) AS c "
            f"WHERE w.{q('id')} = c.{q('id')} "
            f"RETURNING {self._returning_columns('w.')}"
        )

    def _value_placeholders(self) -> tuple[str, str, str]:
        # VALUES columns take their types from the first row; say them.
        return "%s::bigint", "%s::uuid", "%s::jsonb"

    def insert_item(
        self,
        item: WorkItem,
        *,
        run_after: datetime | timedelta | None,
        payload_json: str | None = None,
    ) -> bool:
        # One round trip and, in autocommit, one commit: the INSERT and the
        # NOTIFY run as one statement, and NOTIFY is delivered at commit.
        # Values were validated by enqueue; JSON is encoded here once.
        extra: tuple[Any, ...] = ()
        if run_after is None:
            run_after_sql = "statement_timestamp()"
        elif isinstance(run_after, timedelta):
            run_after_sql, extra = "statement_timestamp() + %s::interval", (run_after,)
        else:
            run_after_sql, extra = "%s", (run_after,)
        sql = self._insert_cache.get(run_after_sql)
        if sql is None:
            table = self.connection.ops.quote_name(WorkItem._meta.db_table)
            sql = (
                f"WITH ins AS (INSERT INTO {table} (handler, queue, payload, status, priority, "
                f"run_after, attempts, max_attempts, claimed_by, last_error, trace_context, "
                f"created_at, updated_at) VALUES (%s, %s, %s::jsonb, 'pending', %s, "
                f"{run_after_sql}, 0, %s, '', '', %s::jsonb, statement_timestamp(), "
                f"statement_timestamp()) RETURNING id, run_after, created_at, updated_at) "
                f"SELECT id, run_after, created_at, updated_at, pg_notify(%s, %s) FROM ins"
            )
            self._insert_cache[run_after_sql] = sql
        if payload_json is None and item.payload is not None:
            payload_json = json.dumps(item.payload)
        payload = None if item.payload is None else payload_json
        params = (
            item.handler,
            item.queue,
            payload,
            item.priority,
            *extra,
            item.max_attempts,
            json.dumps(item.trace_context or {}),
            NOTIFY_CHANNEL,
            item.queue,
        )
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            pk, run_after_value, created_at, updated_at, _ = cursor.fetchone()
        item.pk = pk
        item.run_after = run_after_value
        item.created_at = created_at
        item.updated_at = updated_at
        item._state.adding = False
        item._state.db = self.using
        return True

    def notify(self, queues: Sequence[str]) -> None:
        # NOTIFY is transactional in PostgreSQL: it is delivered only if (and
        # when) the enclosing transaction commits, savepoint rollbacks included.
        with self.connection.cursor() as cursor:
            for queue in sorted(set(queues)):
                cursor.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, queue))

    def table_estimate(self, columns: Sequence[str]) -> TableEstimate | None:
        # reltuples and pg_stats are what ANALYZE (and autovacuum) keep; reading
        # them costs nothing however large the table is. reltuples is -1 (or 0)
        # before the first ANALYZE: then there is nothing to estimate from.
        table = WorkItem._meta.db_table
        with self.connection.cursor() as cursor:
            cursor.execute(
                "SELECT c.reltuples, s.attname, s.most_common_vals::text, "
                "       s.most_common_freqs, s.n_distinct "
                "FROM pg_class c LEFT JOIN pg_stats s "
                "  ON s.tablename = c.relname AND s.schemaname = current_schema() "
                "  AND s.attname = ANY(%s) "
                "WHERE c.oid = to_regclass(%s)",
                (list(columns), table),
            )
            rows = cursor.fetchall()
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


def _parse_text_array(text: str) -> list[str]:
    """Parse PostgreSQL's text form of a one-dimensional text array."""
    import csv

    inner = text[1:-1] if text.startswith("{") and text.endswith("}") else text
    if not inner:
        return []
    reader = csv.reader([inner], delimiter=",", quotechar='"', escapechar="\\")
    return next(reader)
