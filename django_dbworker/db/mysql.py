"""MySQL 8 and MariaDB 10.6+: the operations that run their statements (``mysql_sql.py``).

Neither has ``UPDATE ... RETURNING``, so a claim is three statements in one
short transaction at READ COMMITTED: ``SELECT id ... FOR UPDATE SKIP
LOCKED`` in claim order, ``UPDATE ... WHERE id IN (...)``, and a read of the
claimed rows. Successes lock their rows first (``SELECT ... FOR UPDATE`` in
ascending id order, so that two bulk writers queue behind each other
instead of deadlocking), keep those still claimed under their own token and
update exactly those. A deadlock (1213) or a lock wait timeout (1205) rolls
the transaction back; in autocommit it is retried here, a few times, before
the caller's own retry (``is_transient``) takes over.

Every session's time zone is pinned to UTC (``prepare_session``), so that
Django's ``Now()`` agrees with the statements' ``UTC_TIMESTAMP(6)``. No
cross-process wake-ups: workers poll adaptively, and an enqueue in a
worker's own process wakes it (``VendorOperations.notify``). This module
writes no SQL: every text it runs is a named statement of
``mysql_sql.py``. Nothing outside the db package imports it
(``operations()`` is the way in).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

from django.db import OperationalError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import QuerySet
from django.db.models.functions import Now

from django_dbworker.db.base import (
    Claimed,
    Turn,
    Turns,
    VendorOperations,
    as_uuid,
    numbered_params,
)
from django_dbworker.db.errors import mysql_error_code
from django_dbworker.db.keys import Candidate, current_limits, flow_lock_name, within_limits
from django_dbworker.db.mysql_sql import (
    DISTINCT_QUEUES,
    ESTIMATE_COUNT,
    RESTORE_LOCK_WAIT,
    SERVER_SETTINGS,
    SET_LOCK_WAIT,
    SET_READ_COMMITTED,
    SET_TIME_ZONE,
    claim_candidates_sql,
    claim_read_sql,
    claim_select_sql,
    claim_update_sql,
    count_key_slots_sql,
    fair_claim_sql,
    heartbeat_lock_sql,
    insert_chunks,
    insert_flow_locks_sql,
    insert_items_sql,
    lock_flow_locks_sql,
    lock_rows_sql,
    succeed_lock_sql,
    succeed_update_sql,
)
from django_dbworker.db.types import ServerProblem, UnsupportedDatabase
from django_dbworker.models import WorkItem

logger = logging.getLogger("django_dbworker.db")

T = TypeVar("T")

#: SKIP LOCKED arrived in MySQL 8.0.1 and MariaDB 10.6.
MIN_MYSQL_VERSION = (8, 0, 1)
MIN_MARIADB_VERSION = (10, 6)

MICROSECOND = timedelta(microseconds=1)

#: Deadlock found when trying to get lock; Lock wait timeout exceeded.
DEADLOCK = 1213
LOCK_WAIT_TIMEOUT = 1205
#: Runs again of a claim, success write or enqueue that a deadlock or lock wait
#: timeout rolled back, in autocommit (a hot unique key's enqueues needed > 5).
LOCK_RETRIES = 10


def unsupported_version(*, is_mariadb: bool, version: tuple[int, ...]) -> str | None:
    """Why this server version cannot run django-dbworker, or None if it can."""
    shown = ".".join(map(str, version))
    if is_mariadb and version < MIN_MARIADB_VERSION:
        return (
            "django-dbworker needs MariaDB 10.6 or newer (SELECT ... FOR UPDATE SKIP LOCKED); "
            f"this server is MariaDB {shown}."
        )
    if not is_mariadb and version < MIN_MYSQL_VERSION:
        return (
            "django-dbworker needs MySQL 8.0.1 or newer (SELECT ... FOR UPDATE SKIP LOCKED); "
            f"this server is MySQL {shown}."
        )
    return None


def is_lock_conflict(exc: BaseException) -> bool:
    """A deadlock or a lock wait timeout: the transaction may simply be run again."""
    return mysql_error_code(exc) in (DEADLOCK, LOCK_WAIT_TIMEOUT)


# -- operations ---------------------------------------------------------------------


def filter_params(handlers: Sequence[str], queues: Sequence[str]) -> dict[str, Any]:
    """The parameters of a claim's handlers and queues (``claim_select_sql``'s slots)."""
    params: dict[str, Any] = numbered_params("handler", handlers)
    if len(queues) == 1:
        params["queue"] = queues[0]
    else:
        params.update(numbered_params("queue", queues))
    return params


class MySQLOperations(VendorOperations):
    vendor = "mysql"
    supports_notify = False
    supports_skip_locked = True
    # An empty claim is one SELECT ... SKIP LOCKED that locks nothing.
    poll_adaptively = True

    def check_version(self) -> None:
        connection: Any = self.connection
        connection.ensure_connection()
        problem = unsupported_version(
            is_mariadb=connection.mysql_is_mariadb, version=tuple(connection.mysql_version)
        )
        if problem:
            raise UnsupportedDatabase(problem)

    @property
    def max_json_depth(self) -> int | None:
        """MariaDB's JSON_VALID (its JSONField CHECK constraint) refuses documents of 32
        levels or more (``json_valid(repeat('[', 32) ...)`` is 0 on 10.11); MySQL 8 stores
        up to 100."""
        connection: Any = self.connection
        connection.ensure_connection()
        return 31 if connection.mysql_is_mariadb else 100

    def binlog_format(self) -> str | None:
        """The binary log's format, or None when the binary log is off."""
        ((log_bin, binlog_format),) = self._fetch(SERVER_SETTINGS.sql)
        return str(binlog_format).upper() if int(log_bin or 0) else None

    def server_problems(self) -> list[ServerProblem]:
        """A version without ``SKIP LOCKED``; else a binary log that is not row-based.

        With statement-based (or mixed) binary logging, a replica replays
        ``SELECT ... FOR UPDATE SKIP LOCKED ... LIMIT`` and ``UUID()``
        differently from the source: MySQL marks them unsafe for
        statement-based replication
        (https://dev.mysql.com/doc/refman/8.0/en/replication-rbr-safe-unsafe.html).
        """
        try:
            self.check_version()
        except UnsupportedDatabase as exc:
            return [
                ServerProblem(
                    "version",
                    f"Database {self.using!r}: {exc}",
                    "Upgrade the server, or run django-dbworker on PostgreSQL.",
                )
            ]
        binlog_format = self.binlog_format()
        if binlog_format is not None and binlog_format != "ROW":
            return [
                ServerProblem(
                    "replication",
                    f"Database {self.using!r} writes its binary log in {binlog_format} format.",
                    "Set binlog_format = ROW: the worker's SKIP LOCKED claims and UUID() "
                    "claim tokens are unsafe for statement-based replication.",
                )
            ]
        return []

    @classmethod
    def prepare_session(cls, connection: BaseDatabaseWrapper) -> None:
        """Every MySQL session's time zone is UTC.

        With ``USE_TZ``, Django keeps DATETIME columns in UTC but does not set
        the session's zone, and its ``Now()`` (``db_default``, the querysets'
        time comparisons) is ``CURRENT_TIMESTAMP``, which is in that zone. On a
        server whose zone is not UTC, the worker's heartbeats and the stale
        scan would be hours apart. UTC is what Django already assumes for
        stored values; DATETIME columns are not converted by the session's
        zone, so nothing else changes (only TIMESTAMP columns are, which
        Django does not create).
        """
        with connection.cursor() as cursor:
            cursor.execute(SET_TIME_ZONE.sql)

    # -- claims and outcomes -----------------------------------------------------

    def claim(
        self,
        *,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        worker: str,
        limits: Mapping[str, int] | None = None,
        keyed_cap: int | None = None,
        turn: Turn | None = None,
    ) -> Claimed[WorkItem]:
        queues = list(queues or ())
        params = {"limit": limit, **filter_params(handlers, queues)}
        if turn is not None:
            params.update(turn.params())
        if limits:
            return self._claim_keyed(
                params, worker, len(handlers), len(queues), limits, keyed_cap, turn
            )
        select = fair_claim_sql(claim_select_sql(len(handlers), len(queues)), turn)

        def attempt() -> list[tuple[Any, ...]]:
            with self._read_committed(), self.connection.cursor() as cursor:
                cursor.execute(select, params)
                # Ascending: the UPDATE and the read visit them in id order.
                ids = sorted(pk for (pk,) in cursor.fetchall())
                if not ids:
                    return []
                return self._claim_ids(cursor, ids, worker)

        return self._rows_to_items(self._retrying(attempt, "claiming"))

    def _claim_plain_turns(
        self, *, turns: Turns, handlers: Sequence[str], queues: Sequence[str] | None, worker: str
    ) -> Claimed[WorkItem]:
        # Every turn's locking read in one transaction, then one UPDATE and one read-back:
        # a transaction per turn cost three statements and a commit a key.
        queues = list(queues or ())
        params = filter_params(handlers, queues)
        select = claim_select_sql(len(handlers), len(queues))

        def attempt() -> list[tuple[Any, ...]]:
            with self._read_committed(), self.connection.cursor() as cursor:
                ids: list[int] = []
                for turn, count in turns.each():
                    cursor.execute(
                        fair_claim_sql(select, turn), {**params, **turn.params(), "limit": count}
                    )
                    ids.extend(pk for (pk,) in cursor.fetchall())
                return self._claim_ids(cursor, sorted(ids), worker) if ids else []

        return self._rows_to_items(self._retrying(attempt, "claiming"))

    def _claim_ids(self, cursor: Any, ids: list[int], worker: str) -> list[tuple[Any, ...]]:
        """Mark the locked rows ``ids`` (ascending) claimed; read them back."""
        cursor.execute(claim_update_sql(len(ids)), {"worker": worker, **numbered_params("id", ids)})
        cursor.execute(claim_read_sql(len(ids)), numbered_params("id", ids))
        return list(cursor.fetchall())

    def _claim_keyed(
        self,
        params: dict[str, Any],
        worker: str,
        handlers: int,
        queues: int,
        limits: Mapping[str, int],
        keyed_cap: int | None,
        turn: Turn | None,
    ) -> Claimed[WorkItem]:
        """The claim that honours concurrency keys (``mysql_sql``, "the keyed claim")."""
        select = fair_claim_sql(claim_candidates_sql(handlers, queues, len(limits)), turn)
        params = {**params, **numbered_params("limited", list(limits))}
        params.update(numbered_params("limit", list(limits.values())))

        def attempt() -> tuple[list[tuple[Any, ...]], int]:
            with self._read_committed(), self.connection.cursor() as cursor:
                cursor.execute(select, params)
                candidates: list[Candidate] = current_limits(list(cursor.fetchall()), limits)
                if not candidates:
                    return [], 0
                slots = sorted({(h, k) for _, h, k, lim in candidates if k is not None and lim})
                held: dict[tuple[str, str], int] = {}
                if slots:
                    self._lock_flow_locks(cursor, sorted({flow_lock_name(h, k) for h, k in slots}))
                    pairs = numbered_params("handler", [h for h, _ in slots])
                    pairs.update(numbered_params("key", [k for _, k in slots]))
                    cursor.execute(count_key_slots_sql(len(slots)), pairs)
                    held = {(h, k): int(n) for h, k, n in cursor.fetchall()}
                    # A pair the count did not name back is full, never free.
                    held.update({s: limits[s[0]] for s in slots if s not in held})
                ids, throttled = within_limits(candidates, held, keyed_cap)
                if not ids:
                    return [], throttled
                return self._claim_ids(cursor, sorted(ids), worker), throttled

        rows, throttled = self._retrying(attempt, "claiming")
        return Claimed(self._rows_to_items(rows), throttled=throttled)

    def _lock_flow_locks(self, cursor: Any, names: list[str]) -> None:
        """Lock the FlowLock rows ``names`` (sorted), inserting the missing ones."""
        cursor.execute(lock_flow_locks_sql(len(names)), numbered_params("name", names))
        missing = sorted(set(names) - {name for (name,) in cursor.fetchall()})
        if missing:
            cursor.execute(insert_flow_locks_sql(len(missing)), numbered_params("name", missing))
            # Rows this insert wrote are locked by it; one that another
            # claimer inserted meanwhile is locked here.
            cursor.execute(lock_flow_locks_sql(len(missing)), numbered_params("name", missing))
            cursor.fetchall()

    def succeed_rows(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> list[tuple[int, UUID, bool]]:
        if not outcomes:
            return []
        wanted = {(pk, token) for pk, token, _ in outcomes}
        ids = sorted({pk for pk, _, _ in outcomes})

        def attempt() -> list[tuple[int, UUID, bool]]:
            with self._read_committed(), self.connection.cursor() as cursor:
                cursor.execute(succeed_lock_sql(len(ids)), numbered_params("id", ids))
                linked: dict[tuple[int, UUID], bool] = {}
                for pk, status, token, has_dependents in cursor.fetchall():
                    if status == "claimed" and token is not None:
                        linked[pk, as_uuid(token)] = bool(has_dependents)
                held = set(linked) & wanted
                if not held:
                    return []
                # One row's two attempts cannot both be held: only its current
                # token is. An attempt listed twice is written once.
                results = {(pk, token): result for pk, token, result in outcomes}
                mine = sorted(
                    ((pk, token, results[pk, token]) for pk, token in held),
                    key=lambda outcome: outcome[0],
                )
                token_field = WorkItem._meta.get_field("claim_token")
                params = {
                    **numbered_params("id", [pk for pk, _, _ in mine]),
                    # As UUIDField stores it: 32 hex characters on MySQL, the
                    # native UUID type on MariaDB 10.7+.
                    **numbered_params(
                        "token",
                        [token_field.get_db_prep_value(t, self.connection) for _, t, _ in mine],
                    ),
                    **numbered_params("result", [result for _, _, result in mine]),
                }
                cursor.execute(succeed_update_sql(len(mine)), params)
                if cursor.rowcount != len(mine):
                    # The rows are locked by this transaction; anything else is a bug.
                    raise RuntimeError(
                        f"recorded {cursor.rowcount} of {len(mine)} locked successes"
                    )
                return [(pk, token, linked[pk, token]) for pk, token in held]

        return self._retrying(attempt, "recording successes")

    # -- enqueue ------------------------------------------------------------------

    def insert_item(
        self,
        item: WorkItem,
        *,
        run_after: datetime | timedelta | None,
        payload_json: str | None,
    ) -> bool:
        # One statement, as on PostgreSQL: in autocommit one round trip and
        # one commit, without the ORM compiling the model's every field.
        if not self._returns_inserted_rows():
            return False  # no INSERT ... RETURNING: Django's save()
        params = self._insert_params(item, run_after)
        params["payload_0"] = payload_json
        with self.connection.cursor() as cursor:
            cursor.execute(insert_items_sql(1), params)
            rows = cursor.fetchall()
        self.notify([item.queue], item.priority)
        self._assign(rows, [item])
        return True

    def insert_items(
        self,
        items: Sequence[WorkItem],
        *,
        run_after: datetime | timedelta | None,
        payloads_json: Sequence[str | None],
    ) -> bool:
        # Django's bulk_create spends about 80% of a 10,000-row batch
        # compiling every value of every row (docs/internals/benchmarks.md, W2).
        if not self._returns_inserted_rows():
            return False  # no INSERT ... RETURNING: Django's bulk_create
        connection: Any = self.connection
        first = items[0]
        shared = self._insert_params(first, run_after)
        rows: list[tuple[Any, ...]] = []
        # All or nothing: one transaction in autocommit; a savepoint inside
        # the caller's transaction (an atomic block, or AUTOCOMMIT off, where
        # nothing but a savepoint would take back the statements that
        # succeeded), so the caller's transaction stays usable, as it does
        # around Django's bulk_create.
        with transaction.atomic(using=self.using), connection.cursor() as cursor:
            for chunk in insert_chunks(payloads_json):
                cursor.execute(
                    insert_items_sql(len(chunk)), {**shared, **numbered_params("payload", chunk)}
                )
                rows.extend(cursor.fetchall())
            self.notify([first.queue], first.priority)
        self._assign(rows, items)
        return True

    def _returns_inserted_rows(self) -> bool:
        """MariaDB has ``INSERT ... RETURNING`` (10.5+); MySQL 8 does not."""
        connection: Any = self.connection
        connection.ensure_connection()
        return bool(connection.mysql_is_mariadb)

    def _insert_params(
        self, first: WorkItem, run_after: datetime | timedelta | None
    ) -> dict[str, Any]:
        """The parameters the inserted rows share (all but the payload)."""
        return {
            "handler": first.handler,
            "queue": first.queue,
            "priority": first.priority,
            "run_at": (
                self.connection.ops.adapt_datetimefield_value(run_after)
                if isinstance(run_after, datetime)
                else None
            ),
            "delay_us": run_after // MICROSECOND if isinstance(run_after, timedelta) else 0,
            "max_attempts": first.max_attempts,
            "trace_context": json.dumps(first.trace_context or {}),
            "concurrency_key": first.concurrency_key,
            "concurrency_limit": first.concurrency_limit,
            "fair_key": first.fair_key,
        }

    def _read_committed(self) -> Any:
        """A transaction of its own (or the caller's), at READ COMMITTED.

        Django's MySQL backend sets READ COMMITTED on every session unless
        the project's OPTIONS choose another level; then the next
        transaction is set to it here. Under REPEATABLE READ the claim's
        locking read would take gap locks on the index it scans and block
        enqueues; the read-back would see an old snapshot. Inside a
        caller's transaction (``run_until_empty`` in a test) its level stays.
        """
        connection: Any = self.connection
        if connection.in_atomic_block:
            # No savepoint, as PostgreSQL's one-statement claim has none: an
            # error breaks the caller's transaction (a deadlock rolls all of
            # it back on MySQL anyway).
            return transaction.atomic(using=self.using, savepoint=False)
        # Django sets ``isolation_level`` when it connects. AUTOCOMMIT off: one is open.
        connection.ensure_connection()
        if connection.isolation_level != "read committed" and connection.get_autocommit():
            with connection.cursor() as cursor:
                cursor.execute(SET_READ_COMMITTED.sql)
        return transaction.atomic(using=self.using)

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        return self._retrying(fn, what)

    @contextmanager
    def bounded_lock_wait(self, seconds: float) -> Iterator[None]:
        with self.connection.cursor() as cursor:
            cursor.execute(SET_LOCK_WAIT.sql, {"seconds": max(1, math.ceil(seconds))})
        try:
            yield
        except BaseException:
            with suppress(Exception):  # the block's error says more (a lost connection)
                self._restore_lock_wait()
            raise
        self._restore_lock_wait()

    def _restore_lock_wait(self) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute(RESTORE_LOCK_WAIT.sql)

    def ending_transaction(self) -> Any:
        # Reads after a lock (a rate window's starts, a batch's rows) are plain
        # reads: at READ COMMITTED they see what the lock's previous holder committed.
        return self._read_committed()

    def _retrying(self, fn: Callable[[], T], what: str) -> T:
        """Run the transaction ``fn`` again when a deadlock or lock wait timeout ended it.

        MySQL rolls back the whole transaction on a deadlock (and the
        statement on a lock wait timeout, which ``atomic`` then rolls back):
        nothing of the attempt stays, so running it again cannot claim or
        record twice. Inside a caller's transaction the error is the
        caller's, and is raised (a deadlock rolled back their work too).
        """
        for attempt in range(LOCK_RETRIES + 1):
            try:
                return fn()
            except OperationalError as exc:
                if (
                    not is_lock_conflict(exc)
                    or attempt == LOCK_RETRIES
                    or self.connection.in_atomic_block
                ):
                    raise
                delay = random.uniform(0.0, min(0.5, 0.01 * 2**attempt))
                logger.info("%s: %s; trying again in %.3fs.", what.capitalize(), exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    @contextmanager
    def locked_in_id_order(self, ids: Collection[int]) -> Iterator[None]:
        # The fenced UPDATEs of heartbeats and releases filter on status too,
        # and the optimizer may run them through dbworker_status_idx
        # (status, id DESC): in descending id order, against the success
        # writer's ascending one, a deadlock. Locked here first by primary
        # key, the rows are this transaction's before the UPDATE reads any.
        ordered = sorted(set(ids))
        with self._read_committed():
            if ordered:
                with self.connection.cursor() as cursor:
                    cursor.execute(lock_rows_sql(len(ordered)), numbered_params("id", ordered))
            yield

    def heartbeat(self, claims: Collection[tuple[int, UUID]]) -> list[tuple[int, UUID, bool]]:
        ids = sorted({pk for pk, _ in claims})
        if not ids:
            return []
        wanted = set(claims)
        with self._read_committed(), self.connection.cursor() as cursor:
            cursor.execute(heartbeat_lock_sql(len(ids)), numbered_params("id", ids))
            held = [
                (pk, as_uuid(token), bool(requested))
                for pk, token, requested in cursor.fetchall()
                if token is not None and (pk, as_uuid(token)) in wanted
            ]
            if held:
                WorkItem.objects.using(self.using).filter(pk__in=[pk for pk, _, _ in held]).update(
                    heartbeat_at=Now()
                )
        return held

    # -- statistics --------------------------------------------------------------

    def distinct_queues(self) -> list[str]:
        return [name for (name,) in self._fetch(DISTINCT_QUEUES.sql)]

    def estimate_count(self, queryset: QuerySet[Any]) -> int | None:
        sql, params = queryset.order_by().query.get_compiler(using=self.using).as_sql()
        with self.connection.cursor() as cursor:
            cursor.execute(ESTIMATE_COUNT.render(query=sql), params)
            names = [col[0].lower() for col in cursor.description]
            rows = cursor.fetchall()
        if not rows or "rows" not in names:
            return None
        first = rows[0]
        estimate = float(first[names.index("rows")] or 0)
        # MySQL 8 also says which share of those rows pass the WHERE.
        if "filtered" in names and first[names.index("filtered")] is not None:
            estimate *= float(first[names.index("filtered")]) / 100.0
        return int(estimate)
