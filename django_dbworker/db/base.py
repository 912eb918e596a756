"""The interface every database vendor implements, and shared row decoding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.functions import Now
from django.db.models.sql.compiler import SQLCompiler

from django_dbworker.models import Status, WorkItem

#: Columns a claim returns: everything the executor needs, nothing bulky it doesn't.
CLAIM_COLUMNS = (
    "id",
    "handler",
    "queue",
    "payload",
    "priority",
    "attempts",
    "max_attempts",
    "claimed_by",
    "claim_token",
    "trace_context",
)

#: Channel of the PostgreSQL wake-up notifications; the payload is the queue name.
NOTIFY_CHANNEL = "django_dbworker"


@dataclass
class ColumnStats:
    """Planner statistics of one column: value frequencies and the rest."""

    frequencies: dict[str, float]
    n_distinct: float

    def frequency(self, value: str) -> float:
        if value in self.frequencies:
            return self.frequencies[value]
        others = self.n_distinct - len(self.frequencies)
        rest = max(0.0, 1.0 - sum(self.frequencies.values()))
        return rest / others if others >= 1 else 0.0


@dataclass
class TableEstimate:
    """The planner's idea of the work table: row count and column statistics."""

    rows: float
    columns: dict[str, ColumnStats]


def _as_uuid(value: Any) -> UUID:
    """A claim token as the driver returns it (a UUID, or hex text on SQLite)."""
    return value if isinstance(value, UUID) else UUID(str(value))


class UnsupportedDatabase(Exception):
    """The configured database cannot run django-dbworker."""


Converter = Callable[[Any, Any, BaseDatabaseWrapper], Any]


