"""Attempts in flight and the one ledger that owns them.

An attempt is one claim of one row: created when the claim returns it,
retired when its outcome is recorded (or when the row is handed back).
It is keyed by ``(row id, claim token)``: a row claimed again by this same
process (a retry after a timeout, a re-claim after a false stale detection)
is a different attempt, and nothing the older one does touches it.

The ledger is the only place that changes an attempt's state, under one
lock; the claim loop, pool threads, the heartbeat, the success writer's
callbacks and shutdown all go through it. It holds no database code and
runs no user code.

States::

    BUFFERED --taken--> RUNNING --handler done--> RECORDING --settled--> retired
       |                   |                          |
       |withdraw           |heartbeat: token gone     |heartbeat: token gone
       v                   v                          v
    RELEASED             LOST  <----------------------'
    (handed back)        (its outcome will be fenced out)

``RELEASED`` and ``LOST`` attempts are retired too, once the release is
written or the lost attempt's run ends. Whether an attempt's ending has
been accounted for is kept here as well: its one ``attempt_recorded`` call
(``mark_recorded``, taken by the first write that landed, else by its own
ending) and the accounting of its own ending (``conclude``), so that a
timed-out attempt whose abandoned run ends later is accounted for once.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum

from django_dbworker.handlers import ATTEMPT_ATTR, WorkItemHandler
from django_dbworker.models import WorkItem
from django_dbworker.transitions import AttemptKey

#: Numbers the attempts in the order their claims dealt them (``Attempt.order``).
_CLAIMS = itertools.count()


class State(Enum):
    BUFFERED = "buffered"
    RUNNING = "running"
    RECORDING = "recording"
    LOST = "lost"
    RELEASED = "released"


@dataclass(eq=False)
class Attempt:
    """One claim of one row, from the claim until its outcome is recorded."""

    item: WorkItem
    handler: WorkItemHandler
    #: Clock time when its claim statement was sent (its row's heartbeat_at
    #: is no older than this).
    claimed_at: float
    #: When the row was last known to be ours: the claim, or the snapshot
    #: of the last heartbeat that found it held.
    confirmed_at: float = 0.0
    #: Clock time when a pool thread started it; None while buffered.
    started_at: float | None = None
    state: State = State.BUFFERED
    #: Its ``attempt_recorded`` hook was called or is due (``Ledger.mark_recorded``).
    recorded: bool = False
    #: Its own ending was accounted for: counted, retired (``Ledger.conclude``).
    ended: bool = False
    #: It overran its timeout; its run goes on, abandoned (``Ledger.abandon``).
    abandoned: bool = False
    #: An operator asked to stop it: its heartbeat found ``cancel_requested_at``
    #: on its row (``Ledger.mark_cancel_requested``); the handler's
    #: ``cancel_requested`` reads it, and its ending is ``cancelled``.
    cancel_requested: bool = False
    _key: AttemptKey = field(init=False)
    #: Its place among this process's claims: the claim route deals a claim's rows in
    #: the order they should start (the fair rotation's turns), not always by due time.
    _seq: int = field(init=False)

    def __post_init__(self) -> None:
        self._seq = next(_CLAIMS)
        self.confirmed_at = self.claimed_at
        assert self.item.claim_token is not None
        self._key = (self.item.pk, self.item.claim_token)
        self.item.__dict__[ATTEMPT_ATTR] = self

    @property
    def key(self) -> AttemptKey:
        return self._key

    @property
    def order(self) -> tuple[int, int]:
        """Start order: highest priority first, then as claimed (``ClaimRoute``)."""
        return (-self.item.priority, self._seq)

    @property
    def lost(self) -> bool:
        return self.state is State.LOST

    @property
    def recording(self) -> bool:
        return self.state is State.RECORDING


class Ledger:
    """The attempts of one worker process that are not yet recorded."""

    def __init__(self, *, on_retired: Callable[[Attempt], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._attempts: dict[AttemptKey, Attempt] = {}
        #: The newest attempt of each row in flight.
        self._by_row: dict[int, Attempt] = {}
        #: Buffered attempts in claim order (a heap; entries of attempts that
        #: started or were withdrawn meanwhile are skipped when popped). Pool
        #: threads start the best one, not the oldest: a higher-priority row
        #: claimed after a buffer of bulk work starts next.
        self._buffer: list[tuple[tuple[int, int], int, Attempt]] = []
        self._seq = itertools.count()
        #: How many buffered attempts there are of each priority.
        self._buffered: Counter[int] = Counter()
        self._on_retired = on_retired

    # -- reading -------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._attempts)

    def __bool__(self) -> bool:
        return len(self) > 0

    def items(self) -> list[WorkItem]:
        with self._lock:
            return [a.item for a in self._attempts.values()]

    def keyed_of(self, handlers: Collection[str]) -> int:
        """Attempts of rows with a concurrency key of ``handlers`` in flight (buffered,
        running, recording): the slots of limited keys this process holds."""
        if not handlers:
            return 0
        with self._lock:
            return sum(
                1
                for a in self._attempts.values()
                if a.item.concurrency_key is not None and a.item.handler in handlers
            )

    def attempts(self) -> list[Attempt]:
        with self._lock:
            return list(self._attempts.values())

    def to_heartbeat(self) -> list[AttemptKey]:
        """Every attempt whose claim is still believed ours."""
        with self._lock:
            return [key for key, a in self._attempts.items() if a.state is not State.LOST]

    def any_recording(self) -> bool:
        with self._lock:
            return any(a.state is State.RECORDING for a in self._attempts.values())

    def youngest_start(self) -> float | None:
        """When the youngest attempt still running its handler started."""
        with self._lock:
            starts = [
                a.started_at
                for a in self._attempts.values()
                if a.started_at is not None and a.state in (State.RUNNING, State.LOST)
            ]
        return max(starts) if starts else None

    # -- changing ------------------------------------------------------------

    def add(self, attempts: Iterable[Attempt]) -> None:
        """Claimed rows, in claim order (dicts keep it: shedding reads it)."""
        with self._lock:
            for attempt in attempts:
                self._attempts[attempt.key] = attempt
                # The row was claimed again: any older attempt of it here was
                # recovered as stale meanwhile, whether the heartbeat saw it or not.
                older = self._by_row.get(attempt.item.pk)
                if older is not None and older is not attempt:
                    self._move(older, State.LOST)
                self._by_row[attempt.item.pk] = attempt
                self._buffered[attempt.item.priority] += 1
                self._push(attempt)

    def _move(self, attempt: Attempt, state: State) -> None:
        """Change ``attempt``'s state (under the lock), keeping the buffer's priorities."""
        if attempt.state is State.BUFFERED:
            priority = attempt.item.priority
            self._buffered[priority] -= 1
            if not self._buffered[priority]:
                del self._buffered[priority]
        if state is State.BUFFERED:
            self._buffered[attempt.item.priority] += 1
        attempt.state = state

    def _push(self, attempt: Attempt) -> None:
        heapq.heappush(self._buffer, (attempt.order, next(self._seq), attempt))

    def take_next(
        self, now: float, *, draining: bool, only: Callable[[Attempt], bool] | None = None
    ) -> tuple[Attempt | None, State | None]:
        """A pool thread takes the best buffered attempt to run it (with ``only``, the
        best of those it accepts: the event loop's starter takes async ones).

        Answers ``(attempt, RUNNING)`` to run it, ``(attempt, LOST)`` for one
        recovered as stale while it waited (the caller drops it), or
        ``(None, None)``: nothing to start, or the worker is stopping
        (buffered rows are then released, not run).
        """
        with self._lock:
            if draining:
                return None, None
            skipped: list[tuple[tuple[int, int], int, Attempt]] = []
            try:
                return self._pop(now, only, skipped)
            finally:
                for entry in skipped:
                    heapq.heappush(self._buffer, entry)

    def _pop(
        self,
        now: float,
        only: Callable[[Attempt], bool] | None,
        skipped: list[tuple[tuple[int, int], int, Attempt]],
    ) -> tuple[Attempt | None, State | None]:
        """``take_next``'s search, under the lock; entries ``only`` refuses go to ``skipped``."""
        while self._buffer:
            entry = heapq.heappop(self._buffer)
            attempt = entry[2]
            state = attempt.state
            if only is not None and state is State.BUFFERED and not only(attempt):
                skipped.append(entry)
                continue
            if state is State.BUFFERED:  # the common case, inline: every job passes here
                priority = attempt.item.priority
                left = self._buffered[priority] - 1
                if left:
                    self._buffered[priority] = left
                else:
                    del self._buffered[priority]
                attempt.state = State.RUNNING
                attempt.started_at = now
                return attempt, State.RUNNING
            if state is State.LOST and attempt.started_at is None:
                # Handed out once to be dropped (a restored attempt has a
                # second heap entry: that one is skipped).
                attempt.started_at = now
                return attempt, State.LOST
        return None, None

    def lowest_buffered_priority(self) -> int | None:
        """The lowest priority among buffered attempts (None: nothing buffered)."""
        with self._lock:
            return min(self._buffered, default=None)

    def buffered(self) -> int:
        """How many attempts wait in the buffer (pool calls of withdrawn ones do not count)."""
        with self._lock:
            return sum(self._buffered.values())

    def buffered_of(self, kind: Callable[[Attempt], bool]) -> int:
        """How many buffered attempts ``kind`` accepts (the event loop's, the threads')."""
        with self._lock:
            return sum(1 for a in self._attempts.values() if a.state is State.BUFFERED and kind(a))

    def begin_recording(self, attempt: Attempt) -> None:
        """The handler is done; its outcome is being written (a heartbeat miss now raced it)."""
        with self._lock:
            if attempt.state is State.RUNNING:
                self._move(attempt, State.RECORDING)

    def lose(self, attempt: Attempt) -> None:
        """A started attempt's claim turned out gone (the start-time fence check)."""
        with self._lock:
            self._move(attempt, State.LOST)

    def mark_lost(self, keys: Iterable[AttemptKey]) -> list[Attempt]:
        """The heartbeat found these tokens gone; returns the attempts that lost a claim.

        An attempt whose outcome was being written lost nothing: the
        heartbeat raced the write (and a fenced write says so itself); it is
        not in the answer, but it is no longer heartbeated either. Nor did one
        being given back: the heartbeat raced its release.
        """
        lost: list[Attempt] = []
        with self._lock:
            for key in keys:
                attempt = self._attempts.get(key)
                if attempt is None or attempt.state in (State.LOST, State.RELEASED):
                    continue
                if attempt.state is not State.RECORDING:
                    lost.append(attempt)
                self._move(attempt, State.LOST)
        return lost

    def mark_held(self, keys: Iterable[AttemptKey], at: float) -> None:
        """The heartbeat whose snapshot was taken at ``at`` found these attempts held."""
        with self._lock:
            for key in keys:
                attempt = self._attempts.get(key)
                if attempt is not None and attempt.confirmed_at < at:
                    attempt.confirmed_at = at

    def mark_cancel_requested(self, keys: Iterable[AttemptKey]) -> None:
        """The heartbeat found cancel requests on these attempts' rows (never another's)."""
        with self._lock:
            for key in keys:
                attempt = self._attempts.get(key)
                if attempt is not None:
                    attempt.cancel_requested = True

    def withdraw_unstarted(self) -> list[Attempt]:
        """Take every buffered attempt back (to release it): no thread starts it after this."""
        with self._lock:
            unstarted = [a for a in self._attempts.values() if a.state is State.BUFFERED]
            for attempt in unstarted:
                self._move(attempt, State.RELEASED)
        return unstarted

    def withdraw_excess(self, keep: int, *, older_than: float) -> list[Attempt]:
        """The buffered attempts beyond the best ``keep``, if the oldest was claimed
        before ``older_than``; withdrawn (the last in claim order are the excess)."""
        with self._lock:
            unstarted = [a for a in self._attempts.values() if a.state is State.BUFFERED]
            if len(unstarted) <= keep or unstarted[0].claimed_at >= older_than:
                return []
            excess = sorted(unstarted, key=lambda a: a.order)[keep:]
            for attempt in excess:
                self._move(attempt, State.RELEASED)
        return excess

    def withdraw_below(self, priority: int) -> list[Attempt]:
        """Withdraw every buffered attempt of lower priority than ``priority``."""
        with self._lock:
            below = [
                a
                for a in self._attempts.values()
                if a.state is State.BUFFERED and a.item.priority < priority
            ]
            for attempt in below:
                self._move(attempt, State.RELEASED)
        return below

    def withdraw_in_queues(self, queues: Collection[str]) -> list[Attempt]:
        """Withdraw every buffered attempt of a row in one of ``queues`` (paused ones)."""
        with self._lock:
            found = [
                a
                for a in self._attempts.values()
                if a.state is State.BUFFERED and a.item.queue in queues
            ]
            for attempt in found:
                self._move(attempt, State.RELEASED)
        return found

    def withdraw_of_handlers(self, handlers: Collection[str]) -> list[Attempt]:
        """Withdraw every buffered attempt of one of ``handlers`` (a full rate window's)."""
        with self._lock:
            found = [
                a
                for a in self._attempts.values()
                if a.state is State.BUFFERED and a.item.handler in handlers
            ]
            for attempt in found:
                self._move(attempt, State.RELEASED)
        return found

    def unstart(self, attempt: Attempt) -> None:
        """A taken attempt that may not start after all (its rate window is full): withdrawn
        as if it had stayed buffered, to be released (or restored)."""
        with self._lock:
            if attempt.state is State.RUNNING:
                self._move(attempt, State.RELEASED)
                attempt.started_at = None

    def restore(self, attempts: Iterable[Attempt]) -> None:
        """Withdrawn attempts whose release failed: still ours, buffered again."""
        with self._lock:
            for attempt in attempts:
                if attempt.state is State.RELEASED:
                    self._move(attempt, State.BUFFERED)
                    self._push(attempt)

    def withdraw_leftovers(self, *, everything: bool) -> list[Attempt]:
        """At the end of a stop: what is left to release.

        Every attempt not recording its outcome (a finished handler's
        outcome is recorded, never released: releasing it would run a
        finished job again), or, with ``everything``, all of them.
        """
        with self._lock:
            leaving = [
                a for a in self._attempts.values() if everything or a.state is not State.RECORDING
            ]
            for attempt in leaving:
                if attempt.state is not State.LOST:
                    self._move(attempt, State.RELEASED)
        return leaving

    def mark_recorded(self, attempt: Attempt) -> bool:
        """Take ``attempt``'s one ``attempt_recorded`` call; False if it was taken."""
        with self._lock:
            if attempt.recorded:
                return False
            attempt.recorded = True
            return True

    def conclude(self, attempt: Attempt, *, hook: bool) -> tuple[bool, bool]:
        """Take the accounting of ``attempt``'s own ending, and its hook if ``hook``.

        Answers whether the accounting was still to take (False: another
        ending of the attempt took it) and whether the hook is due (no write
        of the attempt spoke first). One lock for both: this is every job's path.
        """
        with self._lock:
            if attempt.ended:
                return False, False
            attempt.ended = True
            due = hook and not attempt.recorded
            if due:
                attempt.recorded = True
            return True, due

    def abandon(self, attempt: Attempt) -> None:
        """``attempt`` timed out: whatever its run reports from now on is late."""
        with self._lock:
            attempt.abandoned = True

    def is_abandoned(self, attempt: Attempt) -> bool:
        return attempt.abandoned  # set once, under the lock; a bool read needs none

    def retire(self, attempt: Attempt) -> None:
        """Forget ``attempt`` (and only it): its outcome is recorded or its row handed back."""
        with self._lock:
            if self._attempts.get(attempt.key) is attempt:
                del self._attempts[attempt.key]
            if self._by_row.get(attempt.item.pk) is attempt:
                del self._by_row[attempt.item.pk]
        if self._on_retired is not None:
            self._on_retired(attempt)  # room for another claim (its key's slot)
