"""PostgreSQL: one-statement SKIP LOCKED claims and LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

from collections.abc import Sequence

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
