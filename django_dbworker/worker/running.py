"""Running one attempt on a pool thread (or the event loop): start it, execute it, hand
its ending over.

What a pool thread does with one buffered attempt: the start-time fence
check (a row recovered as stale while it waited is someone else's now),
``execution.execute``, and the hand-off of a success to the batched
success writer. An async handler's attempt is started the same way, then
handed to the worker's event loop (``event_loop.py``), where
``execution.execute_async`` runs it and the pool thread is free at once.
Every ending, from whichever thread, goes to ``Settler.settle``; this
module accounts for nothing itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django_dbworker import errortext, transitions
from django_dbworker.handlers import runs_async
from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import Status
from django_dbworker.outcomes import Outcome
from django_dbworker.worker import endings, execution, failures
from django_dbworker.worker.abandoned import AbandonedThreads
from django_dbworker.worker.attempts import Attempt, Ledger, State
from django_dbworker.worker.clock import Clock
from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.connections import close_quietly
from django_dbworker.worker.control import Control
from django_dbworker.worker.endings import Ending, Observer
from django_dbworker.worker.event_loop import EventLoop
from django_dbworker.worker.prefetch import Prefetch
from django_dbworker.worker.settle import Settler
from django_dbworker.worker.success_writer import Refused, SuccessWriter, Written

logger = logging.getLogger("django_dbworker.worker")


class AttemptRunner:
    """What a pool thread runs: the best buffered attempt, started, executed, handed over.

    The claim loop queues one call of ``run_next`` per claimed row; each call
    takes whichever buffered attempt comes first in claim order (priority,
    ``run_after``, id) at that moment, so a higher-priority row claimed
    behind a buffer of bulk work is the next to start.
    """

    def __init__(
        self,
        *,
        config: WorkerConfig,
        control: Control,
        ledger: Ledger,
        settler: Settler,
        writer: SuccessWriter,
        prefetch: Prefetch,
        metrics: WorkerMetrics,
        abandoned: AbandonedThreads,
        clock: Clock,
        enforce_timeout: bool,
        healthy: Callable[[], bool],
        on_started: Callable[[], None],
        may_start: Callable[[Attempt], bool] = lambda attempt: True,
        give_back: Callable[[list[Attempt]], int] = lambda attempts: 0,
        event_loop: EventLoop | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.ledger = ledger
        self.settler = settler
        self.writer = writer
        self.prefetch = prefetch
        self.metrics = metrics
        self.abandoned = abandoned
        self.clock = clock
        self.enforce_timeout = enforce_timeout
        #: The watchdog's check: False stops starting buffered rows.
        self.healthy = healthy
        #: Told when the buffer shrank (the claim loop may refill).
        self.on_started = on_started
        #: Whether a taken attempt may start now (its rate limit: ``ClaimRoute.start``);
        #: one that may not goes back to pending through ``give_back``.
        self.may_start = may_start
        self.give_back = give_back
        #: Where async handlers' attempts run; None inline (``execution._call``).
        self.event_loop = event_loop

    def run_next(self) -> None:
        """Start the best buffered attempt, execute it, hand its ending over."""
        attempt = self._start()
        if attempt is None:
            return
        assert attempt.started_at is not None
        if self.event_loop is not None and runs_async(type(attempt.handler)):
            self.event_loop.submit(attempt, lambda: self._run_async(attempt))
            return
        ending = endings.UNRECORDED
        try:
            ending = execution.execute(
                attempt.item,
                attempt.handler,
                give_up=self.control.aborting,
                metrics=self.metrics,
                record_success=lambda item, result: self._hand_over(attempt, result),
                abandoned=self.abandoned,
                observer=_AttemptObserver(attempt, self.ledger, self.settler),
                enforce_timeout=self.enforce_timeout,
            )
        finally:
            self.settler.settle(attempt, ending)
            self.prefetch.observe_run(self.clock.now() - attempt.started_at)

    async def _run_async(self, attempt: Attempt) -> None:
        """An async handler's attempt, on the event loop; a stop's cancel leaves it unsettled
        (still claimed: shutdown releases it)."""
        loop = self.event_loop
        assert loop is not None
        ending = await execution.execute_async(
            attempt.item,
            attempt.handler,
            offload=loop.offload,
            track=lambda task: loop.track(attempt, task),
            give_up=self.control.aborting,
            metrics=self.metrics,
            record_success=lambda item, result: self._hand_over(attempt, result),
            observer=_AttemptObserver(attempt, self.ledger, self.settler),
        )
        # Hooks are user code that may block: never on the loop.
        self.settler.settle(attempt, ending, defer_hook=True)

    def _start(self) -> Attempt | None:
        """Take the best buffered attempt out of the buffer to run it; None if none may run.

        A worker that is stopping (or whose watchdog just tripped) releases
        buffered rows instead (``shutdown.py``). A row recovered as stale
        while it waited is someone else's now: dropped, not run. Between two
        heartbeats that is not known here, so a row not confirmed for half
        of STALE_AFTER (heartbeats held up) is checked with the database
        first; it cannot have been recovered before STALE_AFTER has passed
        since its heartbeat, so fresher rows start without a query.
        """
        if not self.healthy():
            return None
        attempt, state = self.ledger.take_next(
            self.clock.now(), draining=self.control.draining.is_set()
        )
        if attempt is None:
            return None  # nothing buffered, or released by shutdown / shedding
        lost = state is State.LOST
        if not lost:
            assert attempt.started_at is not None
            if attempt.started_at - attempt.confirmed_at > self.config.stale_after / 2:
                lost = not self._still_held(attempt)
        if lost:
            logger.warning(
                "Dropped work item %s (%s) before it started: it was recovered as stale "
                "while waiting in this worker's buffer.",
                attempt.item.pk,
                attempt.handler.name,
            )
            self.ledger.lose(attempt)
            self.ledger.retire(attempt)
            return None
        if not self._may_start(attempt):
            self.ledger.unstart(attempt)
            self.give_back([attempt])
            self.on_started()
            return None
        self.on_started()
        return attempt

    def _may_start(self, attempt: Attempt) -> bool:
        """``may_start``; if the database cannot say, the row waits (given back)."""
        try:
            return self.may_start(attempt)
        except Exception as exc:
            logger.warning(
                "Could not take a start of %s's rate limit for work item %s (%s); it goes "
                "back to pending.",
                attempt.handler.name,
                attempt.item.pk,
                errortext.error_summary(exc),
            )
            close_quietly(self.config.using)
            return False

    def _still_held(self, attempt: Attempt) -> bool:
        """Refresh the heartbeat of a buffered row that waited long; False if it is gone.

        If the database cannot say, the row starts only while it cannot have
        been recovered yet; otherwise it is left to stale recovery.
        """
        assert attempt.started_at is not None
        try:
            beat = transitions.beat({attempt.key}, using=self.config.using)
            held = bool(beat.held)
            self.ledger.mark_cancel_requested(beat.cancel_requested)
        except Exception as exc:
            age = self.clock.now() - attempt.confirmed_at
            logger.warning(
                "Could not check the claim of work item %s before starting it (%s).",
                attempt.item.pk,
                errortext.error_summary(exc),
            )
            close_quietly(self.config.using)
            return age < self.config.stale_after
        if held:
            attempt.confirmed_at = attempt.started_at
        return held

    def _hand_over(self, attempt: Attempt, result_json: str | None) -> Outcome | None:
        """Queue a success for the writer; the thread is free for the next item.

        The attempt stays in the ledger (heartbeated) until it is written.
        Answers how it ended if that is known at once (inline, or a quick
        writer), else None.
        """
        assert attempt.started_at is not None
        took = self.clock.now() - attempt.started_at
        settled: list[Outcome] = []

        def written(result: Written) -> None:
            # The success of a timed-out attempt's abandoned run is late: the
            # attempt's own ending is the timeout its other thread recorded.
            late = self.ledger.is_abandoned(attempt)
            ending = self._ending_of(attempt, result, took)
            settled.append(ending.outcome)
            self.settler.settle(attempt, ending, late=late, defer_hook=True)

        self.writer.submit(attempt.item, result_json, written)
        return settled[0] if settled else None

    def _ending_of(self, attempt: Attempt, result: Written, took: float) -> Ending:
        """How a success the writer wrote (or could not write) ended."""
        item, handler = attempt.item, attempt.handler
        if isinstance(result, Refused):
            return failures.record_refused_result(
                item,
                handler,
                result.error,
                give_up=self.control.aborting,
                landed=lambda ending: self.settler.landed(attempt, ending, defer_hook=True),
            ).took(took)
        if isinstance(result, BaseException):
            if not self.control.aborting.is_set():
                # Not a stop: the writer met an error it could not handle.
                # The attempt is retired; stale recovery returns the row.
                logger.error(
                    "Could not record the success of work item %s (%s): %s",
                    item.pk,
                    handler.name,
                    errortext.error_summary(result),
                )
            return endings.UNRECORDED  # when stopping: still claimed, released at shutdown
        if result:
            return Ending(Outcome.SUCCEEDED, Status.SUCCEEDED, seconds=took)
        return endings.FENCED.took(took)


class _AttemptObserver(Observer):
    """What running one attempt reports, routed to the ledger and the settler."""

    __slots__ = ("attempt", "ledger", "settler")

    def __init__(self, attempt: Attempt, ledger: Ledger, settler: Settler) -> None:
        self.attempt = attempt
        self.ledger = ledger
        self.settler = settler

    def recording(self) -> None:
        self.ledger.begin_recording(self.attempt)

    def landed(self, ending: Ending) -> None:
        self.settler.landed(self.attempt, ending)

    def abandoned(self) -> None:
        self.ledger.abandon(self.attempt)

    def late(self, ending: Ending) -> None:
        self.settler.settle(self.attempt, ending, late=True)
