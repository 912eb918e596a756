"""The interface every database vendor implements, and what the vendors' operations share.

A vendor is a statements module (named ``Statement`` constants, complete
SQL read top to bottom: ``postgresql_sql.py``, ``mysql_sql.py``) and an
operations module with a ``VendorOperations`` subclass that runs them
(``postgresql.py``, ``mysql.py``; ``sqlite.py`` holds both, being short).
This module holds no SQL; it decodes claimed rows into ``WorkItem``
instances the same way for every vendor, inserts' wake-ups of this
process's workers included. The types the interface speaks in live in
``types.py``, the ``Statement`` type in ``sql.py``, the local wake-ups in
``wakers.py``; their names are importable from here too. It must not
import from the worker, the admin or enqueuing: they call it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from typing import Any, ClassVar, TypeVar
from uuid import UUID

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Q, QuerySet
from django.db.models.base import ModelState
from django.db.models.functions import Now

from django_dbworker.db.expressions import JsonEquals, JsonScalar
from django_dbworker.db.sql import (
    CLAIM_COLUMNS,
    INSERTED_COLUMNS,
    Statement,
    Turn,
    Turns,
    fair_filtered,
    numbered,
    numbered_params,
)
from django_dbworker.db.types import (
    Claimed,
    ColumnStats,
    RunTimes,
    ServerProblem,
    Subscription,
    TableEstimate,
    UnsupportedDatabase,
    percentile,
)
from django_dbworker.db.wakers import (
    add_local_waker,
    has_local_wakers,
    remove_local_waker,
    wake_local,
)
from django_dbworker.models import Status, WorkItem

logger = logging.getLogger("django_dbworker.worker")

__all__ = [
    "CAPABILITIES",
    "CLAIM_COLUMNS",
    "INSERTED_COLUMNS",
    "Claimed",
    "ColumnStats",
    "RunTimes",
    "ServerProblem",
    "Statement",
    "Subscription",
    "TableEstimate",
    "Turn",
    "Turns",
    "UnsupportedDatabase",
    "VendorOperations",
    "add_local_waker",
    "as_uuid",
    "fair_filtered",
    "numbered",
    "numbered_params",
    "percentile",
    "remove_local_waker",
    "wake_local",
]

T = TypeVar("T")


def as_uuid(value: Any) -> UUID:
    """A claim token as the driver returns it (a UUID, or hex text on SQLite)."""
    return value if isinstance(value, UUID) else UUID(str(value))


Converter = Callable[[Any, Any, BaseDatabaseWrapper], Any]

#: What every vendor class must say about its database (class attributes).
CAPABILITIES = ("vendor", "supports_notify", "supports_skip_locked", "poll_adaptively")


class VendorOperations(ABC):
    """Vendor-specific database operations for one connection alias.

    The rest of the package calls these and never looks at
    ``connection.vendor`` or ``connection.features`` itself, so a new
    database (MySQL) is one new subclass with its own statements. A
    subclass implements the abstract methods and states every capability
    (``CAPABILITIES``) itself: none has a default, so a new vendor cannot
    inherit an answer it never gave.
    """

    #: Django's ``connection.vendor`` of the databases this class runs on.
    vendor: ClassVar[str]
    #: Whether ``listen`` can deliver wake-ups across processes.
    supports_notify: ClassVar[bool]
    #: Whether ``SELECT ... FOR UPDATE SKIP LOCKED`` exists (``claim_next`` asks).
    supports_skip_locked: ClassVar[bool]
    #: Whether the idle claim loop should poll often for a while after work
    #: (``worker.wakeup.AdaptivePoll``): only without ``listen`` wake-ups, and
    #: only where a claim that finds nothing is cheap and locks nothing.
    poll_adaptively: ClassVar[bool]
    #: Seconds a rate window is counted beyond its period (``flow/rates.py``). A
    #: claim counts as the row's start, but the handler starts a few
    #: milliseconds later (the claim's commit, dispatch to a thread), and the
    #: claims that follow a full window come in bursts as the window's earliest
    #: starts leave it: without an allowance, two bursts one period apart at the
    #: claim could start less than one period apart in the handlers. 20 ms costs
    #: 2% of a "N/s" limit's throughput and nothing measurable of "N/m" or "N/h".
    rate_allowance: ClassVar[float] = 0.02

    @property
    def max_json_depth(self) -> int | None:
        """The deepest nesting of JSON arrays and objects the database stores (None: no
        limit worth checking before the write)."""
        return None

    def __init__(self, using: str) -> None:
        missing = [name for name in CAPABILITIES if not hasattr(type(self), name)]
        if missing:
            raise TypeError(f"{type(self).__qualname__} does not say its {', '.join(missing)}")
        self.using = using
        self._converters: list[tuple[int, list[Converter], Any]] | None = None
        self._inserted_converters: list[tuple[int, list[Converter], Any]] | None = None

    @property
    def connection(self) -> BaseDatabaseWrapper:
        # Looked up on each use: Django's connections are per thread.
        return connections[self.using]

    # -- the server and its sessions --------------------------------------------

    @abstractmethod
    def check_version(self) -> None:
        """Raise ``UnsupportedDatabase`` when the server is too old."""

    def server_problems(self) -> list[ServerProblem]:
        """What is wrong with the server for django-dbworker; connects. None by default.

        For the database system checks (``checks.py``), which Django runs
        only for the aliases it is asked about.
        """
        return []

    @classmethod
    def prepare_session(cls, connection: BaseDatabaseWrapper) -> None:
        """Set up a new connection of this vendor (``connection_created``). Nothing by default.

        A class method: Django also opens connections of no alias of its
        own (test databases being created, ``_nodb_cursor``).
        """
        return

    # -- claims and outcomes -----------------------------------------------------

    @abstractmethod
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
        """Atomically move up to ``limit`` ready rows to ``claimed``; return them in claim order.

        Ready means ``pending`` with ``run_after`` passed by the database's
        clock, of one of ``handlers`` (and of ``queues`` when given), in a queue
        that is not paused; claim order is ``priority DESC, run_after, id``
        (``WorkItem.objects.ready().in_order()``). Each row gets ``attempts +
        1``, a fresh ``claim_token``, ``claimed_by = worker`` and DB-clock
        ``claimed_at``/``heartbeat_at``. Rows locked or claimed by another
        worker are skipped, never waited for and never returned twice.

        ``limits`` (handler -> its current ``concurrency_limit``): the keyed
        claim, keys held to these limits, not to the rows' stored ones, and at
        most ``keyed_cap`` rows of limited keys taken (None: no cap); rows it
        leaves for their keys or the cap are counted in ``throttled``.

        ``turn``: only the rows of one fair key and priority, a turn of the fair
        rotation (``flow/fair.py``); None: any.
        """

    def claim_turns(
        self,
        *,
        turns: Turns,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        worker: str,
        limits: Mapping[str, int] | None = None,
        keyed_cap: int | None = None,
    ) -> Claimed[WorkItem]:
        """``claim`` of each of ``turns``: up to its count of its key's rows (``keyed_cap``
        is the whole claim's, across the turns).

        A plain claim's turns all at once where the vendor can (``_claim_plain_turns``),
        else a claim per turn. A turn that fails ends the claim: with rows of earlier turns
        taken, those are returned (they are claimed: the caller must run them) and the error
        is logged.
        """
        if not limits:
            plain = self._claim_plain_turns(
                turns=turns, handlers=handlers, queues=queues, worker=worker
            )
            if plain is not None:
                return plain
        rows: list[WorkItem] = []
        throttled = 0
        for turn, count in turns.each():
            try:
                taken = self.claim(
                    limit=count,
                    handlers=handlers,
                    queues=queues,
                    worker=worker,
                    limits=limits,
                    keyed_cap=keyed_cap,
                    turn=turn,
                )
            except DatabaseError:
                if not rows:
                    raise
                # The next claim meets the same database and says so; these rows run.
                logger.warning("A fair claim stopped after %d rows.", len(rows), exc_info=True)
                break
            rows.extend(taken)
            throttled += taken.throttled
            if keyed_cap is not None:
                keyed_cap = max(0, keyed_cap - sum(1 for i in taken if i.concurrency_key))
        return Claimed(rows, throttled)

    def _claim_plain_turns(
        self, *, turns: Turns, handlers: Sequence[str], queues: Sequence[str] | None, worker: str
    ) -> Claimed[WorkItem] | None:
        """Every turn of a plain claim at once (None: this vendor claims turn by turn)."""
        return None

    def ending_transaction(self) -> AbstractContextManager[Any]:
        """A transaction whose reads after a lock see what the lock's previous holder
        committed (READ COMMITTED where the vendor can say so): an ending's, and a
        rate-limited claim's (the window is counted after the handler's lock)."""
        return transaction.atomic(using=self.using)

    def succeed_many(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> set[tuple[int, UUID]]:
        """Record ``(id, claim_token, result JSON)`` successes in one fenced UPDATE; return
        the attempts recorded. Each row matches its own id, token and ``claimed`` status:
        a re-claimed row, or a superseded attempt beside the current one, is not recorded."""
        return {(pk, token) for pk, token, _ in self.succeed_rows(outcomes)}

    @abstractmethod
    def succeed_rows(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> list[tuple[int, UUID, bool]]:
        """``succeed_many``, each attempt recorded with its row's ``has_dependents``
        as the write found it (set by an ``after=`` enqueue since the claim, too)."""

    def heartbeat(self, claims: Collection[tuple[int, UUID]]) -> list[tuple[int, UUID, bool]]:
        """Refresh ``heartbeat_at`` (DB clock) of the claimed rows of ``claims``; return them.

        ``claims`` are attempts ``(id, claim_token)``; the answer holds
        ``(id, claim_token, cancel requested)`` of the rows that are still
        claimed under one of those tokens (the caller matches each to its
        attempt). This default, for a vendor without UPDATE ... RETURNING,
        reads the rows back after the UPDATE; the vendors override it with
        one statement (or a locking read they need anyway).
        """
        rows = WorkItem.objects.using(self.using).filter(
            pk__in={pk for pk, _ in claims},
            claim_token__in={token for _, token in claims},
            status=Status.CLAIMED,
        )
        with self.locked_in_id_order({pk for pk, _ in claims}):
            rows.update(heartbeat_at=Now())
            return [
                (pk, as_uuid(token), requested is not None)
                for pk, token, requested in rows.values_list(
                    "pk", "claim_token", "cancel_requested_at"
                )
            ]

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        """Run the transaction ``fn``, again if a lock conflict ended it.

        Only MySQL's deadlocks (1213) and lock wait timeouts (1205) end a
        transaction that simply running it again fixes; elsewhere ``fn``
        runs once.
        """
        return fn()

    def locked_in_id_order(self, ids: Collection[int]) -> AbstractContextManager[None]:
        """A transaction holding the row locks of ``ids``, taken in ascending id order.

        For the bulk writes of the ORM (heartbeat, release, stale recovery)
        where the database's plan decides the order in which an UPDATE
        locks rows: taking them first in one order means two bulk writers
        queue behind each other instead of deadlocking. A no-op here;
        MySQL, whose UPDATEs may lock through a descending secondary
        index, overrides it.
        """
        return nullcontext()

    def bounded_lock_wait(self, seconds: float) -> AbstractContextManager[Any]:
        """A block whose statements wait at most about ``seconds`` for a row lock, then fail.

        For writes that must not hold up their thread (the register of live
        workers, written by the heartbeat thread). SQLite has no row locks:
        its writes wait for the database lock as long as the connection's
        ``timeout`` says, as every write there does; this default changes
        nothing. PostgreSQL runs the block in a transaction with a local
        ``lock_timeout``; MySQL sets ``innodb_lock_wait_timeout`` (whole
        seconds, at least one) for the block.
        """
        return nullcontext()

    # -- enqueue and wake-ups ----------------------------------------------------

    def insert_item(
        self,
        item: WorkItem,
        *,
        run_after: datetime | timedelta | None,
        payload_json: str | None,
    ) -> bool:
        """Insert a validated item without a unique_key, and wake workers; in one go.

        Returns False where the vendor has no faster way than the ORM's
        ``save()`` followed by ``notify()``; the caller then does that.
        ``run_after`` is the caller's original value (None: now, by the DB clock);
        ``payload_json`` the payload already encoded by validation, None for
        a None payload (stored as SQL NULL, as the ORM stores it).
        """
        return False

    def insert_items(
        self,
        items: Sequence[WorkItem],
        *,
        run_after: datetime | timedelta | None,
        payloads_json: Sequence[str | None],
    ) -> bool:
        """``insert_item`` for items sharing handler, queue, priority and run_after
        (``payloads_json``: one ``payload_json`` per item)."""
        return False

    def notify(self, queues: Sequence[str], priority: int = 0) -> None:
        """Wake idle workers for ``queues`` when the current transaction commits.

        ``priority`` is that of the rows enqueued (where the wake-up can say
        it: a worker then claims an urgent row ahead of its buffer).

        Without cross-process wake-ups this wakes only the workers of this
        process (an enqueue from a handler, a periodic slot, a test driving
        a worker in-process); the others find the rows when they next poll.
        On commit only: before it, a worker could not see the rows, and a
        rolled-back enqueue wakes nobody.
        """
        if not has_local_wakers():
            return
        names = list(queues)
        connection = self.connection
        if not connection.in_atomic_block and not connection.get_autocommit():
            # AUTOCOMMIT off, outside atomic(): Django has no commit hooks
            # there (on_commit raises). The workers find the rows when they
            # next poll; waking them now would only find nothing.
            return
        transaction.on_commit(lambda: wake_local(names), using=self.using)

    def listen(self) -> Subscription:
        """Open a connection of its own that receives ``notify``'s wake-ups.

        Only where ``supports_notify``; elsewhere workers just poll.
        """
        raise NotImplementedError(f"{self.vendor} has no cross-process wake-ups")

    # -- statistics for the admin and the stats ----------------------------------

    @abstractmethod
    def distinct_queues(self) -> list[str]:
        """Every queue name in the table, at one index probe per queue."""

    def estimate_count(self, queryset: QuerySet[Any]) -> int | None:
        """The planner's estimate of ``queryset``'s row count, or None where there is none.

        For pages of a big table, where "about how many" is enough and an
        exact COUNT(*) would read every matching row.
        """
        return None

    def payload_matches(self, leaves: Sequence[tuple[tuple[str, ...], JsonScalar]]) -> Q:
        """Rows whose payload holds every ``(path, value)`` of ``leaves`` (a non-empty list).

        ``path`` is the object keys from the outside in; the value there has
        the same JSON type and value (numbers compare as numbers). This
        default tests each leaf with ``JsonEquals``: a scan of the rows the
        other conditions leave, as no index serves it. PostgreSQL answers with
        ``@>`` containment instead, which a GIN index on ``payload`` serves.
        """
        match = Q()
        for path, value in leaves:
            match &= Q(JsonEquals("payload", path, value))
        return match

    def table_estimate(self, columns: Sequence[str]) -> TableEstimate | None:
        """Planner statistics for the work table, or None where there are none."""
        return None

    def run_times(self, since: timedelta, sample: int) -> list[RunTimes]:
        """p50 and p95 run time per handler, of succeeded rows finished in the last ``since``.

        This default computes them in Python from at most the ``sample`` latest
        such rows (a backward range scan of ``dbworker_finished_idx``), so that the
        web process never sorts a whole hour of a busy table; a full sample says
        so. Vendors that can compute percentiles override this.
        """
        rows = list(
            WorkItem.objects.using(self.using)
            .filter(
                finished_at__gte=Now() - since,
                status=Status.SUCCEEDED,
                claimed_at__isnull=False,
            )
            .order_by("-finished_at")
            .values_list("handler", "claimed_at", "finished_at")[: sample + 1]
        )
        sampled = len(rows) > sample
        durations: dict[str, list[float]] = {}
        for handler, claimed_at, finished_at in rows[:sample]:
            if claimed_at is None or finished_at is None:  # filtered out; for the types
                continue
            seconds = (finished_at - claimed_at).total_seconds()
            durations.setdefault(handler, []).append(max(0.0, seconds))
        found = []
        for handler, values in sorted(durations.items()):
            values.sort()
            p50, p95 = percentile(values, 0.5), percentile(values, 0.95)
            found.append(RunTimes(handler, len(values), p50, p95, sampled))
        return found

    # -- helpers shared by the vendors --------------------------------------------

    def _fetch(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement on this alias's connection; return all its rows."""
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def _rows_to_items(self, rows: Sequence[Sequence[Any]]) -> Claimed[WorkItem]:
        """Model instances from rows of ``CLAIM_COLUMNS``, in claim order.

        Decoded through Django's own converters (JSON, UUID, aware datetimes),
        so a claimed item equals what the ORM would load. RETURNING gives no
        order, hence the sort.
        """
        if self._converters is None:
            self._converters = self._converters_of(CLAIM_COLUMNS)
        converters, connection = self._converters, self.connection
        items = [self._claimed_item(self._convert(row, converters, connection)) for row in rows]
        items.sort(key=lambda i: (-i.priority, i.run_after, i.pk))
        return Claimed(items)

    def _converters_of(self, names: Sequence[str]) -> list[tuple[int, list[Converter], Any]]:
        """Django's converters of the WorkItem columns ``names`` on this connection.

        Only the columns that have any, by position: on PostgreSQL that is
        the JSON columns alone (the driver loads UUIDs and aware datetimes
        itself), so a claimed row's other values are taken as they come.
        """
        connection = self.connection
        table = WorkItem._meta.db_table
        converters: list[tuple[int, list[Converter], Any]] = []
        for index, name in enumerate(names):
            col = WorkItem._meta.get_field(name).get_col(table)  # type: ignore[union-attr]
            funcs = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
            if funcs:
                converters.append((index, funcs, col))
        return converters

    @staticmethod
    def _convert(
        row: Sequence[Any],
        converters: list[tuple[int, list[Converter], Any]],
        connection: BaseDatabaseWrapper,
    ) -> list[Any]:
        """One row's values as the ORM would load them (JSON, UUID, aware datetimes).

        ``connection`` is passed in: looking it up (a thread-local) per row
        cost more than converting the row.
        """
        values = list(row)
        for index, funcs, col in converters:
            value = values[index]
            for func in funcs:
                value = func(value, col, connection)
            values[index] = value
        return values

    def _assign(self, rows: Sequence[Sequence[Any]], items: Sequence[WorkItem]) -> None:
        """Give inserted items their ids and database-set times, as ``save()`` would.

        ``rows`` are ``(id, run_after, created_at, updated_at)``, one per item,
        in the items' order.
        """
        if len(rows) != len(items):
            raise RuntimeError(f"inserted {len(rows)} rows for {len(items)} items")
        if self._inserted_converters is None:
            self._inserted_converters = self._converters_of(INSERTED_COLUMNS)
        converters, connection = self._inserted_converters, self.connection
        for item, row in zip(items, rows, strict=True):
            pk, run_after, created_at, updated_at = self._convert(row[:4], converters, connection)
            item.pk = pk
            item.run_after = run_after
            item.created_at = created_at
            item.updated_at = updated_at
            item._state.adding = False
            item._state.db = self.using

    def _claimed_item(self, values: list[Any]) -> WorkItem:
        """A ``WorkItem`` of the claim's columns, as ``Model.from_db`` would build it.

        Built directly rather than through ``Model.__init__``: on the claim
        path of short jobs, ``__init__`` (its per-field loop and its
        pre_init/post_init signals) was a tenth of a worker's CPU per job.
        Receivers of WorkItem's init signals therefore do not see claimed
        rows; django-dbworker has none. Otherwise the result is the same:
        the claimed columns set, every other field deferred (loaded from the
        database on first access), the instance bound to this alias and not
        "adding".
        """
        item: WorkItem = WorkItem.__new__(WorkItem)
        state = item._state = ModelState()
        state.adding = False
        state.db = self.using
        item.__dict__.update(zip(CLAIM_COLUMNS, values, strict=True))
        item.status = Status.CLAIMED
        return item
