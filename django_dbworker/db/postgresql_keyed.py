"""PostgreSQL's keyed claims: the transaction that honours per-key concurrency limits.

Two statements in one READ COMMITTED transaction (``postgresql_keyed_sql.py`` says what
each does and why): the candidates, locked with their keys, then CLAIM_WITHIN_LIMITS,
which counts the keys' slots after the locks. The candidates are the free keys' heads,
or the walk's next ready rows. ``succeed_and_transfer``: a success write that claims the
next rows of the keys it frees. ``PostgresOperations`` inherits this class and runs the
statements.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.backends.postgresql.psycopg_any import IsolationLevel

from django_dbworker.db.base import Claimed, as_uuid, current_limits
from django_dbworker.db.postgresql_estimates import PostgresEstimates
from django_dbworker.db.postgresql_keyed_sql import (
    CLAIM_WITHIN_LIMITS,
    CLAIMED_FOR_KEYS,
    HEADS_PLAN,
    READ_COMMITTED,
    REGISTER_BOUNDED,
    TRANSACTION_ISOLATION,
    WALK_FOR,
    candidates_statement,
    heads_statement,
    succeed_and_transfer_statement,
)
from django_dbworker.db.types import UnsupportedDatabase
from django_dbworker.models import WorkItem


class PostgresKeyedClaims(PostgresEstimates):
    supports_key_handover = True
    #: Until when (time.monotonic()) the keyed claim walks without trying the heads.
    _walk_keys_until = 0.0

    def _fetch_bound(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # PostgresOperations

    def _fetch_last(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # PostgresOperations

    def succeed_and_transfer(
        self,
        outcomes: Sequence[tuple[int, UUID, str | None]],
        *,
        limit: int,
        queues: Sequence[str] | None,
        worker: str,
        limits: Mapping[str, int],
        adopt: bool = False,
    ) -> tuple[list[tuple[int, UUID, bool]], list[WorkItem]]:
        """``succeed_rows``; the keys of limit 1 among ``limits`` pass their slots on (a limit
        above 1 could be exceeded: ``worker/handover.py``); ``adopt``: see CLAIMED_FOR_KEYS."""
        if not outcomes:
            return [], []
        limits = {handler: 1 for handler, limit in limits.items() if limit == 1}
        sql, params = succeed_and_transfer_statement(
            outcomes=outcomes, limit=limit, queues=queues, limits=limits, worker=worker
        )
        connection = self.connection
        if connection.get_autocommit() and not connection.in_atomic_block:
            found = self._fetch_last(HEADS_PLAN.sql + sql, params)
        else:
            found = self._fetch_bound(sql, params)
        recorded = [(row[1], as_uuid(row[10]), bool(row[13])) for row in found if not row[0]]
        claimed = [row[1:] for row in found if row[0]]
        if adopt:  # a retry: also what a write whose answer was lost claimed for them
            ids = {row[0] for row in claimed}
            held = self._fetch_bound(CLAIMED_FOR_KEYS.sql, {"worker": worker, "ids": params["ids"]})
            claimed += [row for row in held if row[0] not in ids]
        return recorded, self._rows_to_items(claimed)

    def _claim_keyed(
        self,
        *,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        worker: str,
        limits: Mapping[str, int],
    ) -> Claimed[WorkItem]:
        """The claim that honours concurrency keys: the heads of free keys, or the walk."""
        connection = self.connection
        own = not connection.in_atomic_block
        # The slot count must see the claims committed by the key's previous lock holder:
        # REPEATABLE READ or SERIALIZABLE (the connection's OPTIONS, the server's default)
        # would count in the first snapshot and over-claim. In autocommit the level rides on
        # psycopg's BEGIN. In a caller's transaction no savepoint, as the plain claim has none.
        level_on_begin = own and connection.get_autocommit()
        with (
            self._read_committed_transaction()
            if level_on_begin
            else transaction.atomic(using=self.using, savepoint=False)
        ):
            if own and not level_on_begin:
                with connection.cursor() as cursor:
                    cursor.execute(READ_COMMITTED.sql)
            elif not own:
                self._refuse_snapshot_isolation(connection)
            found, pending_keys = self._candidates(
                limit, handlers, queues, limits, pin=level_on_begin
            )
            if not found:
                return Claimed(pending_keys=pending_keys)
            # Each row carries how many rows the statement locked (some held back by keys).
            locked = found[0][-1]
            chosen = current_limits([row[:-1] for row in found], limits)
            columns = list(zip(*chosen, strict=True))
            rows = self._fetch_bound(
                CLAIM_WITHIN_LIMITS.sql,
                {
                    "worker": worker,
                    "ids": list(columns[0]),
                    "handlers": list(columns[1]),
                    "keys": list(columns[2]),
                    "limits": list(columns[3]),
                },
            )
        return Claimed(
            self._rows_to_items(rows), throttled=locked - len(rows), pending_keys=pending_keys
        )

    def _candidates(
        self,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        limits: Mapping[str, int],
        *,
        pin: bool,
    ) -> tuple[list[tuple[Any, ...]], int | None]:
        """The keyed claim's candidates, locked: the free keys' heads (``CLAIM_HEADS``: every
        handler limited, no ready row without a key; HEADS_PLAN first where the claim's BEGIN
        opened the transaction), else the walk; past KEYS_WALKED keys, for WALK_FOR seconds.
        With the pending keys the heads counted (None: the walk counts none)."""
        heads = heads_statement(limit=limit, handlers=handlers, queues=queues, limits=limits)
        if heads is not None and time.monotonic() >= self._walk_keys_until:
            sql, params = heads
            fetch = self._fetch_last if pin else self._fetch_bound
            found = fetch(HEADS_PLAN.sql + sql if pin else sql, params)
            if found and found[-1][0] is not None:  # the heads, with the keys counted
                return [row[:4] + row[5:] for row in found], found[0][4]
            mark = found[-1][-1] if found else 2
            if mark == 2:  # no free key's head to take
                return [], found[-1][4] if found else None
            if mark == 1:  # many keys, not a row without a key: the walk for a while
                self._walk_keys_until = time.monotonic() + WALK_FOR
        walk = candidates_statement(limit=limit, handlers=handlers, queues=queues, limits=limits)
        return self._fetch_bound(*walk), None

    @contextmanager
    def register_transaction(self) -> Iterator[None]:
        """A transaction for the register of live workers whose statements give up soon,
        lock waits included (REGISTER_BOUNDED)."""
        with transaction.atomic(using=self.using):
            with self.connection.cursor() as cursor:
                cursor.execute(REGISTER_BOUNDED.sql)
            yield

    @contextmanager
    def _read_committed_transaction(self) -> Iterator[None]:
        # The level rides on psycopg's own BEGIN: no statement, no round trip more.
        connection = self.connection
        connection.ensure_connection()
        raw = connection.connection
        previous = raw.isolation_level

        def restore() -> None:
            if not raw.closed and raw.isolation_level != previous:
                raw.isolation_level = previous

        raw.isolation_level = IsolationLevel.READ_COMMITTED
        try:
            with transaction.atomic(using=self.using):
                # First of the commit's callbacks: a transaction that a later one
                # opens (a receiver of the callback row's save) runs at the
                # project's level again.
                transaction.on_commit(restore, using=self.using)
                yield
        finally:
            restore()

    def _refuse_snapshot_isolation(self, connection: Any) -> None:
        """Refuse the keyed claim in a caller's transaction stricter than READ COMMITTED."""
        with connection.cursor() as cursor:
            cursor.execute(TRANSACTION_ISOLATION.sql)
            (level,) = cursor.fetchone()
        if level != "read committed":
            raise UnsupportedDatabase(
                f"the keyed claim (concurrency_limit) needs READ COMMITTED; the caller's "
                f"transaction is {level.upper()}, whose snapshot would count a key's slots "
                "before the previous claimer's commit. Claim outside that transaction."
            )
