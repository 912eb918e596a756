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
        self._insert_cache: dict[tuple[str, bool], str] = {}

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
        if payload_json is None and item.payload is not None:
            payload_json = json.dumps(item.payload)
        payload = None if item.payload is None else payload_json
        return self._insert([item], run_after, [payload], many=False)

    def insert_items(
        self,
        items: Sequence[WorkItem],
        *,
        run_after: datetime | timedelta | None,
        payloads_json: Sequence[str | None],
    ) -> bool:
        # All payloads travel as one jsonb[] parameter: one statement whatever
        # the batch size (no 65,535-parameter ceiling, no per-row SQL).
        return self._insert(items, run_after, list(payloads_json), many=True)

    def _insert(
        self,
        items: Sequence[WorkItem],
        run_after: datetime | timedelta | None,
        payloads: list[str | None],
        *,
        many: bool,
    ) -> bool:
        extra: tuple[Any, ...] = ()
        if run_after is None:
            run_after_sql = "statement_timestamp()"
        elif isinstance(run_after, timedelta):
            run_after_sql, extra = "statement_timestamp() + %s::interval", (run_after,)
        else:
            run_after_sql, extra = "%s", (run_after,)
        key = (run_after_sql, many)
        sql = self._insert_cache.get(key)
        if sql is None:
            sql = self._insert_sql(run_after_sql, many)
            self._insert_cache[key] = sql
        first = items[0]
        values = (first.handler, first.queue) + (() if many else (payloads[0],))
        params = (
            *values,
            first.priority,
            *extra,
            first.max_attempts,
            json.dumps(first.trace_context or {}),
            *((payloads,) if many else ()),
            NOTIFY_CHANNEL,
            first.queue,
        )
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        if len(rows) != len(items):
            raise RuntimeError(f"inserted {len(rows)} rows for {len(items)} items")
        for item, (pk, run_after_value, created_at, updated_at) in zip(items, rows, strict=True):
            item.pk = pk
            item.run_after = run_after_value
            item.created_at = created_at
            item.updated_at = updated_at
            item._state.adding = False
            item._state.db = self.using
        return True

    def _insert_sql(self, run_after_sql: str, many: bool) -> str:
        table = self.connection.ops.quote_name(WorkItem._meta.db_table)
        columns = (
            "handler, queue, payload, status, priority, run_after, attempts, max_attempts, "
            "claimed_by, last_error, trace_context, created_at, updated_at"
        )
        row = (
            f"%s, %s, {'u.p' if many else '%s::jsonb'}, 'pending', %s, {run_after_sql}, 0, %s, "
            "'', '', %s::jsonb, statement_timestamp(), statement_timestamp()"
        )
        # Ids come from the sequence in insertion order, which follows the
        # ORDER BY; the outer ORDER BY id lines the rows up with the items.
        source = (
            f"SELECT {row} FROM unnest(%s::jsonb[]) WITH ORDINALITY AS u(p, n) ORDER BY u.n"
            if many
            else f"VALUES ({row})"
        )
        return (
            f"WITH ins AS (INSERT INTO {table} ({columns}) {source} "
            f"RETURNING id, run_after, created_at, updated_at) "
            f"SELECT ins.id, ins.run_after, ins.created_at, ins.updated_at "
            f"FROM ins, (SELECT pg_notify(%s, %s)) AS wake ORDER BY ins.id"
        )

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
