"""The WorkItem claim loop: how many rows to claim, claiming them, and dispatch.

Runs on the worker's calling (main) thread. Each step recovers stale rows if due
(``recovery.py``), gives back buffered rows it cannot start soon, claims a batch in
one short statement sized to the free threads plus a prefetch buffer (``prefetch.py``:
what the threads can start within PREFETCH_HORIZON), records the rows as attempts in
the ledger and queues them on the pool. Between steps it sleeps on the wake-up event
that LISTEN/NOTIFY, a buffer running low and signals set. Handler code never runs
here, and nothing here holds a row lock beyond its claim statement.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django_dbworker.db import VendorOperations
from django_dbworker.db.errors import is_transient
from django_dbworker.handlers import WorkItemHandler, runs_async
from django_dbworker.metrics import WORK_ITEM_LOOP, WorkerMetrics
from django_dbworker.models import WorkItem
from django_dbworker.worker.attempts import Attempt, Ledger
from django_dbworker.worker.claim import KEYED_REFILL, Claim, ClaimRoute
from django_dbworker.worker.clock import Clock
from django_dbworker.worker.config import (
    MAX_CLAIM,
    SHED_AFTER_HORIZONS,
    UNRECORDED_EXTRA,
    URGENT_PEEK,
    WorkerConfig,
)
from django_dbworker.worker.connections import Backoff, close_quietly, outage, report_error
from django_dbworker.worker.control import Control
from django_dbworker.worker.event_loop import EventLoop
from django_dbworker.worker.pool import Pool
from django_dbworker.worker.prefetch import Prefetch
from django_dbworker.worker.recovery import Recovery
from django_dbworker.worker.shutdown import Shutdown
from django_dbworker.worker.wakeup import AdaptivePoll, polls_adaptively

logger = logging.getLogger("django_dbworker.worker")

#: Seconds between two looks at whether the buffer should shed rows.
SHED_CHECK_EVERY = 0.25


@dataclass(frozen=True)
class Rooms:
    """The rows each kind of handler has room for in a worker that serves both: threads
    for the sync ones, the event loop's slots for the async ones (with each one's share of
    the buffer)."""

    sync: int
    async_: int

    @property
    def full_kind(self) -> bool | None:
        """The kind without room: True (async), False (sync); None: room for both."""
        if self.sync <= 0:
            return False
        if self.async_ <= 0:
            return True
        return None


class ClaimLoop:
    def __init__(
        self,
        *,
        config: WorkerConfig,
        control: Control,
        ops: VendorOperations,
        pool: Pool,
        ledger: Ledger,
        prefetch: Prefetch,
        recovery: Recovery,
        shutdown: Shutdown,
        metrics: WorkerMetrics,
        clock: Clock,
        handlers: Callable[[], dict[str, WorkItemHandler]],
        run_next: Callable[[], None],
        start_async: Callable[[], None] = lambda: None,
        healthy: Callable[[], bool],
        raise_errors: bool,
        priorities_arrive: Callable[[], bool] = lambda: False,
        event_loop: EventLoop | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.ops = ops
        self.pool = pool
        #: Where async handlers' attempts run: its slots count beside the threads.
        self.event_loop = event_loop
        self.ledger = ledger
        self.prefetch = prefetch
        self.recovery = recovery
        self.shutdown = shutdown
        self.metrics = metrics
        self.clock = clock
        #: The WorkItem handlers claimed for, by name (replaced, never changed
        #: in place, when tasks are discovered after start).
        self.handlers = handlers
        #: What a pool thread runs: the best buffered attempt (``AttemptRunner.run_next``).
        self.run_next = run_next
        #: What the event loop's threads run per claimed async row (``AttemptRunner.start_async``).
        self.start_async = start_async
        self.healthy = healthy
        #: Inline, a claim error is the caller's (its connection, its transaction).
        self.raise_errors = raise_errors
        #: Whether wake-ups say the priority of what was enqueued (a LISTEN that NOTIFY
        #: reaches); if not, a worker with a buffer looks for outranking rows itself.
        self.priorities_arrive = priorities_arrive
        #: Rows claimed so far, and by how many claim statements that found rows.
        self.claimed = 0
        self.claims = 0
        #: Buffered rows handed back because jobs got too long to start them soon.
        self.given_back = 0
        self._backoff = Backoff(first=0.2, cap=10.0)
        #: When the loop last began a cycle (the health file's sign of life).
        self.cycled_at = clock.now()
        self._poll = AdaptivePoll(
            config.poll_interval, enabled=polls_adaptively(ops, config.wakeups), clock=clock.now
        )
        #: The claim loop is woken to refill when this few rows are buffered.
        self._refill_at = 0
        #: The last claim statement found fewer rows than it asked for.
        self._ran_dry = False
        #: The last claim (not an urgent one) came back full, or the loop was woken with
        #: no room (``saturated``).
        self._saturated = False
        #: Rows each kind of handler has room for, when the worker serves both (``_rooms``;
        #: None: one kind, or an urgent claim).
        self._rooms: Rooms | None = None
        #: Wake-ups announced so far (the listener's thread adds), and their count when
        #: the last claim began if it found all that was ready (``Claim.drained``); a
        #: buffer running low claims again only once they differ.
        self._heard = 0
        self._drained: int | None = None
        self._next_shed_check = 0.0
        #: Wake-ups of rows that outrank something buffered, since the last claim.
        self._urgent = 0
        #: The claim being made was sized by such wake-ups.
        self._urgent_claim = False
        self._urgent_lock = threading.Lock()
        #: Held by a claim and by a give-back: a claim beside a give-back of this
        #: worker's would skip the rows being given back (locked) and take the rows
        #: behind them, which would then start first. Reentrant: in burst mode a
        #: claimed row runs inside the claim's dispatch, and may be given back there.
        self._claim_or_give_back = threading.RLock()
        #: Which rows to claim, by which statement (``claim.py``).
        self.route = ClaimRoute(
            ops=ops, config=config, metrics=metrics, now=clock.now, handlers=handlers
        )
        #: The last claim was keyed and took all it could: until a key is freed here
        #: (``retired``) or rows come, a low buffer does not wake the loop (an empty keyed
        #: claim costs as much as a full one).
        self.rests = False

    @property
    def saturated(self) -> bool:
        """More may be ready than this worker takes, or it is stopping: it passes the
        wake-up turn on (``wakeup.Listener``) until a claim of its comes back short."""
        return self._saturated or self.control.stopping.is_set()

    # -- one step --------------------------------------------------------------

    def run_once(self) -> int:
        """One claim-and-dispatch step: recover stale rows if due, claim a batch, submit it.

        Returns the number of rows claimed.
        """
        if not self.healthy():
            return 0
        self.recovery.maybe_recover()
        self._shed_hoard()
        self._give_back_paused()
        self._give_back_withheld()
        limit = self._claim_limit()
        max_items = self.config.max_items
        if max_items is not None:
            limit = min(limit, max_items - self.claimed)
            if limit <= 0 and self.claimed >= max_items:
                self.control.stopping.set()
                return 0
        if limit <= 0:
            return 0
        self.metrics.poll(WORK_ITEM_LOOP)
        started = self.clock.now()
        lowest = self.ledger.lowest_buffered_priority()
        heard = self._heard
        taken: list[WorkItem] = []

        def dispatch(items: Sequence[WorkItem]) -> None:
            taken.extend(items)
            self._dispatch(items, claimed_at=started)

        try:
            with self._claim_or_give_back:
                result = self._claim(limit, dispatch, taken)
        except Exception:
            if self._urgent_claim:
                with self._urgent_lock:
                    self._urgent += limit  # the retry after the backoff is urgent still
            raise
        took = self.clock.now() - started
        self.metrics.claim_took(WORK_ITEM_LOOP, took)
        self.prefetch.observe_claim(took)
        self.recovery.observe_write(took)
        self._ran_dry = result.dry
        # Rows of a kind left out may be ready: room for them, not a wake-up, says when.
        self._drained = heard if result.drained and self._full_kind() is None else None
        if not self._urgent_claim:
            self._saturated = not result.dry or self._full_kind() is not None
        # Not after a claim that left a kind out: its rows wait for room, not for a key, and
        # no wake-up announces them again (room that frees up wakes the loop, ``maybe_wake``).
        self.rests = (
            result.dry
            and result.keyed
            and not result.rated
            and not self._urgent_claim
            and self._full_kind() is None
        )
        if taken and not self._ran_dry and lowest is not None:
            top = min(item.priority for item in taken)
            if self._urgent_claim:
                if top > lowest:
                    # One wake-up may stand for a batch (enqueue_many sends
                    # one): while urgent claims come back full of outranking
                    # rows, claim twice as many of them next.
                    with self._urgent_lock:
                        self._urgent += min(2 * len(taken), MAX_CLAIM)
                    self.control.wake.set()
            else:
                # A full claim of rows that outrank buffered ones: more such
                # rows may be pending, which the buffer would keep this worker
                # (and, held here, every other worker) from taking.
                self._give_back_outranked(top, than=lowest)
        return result.taken

    def _claim(
        self, limit: int, dispatch: Callable[[Sequence[WorkItem]], None], taken: list[WorkItem]
    ) -> Claim:
        """The claim of up to ``limit`` rows: one statement, or, when the sync rows could take
        more than the threads' room (``Rooms.sync``), one per kind, each within its room
        (the event loop's free slots are no room for sync rows, nor threads for async ones)."""

        def claim(rows: int, skip_async: bool | None) -> Claim:
            return self.route.claim(
                rows,
                free=self._free_threads(),
                limited_in_flight=self.ledger.keyed_of(self.route.limited()),
                dispatch=dispatch,
                skip_async=skip_async,
            )

        rooms = self._rooms
        if rooms is None or rooms.full_kind is not None or rooms.sync >= limit:
            return claim(limit, self._full_kind())
        sync = claim(rooms.sync, True)
        rows = min(limit - len(taken), rooms.async_)
        if rows <= 0:
            return sync
        return sync.and_then(claim(rows, False))

    def _free_threads(self) -> int:
        """Threads with nothing to start: rate-limited rows are claimed for these only.

        Not prefetched, so that a rate-limited row starts about when it is
        claimed (its start was counted in the window at the claim).
        """
        return max(0, self._slots() - self._running() - self.ledger.buffered())

    def _slots(self) -> int:
        """Threads, plus the event loop's slots while an async handler is served."""
        loop = self.event_loop
        if loop is not None and self._serves_async():
            return self.pool.size + loop.size
        return self.pool.size

    def _running(self) -> int:
        """Attempts running on the threads and on the event loop."""
        loop = self.event_loop
        return self.pool.running() + (loop.running() if loop is not None else 0)

    def _give_back_paused(self) -> None:
        """Give back buffered rows of queues paused since they were claimed (once per poll).

        Nothing buffered, nothing to give back: no read (the claims skip
        paused queues themselves).
        """
        if not self.ledger.buffered():
            return
        paused = self.route.paused_since_claim()
        if not paused or self.control.draining.is_set():
            return
        given_back = self._give_back(self.ledger.withdraw_in_queues(paused))
        if given_back:
            logger.info(
                "Gave back %d buffered work item(s) of paused queue(s) %s.",
                given_back,
                ", ".join(sorted(paused)),
            )

    def _give_back_withheld(self) -> None:
        """Give back buffered rows of rate-limited handlers whose window filled since they
        were claimed: they could not start before it frees up, and other handlers' rows
        (or other workers, by then) can use the threads."""
        if not self.ledger.buffered():
            return
        held = self.route.withheld()
        if not held or self.control.draining.is_set():
            return
        given_back = self._give_back(self.ledger.withdraw_of_handlers(held))
        if given_back:
            logger.debug(
                "Gave back %d buffered work item(s) of %s: the rate limit's window is full.",
                given_back,
                ", ".join(sorted(held)),
            )

    def give_back(self, attempts: list[Attempt]) -> int:
        """Release attempts a pool thread could not start (their rate window is full),
        with their handlers' buffered rows: those were claimed after them, and kept here
        they would start first (a window that frees up before the loop next gives back
        withheld rows), while the refused rows wait behind them in pending."""
        handlers = frozenset(attempt.handler.name for attempt in attempts)
        return self._give_back(attempts + self.ledger.withdraw_of_handlers(handlers))

    def announce(self, priority: int | None) -> None:
        """A wake-up: rows of ``priority`` were committed (None: unknown, after a reconnect).

        A row that outranks something in the buffer is claimed at once,
        ahead of the refill mark, and starts on the next free thread (the
        buffer starts in claim order); one that does not just wakes the
        loop, which claims when the buffer runs low as usual.
        """
        self._heard += 1  # rows came: a buffer running low claims them
        lowest = self.ledger.lowest_buffered_priority()
        if lowest is not None and (priority is None or priority > lowest):
            with self._urgent_lock:
                self._urgent += 1
        self.control.wake.set()

    def _take_urgent(self) -> int:
        with self._urgent_lock:
            urgent, self._urgent = self._urgent, 0
        return urgent

    def _claim_limit(self) -> int:
        """How many rows to claim now: free threads plus what the buffer lacks.

        Nothing while the buffer holds more than its refill mark (a refill of
        a few rows would cost a commit each), unless a wake-up announced rows
        that outrank buffered ones: then one row per such wake-up (the claim
        takes the highest priority first). Rows awaiting their success
        write still count against the process: at most the running and
        buffered rows plus UNRECORDED_EXTRA are claimed and not yet recorded,
        so a slow database applies back-pressure instead of a growing queue
        (and heartbeats stay one bounded UPDATE).
        """
        running_for = self._youngest_running_age()
        target = self.prefetch.target(running_for, fair=self.route.fair_turns())
        self._refill_at = self.prefetch.refill_at(target, running_for)
        urgent = self._take_urgent()
        self._urgent_claim = bool(urgent)
        self._rooms = None
        if urgent:
            # One row per such wake-up, and only those: a small claim is a
            # quick one (a refill of hundreds takes several milliseconds),
            # and the refill, if due, follows at once. Past the back-pressure
            # bound too, so a buffer that outgrew its (shrunken) target
            # cannot hold an urgent row back; shedding gives the excess back.
            return min(urgent, MAX_CLAIM)
        # The buffer as the ledger counts it: pool calls queued for rows
        # given back meanwhile would otherwise hold the next claim back.
        room = self._room(target)
        self._rooms = self._rooms_of_kinds(target)
        if (room <= 0 or self._full_kind() is not None) and not self._waits_for_wakeups():
            # Woken with no room: let an idle worker take the rows. Not when no rows were
            # announced since a claim that found all that was ready (a job's end woke it):
            # no claim might follow to say it has room again, and it kept passing the turn.
            self._saturated = True
        if self.ledger.buffered() > self._refill_at:
            return 0
        return room

    def _room(self, target: int) -> int:
        """Free threads plus what the buffer lacks of ``target``, within the back-pressure bound."""
        outstanding = self._running() + self.ledger.buffered()
        unrecorded = len(self.ledger)
        slots = self._slots()
        hold = slots + target  # inline, one at a time
        # The event loop's finished items wait for their batched success write like the
        # threads' do, as many of them as it has slots: room for that many more.
        extra = UNRECORDED_EXTRA + slots - self.pool.size
        limit = min(hold - outstanding, hold + extra - unrecorded, MAX_CLAIM)
        if self.config.batch_size > 0:
            limit = min(limit, self.config.batch_size)
        return max(0, limit)

    def _rooms_of_kinds(self, target: int) -> Rooms | None:
        """The rows each kind of handler has room for, when this worker serves both (None:
        one kind). Counted together, the event loop's free slots were room for a sync row,
        which waited here for a thread while another worker idled (and kept the wake-up
        turn): the claim leaves a kind without room to other workers (``Rooms.full_kind``).
        """
        loop = self.event_loop
        if loop is None or not self._serves_async():
            return None
        if all(runs_async(type(h)) for h in self.handlers().values()):
            return None
        waiting_async = self.ledger.buffered_of(lambda a: runs_async(type(a.handler)))
        waiting_sync = self.ledger.buffered() - waiting_async
        return Rooms(
            sync=self.pool.size + target - self.pool.running() - waiting_sync,
            async_=loop.size + target - loop.running() - waiting_async,
        )

    def _full_kind(self) -> bool | None:
        """The kind the claim being made leaves out for want of room (``Rooms.full_kind``)."""
        return None if self._rooms is None else self._rooms.full_kind

    def _serves_async(self) -> bool:
        """Whether any of this worker's handlers is async (the event loop's slots count)."""
        return any(runs_async(type(h)) for h in self.handlers().values())

    def retired(self, attempt: Attempt) -> None:
        """An attempt left the ledger. If it held a slot of a limited key, a resting loop
        claims once this process holds few such rows (``KEYED_REFILL`` per thread): the
        keys' next rows, without waiting for a poll, a batch at a time. Otherwise the loop
        wakes when its buffer runs low."""
        if (
            self.rests
            and attempt.handler.concurrency_limit is not None
            and self.ledger.keyed_of(self.route.limited()) <= KEYED_REFILL * self.config.concurrency
        ):
            self.control.wake.set()
        else:
            self.maybe_wake()

    def _dispatch(self, items: Sequence[WorkItem], *, claimed_at: float) -> None:
        """Record claimed rows as attempts in flight and queue them, in claim order."""
        if not items:
            return
        self.claimed, self.claims = self.claimed + len(items), self.claims + 1
        handlers = self.handlers()
        attempts = [Attempt(item, handlers[item.handler], claimed_at=claimed_at) for item in items]
        self.ledger.add(attempts)
        self.pool.submit_many([self.run_next] * len(attempts))
        if self.event_loop is not None:
            starts = sum(1 for attempt in attempts if runs_async(type(attempt.handler)))
            if starts:
                self.event_loop.start_soon([self.start_async] * starts)

    def _shed_hoard(self) -> None:
        """Give back buffered rows this worker cannot start soon.

        The buffer is sized from the jobs seen so far; when jobs suddenly get
        long (a batch of slow items behind fast ones), rows claimed for the
        fast pace would wait here while other workers sit idle. Once the
        oldest buffered row has waited a few horizons, the rows beyond what
        the current estimate allows (the last claimed first) go back to
        pending, where any worker can take them.
        """
        now = self.clock.now()
        if (
            not self.prefetch.enabled
            or self.control.draining.is_set()
            or now < self._next_shed_check
        ):
            return
        self._next_shed_check = now + SHED_CHECK_EVERY
        patience = max(1.0, SHED_AFTER_HORIZONS * self.prefetch.horizon)
        keep = self.prefetch.target(self._youngest_running_age())
        given_back = self._give_back(self.ledger.withdraw_excess(keep, older_than=now - patience))
        if given_back:
            logger.info(
                "Gave back %d buffered work item(s) that this worker could not start within "
                "PREFETCH_HORIZON (%gs): its jobs now take longer.",
                given_back,
                self.prefetch.horizon,
            )

    def _give_back(self, withdrawn: list[Attempt]) -> int:
        """Release withdrawn buffered attempts to pending; how many rows went back.

        If the release fails they are still this worker's: kept in flight
        (heartbeated) and run after all; their queued pool calls may be
        gone, so they are queued anew.
        """
        if not withdrawn:
            return 0
        try:
            with self._claim_or_give_back:
                given_back = self.shutdown.release(withdrawn, "giving back buffered work items")
        except Exception as exc:
            logger.warning("Could not give back %d buffered work item(s): %s", len(withdrawn), exc)
            self.ledger.restore(withdrawn)
            self.pool.submit_many([self.run_next] * len(withdrawn))
            return 0
        self.given_back += given_back
        for attempt in withdrawn:
            self.ledger.retire(attempt)
        return given_back

    def _give_back_outranked(self, priority: int, *, than: int) -> None:
        """Release the buffered rows of lower priority than ``priority`` (the rows just claimed)."""
        if priority <= than:
            return
        given_back = self._give_back(self.ledger.withdraw_below(priority))
        if given_back:
            logger.debug(
                "Gave back %d buffered work item(s) of lower priority than %d: such rows are "
                "pending.",
                given_back,
                priority,
            )

    def _youngest_running_age(self) -> float:
        """Seconds the youngest running attempt has run, when every thread is busy; else 0.

        Jobs that suddenly take long show here before any of them finishes.
        """
        if self.pool.running() < self.pool.size:
            return 0.0
        start = self.ledger.youngest_start()
        return self.clock.now() - start if start is not None else 0.0

    def _peeks(self) -> bool:
        """Whether to look for outranking rows now: something is buffered, and wake-ups do
        not say their priority (no LISTEN, or one that NOTIFY does not reach)."""
        return self.ledger.buffered() > 0 and not self.priorities_arrive()

    def _peek(self) -> None:
        """A ready row outranks the buffer: claim it now (``announce``), ahead of the buffer.

        Where wake-ups carry priorities an urgent enqueue says so itself; elsewhere the
        worker would learn of it only at its next refill, a PREFETCH_HORIZON of buffered
        work later. One indexed read, no lock; a failure waits for the claim's own report.
        """
        lowest = self.ledger.lowest_buffered_priority()
        if lowest is None:
            return
        try:
            outranked = self.route.outranked(lowest)
        except Exception as exc:
            logger.debug("Could not look for outranking rows: %s", exc)
            return
        if outranked:
            self.announce(None)

    def maybe_wake(self) -> None:
        """Wake the loop if the buffer is down to its refill mark.

        Asked three times per job from pool threads, so it reads the pool's
        count (no ledger lock). With pool calls of given-back rows still
        queued it wakes the loop later, never more often than the claim
        gate (``_claim_limit``, which counts the ledger's buffer) allows:
        waking more often measured as a claim loop spinning on the GIL
        (W6 p50 2.6 -> 16 ms).
        """
        wake = self.control.wake
        # ``is_set`` first: ``set`` takes the event's lock and notifies even when
        # it is already set, which it is for most of a drain's jobs.
        if (
            not wake.is_set()
            and not self.rests
            and self.pool.queued() <= self._refill_at
            and not self._waits_for_wakeups()
        ):
            wake.set()

    def _waits_for_wakeups(self) -> bool:
        """The last claim found all that was ready, and new rows say so themselves.

        Then a buffer running low is no reason to claim: the claim would find
        nothing (it did: 1.8 empty claims per streamed job). Where wake-ups do
        not reach this worker, or the claim was held back by limits, it claims.
        """
        return self._drained == self._heard and self.priorities_arrive()

    # -- the loop --------------------------------------------------------------

    def run(self) -> None:
        """Claim until stopped (or, in burst mode, until nothing is left to claim or run)."""
        control, clock = self.control, self.clock
        while not control.stopping.is_set():
            self.cycled_at = clock.now()
            control.wake.clear()
            # Burst mode stops only after a claim that began with nothing in flight:
            # an attempt's ending can enqueue work (a batch's callback, released
            # dependents) in the same commit, which a claim begun before it misses. Nor
            # while a thread still runs its task after its attempt left the ledger: the
            # threads are full then, and a claim with no room finds nothing.
            settled = not self.ledger and not self._running()
            try:
                claimed = self.run_once()
            except Exception as exc:
                if self.raise_errors:
                    raise
                self.metrics.claim_error(WORK_ITEM_LOOP)
                self.recovery.observe_write(math.inf)  # a claim that failed was held up too
                delay = self._backoff.next()
                if report_error(self.config.using, "claiming", exc):
                    pass  # one line per outage (connections.DatabaseOutage)
                elif is_transient(exc):
                    logger.error(
                        "Database unavailable while claiming (%s); retrying in %.1fs.", exc, delay
                    )
                else:
                    # Not a connection problem (a missing table, a bad query): say
                    # so loudly, but keep the process alive and its rows owned.
                    logger.exception("Claiming failed; retrying in %.1fs.", delay)
                close_quietly(self.config.using)
                clock.wait(control.stopping, delay)
                continue
            self._backoff.reset()
            outage.back(self.config.using)
            if control.stopping.is_set():
                return
            if claimed:
                self._poll.found_work()
            if claimed and not self._ran_dry:
                continue  # a full batch: more rows may be ready right now
            if (
                self.config.burst
                and not claimed
                and settled
                and not self.ledger
                and self.route.finished()
            ):
                return
            if not claimed and self._ran_dry:
                control.idle.set()
            # A full rate window ends by itself: claim when it does.
            wait = min(self._poll.next(), self.route.next_window())
            peeking = self._peeks()
            if peeking:
                wait = min(wait, URGENT_PEEK)
            if not clock.wait(control.wake, wait) and peeking:
                self._peek()
            control.idle.clear()
