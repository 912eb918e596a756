"""PostgreSQL: the operations that run its statements (``postgresql_sql.py``).

One-statement ``FOR UPDATE SKIP LOCKED`` claims (and the keyed claim's two statements in a
READ COMMITTED transaction, ``postgresql_keyed_sql.py``), batched fenced successes, inserts that
carry their own NOTIFY or, with WAKEUP_WINDOW, send it after the commit (``wake_window.py``;
a large batch goes in by COPY), LISTEN wake-ups (``postgresql_listen.py``) and planner
estimates. The claims and the success writes bind their array parameters on the server, on
a psycopg cursor that Django wraps as its own; the enqueue statements do where the
connection allows prepared statements. This module writes no SQL: every text it runs is a
named statement of ``postgresql_sql.py`` (the keyed claim's: ``postgresql_keyed_sql.py``).
Nothing outside the db package imports it (``operations()`` is the way in).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from django.db import transaction
from django.db.backends.postgresql.psycopg_any import IsolationLevel, register_tzloader
from django.db.backends.utils import CursorWrapper
from django.db.models import Q, QuerySet
from psycopg.pq import Format

from django_dbworker.db.base import (
    Claimed,
    Turn,
    Turns,
    VendorOperations,
    as_uuid,
    fair_filtered,
)
from django_dbworker.db.expressions import JsonScalar
from django_dbworker.db.keys import capped, current_limits
from django_dbworker.db.postgresql_keyed_sql import (
    CLAIM_WITHIN_LIMITS,
    HEADS_PLAN,
    READ_COMMITTED,
    TRANSACTION_ISOLATION,
    WALK_FOR,
    candidates_statement,
    heads_statement,
)
from django_dbworker.db.postgresql_listen import PostgresSubscription
from django_dbworker.db.postgresql_sql import (
    CLAIM_PLAN,
    COPY_ITEMS,
    DISTINCT_QUEUES,
    ESTIMATE_COUNT,
    HEARTBEAT,
    INSERT_ITEM,
    INSERT_ITEM_QUIET,
    INSERT_ITEMS,
    INSERT_ITEMS_QUIET,
    LOCAL_LOCK_TIMEOUT,
    LOCK_ROWS,
    NOTIFY,
    RESERVE_IDS,
    RUN_TIMES,
    SUCCEED_MANY,
    TABLE_ESTIMATE,
    claim_statement,
    fair_claim_statement,
    index_ordered,
)
from django_dbworker.db.postgresql_text import (
    copy_nullable,
    copy_payload,
    copy_text,
    parse_text_array,
)
from django_dbworker.db.types import ColumnStats, RunTimes, TableEstimate, UnsupportedDatabase
from django_dbworker.db.wake_window import IN_TRANSACTION, OFF, mode, wake_after_commit
from django_dbworker.db.wakers import wake_payload
from django_dbworker.models import WorkItem

#: ``server_version_num`` of PostgreSQL 13 (gen_random_uuid() in core).
MIN_VERSION = 130000

#: Batches of at least this many items go in by COPY (``insert_items``). The
#: COPY path costs four more round trips (a transaction, the id reservation,
#: the NOTIFY); measured, it breaks even at 20 to 50 rows, takes about 80% of
#: the one-statement insert's time at 100 to 200 rows and 55% at 1,000 and
#: more (docs/internals/benchmarks.md, W2).
COPY_THRESHOLD = 100

#: Rows per chunk of COPY data.
COPY_CHUNK = 1000

#: The type whose loader Django sets to its time zone (``create_cursor``).
#: Where a connection (a ``DatabaseWrapper``, one per thread) keeps the psycopg
#: cursors of ``_binding_cursor``, by cursor class: (raw connection, time zone, cursor).
_KEPT_CURSORS = "_dbworker_kept_cursors"
TIMESTAMPTZ_OID = psycopg.adapters.types["timestamptz"].oid

# -- operations ---------------------------------------------------------------------


class PostgresOperations(VendorOperations):
    vendor = "postgresql"
    supports_notify = True
    supports_skip_locked = True
    # LISTEN wakes the workers: nothing to poll for.
    poll_adaptively = False
    #: Until when (time.monotonic()) the keyed claim walks without trying the heads.
    _walk_keys_until = 0.0

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
        limits: Mapping[str, int] | None = None,
        keyed_cap: int | None = None,
        turn: Turn | None = None,
    ) -> Claimed[WorkItem]:
        if limits:
            return self._claim_keyed(
                limit=limit,
                handlers=handlers,
                queues=queues,
                worker=worker,
                limits=limits,
                keyed_cap=keyed_cap,
                turn=turn,
            )
        sql, params = claim_statement(limit=limit, handlers=handlers, queues=queues, worker=worker)
        if turn is not None:
            sql, params = fair_filtered(sql, turn), {**params, **turn.params()}
        return self._claimed(sql, params)

    def _claim_plain_turns(
        self, *, turns: Turns, handlers: Sequence[str], queues: Sequence[str] | None, worker: str
    ) -> Claimed[WorkItem]:
        return self._claimed(
            *fair_claim_statement(turns=turns, handlers=handlers, queues=queues, worker=worker)
        )

    def _claimed(self, sql: str, params: dict[str, Any]) -> Claimed[WorkItem]:
        """The rows the plain claim ``sql`` takes."""
        connection = self.connection
        if index_ordered(sql) and connection.get_autocommit() and not connection.in_atomic_block:
            # An implicit transaction of its own: CLAIM_PLAN's settings end with it.
            return self._rows_to_items(self._fetch_last(CLAIM_PLAN.sql + sql, params))
        # Inside a caller's transaction the settings would outlive the claim: as planned.
        return self._rows_to_items(self._fetch_bound(sql, params))

    def _claim_keyed(
        self,
        *,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        worker: str,
        limits: Mapping[str, int],
        keyed_cap: int | None,
        turn: Turn | None,
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
            found = self._candidates(limit, handlers, queues, limits, pin=level_on_begin, turn=turn)
            if not found:
                return Claimed()
            # Each row carries how many rows the statement locked (some held back by keys).
            locked = found[0][-1]
            # Past the cap: left pending, locked until this claim commits (``throttled``).
            chosen = capped(current_limits([row[:-1] for row in found], limits), keyed_cap)
            if not chosen:
                return Claimed(throttled=locked)
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
        return Claimed(self._rows_to_items(rows), throttled=locked - len(rows))

    def _candidates(
        self,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        limits: Mapping[str, int],
        *,
        pin: bool,
        turn: Turn | None,
    ) -> list[tuple[Any, ...]]:
        """The keyed claim's candidates, locked: the free keys' heads (``CLAIM_HEADS``: every
        handler limited, no ready row without a key; HEADS_PLAN first where the claim's BEGIN
        opened the transaction), else the walk; past KEYS_WALKED keys, for WALK_FOR seconds.
        A turn of the fair rotation (``turn``) walks: the heads span every fair key."""
        heads = heads_statement(limit=limit, handlers=handlers, queues=queues, limits=limits)
        if heads is not None and turn is None and time.monotonic() >= self._walk_keys_until:
            sql, params = heads
            fetch = self._fetch_last if pin else self._fetch_bound
            found = fetch(HEADS_PLAN.sql + sql if pin else sql, params)
            if found and found[-1][0] is not None:  # the heads
                return found
            mark = found[-1][-1] if found else 2
            if mark == 2:  # no free key's head to take
                return []
            if mark == 1:  # many keys, not a row without a key: the walk for a while
                self._walk_keys_until = time.monotonic() + WALK_FOR
        sql, params = candidates_statement(
            limit=limit, handlers=handlers, queues=queues, limits=limits
        )
        if turn is not None:
            sql, params = fair_filtered(sql, turn), {**params, **turn.params()}
        return self._fetch_bound(sql, params)

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

    @contextmanager
    def bounded_lock_wait(self, seconds: float) -> Iterator[None]:
        with transaction.atomic(using=self.using):
            with self.connection.cursor() as cursor:
                cursor.execute(
                    LOCAL_LOCK_TIMEOUT.sql, {"timeout": f"{max(1, round(seconds * 1000))}ms"}
                )
            yield

    def ending_transaction(self) -> AbstractContextManager[Any]:
        """A transaction at READ COMMITTED, whatever OPTIONS, the session or the server
        default say: an ending's reads after its lock must see what the lock's previous
        holder committed. Inside a caller's transaction, the caller's level stays."""
        connection = self.connection
        if connection.in_atomic_block or not connection.get_autocommit():
            # Inside a caller's transaction (or AUTOCOMMIT off: always inside one).
            return transaction.atomic(using=self.using)
        return self._read_committed_transaction()

    def succeed_rows(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> list[tuple[int, UUID, bool]]:
        if not outcomes:
            return []
        params = {
            "ids": [pk for pk, _, _ in outcomes],
            "tokens": [token for _, token, _ in outcomes],
            "results": [result for _, _, result in outcomes],
        }
        rows = self._fetch_bound(SUCCEED_MANY.sql, params)
        return [(pk, as_uuid(token), linked) for pk, token, linked in rows]

    @contextmanager
    def locked_in_id_order(self, ids: Collection[int]) -> Iterator[None]:
        # The bulk writers of claimed rows lock them in the plan's order (the
        # table's) unless locked first: against the id order of the heartbeat
        # and the success write, a deadlock (tests/integration/test_postgres_lock_order.py).
        ordered = sorted(set(ids))
        with transaction.atomic(using=self.using, savepoint=False):
            if ordered:
                self._fetch_bound(LOCK_ROWS.sql, {"ids": ordered})
            yield

    def heartbeat(self, claims: Collection[tuple[int, UUID]]) -> list[tuple[int, UUID, bool]]:
        params = {"ids": [pk for pk, _ in claims], "tokens": [token for _, token in claims]}
        return [
            (pk, as_uuid(token), bool(requested))
            for pk, token, requested in self._fetch_bound(HEARTBEAT.sql, params)
        ]

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

    def _fetch_last(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """The rows of the last of several statements sent in one message (``CLAIM_PLAN``).

        A ``ClientCursor``: parameters quoted into the text, which goes as one
        simple-protocol message (server-side binding takes one statement per
        message). Outside a transaction block the server runs the statements as
        one implicit transaction.
        """
        with self._binding_cursor(psycopg.ClientCursor) as cursor:
            cursor.execute(sql, params or None)
            while cursor.nextset():
                pass
            return list(cursor.fetchall()) if cursor.description else []

    def insert_item(
        self,
        item: WorkItem,
        *,
        run_after: datetime | timedelta | None,
        payload_json: str | None,
    ) -> bool:
        # One round trip and, in autocommit, one commit: the INSERT and the
        # NOTIFY run as one statement (WAKEUP_WINDOW 0; else it follows).
        params = self._insert_params(item, run_after)
        params["payload"] = payload_json
        wakes = mode()
        with self._insert_cursor() as cursor:
            cursor.execute(
                (INSERT_ITEM if wakes == IN_TRANSACTION else INSERT_ITEM_QUIET).sql, params
            )
            rows = cursor.fetchall()
        self._assign(rows, [item])
        if wakes != IN_TRANSACTION:
            self._wake(wakes, item.queue, item.priority)
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
        wakes = mode()
        with self._insert_cursor() as cursor:
            cursor.execute(
                (INSERT_ITEMS if wakes == IN_TRANSACTION else INSERT_ITEMS_QUIET).sql, params
            )
            rows = cursor.fetchall()
        self._assign(rows, items)
        if wakes != IN_TRANSACTION:
            self._wake(wakes, items[0].queue, items[0].priority)
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
                    copy_text(params["handler"]),
                    copy_text(params["queue"]),
                    "pending",
                    str(params["priority"]),
                    run_after_value.isoformat(),
                    "0",
                    str(params["max_attempts"]),
                    "",
                    "",
                    copy_text(params["trace_context"]),
                    copy_nullable(params["concurrency_key"]),
                    copy_nullable(params["concurrency_limit"]),
                    copy_nullable(params["fair_key"]),
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
                            [f"{pk}\t{copy_payload(payload)}\t{shared}\n" for pk, payload in rows]
                        )
                    )
            if (wakes := mode()) == IN_TRANSACTION:
                cursor.execute(NOTIFY.sql, {"wake": params["wake"]})
            else:  # on the commit of this transaction (or the caller's)
                self._wake(wakes, params["queue"], params["priority"])
        self._assign([(pk, run_after_value, now, now) for pk in ids], items)

    def _insert_cursor(self) -> AbstractContextManager[CursorWrapper]:
        """A cursor for the enqueue statements: prepared where the connection allows it.

        Django's psycopg backend uses a ``ClientCursor`` unless told otherwise:
        parameters are quoted into the text, the server parses and plans it
        on every call, and such a cursor is never prepared. Parsing and
        planning are a good part of a single enqueue's cost (about 80 µs of
        450 on the development machine, docs/internals/benchmarks.md, W2). Where the
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
            # Django's own cursor class (the connection's cursor_factory), as
            # ``connection.cursor()`` would create it.
            return self._binding_cursor(None)
        return self._binding_cursor()

    @contextmanager
    def _binding_cursor(
        self, cursor_class: type[psycopg.Cursor[Any]] | None = psycopg.Cursor
    ) -> Iterator[CursorWrapper]:
        """A ``psycopg.Cursor`` of this alias's connection, wrapped as Django wraps its own.

        Parameters are bound on the server (and the statement prepared if
        the connection's ``prepare_threshold`` allows); ``cursor_class``
        None: the connection's own ``cursor_factory`` (Django's client-side
        binding cursor). Query logging, execute wrappers, error translation
        and the broken-transaction check apply as to Django's cursors, and
        timestamps load in the connection's time zone as
        ``DatabaseWrapper.create_cursor`` arranges.

        The psycopg cursor is kept for the connection's next statement
        rather than closed: a new cursor starts with no dumpers and loaders,
        and finding them again for a dozen parameters and the returned
        timestamps was about a third of a single enqueue's client CPU
        (docs/internals/benchmarks.md, W2). It is kept per connection (so per
        thread), for one raw connection and one time zone: a reconnected
        or re-zoned connection gets a new one; and it is dropped after an
        error, which may leave it mid-result.
        """
        connection = self.connection
        connection.ensure_connection()
        raw = connection.connection
        kept: dict[Any, tuple[Any, Any, Any]] = connection.__dict__.setdefault(_KEPT_CURSORS, {})
        entry = kept.get(cursor_class)
        if entry is not None and entry[0] is raw and entry[1] == connection.timezone:
            cursor = entry[2]
        else:
            with connection.wrap_database_errors:
                # Any: django-stubs types make_cursor's argument as a CursorWrapper.
                cursor = raw.cursor() if cursor_class is None else cursor_class(raw)
                loader = raw.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT)
                if connection.timezone != getattr(loader, "timezone", None):
                    register_tzloader(connection.timezone, cursor)
            kept[cursor_class] = (raw, connection.timezone, cursor)
        connection.validate_thread_sharing()
        try:
            if connection.queries_logged:
                yield connection.make_debug_cursor(cursor)
            else:
                yield connection.make_cursor(cursor)
        except BaseException:
            kept.pop(cursor_class, None)
            with suppress(psycopg.Error):  # the connection is gone: nothing to tidy
                cursor.close()
            raise

    def _insert_params(
        self, first: WorkItem, run_after: datetime | timedelta | None
    ) -> dict[str, Any]:
        """The parameters the inserted rows share (all but the payload)."""
        return {
            "handler": first.handler,
            "queue": first.queue,
            "priority": first.priority,
            "wake": wake_payload(first.queue, first.priority),
            "run_at": run_after if isinstance(run_after, datetime) else None,
            "delay": run_after if isinstance(run_after, timedelta) else timedelta(0),
            "max_attempts": first.max_attempts,
            "trace_context": json.dumps(first.trace_context or {}),
            "concurrency_key": first.concurrency_key,
            "concurrency_limit": first.concurrency_limit,
            "fair_key": first.fair_key,
        }

    def notify(self, queues: Sequence[str], priority: int = 0) -> None:
        # Delivered only if (and when) the enclosing transaction commits,
        # savepoint rollbacks included.
        if (wakes := mode()) != IN_TRANSACTION:
            for queue in sorted(set(queues)):
                self._wake(wakes, queue, priority)
            return
        with self.connection.cursor() as cursor:
            for queue in sorted(set(queues)):
                cursor.execute(NOTIFY.sql, {"wake": wake_payload(queue, priority)})

    def _wake(self, wakes: str, queue: str, priority: int) -> None:
        """The wake-up of a committed (or committing) enqueue, but inside it (``wake_window``)."""
        if wakes == OFF:  # this process's workers only (they do not LISTEN)
            super().notify([queue], priority)
            return

        def send() -> None:
            with self.connection.cursor() as cursor:
                cursor.execute(NOTIFY.sql, {"wake": wake_payload(queue, priority)})

        wake_after_commit(self.connection, self.using, queue, priority, send)

    def listen(self) -> PostgresSubscription:
        return PostgresSubscription(self.connection)

    # -- statistics for the admin and the stats ----------------------------------

    def distinct_queues(self) -> list[str]:
        return [name for (name,) in self._fetch(DISTINCT_QUEUES.sql)]

    def payload_matches(self, leaves: Sequence[tuple[tuple[str, ...], JsonScalar]]) -> Q:
        """``payload @> {...}``: the leaves as one JSON object that the payload contains.

        For scalar leaves containment is equality at each path (``{"k": [5]}``
        does not contain ``{"k": 5}``: the array exception of ``@>`` holds only
        at the top level), so the answer is ``JsonEquals``'s on the other
        databases. A GIN index on ``payload`` (``jsonb_path_ops``) serves it.
        """
        document: dict[str, Any] = {}
        for path, value in leaves:
            node = document
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        return Q(payload__contains=document)

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
            parsed = parse_text_array(values) if values else []
            distinct = float(n_distinct or 0)
            if distinct < 0:  # a negative n_distinct is a fraction of the rows
                distinct = -distinct * reltuples
            stats[name] = ColumnStats(dict(zip(parsed, freqs or [], strict=False)), distinct)
        if set(stats) != set(columns):
            return None
        return TableEstimate(reltuples, stats)
