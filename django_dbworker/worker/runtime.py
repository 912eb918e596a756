"""``Worker``: the process-level runtime behind ``manage.py run_workers``.

The calling (main) thread runs the WorkItem claim loop: it claims batches
in one short statement each, sized to the free threads plus a prefetch
buffer (``prefetch.py``: what the threads can start within
PREFETCH_HORIZON), queues the rows on the pool, runs the stale-recovery
pass at a bounded rate, and sleeps on a wake-up event that LISTEN/NOTIFY,
a buffer running low and signals set. Pool threads take the next buffered
row as soon as they finish one. Handler code never runs on the main thread
and never inside the claim transaction.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

from django_dbworker import transitions, validation
from django_dbworker.conf import dbworker_settings
from django_dbworker.db import operations
from django_dbworker.db.errors import is_transient
from django_dbworker.errors import WorkerLost
from django_dbworker.handlers import Handler, WorkItemHandler
from django_dbworker.metrics import WORK_ITEM_LOOP, WorkerMetrics, default_metrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.outcomes import Outcome
from django_dbworker.routing import work_db_for_write
from django_dbworker.transitions import AttemptKey
from django_dbworker.worker import execution
from django_dbworker.worker.abandoned import AbandonedThreads
from django_dbworker.worker.connections import (
    Backoff,
    close_quietly,
    close_thread_connections,
    persist,
)
from django_dbworker.worker.heartbeat import Heartbeat
from django_dbworker.worker.identity import worker_id
from django_dbworker.worker.notifier import Notifier
from django_dbworker.worker.own_table import HandlerLoop
from django_dbworker.worker.pool import InlinePool, Pool
from django_dbworker.worker.prefetch import Prefetch
from django_dbworker.worker.scheduler import Scheduler, start_scheduler
from django_dbworker.worker.success_writer import Refused, SuccessWriter, Written
from django_dbworker.worker.wakeup import AdaptivePoll, Listener, LocalWaker

logger = logging.getLogger("django_dbworker.worker")

#: Finished rows whose success write may still be pending, beyond the rows
#: running and buffered.
UNRECORDED_EXTRA = 100
#: Most rows one claim statement takes.
MAX_CLAIM = 500
#: A buffered row that waited this many horizons (and at least a second)
#: makes the worker reconsider what it holds.
SHED_AFTER_HORIZONS = 2.0
#: Seconds past SHUTDOWN_TIMEOUT a stopping worker waits for the outcomes of
#: finished handlers to be written (while the database is briefly away).
RECORD_GRACE = 30.0
#: How long a stopping worker waits for handlers' attempt_recorded hooks
#: (task_finished receivers) still queued.
NOTIFY_GRACE = 10.0


@dataclass
class WorkerConfig:
    """Everything a ``Worker`` needs; defaults come from ``DBWORKER`` settings."""

    concurrency: int = field(default_factory=lambda: int(dbworker_settings.CONCURRENCY))
    poll_interval: float = field(default_factory=lambda: float(dbworker_settings.POLL_INTERVAL))
    batch_size: int = field(default_factory=lambda: int(dbworker_settings.BATCH_SIZE))
    heartbeat_interval: float = field(
        default_factory=lambda: float(dbworker_settings.HEARTBEAT_INTERVAL)
    )
    stale_after: float = field(default_factory=lambda: float(dbworker_settings.STALE_AFTER))
    shutdown_timeout: float = field(
        default_factory=lambda: float(dbworker_settings.SHUTDOWN_TIMEOUT)
    )
    #: Timed-out handler threads still running at which the process stops
    #: claiming and exits non-zero; None means ``concurrency``.
    max_abandoned_threads: int | None = field(
        default_factory=lambda: dbworker_settings.MAX_ABANDONED_THREADS
    )
    burst: bool = False
    queues: Sequence[str] | None = None
    #: The database alias of the work table (routing.py: the routers' write alias).
    using: str = field(default_factory=work_db_for_write)
    #: Run each item in the calling thread, one at a time: no pool, writer,
    #: heartbeat or wake-up threads, and no timeouts (they need a second
    #: thread, which would not see the caller's transaction). What
    #: ``testing.run_until_empty`` uses, so tests run the production path.
    inline: bool = False
    #: Claim at most this many items, then stop (None: no limit).
    max_items: int | None = None
    #: Seconds of work to hold claimed beyond the running items (0: claim
    #: only for free threads); see ``prefetch.py``. Inline, nothing is held.
    prefetch_horizon: float = field(
        default_factory=lambda: float(dbworker_settings.PREFETCH_HORIZON)
    )

    def __post_init__(self) -> None:
        # The same validators as the system checks and run_workers' flags.
        validation.validate_worker_config(self)


@dataclass(eq=False)
class Attempt:
    """One claim of one row, from the claim until its outcome is recorded.

    Keyed by ``(id, claim_token)``: a row claimed again by this same process
    (a retry after a timeout, a re-claim after a false stale detection) is a
    different attempt, and nothing the older one does touches it.
    """

    item: WorkItem
    handler: WorkItemHandler
    #: ``time.perf_counter()`` when its claim statement was sent (its row's
    #: heartbeat_at is no older than this).
    claimed_at: float = field(default_factory=time.perf_counter)
    #: When the row was last known to be ours: the claim, or the snapshot
    #: of the last heartbeat that found it held.
    confirmed_at: float = 0.0
    #: A pool thread took it (until then it waits in the prefetch buffer).
    started: bool = False
    #: ``time.perf_counter()`` when it started.
    started_at: float = 0.0
    #: Taken back before it started (the worker is stopping): released, never run.
    withdrawn: bool = False
    #: The handler returned and its outcome is being written.
    recording: bool = False
    #: The heartbeat found the token gone: recovered as stale meanwhile.
    lost: bool = False

    def __post_init__(self) -> None:
        self.confirmed_at = self.claimed_at

    @property
    def key(self) -> AttemptKey:
        assert self.item.claim_token is not None
        return (self.item.pk, self.item.claim_token)


class Worker:
    """Runs the given handler classes until stopped (or, in burst mode, until idle)."""

    def __init__(
        self,
        handlers: Sequence[type[Handler[Any]]],
        config: WorkerConfig | None = None,
        *,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.config = config or WorkerConfig()
        self.metrics = metrics or default_metrics()
        self.work_item_handlers: dict[str, WorkItemHandler] = {}
        self.own_table_handlers: list[Handler[Any]] = []
        for cls in handlers:
            instance = cls()
            if isinstance(instance, WorkItemHandler):
                self.work_item_handlers[cls.name] = instance
            else:
                self.own_table_handlers.append(instance)
        self.ops = operations(self.config.using)
        self.stopping = threading.Event()  # stop claiming
        #: Stopping on a signal (or the watchdog): buffered rows that have not
        #: started are released at once instead of run.
        self.draining = threading.Event()
        self.aborting = threading.Event()  # second signal: release now
        self.wake = threading.Event()
        #: Set while the claim loop sleeps with nothing to claim (tests wait on it).
        self.idle = threading.Event()
        self.listener: Listener | None = None
        self._lock = threading.Lock()
        self._in_flight: dict[AttemptKey, Attempt] = {}
        #: The newest attempt of each row in flight.
        self._by_row: dict[int, Attempt] = {}
        self.abandoned = AbandonedThreads(self.metrics)
        #: Rows claimed so far, by how many claim statements, and how their
        #: attempts ended (final outcomes).
        self.claimed = 0
        self.claims = 0
        self.outcomes: Counter[Outcome] = Counter()
        #: Rows handed back to pending at shutdown.
        self.released = 0
        #: Buffered rows handed back because jobs got too long to start them soon.
        self.given_back = 0
        #: Why the process stopped itself (watchdog), or None; exit non-zero if set.
        self.unhealthy: str | None = None
        self._heartbeat: Heartbeat | None = None
        self._pool: Pool | None = None
        self._writer: SuccessWriter | None = None
        self._notifier = Notifier(inline=self.config.inline)
        self._scheduler: Scheduler | None = None
        self._next_recovery = 0.0
        #: When one of this process's writes (claim, heartbeat) last waited
        #: longer than HEARTBEAT_INTERVAL; monotonic seconds.
        self._slow_write_at = -math.inf
        self._recovery_deferred_since: float | None = None
        self._claim_backoff = Backoff(first=0.2, cap=10.0)
        self._poll = AdaptivePoll(self.config.poll_interval, enabled=self.ops.poll_adaptively)
        self.prefetch = Prefetch(
            concurrency=self.config.concurrency,
            horizon=0.0 if self.config.inline else self.config.prefetch_horizon,
        )
        #: The claim loop is woken to refill when this few rows are buffered.
        self._refill_at = 0
        #: The last claim statement found fewer rows than it asked for.
        self._ran_dry = False
        self._next_shed_check = 0.0

    # -- control -----------------------------------------------------------------

    def stop(self, *, immediate: bool = False) -> None:
        """Stop claiming; with ``immediate`` also stop waiting for running items."""
        if immediate:
            self.aborting.set()
        self.draining.set()
        self.stopping.set()
        self.wake.set()

    # -- the loop ---------------------------------------------------------------

    def add_handlers(self, classes: Sequence[type[WorkItemHandler]]) -> None:
        """Claim for these WorkItem handlers too, from the next claim on.

        For ``@task`` functions found after start-up (run_workers'
        ``watch_new_tasks``). The claim loop, heartbeat and recovery read
        ``work_item_handlers`` from other threads: it is replaced, never
        changed in place.
        """
        added = {cls.name: cls() for cls in classes if cls.name not in self.work_item_handlers}
        if added:
            self.work_item_handlers = {**self.work_item_handlers, **added}
            self.wake.set()

    def run(self) -> None:
        """Run until ``stop()`` (or idle, in burst mode); release unfinished rows.

        If a helper thread dies or abandoned threads reach their cap, the
        worker stops claiming, drains like on SIGTERM and sets ``unhealthy``
        (``run_workers`` then exits non-zero so a supervisor restarts it).
        """
        cfg = self.config
        # Inline, only WorkItem handlers run: an own-table loop needs threads.
        own_table = [] if cfg.inline else self.own_table_handlers
        loops = [
            HandlerLoop(
                h, stopping=self.stopping, burst=cfg.burst, using=cfg.using, metrics=self.metrics
            )
            for h in own_table
        ]
        listener = None
        local_waker = None
        if self.work_item_handlers and cfg.inline:
            self._writer = SuccessWriter(cfg.using, give_up=self.aborting, inline=True)
            self._pool = InlinePool()
        elif self.work_item_handlers:
            self._writer = SuccessWriter(cfg.using, give_up=self.aborting)
            self._writer.start()
            self._pool = Pool(cfg.concurrency, name="dbworker", on_done=self._maybe_wake)
            self._heartbeat = Heartbeat(
                interval=cfg.heartbeat_interval,
                snapshot=self._claims_to_heartbeat,
                on_lost=self._mark_lost,
                on_held=self._mark_held,
                using=cfg.using,
                observe=self._observe_write,
            )
            self._heartbeat.start()
            if self.ops.supports_notify and not cfg.burst:
                listener = Listener(using=cfg.using, queues=cfg.queues, wake=self.wake.set)
                listener.start()
                self.listener = listener
            elif not cfg.burst:
                local_waker = LocalWaker(queues=cfg.queues, wake=self.wake.set)
                local_waker.start()
        if self.work_item_handlers and not cfg.inline:
            # Periodic handlers' slots (worker/scheduler.py); None without any.
            self._scheduler = start_scheduler(
                self.work_item_handlers.values(),
                using=cfg.using,
                queues=cfg.queues,
                burst=cfg.burst,
                metrics=self.metrics,
                on_enqueued=self.wake.set,
            )
        for loop in loops:
            loop.start()
        try:
            if self._pool is not None:
                self._claim_loop()
            # Own-table loops end by themselves in burst mode; otherwise they
            # run until a stop is requested.
            while any(loop.is_alive() for loop in loops) and not self.stopping.is_set():
                self.stopping.wait(0.2)
            self.stopping.set()
            self._drain(loops)
        finally:
            self.stopping.set()
            if listener is not None:
                listener.stop()
            if local_waker is not None:
                local_waker.stop()
            if self._heartbeat is not None:
                self._heartbeat.stop()
            if self._scheduler is not None:
                self._scheduler.stop()
            if self._pool is not None:
                self._pool.shutdown()
            if self._writer is not None and self._writer.is_alive():
                self._writer.close()
                self._writer.join(10)
            self._notifier.close(NOTIFY_GRACE)  # after the writer: it hands hooks over
            if not cfg.inline:  # inline, the connection is the caller's
                close_thread_connections()

    def run_once(self) -> int:
        """One claim-and-dispatch step: recover stale rows if due, claim a batch, submit it.

        Returns the number of rows claimed. Drives the same code as ``run``,
        for tests that step the worker by hand.
        """
        assert self._pool is not None
        if self._check_health():
            return 0
        self._maybe_recover()
        self._shed_hoard()
        limit = self._claim_limit()
        if self.config.max_items is not None:
            limit = min(limit, self.config.max_items - self.claimed)
            if limit <= 0 and self.claimed >= self.config.max_items:
                self.stopping.set()
                return 0
        if limit <= 0:
            return 0
        self.metrics.poll(WORK_ITEM_LOOP)
        started = time.perf_counter()
        items = self.ops.claim(
            limit=limit,
            handlers=list(self.work_item_handlers),
            queues=self.config.queues,
            worker=worker_id(),
        )
        took = time.perf_counter() - started
        self.metrics.claim_took(WORK_ITEM_LOOP, took)
        self.prefetch.observe_claim(took)
        self._observe_write(took)
        self.claimed += len(items)
        self.claims += bool(items)
        self._ran_dry = len(items) < limit
        self._dispatch(items, claimed_at=started)
        return len(items)

    def _claim_limit(self) -> int:
        """How many rows to claim now: free threads plus what the buffer lacks.

        Nothing while the buffer holds more than its refill mark (a refill of
        a few rows would cost a commit each). Rows awaiting their success
        write still count against the process: at most the running and
        buffered rows plus UNRECORDED_EXTRA are claimed and not yet recorded,
        so a slow database applies back-pressure instead of a growing queue
        (and heartbeats stay one bounded UPDATE).
        """
        assert self._pool is not None
        cfg = self.config
        running_for = self._youngest_running_age()
        target = self.prefetch.target(running_for)
        self._refill_at = self.prefetch.refill_at(target, running_for)
        outstanding = self._pool.busy()
        if outstanding - self._pool.running() > self._refill_at:
            return 0
        with self._lock:
            unrecorded = len(self._in_flight)
        hold = self._pool.size + target  # inline, one at a time
        limit = min(hold - outstanding, hold + UNRECORDED_EXTRA - unrecorded, MAX_CLAIM)
        if cfg.batch_size > 0:
            limit = min(limit, cfg.batch_size)
        return max(0, limit)

    def _shed_hoard(self) -> None:
        """Give back buffered rows this worker cannot start soon.

        The buffer is sized from the jobs seen so far; when jobs suddenly get
        long (a batch of slow items behind fast ones), rows claimed for the
        fast pace would wait here while other workers sit idle. Once the
        oldest buffered row has waited a few horizons, the rows beyond what
        the current estimate allows (the last claimed first) go back to
        pending, where any worker can take them.
        """
        now = time.perf_counter()
        if not self.prefetch.enabled or self.draining.is_set() or now < self._next_shed_check:
            return
        self._next_shed_check = now + 0.25
        patience = max(1.0, SHED_AFTER_HORIZONS * self.prefetch.horizon)
        running_for = self._youngest_running_age()
        keep = self.prefetch.target(running_for)
        with self._lock:
            # In claim order: dicts keep insertion order.
            unstarted = [
                a
                for a in self._in_flight.values()
                if not a.started and not a.withdrawn and not a.lost
            ]
            if len(unstarted) <= keep or now - unstarted[0].claimed_at < patience:
                return
            excess = unstarted[keep:]
            for attempt in excess:
                attempt.withdrawn = True  # pool threads skip it from now on
        try:
            given_back = self._release([a.item for a in excess], "giving back buffered work items")
        except Exception as exc:
            # Still this worker's: keep them in flight (heartbeated) and run
            # them after all; their queued tasks may be gone, so queue them anew.
            logger.warning("Could not give back %d buffered work item(s): %s", len(excess), exc)
            with self._lock:
                for attempt in excess:
                    attempt.withdrawn = False
            assert self._pool is not None
            self._pool.submit_many([self._runner(attempt) for attempt in excess])
            return
        else:
            self.given_back += given_back
            logger.info(
                "Gave back %d buffered work item(s) that this worker could not start within "
                "PREFETCH_HORIZON (%gs): its jobs now take longer.",
                given_back,
                self.prefetch.horizon,
            )
        for attempt in excess:
            self._forget(attempt)

    def _youngest_running_age(self) -> float:
        """Seconds the youngest running attempt has run, when every thread is busy; else 0.

        Jobs that suddenly take long show here before any of them finishes.
        """
        assert self._pool is not None
        if self._pool.running() < self._pool.size:
            return 0.0
        with self._lock:
            starts = [
                a.started_at for a in self._in_flight.values() if a.started and not a.recording
            ]
        return time.perf_counter() - max(starts) if starts else 0.0

    def _maybe_wake(self) -> None:
        """Wake the claim loop if the buffer is down to its refill mark."""
        pool = self._pool
        if pool is None or pool.queued() <= self._refill_at:
            self.wake.set()

    def _claim_loop(self) -> None:
        assert self._pool is not None
        cfg = self.config
        while not self.stopping.is_set():
            self.wake.clear()
            try:
                claimed = self.run_once()
            except Exception as exc:
                if cfg.inline:
                    raise  # the caller's connection and transaction: theirs to handle
                self.metrics.claim_error(WORK_ITEM_LOOP)
                self._observe_write(math.inf)  # a claim that failed was held up too
                delay = self._claim_backoff.next()
                if is_transient(exc):
                    logger.error(
                        "Database unavailable while claiming (%s); retrying in %.1fs.", exc, delay
                    )
                else:
                    # Not a connection problem (a missing table, a bad query): say
                    # so loudly, but keep the process alive and its rows owned.
                    logger.exception("Claiming failed; retrying in %.1fs.", delay)
                close_quietly(cfg.using)
                self.stopping.wait(delay)
                continue
            self._claim_backoff.reset()
            if self.stopping.is_set():
                return
            if claimed:
                self._poll.found_work()
            if claimed and not self._ran_dry:
                continue  # a full batch: more rows may be ready right now
            if cfg.burst and not claimed and not self._has_in_flight():
                return
            if not claimed and self._ran_dry:
                self.idle.set()
            self.wake.wait(self._poll.next())
            self.idle.clear()

    # -- watchdog ---------------------------------------------------------------

    def _check_health(self) -> bool:
        """Stop claiming if the process cannot keep its promises; True if stopping.

        Without heartbeats every job longer than STALE_AFTER would run twice;
        without the writer no success would be recorded; past the cap of
        abandoned threads, hung handlers would pile up threads and
        connections. A supervisor restarting the process is the cure.
        """
        reason = None
        cap = self.config.max_abandoned_threads or self.config.concurrency
        if self._heartbeat is not None and not self._heartbeat.is_alive():
            reason = "the heartbeat thread died"
        elif self._writer is not None and not self._writer.inline and not self._writer.is_alive():
            reason = "the success writer thread died"
        elif self._scheduler is not None and not self._scheduler.is_alive():
            reason = "the periodic scheduler thread died"
        elif self.abandoned.count >= cap:
            reason = (
                f"{self.abandoned.count} handler thread(s) that overran their timeout are still "
                f"running (abandoned threads), the cap is {cap} (MAX_ABANDONED_THREADS)"
            )
        if reason is None:
            return False
        self.draining.set()
        if self.unhealthy is None:
            self.unhealthy = reason
            logger.critical(
                "Stopping this worker: %s. It finishes or releases its running items and "
                "exits non-zero so that a supervisor restarts it.",
                reason,
            )
        self.stopping.set()
        self.wake.set()
        return True

    # -- running one attempt -------------------------------------------------------

    def _dispatch(self, items: Sequence[WorkItem], *, claimed_at: float) -> None:
        """Queue claimed rows on the pool, in claim order, as attempts in flight."""
        assert self._pool is not None
        attempts = [
            Attempt(item, self.work_item_handlers[item.handler], claimed_at=claimed_at)
            for item in items
        ]
        with self._lock:
            for attempt in attempts:
                self._in_flight[attempt.key] = attempt
                # The row was claimed again: any older attempt of it here was
                # recovered as stale meanwhile, whether the heartbeat saw it or not.
                older = self._by_row.get(attempt.item.pk)
                if older is not None and older is not attempt:
                    older.lost = True
                self._by_row[attempt.item.pk] = attempt
        self._pool.submit_many([self._runner(attempt) for attempt in attempts])

    def _runner(self, attempt: Attempt) -> Callable[[], None]:
        """What a pool thread runs for ``attempt``: start it, execute it, retire it."""
        item, handler = attempt.item, attempt.handler
        writer = self._writer
        assert writer is not None  # run() creates it with the pool

        settled: list[Outcome] = []

        def hand_over(item: WorkItem, result_json: str | None) -> Outcome | None:
            # The thread is free for the next item as soon as the success is
            # queued; the attempt stays in flight (heartbeated) until written.
            took = time.perf_counter() - attempt.started_at

            def written(outcome: Written) -> None:
                if isinstance(outcome, Refused):
                    label = execution.record_refused_result(
                        item, handler, outcome.error, give_up=self.aborting
                    )
                elif isinstance(outcome, BaseException):
                    if self.aborting.is_set():
                        self._notify(handler, item, None)
                        return  # still claimed: released at shutdown
                    # Not a stop: the writer met an error it could not handle.
                    # Retire the attempt; stale recovery returns the row.
                    logger.error(
                        "Could not record the success of work item %s (%s): %s",
                        item.pk,
                        handler.name,
                        transitions.error_summary(outcome),
                    )
                    label = Outcome.UNRECORDED
                elif outcome:
                    label = Outcome.SUCCEEDED
                else:
                    execution.log_fenced(item, handler)
                    label = Outcome.FENCED
                if label == Outcome.SUCCEEDED:
                    self._notify(handler, item, Status.SUCCEEDED)
                elif label in (Outcome.FENCED, Outcome.UNRECORDED):
                    self._notify(handler, item, None)
                if label.final:
                    self.metrics.task_done(handler.name, label, took)
                    self._count(attempt, label)
                settled.append(label)
                self._forget(attempt)

            writer.submit(item, result_json, written)
            # Written already (inline, or a quick writer): say how it ended.
            return settled[0] if settled else None

        def recording() -> None:
            with self._lock:
                attempt.recording = True

        def run() -> None:
            if not self._start(attempt):
                return
            outcome = Outcome.UNRECORDED
            try:
                outcome = execution.execute(
                    item,
                    handler,
                    give_up=self.aborting,
                    metrics=self.metrics,
                    record_success=hand_over,
                    abandoned=self.abandoned,
                    on_recording=recording,
                    enforce_timeout=not self.config.inline,
                )
            finally:
                if outcome.final:
                    self._count(attempt, outcome)
                if outcome == Outcome.DEFERRED:
                    pass  # the writer's callback retires the attempt
                elif outcome == Outcome.UNRECORDED and self.aborting.is_set():
                    pass  # still claimed under this attempt: released at shutdown
                else:
                    self._forget(attempt)
                self.prefetch.observe_run(time.perf_counter() - attempt.started_at)

        return run

    def _start(self, attempt: Attempt) -> bool:
        """Take ``attempt`` out of the buffer to run it; False if it must not run.

        A worker that is stopping (or whose watchdog just tripped) releases
        buffered rows instead (``_drain``). A row recovered as stale while
        it waited is someone else's now: dropped, not run. Between two
        heartbeats that is not known here, so a row not confirmed for half
        of STALE_AFTER (heartbeats held up) is checked with the database
        first; it cannot have been recovered before STALE_AFTER has passed
        since its heartbeat, so fresher rows start without a query.
        """
        if self._check_health():
            return False
        with self._lock:
            if attempt.started or attempt.withdrawn or self.draining.is_set():
                return False  # already running, or released by _drain / _shed_hoard
            lost = attempt.lost
            if not lost:
                attempt.started = True
                attempt.started_at = time.perf_counter()
        if not lost and attempt.started_at - attempt.confirmed_at > self.config.stale_after / 2:
            lost = not self._still_held(attempt)
        if lost:
            logger.warning(
                "Dropped work item %s (%s) before it started: it was recovered as stale "
                "while waiting in this worker's buffer.",
                attempt.item.pk,
                attempt.handler.name,
            )
            with self._lock:
                attempt.lost = True
            self._forget(attempt)
            return False
        self._maybe_wake()  # the buffer shrank
        return True

    def _still_held(self, attempt: Attempt) -> bool:
        """Refresh the heartbeat of a buffered row that waited long; False if it is gone.

        If the database cannot say, the row starts only while it cannot have
        been recovered yet; otherwise it is left to stale recovery.
        """
        try:
            held = bool(transitions.heartbeat({attempt.key}, using=self.config.using))
        except Exception as exc:
            age = time.perf_counter() - attempt.confirmed_at
            logger.warning(
                "Could not check the claim of work item %s before starting it (%s).",
                attempt.item.pk,
                transitions.error_summary(exc),
            )
            close_quietly(self.config.using)
            return age < self.config.stale_after
        if held:
            attempt.confirmed_at = attempt.started_at
        return held

    def _count(self, attempt: Attempt, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
        # One line per item at DEBUG (run_workers -v 2); failures are logged
        # at WARNING/ERROR where they are recorded.
        logger.debug(
            "Work item %s (%s) attempt %d: %s.",
            attempt.item.pk,
            attempt.handler.name,
            attempt.item.attempts,
            outcome,
        )

    def _forget(self, attempt: Attempt) -> None:
        """Retire ``attempt`` (and only it) once its outcome is recorded."""
        with self._lock:
            if self._in_flight.get(attempt.key) is attempt:
                del self._in_flight[attempt.key]
            if self._by_row.get(attempt.item.pk) is attempt:
                del self._by_row[attempt.item.pk]
        self._maybe_wake()  # room for another claim

    def _has_in_flight(self) -> bool:
        """Attempts of this process not yet recorded (running or being written)."""
        with self._lock:
            return bool(self._in_flight)

    # -- recovery ---------------------------------------------------------------

    def _recovery_interval(self) -> float:
        # Often enough to notice a crash soon after STALE_AFTER, rarely
        # enough that many workers add little load; jitter de-synchronises them.
        return max(0.5, min(self.config.stale_after / 4.0, 60.0)) * random.uniform(0.8, 1.2)

    def _observe_write(self, seconds: float) -> None:
        if seconds > self.config.heartbeat_interval:
            self._slow_write_at = time.monotonic()

    def _maybe_recover(self) -> None:
        """Run the stale-recovery pass if it is due, unless heartbeats may be held up.

        A heartbeat that could not be written is not a sign of a dead worker.
        On SQLite every write waits while any transaction holds the database
        write lock (a long atomic handler, in any process): no heartbeat gets
        through, and the first pass after the lock is released would take
        live rows for crashed ones. So the pass is put off while this
        process's own writes are waiting, and rolled back if it had to wait
        itself; a pass put off for longer than STALE_AFTER runs regardless,
        so recovery is delayed, never lost.
        """
        cfg = self.config
        now = time.monotonic()
        if now < self._next_recovery:
            return
        self._next_recovery = now + self._recovery_interval()
        overdue = (
            self._recovery_deferred_since is not None
            and now - self._recovery_deferred_since > cfg.stale_after
        )
        if not overdue and now - self._slow_write_at < 2 * cfg.heartbeat_interval:
            self._defer_recovery(now, "this worker's own writes were waiting")
            return
        started = time.perf_counter()
        try:
            with transaction.atomic(using=cfg.using):
                recovered = transitions.recover_stale(
                    handlers=list(self.work_item_handlers),
                    stale_after=cfg.stale_after,
                    using=cfg.using,
                    log=False,  # said once committed
                )
                if not overdue and time.perf_counter() - started > cfg.heartbeat_interval:
                    raise _RecoveryWaited
        except _RecoveryWaited:
            self._defer_recovery(now, "the recovery pass itself had to wait")
            return
        except Exception as exc:
            # Recovery is best effort per pass; claiming must go on.
            self._observe_write(math.inf)
            logger.warning("Stale recovery failed (%s); trying again later.", exc)
            return
        self._recovery_deferred_since = None
        recovered.log()
        self.metrics.recover_took(WORK_ITEM_LOOP, time.perf_counter() - started)
        for name, count in recovered.by_handler.items():
            self.metrics.recovered(name, count)
        self._tell_recovered_failures(recovered.failed_rows)

    def _tell_recovered_failures(self, rows: list[tuple[int, str]]) -> None:
        """``attempt_recorded`` for rows this pass failed, for the handlers that listen.

        The attempt's own worker is gone; the recovering worker speaks for
        it, once the failure committed, with the row as it is now.
        """
        listening = {
            name for name, handler in self.work_item_handlers.items() if execution.listens(handler)
        }
        wanted = [pk for pk, name in rows if name in listening]
        if not wanted:
            return
        try:
            items = list(WorkItem.objects.using(self.config.using).filter(pk__in=wanted))
        except Exception as exc:
            logger.warning("Could not read the rows stale recovery failed: %s", exc)
            return
        for item in items:
            self._notify(
                self.work_item_handlers[item.handler],
                item,
                Status.FAILED,
                WorkerLost(item.last_error),
            )

    def _notify(
        self,
        handler: WorkItemHandler,
        item: WorkItem,
        status: str | None,
        error: BaseException | None = None,
    ) -> None:
        """``attempt_recorded`` off the success writer's and the claim loop's threads."""
        if execution.listens(handler):
            self._notifier.submit(
                functools.partial(execution.notify_recorded, handler, item, status, error)
            )

    def _defer_recovery(self, now: float, why: str) -> None:
        if self._recovery_deferred_since is None:
            self._recovery_deferred_since = now
        logger.debug("Stale recovery put off: %s, so heartbeats may be held up too.", why)

    # -- heartbeat callbacks -------------------------------------------------------

    def _claims_to_heartbeat(self) -> list[AttemptKey]:
        with self._lock:
            return [key for key, attempt in self._in_flight.items() if not attempt.lost]

    def _mark_held(self, keys: set[AttemptKey], at: float) -> None:
        """The heartbeat whose snapshot was taken at ``at`` found these attempts held."""
        with self._lock:
            for key in keys:
                attempt = self._in_flight.get(key)
                if attempt is not None and attempt.confirmed_at < at:
                    attempt.confirmed_at = at

    def _mark_lost(self, keys: set[AttemptKey]) -> None:
        with self._lock:
            for key in keys:
                attempt = self._in_flight.get(key)
                if attempt is None or attempt.lost:
                    continue
                attempt.lost = True
                # An attempt whose outcome is being written lost nothing: the
                # heartbeat raced the write (and a fenced write says so itself).
                if not attempt.recording:
                    logger.warning(
                        "Lost the claim on work item %s (%s): it was recovered as stale. "
                        "Its outcome will be discarded.",
                        key[0],
                        attempt.handler.name,
                    )

    # -- shutdown ---------------------------------------------------------------

    def in_flight(self) -> list[WorkItem]:
        with self._lock:
            return [attempt.item for attempt in self._in_flight.values()]

    def _drain(self, loops: Sequence[HandlerLoop]) -> None:
        """Give running items up to SHUTDOWN_TIMEOUT (or until a second signal)."""
        cfg = self.config
        if self.draining.is_set():
            self._release_buffered()
        busy = (self._pool.running() if self._pool is not None else 0) + sum(
            loop.pool.busy() for loop in loops
        )
        if busy:
            logger.info(
                "Stopping: waiting up to %.0fs for %d running item(s).", cfg.shutdown_timeout, busy
            )
        deadline = time.monotonic() + cfg.shutdown_timeout
        if self._pool is not None:
            self._pool.wait_idle(cfg.shutdown_timeout, abort=self.aborting)
        if self._writer is not None:
            self._writer.close()  # successes handed over are written now
        # A finished handler's outcome is recorded, never released: releasing
        # it would run a finished job again. Its write may be waiting for the
        # database (a failover's read-only window), so it gets a grace period
        # past the deadline; a second signal stops waiting at once.
        grace_end = max(deadline, time.monotonic()) + RECORD_GRACE
        while not self.aborting.is_set() and time.monotonic() < grace_end:
            writing = self._writer is not None and self._writer.is_alive()
            if not writing and not self._recording():
                break
            self.aborting.wait(0.05)
        for loop in loops:
            loop.drain(max(0.0, deadline - time.monotonic()), self.aborting)
        with self._lock:
            leaving = [
                a for a in self._in_flight.values() if self.aborting.is_set() or not a.recording
            ]
            for attempt in leaving:
                attempt.withdrawn = True  # a queued task must not start it after the release
            leftovers = [a.item for a in leaving]
        if leftovers:
            # Fenced like every write: a row whose outcome did land is not touched.
            released = self._release(leftovers, "releasing unfinished work items")
            self.released += released
            logger.warning("Released %d unfinished work item(s) back to pending.", released)

    def _release_buffered(self) -> None:
        """Hand back the buffered rows that never started, at once.

        Other workers can run them while this one waits for its running items.
        """
        with self._lock:
            unstarted = [a for a in self._in_flight.values() if not a.started and not a.withdrawn]
            for attempt in unstarted:
                attempt.withdrawn = True
        if not unstarted:
            return
        try:
            released = self._release([a.item for a in unstarted], "releasing buffered work items")
        except Exception as exc:
            # Still in flight (heartbeated): the release at the end tries again.
            logger.warning("Could not release buffered work items yet (%s).", exc)
            return
        self.released += released
        for attempt in unstarted:
            self._forget(attempt)
        logger.info("Released %d buffered work item(s) that had not started.", released)

    def _release(self, items: list[WorkItem], what: str) -> int:
        """Hand ``items`` back to pending (fenced), retrying the database for up to 5 s."""
        return persist(
            lambda: transitions.release(items, using=self.config.using),
            what=what,
            using=self.config.using,
            give_up=_deadline_event(5.0),
        )

    def _recording(self) -> bool:
        with self._lock:
            return any(a.recording for a in self._in_flight.values())


class _RecoveryWaited(Exception):
    """Rolls back a recovery pass that waited for the database."""


def _deadline_event(seconds: float) -> threading.Event:
    """An event that sets itself after ``seconds``: a bound for ``persist``."""
    event = threading.Event()
    timer = threading.Timer(seconds, event.set)
    timer.daemon = True
    timer.start()
    return event
