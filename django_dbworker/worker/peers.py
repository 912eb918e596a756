"""A worker's share of the concurrency keys: the register of live workers, and the cap.

With ``concurrency_limit = 1`` a key moves one row per claim, run and success write, and
the success write hands the key's slot to the key's next row in the same statement
(``handover.py``): a key stays with the worker that first claimed it. So the first
worker to claim took every free key and kept them; W7 (100 keys, two processes) ran
on one process at a time, 58% of the two cores busy and 0.52 of the plain rate, where
the keys split evenly by queue reached 0.61 (docs/internals/benchmarks.md). A worker
cannot split the keys by itself without knowing how many share them.

So each threaded worker on a vendor with the hand-over writes a ``WorkerProcess`` row
(``flow_models.py``): at its start (and wakes the others of its queues, who may hold
every key), every ``HEARTBEAT_INTERVAL`` after, deleted at its exit. The keyed rows it
holds (buffered, running, being written) are capped at its share of the pending keys
among the live workers of its pool (the same queues and handlers), plus one:
``ceil(keys / workers) + 1``. The cap limits the claim and the hand-over alike, so a
worker over it (it started first) leaves the keys it ends to the others, and wakes them.
The shares add up to more than the keys, so a free key always fits someone's share; and
no thread idles for the cap while a key is free, since a worker holding fewer rows than
threads holds less than its share, or the keys are fewer than the threads of the pool.
(One slot over the share, not a thread's worth: the worker with 8 more keys than its
peer finished its own 38% later, alone for the last quarter of W7.)

Balance only: the claim statements keep the limits by themselves. A row that cannot be
written or read leaves the count where it was (at worst one worker: no cap), a crashed
worker's row counts for three intervals (its peers hold a share each meanwhile: the
keys run, fewer at once), and keys not counted by a claim (the walk's, with rows of
unlimited handlers about) are not capped at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta

from django.db.models import DateTimeField, ExpressionWrapper, Value
from django.db.models.expressions import CombinedExpression
from django.db.models.functions import Now

from django_dbworker.flow_models import WorkerProcess

logger = logging.getLogger("django_dbworker.worker")

#: Heartbeat intervals after which a worker's row no longer counts (it died).
LIVE_FOR_BEATS = 3
#: Seconds between two counts of the live workers (at most; only when claiming keys).
COUNT_EVERY = 0.1
#: Seconds after which a worker that shares keys counts the pending keys again, by a
#: claim (even one its cap leaves no room, for one row): the keys run out unevenly (a
#: worker whose keys are done waits idle while a peer holds its share of a larger count).
RECOUNT_KEYS_EVERY = 0.25


def pool_of(queues: Sequence[str] | None, handlers: Iterable[str]) -> str:
    """The digest of a queue set and a handler set: the workers that share their keys.

    The handlers too: a worker of the same queues without a limited handler takes none of
    its keys, and counted as a peer it would shrink the others' shares below the keys.
    """
    text = json.dumps([sorted(set(queues)) if queues else "*", sorted(set(handlers))])
    return hashlib.sha256(text.encode()).hexdigest()


class KeyShare:
    """This process's row in the register, the live workers of its pool, and its cap."""

    def __init__(
        self,
        *,
        using: str,
        queues: Sequence[str] | None,
        handlers: Callable[[], Mapping[str, object]],
        interval: float,
        stale_after: float,
        clock: Callable[[], float],
    ) -> None:
        self.using = using
        self.queues = sorted(set(queues)) if queues else None
        self.handlers = handlers
        self._seen: Mapping[str, object] | None = None
        self._pool = ""
        self.name = f"{socket.gethostname()}:{os.getpid()}"[:255]
        self.interval = interval
        self.stale_after = stale_after
        self.clock = clock
        #: Live workers of the pool, this one included, as last counted.
        self.workers = 1
        #: Pending keys as the last keyed claim counted them (None: not counted).
        self.pending_keys: int | None = None
        self._next_beat = 0.0
        self._next_count = 0.0
        self._next_recount = 0.0

    @property
    def pool(self) -> str:
        """The pool's digest, for the handlers of now (replaced when tasks are found)."""
        handlers = self.handlers()
        if handlers is not self._seen:
            self._pool, self._seen = pool_of(self.queues, handlers), handlers
        return self._pool

    # -- the register ------------------------------------------------------------

    def join(self) -> bool:
        """Write this worker's row; whether it was written (a failure is logged)."""
        try:
            WorkerProcess.objects.using(self.using).update_or_create(
                name=self.name,
                defaults={"pool": self.pool, "queues": self.queues, "seen_at": Now()},
                create_defaults={
                    "pool": self.pool,
                    "queues": self.queues,
                    "started_at": Now(),
                    "seen_at": Now(),
                },
            )
        except Exception as exc:
            logger.warning("Could not register this worker (%s); it claims keys unshared.", exc)
            return False
        self._next_beat = self.clock() + self.interval
        return True

    def beat(self) -> None:
        """Refresh this worker's row when due, and delete the rows of long-dead workers."""
        if self.clock() < self._next_beat:
            return
        self._next_beat = self.clock() + self.interval
        rows = WorkerProcess.objects.using(self.using)
        try:
            if not rows.filter(name=self.name).update(seen_at=Now(), pool=self.pool):
                self.join()  # deleted meanwhile (taken for dead): back in
            rows.filter(seen_at__lt=_ago(self.stale_after)).delete()
        except Exception as exc:
            logger.debug("Could not refresh this worker's register row: %s", exc)

    def leave(self) -> None:
        """Delete this worker's row (at its exit): the others' shares grow at once."""
        try:
            WorkerProcess.objects.using(self.using).filter(name=self.name).delete()
        except Exception as exc:
            logger.debug("Could not delete this worker's register row: %s", exc)

    def count(self) -> int:
        """The live workers of this pool (at most every COUNT_EVERY seconds; else the last)."""
        now = self.clock()
        if now >= self._next_count:
            self._next_count = now + COUNT_EVERY
            live = _ago(LIVE_FOR_BEATS * self.interval)
            try:
                found = (
                    WorkerProcess.objects.using(self.using)
                    .filter(pool=self.pool, seen_at__gte=live)
                    .count()
                )
            except Exception as exc:
                logger.debug("Could not count the live workers: %s", exc)
            else:
                self.workers = max(1, found)
        return self.workers

    # -- the cap ------------------------------------------------------------------

    def counted(self, pending_keys: int | None) -> None:
        """A keyed claim's count of the pending keys (None: it counted none)."""
        self.pending_keys = pending_keys
        self._next_recount = self.clock() + RECOUNT_KEYS_EVERY

    def room(self, held: int) -> int | None:
        """How many more keyed rows this worker may hold, holding ``held``; None: no cap."""
        if self.pending_keys is None:
            return None
        workers = self.count()
        if workers <= 1:
            return None
        return max(0, math.ceil(self.pending_keys / workers) + 1 - held)

    def recount_in(self) -> float:
        """Seconds until the pending keys are to be counted again (inf: no peer to share with)."""
        if self.workers <= 1 or self.pending_keys is None:
            return math.inf
        return max(0.0, self._next_recount - self.clock())


def _ago(seconds: float) -> ExpressionWrapper[CombinedExpression]:
    """The database's now less ``seconds``: every host's rows on one clock."""
    return ExpressionWrapper(
        Now() - Value(timedelta(seconds=seconds)), output_field=DateTimeField()
    )