class VendorOperations:
    """Vendor-specific database operations for one connection alias."""

    vendor = ""
    #: Whether ``listen`` can deliver wake-ups across processes.
    supports_notify = False

    def __init__(self, using: str) -> None:
        self.using = using
        self._claim_cache: dict[Any, tuple[str, tuple[Any, ...]]] = {}
        self._succeed_cache: dict[int, str] = {}
        self._converters: list[tuple[list[Converter], Any]] | None = None

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.using]

    # -- checks ------------------------------------------------------------------

    def check_version(self) -> None:
        """Raise ``UnsupportedDatabase`` when the server is too old."""

    # -- claims ------------------------------------------------------------------

    def claim(
        self,
        *,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        worker: str,
    ) -> list[WorkItem]:
        """Atomically move up to ``limit`` ready rows to ``claimed``, in claim order.

        Each row gets ``attempts + 1``, a fresh ``claim_token``, ``claimed_by``
        and DB-clock ``claimed_at``/``heartbeat_at``. Rows locked or claimed by
        another worker are skipped, never waited for and never returned twice.
        One statement, one round trip; its SQL is built once per
        (limit, handlers, queues) and reused, since a worker claims with the
        same filters thousands of times a minute.
        """
        if limit <= 0 or not handlers:
            return []
        key = (limit, tuple(handlers), tuple(queues) if queues else None)
        statement = self._claim_cache.get(key)
        if statement is None:
            inner, params = self._ready_subquery(limit, handlers, queues)
            statement = (self._claim_sql(inner), params)
            if len(self._claim_cache) < 1024:
                self._claim_cache[key] = statement
        sql, params = statement
        with self.connection.cursor() as cursor:
            cursor.execute(sql, (worker, *params))
            rows = cursor.fetchall()
        return self._rows_to_items(rows)

    def _claim_sql(self, ready_ids_sql: str) -> str:
        """The vendor's claim statement around the "next ready ids" subquery.

        Its first placeholder is the worker identity; it returns
        ``CLAIM_COLUMNS`` of the claimed rows.
        """
        raise NotImplementedError

    def succeed_many(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> set[tuple[int, UUID]]:
        """Record several successes in one fenced UPDATE; return the attempts recorded.

        ``outcomes`` holds ``(id, claim_token, result as JSON text or None)``;
        the answer holds ``(id, claim_token)`` of the rows written. Each row
        is matched on its own id, token and ``claimed`` status, so batching
        keeps per-row fencing: a row recovered and re-claimed meanwhile is
        not in the answer, and two attempts of one row in one batch (a late,
        superseded one and the current one) are told apart by their tokens.
        """
        if not outcomes:
            return set()
        sql = self._succeed_cache.get(len(outcomes))
        if sql is None:
            sql = self._succeed_sql(len(outcomes))
            if len(self._succeed_cache) < 1024:
                self._succeed_cache[len(outcomes)] = sql
        params: list[Any] = []
        for pk, claim_token, result_json in outcomes:
            params += [pk, self._token_param(claim_token), result_json]
        params += [pk for pk, _, _ in outcomes]
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return {(row[0], _as_uuid(row[1])) for row in cursor.fetchall()}

    def _succeed_sql(self, rows: int) -> str:
        q = self.connection.ops.quote_name
        id_, token, result = self._value_placeholders()
        values = ", ".join([f"({id_}, {token}, {result})"] * rows)
        now = self._now_sql()
        table = q(WorkItem._meta.db_table)
        return (
            f"WITH v(id, token, result) AS (VALUES {values}) "
            f"UPDATE {table} SET {q('status')} = '{Status.SUCCEEDED.value}', "
            f"{q('result')} = v.result, {q('finished_at')} = {now}, "
            f"{q('updated_at')} = {now}, {q('last_error')} = '' "
            # The explicit id list pins the plan to primary-key lookups.
            f"FROM v WHERE {table}.{q('id')} IN ({', '.join([id_] * rows)}) "
            f"AND {table}.{q('id')} = v.id "
            f"AND {table}.{q('claim_token')} = v.token "
            f"AND {table}.{q('status')} = '{Status.CLAIMED.value}' "
            f"RETURNING {table}.{q('id')}, {table}.{q('claim_token')}"
        )

    def _value_placeholders(self) -> tuple[str, str, str]:
        """Placeholders (with any casts) for a VALUES row of (id, token, result)."""
        return "%s", "%s", "%s"

    def _token_param(self, token: UUID) -> Any:
        return token

    def insert_item(
        self,
        item: WorkItem,
        *,
        run_after: datetime | timedelta | None,
        payload_json: str | None = None,
    ) -> bool:
        """Insert a validated item without a unique_key, and wake workers; in one go.

        Returns False where the vendor has no faster way than the ORM's
        ``save()`` followed by ``notify()``; the caller then does that.
        ``run_after`` is the caller's original value (None: now, by the DB clock);
        ``payload_json`` the payload already encoded by validation.
        """
        return False

    def insert_items(
        self,
        items: Sequence[WorkItem],
        *,
        run_after: datetime | timedelta | None,
        payloads_json: Sequence[str | None],
    ) -> bool:
        """``insert_item`` for a batch sharing handler, queue, priority and run_after."""
        return False

    def notify(self, queues: Sequence[str]) -> None:
        """Wake idle workers for ``queues`` when the current transaction commits."""

    def distinct_queues(self) -> list[str]:
        """Every queue name in the table, by a loose index scan.

        ``SELECT DISTINCT queue`` reads every row (or index entry); this
        recursive query jumps from one queue to the next through the
        ``(queue, id)`` index, so it costs one index probe per queue whatever
        the table size. Standard SQL, run as is by PostgreSQL and SQLite.
        """
        q = self.connection.ops.quote_name
        table, col = q(WorkItem._meta.db_table), q("queue")
        sql = (
            f"WITH RECURSIVE queues(name) AS ("
            f" SELECT (SELECT {col} FROM {table} ORDER BY {col} LIMIT 1)"
            f" UNION ALL"
            f" SELECT (SELECT {col} FROM {table} WHERE {col} > queues.name ORDER BY {col} LIMIT 1)"
            f" FROM queues WHERE queues.name IS NOT NULL"
            f") SELECT name FROM queues WHERE name IS NOT NULL"
        )
        with self.connection.cursor() as cursor:
            cursor.execute(sql)
            return [row[0] for row in cursor.fetchall()]

    def table_estimate(self, columns: Sequence[str]) -> TableEstimate | None:
        """Planner statistics for the work table, or None where there are none."""
        return None

    # -- helpers shared by the vendors --------------------------------------------

    def _ready_subquery(
        self, limit: int, handlers: Sequence[str], queues: Sequence[str] | None
    ) -> tuple[str, tuple[Any, ...]]:
        """SQL and params selecting the ids of the next ``limit`` ready rows."""
        qs = WorkItem.objects.using(self.using).ready().filter(handler__in=list(handlers))
        if queues:
            qs = qs.filter(queue__in=list(queues))
        ids = qs.in_order().values("id")[:limit]
        sql, params = ids.query.sql_with_params()
        return sql, tuple(params)

    def _compiler(self) -> SQLCompiler:
        compiler: SQLCompiler = (
            WorkItem.objects.using(self.using).all().query.get_compiler(self.using)
        )
        return compiler

    def _now_sql(self) -> str:
        sql, _ = self._compiler().compile(Now())
        return sql

    def _claim_set_clause(self, token_sql: str) -> str:
        q = self.connection.ops.quote_name
        now = self._now_sql()
        return (
            f"{q('status')} = '{Status.CLAIMED.value}', "
            f"{q('attempts')} = {q('attempts')} + 1, "
            f"{q('claimed_at')} = {now}, {q('heartbeat_at')} = {now}, "
            f"{q('updated_at')} = {now}, {q('claimed_by')} = %s, "
            f"{q('claim_token')} = {token_sql}"
        )

    def _returning_columns(self, prefix: str = "") -> str:
        q = self.connection.ops.quote_name
        return ", ".join(f"{prefix}{q(c)}" for c in CLAIM_COLUMNS)

    def _rows_to_items(self, rows: Sequence[Sequence[Any]]) -> list[WorkItem]:
        """Build model instances from raw rows, through Django's own converters."""
        connection = self.connection
        if self._converters is None:
            table = WorkItem._meta.db_table
            converters: list[tuple[list[Converter], Any]] = []
            for name in CLAIM_COLUMNS:
                col = WorkItem._meta.get_field(name).get_col(table)  # type: ignore[union-attr]
                funcs = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
                converters.append((funcs, col))
            self._converters = converters
        items = []
        for row in rows:
            values = []
            for value, (funcs, col) in zip(row, self._converters, strict=True):
                for func in funcs:
                    value = func(value, col, connection)
                values.append(value)
            item = WorkItem.from_db(self.using, list(CLAIM_COLUMNS), values)
            item.status = Status.CLAIMED
            items.append(item)
        items.sort(key=lambda i: (-i.priority, i.pk))
        return items
