"""What the claim loop knows about flow control: limits, busy keys, rate windows, pauses.

``concurrency_limits``: the handlers' current limits, passed into keyed claims;
``keys_busy``: whether ready rows wait for a key's slot (a burst worker stays).

``RateHolds``: the rate-limited handlers of this worker and, for each whose
window was full at its last claim, until when (this process's monotonic
clock) it is left out of claims: the database said when the window's
earliest start leaves it (``VendorOperations.claim_rated``). Rows of other
handlers flow meanwhile.

``PausedQueues``: the paused queue names, read at most once per poll
interval (a read of the few ``QueueState`` rows), so that the claim loop can
give back buffered rows of a queue paused since they were claimed. The
claim statements skip paused queues themselves; this is only about rows
claimed before the pause. Neither holds a lock or a connection.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from django_dbworker import validation
from django_dbworker.db import VendorOperations
from django_dbworker.flow_models import QueueState
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import WorkItem
from django_dbworker.worker.identity import worker_id

logger = logging.getLogger("django_dbworker.worker")


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

    Such a row's key is held by another worker's claimed row, so this
    claim found nothing; the holder may end before it claims again, and
    a burst worker that left now could leave the row behind with no one
    to run it. It waits for a poll interval and claims again instead
    (stale recovery frees a dead holder's slot meanwhile). Not inline
    (``run_until_empty``): a test's rows claimed by no running worker
    would hold it until they went stale.
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


class RateHolds:
    """Rate-limited handlers, and until when each is left out of claims."""

    def __init__(
        self,
        ops: VendorOperations | None = None,
        queues: Sequence[str] | None = None,
        *,
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: What ``claim_open`` claims with: the vendor, the worker's queues, its metrics.
        self.ops, self.queues, self.metrics, self.clock = ops, queues, metrics, clock
        self._until: dict[str, float] = {}
        self._rates: dict[str, tuple[int, float]] = {}
        self._seen: Mapping[str, WorkItemHandler] | None = None

    def rates(self, handlers: Mapping[str, WorkItemHandler]) -> dict[str, tuple[int, float]]:
        """``{name: (starts, period seconds)}`` of the rate-limited ones among ``handlers``.

        Parsed once per handler mapping (it is replaced, never changed, when
        handlers are added); a declaration the system check refuses is
        treated as no limit here, with a log line.
        """
        if handlers is not self._seen:
            rates = {}
            for name, handler in handlers.items():
                value = getattr(handler, "rate_limit", None)
                if value is None:
                    continue
                try:
                    rates[name] = validation.rate_limit(value)
                except validation.InvalidValue as exc:
                    logger.error("Handler %r: rate_limit %s; running it without one.", name, exc)
            self._rates, self._seen = rates, handlers
        return self._rates

    def held(self, name: str, now: float) -> bool:
        until = self._until.get(name)
        if until is None:
            return False
        if now >= until:
            del self._until[name]
            return False
        return True

    def hold(self, name: str, until: float) -> None:
        self._until[name] = until

    def claim_open(
        self,
        rates: dict[str, tuple[int, float]],
        *,
        limit: int,
        handlers: Mapping[str, WorkItemHandler],
        dispatch: Callable[[Sequence[WorkItem]], object],
    ) -> int:
        """Claim and ``dispatch`` rows of the rate-limited handlers whose window has room.

        Each handler in a claim of its own (``claim_rated``), dispatched at
        once, so that an error in a later one leaves no claimed row without
        an owner. A handler whose window is full is left out until the
        window's earliest start leaves it (the database says when), so its
        rows never hold back other handlers' rows behind them.
        """
        assert self.ops is not None and self.metrics is not None
        claimed = 0
        for name, (starts, period) in rates.items():
            left = limit - claimed
            if left <= 0:
                break
            if self.held(name, self.clock()):
                self.metrics.throttle(name, "rate")
                continue
            result = self.ops.claim_rated(
                handler=name,
                starts=starts,
                period=period,
                limit=left,
                queues=self.queues,
                worker=worker_id(),
                limits=concurrency_limits(handlers, [name]),
            )
            dispatch(result.items)
            claimed += len(result.items)
            if result.full_for is not None:
                self.hold(name, self.clock() + result.full_for)
            self.metrics.throttle(name, "rate", result.held_back)
        return claimed

    def next_release(self, now: float) -> float:
        """Seconds until the first hold ends (``inf`` without holds)."""
        if not self._until:
            return math.inf
        return max(0.0, min(self._until.values()) - now)


class PausedQueues:
    """The paused queue names, re-read when ``every`` seconds have passed."""

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
