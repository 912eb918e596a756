"""Fair share between tenants: whose turn a claim is, among the fair keys with ready work.

Stride scheduling, kept in the database so that every worker shares one rotation. Each
``FairKey`` row holds its key's pass (``served``): virtual time that advances by 1/weight
for each row claimed for the key. A claim (``FairRotation.claim``, called by the one claim
route, ``worker/claim.py``) reads the highest priority with ready work, then the keys with
ready work at that priority, lowest pass first, and deals its rows out one at a time to the
key of lowest pass (which then advances): with weights 3 and 1, three rows to one for each
of the other. The keys' shares are then claimed (``VendorOperations.claim_turns``): on
PostgreSQL in one statement, elsewhere by the vendor's claim statement narrowed to each key
(``fair_filtered``), so limits, rates, pauses and queues apply as to any claim. The passes
advance by what was taken, in one UPDATE (an increment: two workers that dealt from the
same passes both count). Rows without a key take turns as one key, the row ``""``. What
the shares left (keys with fewer ready rows than their share, lower priorities) goes to
one claim of the usual order: a key alone gets every thread.

A key that comes back after idling starts from the rotation's clock (the highest pass the
turns of the keys with ready work reached, ``started``) rather than the pass it left with:
it neither takes the turns it missed nor waits for the others to catch up with a pass it
ran ahead to.

Cost: with fair keys in the table, a claim reads whether any key has a ready row (one
statement; without such a row the claim goes on as usual from there), then the keys with a
ready row at the top priority, with their passes (one statement: a probe of
``dbworker_fair_idx`` per fair key ever enqueued, the ``FairKey`` rows; delete those of
tenants gone for good), claims the turns, and updates those keys' passes. A process that
finds no ``FairKey`` row reads again after a poll interval, and claims as before
meanwhile. While keys take turns the worker buffers less (``prefetch.FAIR_HORIZON``): a
key's new item is dealt its turn in the next claim, and starts behind what is buffered.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from django.db import DatabaseError, connections
from django.db.models import (
    BigIntegerField,
    Case,
    Max,
    OuterRef,
    QuerySet,
    Subquery,
    When,
    Window,
)

from django_dbworker import validation
from django_dbworker.db import operations
from django_dbworker.db.sql import Turns, numbered, numbered_params
from django_dbworker.db.types import Claimed
from django_dbworker.flow.models import FairKey, QueueState
from django_dbworker.models import WorkItem
from django_dbworker.routing import work_db_for_write

logger = logging.getLogger("django_dbworker.worker")

#: The ``FairKey`` row of the rows without a fair key, which take turns as one key.
NO_KEY = ""

#: Claims up to ``rows`` rows: ``turns``' (None: any rows, in the usual order).
Take = Callable[[int, Turns | None], Claimed[WorkItem]]

#: The compiled keys read's stand-in for the priority its turns must be below (``_read``):
#: out of the priorities' range (-100 to 100), so no other parameter equals it, and in the
#: column's (a small integer: past it, Django drops the test as always true).
BELOW = 10_003

#: A key's lift when it keeps its own pass (below every pass).
NOT_LIFTED = -1e300

#: The most keys a claim reads (those of lowest pass; every key with ready work is probed).
READ_KEYS = 1024

#: dbworker_fair_idx's order: a fair read or claim walks it from a key's first ready row.
FAIR_ORDER = ("fair_key", "-priority", "run_after", "id")


def set_fair_weight(key: str | None, weight: float, *, using: str | None = None) -> None:
    """Give ``key`` (None: the items without a fair key) ``weight``: over a window, the
    starts of the keys with ready work divide in proportion to their weights (default 1).

    Raises ``ValueError`` for a key that is not a 1-200 character string (or None) and a
    weight that is not a positive number (at most a million); nothing is written then.
    ``using``: the database of the work table (default: the routers' write alias).
    """
    try:
        checked_key = validation.fair_key(key)
    except validation.InvalidValue as exc:
        raise ValueError(f"fair key {exc}.") from None
    try:
        checked = validation.fair_weight(weight)
    except validation.InvalidValue as exc:
        raise ValueError(f"fair weight {exc}.") from None
    name = NO_KEY if checked_key is None else checked_key
    rows = FairKey.objects.using(work_db_for_write(using))
    rows.bulk_create([FairKey(key=name)], ignore_conflicts=True)
    rows.filter(key=name).update(weight=checked)


def register_key(key: str, *, using: str) -> None:
    """Make ``key``'s ``FairKey`` row (an enqueue's), so that claims give it turns.

    Read first: the row exists after the key's first enqueue, and an insert-or-ignore
    of an existing row takes a shared lock on MySQL (``flow/rates.lock_flow``).
    """
    rows = FairKey.objects.using(using)
    if not rows.filter(key=key).exists():
        rows.bulk_create([FairKey(key=key)], ignore_conflicts=True)


class FairRotation:
    """The rotation for one worker's claims: which keys take this claim's rows."""

    def __init__(self, *, using: str, every: float, clock: Callable[[], float]) -> None:
        self.using = using
        self._every = every
        self._clock = clock
        #: Until when (``clock``) no ``FairKey`` row exists: claims go as usual.
        self._none_until = 0.0
        #: The keys with ready work in the last read, by priority; the pass each key of
        #: the last read starts from (``NOT_LIFTED``: its own).
        self._active: dict[int, frozenset[str]] = {}
        self._lifts: dict[str, float] = {}
        #: The priority of the last read (its keys: ``_lifts``'s).
        self._top = 0
        #: The row of the rows without a key is known to exist.
        self._no_key_row = False
        #: The last claim was dealt in turns of fair keys (some had ready rows at its priority).
        self.dealt = False
        #: The passes' advance, by its number of keys (``_advance_sql``).
        self._compiled_advance: dict[int, str] = {}
        #: The reads' SQL and parameters, by what they depend on (``_read``).
        self._compiled: dict[tuple[object, ...], tuple[str, tuple[Any, ...]]] = {}

    def claim(
        self, limit: int, *, handlers: Sequence[str], queues: Sequence[str] | None, take: Take
    ) -> Claimed[WorkItem]:
        """Up to ``limit`` rows: the fair keys' turns, priority by priority, then (no key's
        turn left, or turns that took nothing) the usual order for the rest."""
        rows: list[WorkItem] = []
        throttled = 0
        below: int | None = None  # turns only below this priority
        try:
            while (wanted := limit - len(rows) - throttled) > 0:
                turns, dealt = (
                    self._turns(wanted, handlers, queues, below) if self._in_use() else (None, [])
                )
                if not rows:
                    self.dealt = turns is not None and any(key for key, _ in turns.shares)
                taken = take(wanted, turns) if turns is not None else Claimed[WorkItem]()
                throttled += taken.throttled
                if turns is not None and not taken and (below is None or turns.priority < below):
                    # The turns at this priority took nothing (their rows held back by their
                    # keys' limits, or by other claimers): the next priority's turns, not the
                    # usual order, where one key's flood took every row.
                    below = turns.priority
                    continue
                if not taken:
                    # No turn (no ready row at a priority with turns left): the usual order,
                    # for what the turns left (rows of keys without a FairKey row).
                    rest = take(wanted, None)
                    rows.extend(rest)
                    throttled += rest.throttled
                    break
                by_key: dict[str, list[WorkItem]] = {}
                for item in taken:
                    by_key.setdefault(item.fair_key or NO_KEY, []).append(item)
                # Dealt in turn order, so that the buffer starts them in turn order too.
                queued = {key: iter(part) for key, part in by_key.items()}
                rows.extend(
                    row for key in dealt if key in queued and (row := next(queued[key], None))
                )
                rows.extend(row for rest in queued.values() for row in rest)  # none: claimed
                self._advance({key: len(part) for key, part in by_key.items()})
        except DatabaseError:
            if not rows:
                raise
            # The next claim meets the same database and says so; these rows run.
            logger.warning("A fair claim stopped after %d rows.", len(rows), exc_info=True)
        return Claimed(rows, throttled)

    def _in_use(self) -> bool:
        return self._clock() >= self._none_until

    def _turns(
        self,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        below: int | None = None,
    ) -> tuple[Turns | None, list[str]]:
        """This claim's turns at the top priority with ready rows (below ``below``, if
        given), and the key of each of its rows in turn order (None: no ready row there:
        the usual order)."""
        found = self._read(("ready",), self._ready_query)
        if not found:  # no FairKey row: not again for a poll interval
            self._none_until = self._clock() + self._every
            return None, []
        if found[0]["keyed"] is None:
            return None, []
        if not self._no_key_row:  # the rows without a key take turns as this row
            FairKey.objects.using(self.using).bulk_create(
                [FairKey(key=NO_KEY)], ignore_conflicts=True
            )
            self._no_key_row = True
        # Up to 1,024 keys, or a power of two above the claim's rows (``_keys_query``): one
        # compiled read serves claims of many sizes (the deal takes the lowest passes).
        keys = max(READ_KEYS, 1 << (limit + 1).bit_length())
        active = self._read(
            ("keys", tuple(handlers), tuple(queues or ()), keys, below is not None),
            lambda: self._keys_query(handlers, queues, keys, below is not None),
            below,
        )
        if not active:
            return None, []  # no ready row: the usual order says so
        # The clock: the highest pass any of these keys' turns reached (``started``: the pass
        # of its last row as dealt). A key behind it (back from idling) starts from it. Of
        # every key with ready work for this worker (the read's window), not of every key: a
        # key that other workers serve alone (their queues, their handlers) ran the clock
        # ahead of these, which all started from it each claim, the same one first.
        clock = active[0]["clock"]
        # A key with ready work in this worker's last read at this priority too has waited
        # all along: its pass stands, credit and all. One that was not there (back from
        # idling, new, or the worker's first claim) starts from the clock. Lifting every key
        # behind the clock took the credit of keys another priority's or another worker's
        # turns left behind it: 3:1 weights came out 1:1.
        before = self._active.get(active[0]["top"], frozenset())
        self._top = active[0]["top"]
        self._lifts = {row["key"]: NOT_LIFTED if row["key"] in before else clock for row in active}
        if all(row["key"] == NO_KEY for row in active):
            # No key's turn at this priority: its rows without a key, then the next one's.
            return Turns(active[0]["top"], ((NO_KEY, limit),)), [NO_KEY] * limit
        # Ties (keys started from the clock together) go to the key served least.
        entries = [
            (max(row["served"], self._lifts[row["key"]]), row["served"], row["key"], row["weight"])
            for row in active
        ]
        heapq.heapify(entries)
        dealt: list[str] = []
        for _ in range(limit):
            due, served, key, weight = heapq.heappop(entries)
            dealt.append(key)
            heapq.heappush(entries, (due + 1.0 / weight, served + 1.0 / weight, key, weight))
        return Turns(active[0]["top"], tuple(Counter(dealt).items())), dealt

    def _read(
        self,
        name: tuple[object, ...],
        build: Callable[[], QuerySet[Any]],
        below: int | None = None,
    ) -> list[dict[str, Any]]:
        """The rows of the query ``build`` makes, by column name. Its SQL depends on ``name``
        alone (the worker's handlers and queues, the claim's size), so it is compiled once:
        compiling these reads took longer than running them, on each claim. ``below`` takes
        the place of the parameter ``BELOW`` (a priority no row has)."""
        compiled = self._compiled.get(name)
        if compiled is None:
            if len(self._compiled) > 64:  # claims of many sizes
                self._compiled.clear()
            query = build().query
            compiled = self._compiled[name] = query.get_compiler(using=self.using).as_sql()
        sql, params = compiled
        if below is not None:
            params = tuple(below if param == BELOW else param for param in params)
        with connections[self.using].cursor() as cursor:
            cursor.execute(sql, params)
            names = [column[0] for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def _ready_query(self) -> QuerySet[Any]:
        """Whether any fair key has a ready row (no row: no ``FairKey`` row at all): the
        rows of keys long finished stay, and without ready rows of theirs a claim costs this
        one read more than the usual order. In dbworker_fair_idx's order: a plan that scans
        the table for it (the statistics of a fresh flood) reads every claimed row."""
        keyed = WorkItem.objects.using(self.using).ready().filter(fair_key__isnull=False)
        head = keyed.order_by(*FAIR_ORDER).values("pk")[:1]
        return FairKey.objects.using(self.using).annotate(keyed=Subquery(head)).values("keyed")[:1]

    def _keys_query(
        self, handlers: Sequence[str], queues: Sequence[str] | None, limit: int, below: bool
    ) -> QuerySet[Any]:
        """Up to ``limit`` keys with a ready row at the top priority (also in each row), by
        pass: each by one probe of dbworker_fair_idx. The key as a range, not an equality:
        that would make the order by key no order at all, and the claim index (in claim order
        too, at one key) would walk the other keys' ready rows. By pass, not by the pass from
        the clock: keys behind the clock are all first either way."""
        ready = WorkItem.objects.using(self.using).ready().filter(handler__in=list(handlers))
        if queues:
            ready = ready.filter(queue__in=list(queues))
        paused = QueueState.objects.using(self.using).filter(paused=True).values("name")
        ready = ready.exclude(queue__in=paused)
        if below:  # the priorities below one whose turns were all held by their limits
            ready = ready.filter(priority__lt=BELOW)
        top = Subquery(ready.in_order().values("priority")[:1])
        at_top = ready.filter(priority=top).order_by(*FAIR_ORDER).values("pk")
        own = at_top.filter(fair_key__gte=OuterRef("key"), fair_key__lte=OuterRef("key"))
        head = Case(
            When(key=NO_KEY, then=Subquery(at_top.filter(fair_key__isnull=True)[:1])),
            default=Subquery(own[:1]),
            output_field=BigIntegerField(),
        )
        keys = FairKey.objects.using(self.using).alias(head=head).filter(head__isnull=False)
        clock = Window(Max("started"))  # of every key with ready work, before the cut
        by_pass = keys.annotate(top=top, clock=clock).order_by("served", "key")
        return by_pass.values("key", "served", "weight", "top", "clock")[:limit]

    def _advance(self, took: dict[str, int]) -> None:
        """Each key's pass forward by 1/weight for each row its turn took (from the clock,
        for a key this claim lifted to it), and ``started`` to the pass of its last row: one
        UPDATE, from the passes as it finds them (other workers' turns of the same keys
        count too). ``started`` is the pass a key's turns reached, not the one a turn began
        at: after a large turn, a key back from idling started that far behind the keys it
        joined, and took the rows they had meanwhile."""
        keys = sorted(took)
        sql = self._compiled_advance.get(len(keys))
        if sql is None:
            sql = self._compiled_advance[len(keys)] = _advance_sql(self.using, len(keys))
        params: dict[str, Any] = {}
        params.update(numbered_params("key", keys))
        params.update(numbered_params("rows", [float(took[key]) for key in keys]))
        params.update(numbered_params("lift", [self._lifts.get(key, NOT_LIFTED) for key in keys]))
        # At READ COMMITTED whatever the project's level: at REPEATABLE READ, an UPDATE that
        # waited for another claimer's commit of a key's row fails, and the pass forgets
        # this claim's rows (an increment is right from the committed value).
        with (
            operations(self.using).ending_transaction(),
            connections[self.using].cursor() as cursor,
        ):
            cursor.execute(sql, params)
        # Waiting all along, for the next claim: the keys of this read that were so already,
        # and those whose lift this UPDATE kept (a lift of a key without a turn is not kept:
        # it is lifted again next time, from the clock then).
        before = self._active.get(self._top, frozenset())
        self._active[self._top] = frozenset(self._lifts.keys() & before | took.keys())


def _advance_sql(using: str, keys: int) -> str:
    """The passes' advance for ``keys`` keys, as every vendor runs it: written out, as the
    ORM's took longer to build than to run, on each claim (CASE for the greater of two:
    SQLite has no GREATEST). ``started`` first, from the old pass: MySQL sets a row's
    columns left to right, each from the values set before it."""
    quote = connections[using].ops.quote_name
    key, served, started, weight = quote("key"), quote("served"), quote("started"), quote("weight")

    def each(value: str) -> str:  # the key's own value
        return (
            f"CASE {key} "
            + " ".join(f"WHEN %(key_{i})s THEN {value.format(i=i)}" for i in range(keys))
            + " END"
        )

    start = each(f"CASE WHEN {served} > %(lift_{{i}})s THEN {served} ELSE %(lift_{{i}})s END")
    rows = each("%(rows_{i})s")
    last = f"{start} + ({rows} - 1) / {weight}"
    return (
        f"UPDATE {quote(FairKey._meta.db_table)} "
        f"SET {started} = CASE WHEN {started} > {last} THEN {started} ELSE {last} END, "
        f"{served} = {start} + {rows} / {weight} "
        f"WHERE {key} IN ({numbered('key', keys)})"
    )
