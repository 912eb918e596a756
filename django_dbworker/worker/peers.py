"""A worker's share of the concurrency keys: the register of live workers, and the cap.

With ``concurrency_limit = 1`` a key moves one row per claim, run and success write, and
the success write hands the key's slot to the key's next row in the same statement
(``handover.py``): a key stays with the worker that first claimed it. So the first
worker to claim took every free key and kept them; W7 (100 keys, two processes) ran
on one process at a time, 58% of the two cores busy and 0.52 of the plain rate, where
the keys split evenly by queue reached 0.61 (docs/internals/benchmarks.md). A worker
cannot split the keys by itself without knowing who shares them.

So each threaded worker on a vendor with the hand-over writes a ``WorkerProcess`` row
(``flow_models.py``) with its thread count: at its start (and, if it has limited
handlers, wakes the others of its queues, who may hold every key), every
``HEARTBEAT_INTERVAL`` after, deleted when it stops claiming (a draining worker is no
peer). While every limited handler of its claims has limit 1 (only those keys are handed
over, so only they stick), the keyed rows it holds (buffered, running, being written)
are capped at its threads' share of the keys in play among the live workers of its pool
(the same queues and handlers), plus one: ``ceil(keys * threads / pool threads) + 1``.
The keys in play are the free keys whose next row the claim could take and the keys
held (a key due later, paused or in another pool's queue is not shared). The cap limits
the claim and the hand-over alike, so a worker over it (it started first) leaves the
keys it ends to the others, and wakes them.

By threads, not by workers: a worker of 30 threads beside one of 1 whose thread is busy
takes 30 of 31 keys, not 16 (attack s15). The shares add up to more than the keys, so a
free key fits someone's share; a peer whose threads are all busy leaves its share waiting
until the count changes (every RECOUNT_KEYS_EVERY).

Balance only: the claim statements keep the limits by themselves. A row that cannot be
written or read leaves the count where it was (at worst this worker alone: no cap), a
crashed worker's row counts for three intervals (its peers hold their shares meanwhile:
the keys run, fewer at once), and keys not counted by a claim (the walk's, with rows of
unlimited handlers about) are not capped at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Sum
from django.db.models.functions import Now

from django_dbworker.flow_models import WorkerProcess
from django_dbworker.queues import DEFAULT_QUEUE
from django_dbworker.worker.clock import Clock
from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.connections import close_thread_connections

logger = logging.getLogger("django_dbworker.worker")

#: Heartbeat intervals after which a worker's row no longer counts (it died).
LIVE_FOR_BEATS = 3
#: Seconds between two counts of the live workers (at most; only when claiming keys).
COUNT_EVERY = 0.1
#: Seconds after which a worker that shares keys counts the keys in play again, by a
#: claim (even one its cap leaves no room, for one row): the keys run out unevenly (a
#: worker whose keys are done waits idle while a peer holds its share of a larger count).
RECOUNT_KEYS_EVERY = 0.25
#: Seconds a worker that stops claiming waits for the delete of its register row.
LEAVE_WAIT = 0.5
#: Least wait of a claim loop for a count that is due.
MIN_RECOUNT_WAIT = 0.05


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
        threads: int,
        interval: float,
        stale_after: float,
        clock: Callable[[], float],
        poll: float = 1.0,
        bounded: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.using = using
        self.queues = sorted(set(queues)) if queues else None
        self.handlers = handlers
        self._seen: Mapping[str, object] | None = None
        self._pool = ""
        # host:pid, and a token: two containers on the host's network share its name and
        # may both run their worker as pid 1.
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"[-255:]
        self.threads = threads
        self.interval = interval
        self.stale_after = stale_after
        #: The poll interval: the longest wait between two counts of a worker holding keys.
        self.poll = poll
        self.bounded = bounded
        self._recount_every = RECOUNT_KEYS_EVERY
        self.clock = clock
        #: Threads of the pool's live workers, this one's included, as last counted.
        self.pool_threads = threads
        #: The keys in play as the last keyed claim counted them (None: not counted).
        self.pending_keys: int | None = None
        #: Set by ``leave``: this worker claims no more, and is no peer again.
        self.left = False
        #: The last claim's limited handlers all have limit 1: keys it shares (``cap``).
        self.shares = False
        self._next_beat = 0.0
        self._next_count = 0.0
        self._next_recount = 0.0

    @classmethod
    def of(
        cls,
        cfg: WorkerConfig,
        *,
        handlers: Callable[[], Mapping[str, object]],
        clock: Clock,
        bounded: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> KeyShare:
        """The share of a worker of ``cfg`` (its queues, threads and heartbeat)."""
        return cls(
            using=cfg.using,
            queues=cfg.queues,
            handlers=handlers,
            threads=cfg.concurrency,
            interval=cfg.heartbeat_interval,
            stale_after=cfg.stale_after,
            clock=clock.now,
            poll=cfg.poll_interval,
            bounded=bounded,
        )

    def limited(self) -> bool:
        """Whether a handler of this worker declares a ``concurrency_limit``."""
        return any(
            getattr(handler, "concurrency_limit", None) is not None
            for handler in self.handlers().values()
        )

    @property
    def pool(self) -> str:
        """The pool's digest, for the handlers of now (replaced when tasks are found)."""
        handlers = self.handlers()
        if handlers is not self._seen:
            self._pool, self._seen = pool_of(self.queues, handlers), handlers
        return self._pool

    # -- the register ------------------------------------------------------------

    def _bounded(self) -> AbstractContextManager[Any]:
        """A transaction whose statements give up soon, lock waits included (the vendor's
        ``register_transaction``): the heartbeat thread, the claim loop and the success
        writer call in here, and a register row or table locked by someone else must not
        hold them (the heartbeat of running items least of all: they would be recovered as
        stale and run again; attack s15b)."""
        if self.bounded is not None:
            return self.bounded()
        return transaction.atomic(using=self.using)

    def join(self, announce: Callable[[Sequence[str]], object] | None = None) -> bool:
        """Write this worker's row; whether it was written (a failure is logged). With
        limited handlers, ``announce`` wakes the others of its queues: they may hold every
        key, and count again (``KeyHandOver.share_out``)."""
        if self.left:
            return False
        row = {"pool": self.pool, "queues": self.queues, "threads": self.threads}
        try:
            with self._bounded():
                WorkerProcess.objects.using(self.using).update_or_create(
                    name=self.name,
                    defaults={**row, "seen_at": Now()},
                    create_defaults={**row, "started_at": Now(), "seen_at": Now()},
                )
        except Exception as exc:
            logger.warning("Could not register this worker (%s); it claims keys unshared.", exc)
            return False
        self._next_beat = self.clock() + self.interval
        if announce is not None and self.limited():
            announce(self.queues or [DEFAULT_QUEUE])
        return True

    def beat(self) -> None:
        """Refresh this worker's row when due, and delete the rows of long-dead workers."""
        if self.left or self.clock() < self._next_beat:
            return
        self._next_beat = self.clock() + self.interval
        rows = WorkerProcess.objects.using(self.using)
        try:
            with self._bounded():
                found = rows.filter(name=self.name).update(seen_at=Now(), pool=self.pool)
                rows.filter(seen_at__lt=Now() - timedelta(seconds=self.stale_after)).delete()
            if not found:
                self.join()  # deleted meanwhile (taken for dead): back in
        except Exception as exc:
            logger.debug("Could not refresh this worker's register row: %s", exc)

    def leave(self) -> threading.Thread | None:
        """Delete this worker's row (it stopped claiming): the others' shares grow at once;
        a beat after this one (the heartbeat beats on while the worker drains) writes none.

        On a thread of its own (returned), waited for LEAVE_WAIT at most: the caller, the
        main thread going on to drain or to release running items (a second signal), never
        waits longer on a register statement; one still running then may leave the row
        behind, to stop counting after three beats like a crashed worker's."""
        if self.left:
            return None
        self.left = True
        thread = threading.Thread(target=self._delete, name="dbworker-leave", daemon=True)
        thread.start()
        thread.join(LEAVE_WAIT)
        return thread

    def _delete(self) -> None:
        try:
            with self._bounded():
                WorkerProcess.objects.using(self.using).filter(name=self.name).delete()
        except Exception as exc:
            logger.debug("Could not delete this worker's register row: %s", exc)
        finally:
            close_thread_connections()

    def count(self) -> int:
        """The threads of the pool's live workers (at most every COUNT_EVERY seconds; else
        the last count), never fewer than this worker's own."""
        now = self.clock()
        if now >= self._next_count:
            self._next_count = now + COUNT_EVERY
            live = Now() - timedelta(seconds=LIVE_FOR_BEATS * self.interval)
            try:
                with self._bounded():
                    found = (
                        WorkerProcess.objects.using(self.using)
                        .filter(pool=self.pool, seen_at__gte=live)
                        .aggregate(threads=Sum("threads"))["threads"]
                    )
            except Exception as exc:
                logger.debug("Could not count the live workers: %s", exc)
            else:
                self.pool_threads = max(self.threads, found or 0)
        return self.pool_threads

    # -- the cap ------------------------------------------------------------------

    def counted(self, pending_keys: int | None) -> None:
        """A keyed claim's count of the keys in play (None: it counted none). While the
        count stays the same, the next one waits twice as long (up to the poll interval):
        a worker running one long keyed item does not claim four times a second."""
        if pending_keys is None or pending_keys != self.pending_keys:
            self._recount_every = RECOUNT_KEYS_EVERY
        else:
            self._recount_every = min(2 * self._recount_every, max(self.poll, RECOUNT_KEYS_EVERY))
        self.pending_keys = pending_keys
        self._next_recount = self.clock() + self._recount_every

    def room(self, held: int) -> int | None:
        """How many more keyed rows this worker may hold, holding ``held``; None: no cap
        (no count of the keys, none in play, or no live peer)."""
        if not self.pending_keys:
            return None
        pool_threads = self.count()
        if pool_threads <= self.threads:
            return None
        share = math.ceil(self.pending_keys * self.threads / pool_threads) + 1
        return max(0, share - held)

    def recount_in(self, held: int) -> float:
        """Seconds the claim loop may wait before the keys in play are to be counted again,
        holding ``held`` keyed rows (inf: none to share, or none held: an idle worker learns
        of keys left to it by a wake-up or its poll; at least MIN_RECOUNT_WAIT: a loop with
        no room to claim counts nothing, and would otherwise not wait at all)."""
        if not self.pending_keys or not held or self.pool_threads <= self.threads:
            return math.inf
        return max(MIN_RECOUNT_WAIT, self._next_recount - self.clock())

    def cap(self, limit: int, *, held: int, limits: Mapping[str, int]) -> tuple[int, bool]:
        """A keyed claim's ``limit`` within the share, and whether the share cut it.

        Keys of limit 1 only (``limits``: the claim's limited handlers): a key of a higher
        limit is never handed over, so it sticks to no worker, and its slots are not keys
        (four keys of limit 5 are 20 slots; attack s15). Cut to nothing, a claim is still
        made now and then, of one row, for its new count of the keys in play.
        """
        self.shares = set(limits.values()) == {1}
        if not self.shares:
            return limit, False
        room = self.room(held)
        if room is None or room >= limit:
            return limit, False
        if room <= 0 and self.clock() >= self._next_recount:
            return 1, True
        return room, True

    def handover_room(self, room: int, *, held: int) -> tuple[int, bool]:
        """A hand-over's ``room`` within the share (as the last claim's: ``shares``), with
        ``held`` the keyed rows this worker keeps after the write; and whether it cut it."""
        shared = self.room(held) if self.shares else None
        if shared is not None and shared < room:
            return shared, True
        return room, False
