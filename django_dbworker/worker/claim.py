"""The one claim route: every ``pending -> claimed`` decision of a worker, and the rate
limits' say over a claimed row's start.

The claim loop (``claim_loop.py``) asks for up to N rows, dispatches what comes back and
sleeps; which rows, and by which statement, is decided here. The handlers go into one
claim: plain, or keyed where some of them declare a ``concurrency_limit`` (the statement
counts the keys' slots; rows held back by their keys are ``throttled``, not an empty
queue). It takes a few rows of limited keys per thread at most (``KEYED_IN_FLIGHT``): a
buffered row of a key holds the key's slot. A rate-limited handler whose window is full
is left out of the claims until the window's earliest start leaves it, so its rows never
hold back the rows of other handlers; its rows are otherwise claimed like any, and each
takes its start in the window just before it runs (``start``, ``flow/rates.py``).

Where fair keys are in use, a claim is dealt in turns across the keys with ready work
(``flow/fair.py``): the same claim, narrowed to one key and priority a turn.

All claims go through ``VendorOperations.claim``, the same on every database.
Paused queues are skipped by the statement itself; this module also says which buffered
rows to give back (``withheld``: their queue was paused, or their handler's window filled,
after their claim) and whether a burst worker may leave (``finished``). Claims run on the
claim loop's thread, ``start`` on the pool threads; it holds no lock beyond a statement
and never runs handler code.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from django_dbworker import validation
from django_dbworker.db import VendorOperations
from django_dbworker.db.sql import Turns
from django_dbworker.db.types import Claimed
from django_dbworker.flow.fair import FairRotation
from django_dbworker.flow.models import QueueState
from django_dbworker.flow.queues import paused_queues
from django_dbworker.flow.rates import take_start
from django_dbworker.handlers import WorkItemHandler, runs_async
from django_dbworker.metrics import WORK_ITEM_LOOP, WorkerMetrics
from django_dbworker.models import WorkItem
from django_dbworker.worker.attempts import Attempt
from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.identity import worker_id

logger = logging.getLogger("django_dbworker.worker")

Dispatch = Callable[[Sequence[WorkItem]], object]

#: Rows of limited handlers a process holds at most (buffered, running, being written), per
#: thread. One per thread leaves each thread idle for a claim after every job (W7: 100 keys,
#: limit 1, 5 ms jobs); the whole prefetch buffer gave one process every key.
KEYED_IN_FLIGHT = 3
#: A resting loop claims the keys' next rows once this few per thread are left in flight:
#: a claim for every ended row cost a keyed claim (two statements) per job.
KEYED_REFILL = 2


@dataclass(frozen=True)
class Claim:
    """What one round of the route claimed (every row already dispatched)."""

    #: Rows claimed, rate-limited ones included.
    taken: int
    #: Fewer rows than asked for were claimable: a claim now would find nothing more.
    dry: bool
    #: The plain claim counted concurrency keys (a keyed claim that finds nothing costs
    #: as much as a full one: the loop rests until a key is freed or rows come).
    keyed: bool
    #: Some handlers are rate-limited (their windows end by themselves: no rest).
    rated: bool
    #: Nothing ready was left behind: no row held back for its key, no handler for its
    #: rate, the keyed cap not reached. Only new rows, which announce themselves, are
    #: reason to claim again.
    drained: bool = False

    def and_then(self, other: Claim) -> Claim:
        """This claim and ``other`` (made right after, for the other kind of handler) as
        one round."""
        return Claim(
            taken=self.taken + other.taken,
            dry=self.dry and other.dry,
            keyed=self.keyed and other.keyed,
            rated=self.rated or other.rated,
            drained=self.drained and other.drained,
        )


class ClaimRoute:
    """Claims for one worker's WorkItem handlers, by the rules they declare."""

    def __init__(
        self,
        *,
        ops: VendorOperations,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        now: Callable[[], float],
        handlers: Callable[[], Mapping[str, WorkItemHandler]],
    ) -> None:
        self.ops = ops
        self.config = config
        self.metrics = metrics
        self.now = now
        #: The WorkItem handlers claimed for, by name (replaced, never changed in place).
        self.handlers = handlers
        #: Rate-limited handlers whose window is full, until when (``now``'s clock): set by
        #: pool threads (``start``), read by the claim loop.
        self._held_until: dict[str, float] = {}
        self._held_lock = threading.Lock()
        self._rates: dict[str, tuple[int, float]] = {}
        self._rates_of: Mapping[str, WorkItemHandler] | None = None
        self._paused = PausedQueues(
            lambda: paused_queues(config.using), every=config.poll_interval, clock=now
        )
        #: Fair share: whose turn each claim is (``flow/fair.py``).
        self._fair = FairRotation(using=config.using, every=config.poll_interval, clock=now)

    def claim(
        self,
        limit: int,
        *,
        free: int,
        limited_in_flight: int,
        dispatch: Dispatch,
        skip_async: bool | None = None,
    ) -> Claim:
        """Claim up to ``limit`` rows and ``dispatch`` them. Rows of limited keys while this
        process holds fewer than ``KEYED_IN_FLIGHT`` per thread of them (``limited_in_
        flight``: keyed rows of limited handlers, buffered, running or being written; their
        unkeyed rows hold no slot), or for the ``free`` threads. ``skip_async`` leaves out
        the async handlers (True) or the sync ones (False): the worker has no room for them,
        or claims for them apart (``drained`` then speaks of the kind claimed for)."""
        handlers = self.handlers()
        rates = self.rates(handlers)
        served = [
            name
            for name, handler in handlers.items()
            if skip_async is None or runs_async(type(handler)) is not skip_async
        ]
        names = [name for name in served if not (name in rates and self._held(name))]
        limits = concurrency_limits(handlers, names)
        keyed_cap = None
        if limits:
            # A buffered row of a limited key holds the key's slot until it starts: a
            # buffer sized for the job length (PREFETCH_HORIZON) took every key into one
            # process while the others' threads idled. A few rows per thread keep the
            # threads busy while the claims of the keys' next rows are under way; threads
            # with nothing to start are claimed for whatever is held. Unkeyed rows are
            # prefetched as usual: the claim stays one statement, in claim order.
            room = KEYED_IN_FLIGHT * self.config.concurrency - limited_in_flight
            keyed_cap = max(room, free, 0)
        items = self._claim(names, limit, limits, keyed_cap) if names else Claimed[WorkItem]()
        dispatch(items)
        keyed = sum(1 for item in items if item.concurrency_key is not None)
        return Claim(
            taken=len(items),
            # Rows held back for their keys were there: a batch cut short by them is not
            # an empty queue (the next claim skips those keys). Cut to the keyed cap: a
            # claim now would find no more keyed rows either.
            dry=(
                not names
                or len(items) + items.throttled < limit
                or (keyed_cap is not None and keyed >= keyed_cap)
            ),
            # Only limited handlers: an empty keyed claim costs as much as a full one, so
            # the loop claims again when a key is freed, not when its buffer runs low.
            keyed=bool(limits) and len(limits) == len(names),
            rated=bool(rates),
            drained=(
                len(names) == len(served)
                and len(items) < limit
                and not items.throttled
                and (keyed_cap is None or keyed < keyed_cap)
            ),
        )

    def _claim(
        self, handlers: list[str], limit: int, limits: dict[str, int], keyed_cap: int | None
    ) -> Claimed[WorkItem]:
        cap = keyed_cap  # the whole claim's, across the fair rotation's takes

        def take(rows: int, turns: Turns | None) -> Claimed[WorkItem]:
            nonlocal cap
            queues, worker = self.config.queues, worker_id()
            if turns is None:
                taken = self.ops.claim(
                    limit=rows,
                    handlers=handlers,
                    queues=queues,
                    worker=worker,
                    limits=limits or None,
                    keyed_cap=cap,
                )
            else:
                taken = self.ops.claim_turns(
                    turns=turns,
                    handlers=handlers,
                    queues=queues,
                    worker=worker,
                    limits=limits or None,
                    keyed_cap=cap,
                )
            if cap is not None:
                cap = max(0, cap - sum(1 for item in taken if item.concurrency_key is not None))
            return taken

        items = self._fair.claim(limit, handlers=handlers, queues=self.config.queues, take=take)
        self.metrics.throttle(WORK_ITEM_LOOP, "concurrency", items.throttled)
        return items

    def fair_turns(self) -> bool:
        """Whether the last claim was dealt in turns of fair keys (the buffer is then kept
        short, ``prefetch.FAIR_HORIZON``)."""
        return self._fair.dealt

    def limited(self) -> frozenset[str]:
        """The handlers whose rows count against ``KEYED_IN_FLIGHT``: those with a
        ``concurrency_limit``."""
        return frozenset(
            name for name, handler in self.handlers().items() if handler.concurrency_limit
        )

    # -- rate limits ---------------------------------------------------------------

    def rates(self, handlers: Mapping[str, WorkItemHandler]) -> dict[str, tuple[int, float]]:
        """``{name: (starts, period seconds)}`` of the rate-limited ones among ``handlers``.

        Parsed once per handler mapping (it is replaced, never changed, when handlers are
        added); a declaration the system check refuses runs without a limit, logged.
        """
        if handlers is not self._rates_of:
            rates = {}
            for name, handler in handlers.items():
                value = getattr(handler, "rate_limit", None)
                if value is None:
                    continue
                try:
                    rates[name] = validation.rate_limit(value)
                except validation.InvalidValue as exc:
                    logger.error("Handler %r: rate_limit %s; running it without one.", name, exc)
            self._rates, self._rates_of = rates, handlers
        return self._rates

    def start(self, attempt: Attempt) -> bool:
        """Whether ``attempt`` may start now (a pool thread asks, just before it runs it):
        always, unless its handler is rate-limited; then only if the window had a start
        left, which it now holds. A refusal leaves the handler out of claims until the
        window frees up; the caller gives the row back."""
        name = attempt.handler.name
        rate = self.rates(self.handlers()).get(name)
        if rate is None:
            return True
        if self._held(name):
            self.metrics.throttle(name, "rate")
            return False
        starts, period = rate
        full_for = take_start(self.ops, handler=name, starts=starts, period=period)
        if full_for is None:
            return True
        with self._held_lock:
            self._held_until[name] = self.now() + full_for
        self.metrics.throttle(name, "rate")
        return False

    def withheld(self) -> frozenset[str] | None:
        """The rate-limited handlers whose window is full now: the loop gives back their
        buffered rows (None when there are none)."""
        now = self.now()
        with self._held_lock:
            names = [name for name, until in self._held_until.items() if until > now]
        return frozenset(names) or None

    def _held(self, name: str) -> bool:
        until = self._held_until.get(name)
        if until is None:
            return False
        if self.now() >= until:
            with self._held_lock:  # not a hold a pool thread set since (a fuller window)
                if self._held_until.get(name) == until:
                    del self._held_until[name]
            return False
        return True

    def next_window(self) -> float:
        """Seconds until a full rate window frees up (``inf`` without one)."""
        with self._held_lock:
            until = min(self._held_until.values(), default=math.inf)
        return max(0.0, until - self.now())

    # -- what the loop asks besides claims --------------------------------------------

    def paused_since_claim(self) -> frozenset[str] | None:
        """The paused queues, once per poll interval (None between reads): the loop gives
        back buffered rows of these (claimed before the pause)."""
        return self._paused.poll()

    def outranked(self, priority: int) -> bool:
        """Whether a ready row of these handlers, of a priority above ``priority``, waits in
        a queue this worker claims from: one the next claim would take (rows of limited keys
        aside: their keys decide; a rate-limited handler's while its window is full aside)."""
        held = self.withheld() or frozenset()
        names = [name for name in self.handlers() if name not in held]
        if not names:
            return False
        rows = WorkItem.objects.using(self.config.using).ready()
        rows = rows.filter(handler__in=names, priority__gt=priority)
        if self.config.queues:
            rows = rows.filter(queue__in=self.config.queues)
        rows = rows.exclude(concurrency_key__isnull=False, handler__in=self.limited())
        paused = QueueState.objects.using(self.config.using).filter(paused=True).values("name")
        return rows.exclude(queue__in=paused).exists()

    def finished(self) -> bool:
        """Whether a burst worker whose claim found nothing, with nothing in flight, may
        leave: no rate window frees up soon and no ready row waits for a key's slot."""
        if self.next_window() <= max(1.0, self.config.poll_interval):
            return False
        return self.config.inline or not keys_busy(
            self.handlers(), using=self.config.using, queues=self.config.queues
        )


