"""Fair share between tenants: whose turn a claim is, among the fair keys with ready work.

Stride scheduling, kept in the database so that every worker shares one rotation. Each
``FairKey`` row holds its key's pass (``served``): virtual time that advances by 1/weight
for each row claimed for the key. A claim (``FairRotation.claim``, called by the one claim
route, ``worker/claim.py``) reads the highest priority with ready work, then the keys with
ready work at that priority, lowest pass first, and deals its rows out one at a time to the
key of lowest pass (which then advances): with weights 3 and 1, three rows to one for each
of the other. Each key's share is then claimed by the vendor's claim statement narrowed to
that key (``fair_filtered``), so limits, rates, pauses and queues apply as to any claim,
and the passes advance by what was taken, in one UPDATE a key (an increment: two workers
that dealt from the same passes both count). Rows without a key take turns as one key, the
row ``""``. What the shares left (keys with fewer ready rows than their share, lower
priorities) goes to one claim of the usual order: a key alone gets every thread.

A key that comes back after idling starts from the rotation's clock (the highest pass at
which a turn began, ``started``) rather than the pass it left with: it neither takes the
turns it missed nor waits for the others to catch up with a pass it ran ahead to.

Cost: with fair keys in the table, a claim reads the rotation's clock and whether any key
has a ready row (one statement; without such a row the claim goes on as usual from there),
then the top priority (one probe of the claim index), probes ``dbworker_fair_idx`` once
per fair key ever enqueued (they are the ``FairKey`` rows; delete those of tenants gone for
good), claims once per key given a turn, and updates those keys' passes in one statement.
A process that finds no ``FairKey`` row reads again after a poll interval, and claims as
before meanwhile.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from django.db import DatabaseError
from django.db.models import Case, Exists, F, FloatField, OuterRef, Value, When
from django.db.models.functions import Coalesce, Greatest

from django_dbworker import validation
from django_dbworker.db import operations
from django_dbworker.db.sql import Turn
from django_dbworker.db.types import Claimed
from django_dbworker.flow.models import FairKey, QueueState
from django_dbworker.models import WorkItem
from django_dbworker.routing import work_db_for_write

logger = logging.getLogger("django_dbworker.worker")

#: The ``FairKey`` row of the rows without a fair key, which take turns as one key.
NO_KEY = ""

#: Claims up to ``rows`` of one turn (None: any rows, in the usual order).
ClaimTurn = Callable[[int, Turn | None], Claimed[WorkItem]]


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
        #: The rotation's clock as the last claim read it.
        self._clock_value = 0.0
        #: The row of the rows without a key is known to exist.
        self._no_key_row = False

    def claim(
        self, limit: int, *, handlers: Sequence[str], queues: Sequence[str] | None, take: ClaimTurn
    ) -> Claimed[WorkItem]:
        """Up to ``limit`` rows: the fair keys' turns, priority by priority, then (no key's
        turn left, or turns that took nothing) the usual order for the rest."""
        rows: list[WorkItem] = []
        throttled = 0
        try:
            while (wanted := limit - len(rows) - throttled) > 0:
                top, shares = (
                    self._shares(wanted, handlers, queues) if self._in_use() else (None, [])
                )
                taken: dict[str, Claimed[WorkItem]] = {}
                try:
                    if top is not None:
                        shares = shares or [NO_KEY] * wanted  # no key's rows at this priority
                        for key, count in Counter(shares).items():
                            taken[key] = take(count, Turn(key, top))
                finally:  # rows taken are dispatched, whatever fails after them
                    # Dealt in turn order, so that the buffer starts them in turn order too.
                    queued = {key: iter(part) for key, part in taken.items()}
                    rows.extend(
                        row for key in shares if key in queued and (row := next(queued[key], None))
                    )
                    throttled += sum(part.throttled for part in taken.values())
                if not any(taken.values()):
                    # No turn, or turns that took nothing (rows of keys without a FairKey
                    # row, rows other workers hold): the usual order.
                    rest = take(wanted, None)
                    rows.extend(rest)
                    throttled += rest.throttled
                    break
                self._advance({key: len(part) for key, part in taken.items() if part})
        except DatabaseError:
            if not rows:
                raise
            # The next claim meets the same database and says so; these rows run.
            logger.warning("A fair claim stopped after %d rows.", len(rows), exc_info=True)
        return Claimed(rows, throttled)

    def _in_use(self) -> bool:
        return self._clock() >= self._none_until

    def _shares(
        self, limit: int, handlers: Sequence[str], queues: Sequence[str] | None
    ) -> tuple[int | None, list[str]]:
        """The top priority with ready rows, and the keys of this claim's rows there, in
        turn order (a key once per row; none: no fair key waits at that priority)."""
        keys = FairKey.objects.using(self.using)
        # With the clock, whether any fair key has a ready row (by ``dbworker_fair_idx``):
        # the rows of keys long finished stay, and without ready rows of theirs a claim
        # costs this one read more than the usual order, not the rotation's probes.
        keyed = WorkItem.objects.using(self.using).ready().filter(fair_key__isnull=False)
        found = (
            keys.annotate(keyed=Exists(keyed))
            .order_by("-started")
            .values_list("started", "keyed")
            .first()
        )
        if found is None:  # no FairKey row: not again for a poll interval
            self._none_until = self._clock() + self._every
            return None, []
        if not found[1]:
            return None, []
        self._clock_value = float(found[0])
        ready = WorkItem.objects.using(self.using).ready().filter(handler__in=list(handlers))
        if queues:
            ready = ready.filter(queue__in=list(queues))
        paused = QueueState.objects.using(self.using).filter(paused=True).values("name")
        ready = ready.exclude(queue__in=paused)
        top = ready.in_order().values_list("priority", flat=True).first()
        if top is None:
            return None, []
        ready = ready.filter(priority=top)
        clock = Value(self._clock_value, output_field=FloatField())
        active = (
            keys.exclude(key=NO_KEY)
            .filter(Exists(ready.filter(fair_key=OuterRef("key"))))
            .annotate(due=Greatest(F("served"), clock))
            .order_by("due", "key")
            .values_list("key", "due", "weight")[:limit]
        )
        entries: list[tuple[float, str, float]] = [(due, key, w) for key, due, w in active]
        if not entries:
            return top, []  # no key's turn at this priority: the usual order
        if ready.filter(fair_key__isnull=True).exists():
            own = keys.filter(key=NO_KEY).annotate(
                due=Greatest(Coalesce(F("served"), Value(0.0)), clock)
            )
            due, weight = own.values_list("due", "weight").first() or (self._clock_value, 1.0)
            entries.append((due, NO_KEY, weight))
        heapq.heapify(entries)
        shares: list[str] = []
        for _ in range(limit):
            due, key, weight = heapq.heappop(entries)
            shares.append(key)
            heapq.heappush(entries, (due + 1.0 / weight, key, weight))
        return top, shares

    def _advance(self, took: dict[str, int]) -> None:
        """Each key's pass forward by 1/weight for each row its turn took, from the
        rotation's clock if it was behind it (a key back from idling)."""
        keys = FairKey.objects.using(self.using)
        if NO_KEY in took and not self._no_key_row:
            keys.bulk_create([FairKey(key=NO_KEY)], ignore_conflicts=True)
            self._no_key_row = True
        start = Greatest(F("served"), Value(self._clock_value, output_field=FloatField()))
        # One UPDATE for every key of the claim: each row by its own count.
        rows = Case(
            *(When(key=key, then=Value(float(n))) for key, n in took.items()),
            output_field=FloatField(),
        )
        # At READ COMMITTED whatever the project's level: at REPEATABLE READ, an UPDATE that
        # waited for another claimer's commit of a key's row fails, and the pass forgets
        # this claim's rows (an increment is right from the committed value).
        with operations(self.using).ending_transaction():
            keys.filter(key__in=sorted(took)).update(
                started=start, served=start + rows / F("weight")
            )