def concurrency_limits(
    handlers: Mapping[str, WorkItemHandler], names: Sequence[str]
) -> dict[str, int]:
    """The current ``concurrency_limit`` of those of ``names`` that declare one."""
    return {
        name: limit for name in names if (limit := handlers[name].concurrency_limit) is not None
    }


def keys_busy(
    handlers: Mapping[str, WorkItemHandler], *, using: str, queues: Sequence[str] | None
) -> bool:
    """Whether ready rows of ``handlers`` wait for a slot of their concurrency key.

    Such a row's key is held by another worker's claimed row, so this claim found
    nothing; the holder may end before it claims again, and a burst worker that left now
    could leave the row behind with no one to run it. It waits for a poll interval and
    claims again instead (stale recovery frees a dead holder's slot meanwhile). Not
    inline (``run_until_empty``): a test's rows claimed by no running worker would hold
    it until they went stale.
    """
    if not any(h.concurrency_limit is not None for h in handlers.values()):
        return False
    rows = WorkItem.objects.using(using).ready()
    rows = rows.filter(handler__in=list(handlers), concurrency_limit__isnull=False)
    if queues:
        rows = rows.filter(queue__in=queues)
    # A paused queue's rows wait for a resume, not for a slot: no claim takes them.
    paused = QueueState.objects.using(using).filter(paused=True).values("name")
    return rows.exclude(queue__in=paused).exists()


class PausedQueues:
    """The paused queue names, re-read when ``every`` seconds have passed.

    A read of the few ``QueueState`` rows, at most once per poll interval, so that the
    loop can give back buffered rows of a queue paused since they were claimed (the claim
    statements skip paused queues themselves). Holds no lock or connection.
    """

    def __init__(
        self, read: Callable[[], list[str]], *, every: float, clock: Callable[[], float]
    ) -> None:
        self._read = read
        self._every = every
        self._clock = clock
        self._next = 0.0
        self.names: frozenset[str] = frozenset()

    def poll(self) -> frozenset[str] | None:
        """The paused names if it was time to read them (None: not yet, or the read failed)."""
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self._every
        try:
            self.names = frozenset(self._read())
        except Exception as exc:
            # The claim that follows meets the same database and says so.
            logger.debug("Could not read the paused queues: %s", exc)
            return None
        return self.names
