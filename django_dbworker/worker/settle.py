"""The one place that settles an attempt's ending.

Execution and the success writer decide and write an outcome and report
it as an ``Ending``; whatever thread or route it came by (a pool thread's
failure or retry, the batched writer's success, a timeout, a fenced or
refused result, an abandoned run that ended late, a row failed by stale
recovery), it ends here. This module is the only caller of the task
metrics, of handlers' ``attempt_recorded`` hook, of the outcome counter
and of the fenced log line (tests/unit/test_architecture.py keeps it so),
and it retires the attempt from the ledger.

An attempt is accounted for once: its own ending is counted and retires
it (``Ledger.conclude``); its hook is called once, by the first write that
landed (``landed``, from the writing thread) or else by its own ending
(``Ledger.mark_recorded``); the ending of a timed-out attempt's abandoned
run adds its own metrics observation and log line, nothing more.
It writes nothing to the database and never raises for a hook.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter

from django_dbworker import errortext
from django_dbworker.errors import WorkerLost
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.outcomes import Outcome
from django_dbworker.worker.attempts import Attempt, Ledger
from django_dbworker.worker.endings import Ending
from django_dbworker.worker.hooks import HookRunner

logger = logging.getLogger("django_dbworker.worker")


class Settler:
    """Accounts for endings: metrics, hooks, counts, log lines; retires attempts."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        metrics: WorkerMetrics,
        hooks: HookRunner,
        aborting: threading.Event,
    ) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.hooks = hooks
        self.aborting = aborting
        self._lock = threading.Lock()
        #: How this process's attempts ended (their first, final endings).
        self.outcomes: Counter[Outcome] = Counter()

    def landed(self, attempt: Attempt, ending: Ending, *, defer_hook: bool = False) -> None:
        """A write of ``attempt``'s outcome committed: its hook, now, if nothing spoke yet.

        Called by the thread that wrote, before its log line, so that the
        write that landed is what the hook hears, even when the attempt's
        other run (a timed-out attempt's abandoned one, or the thread that
        recorded the timeout) ends at the same moment, fenced.
        """
        if listens(attempt.handler) and self.ledger.mark_recorded(attempt):
            self._hook(attempt.handler, attempt.item, ending.status, ending.error, defer=defer_hook)

    def settle(
        self,
        attempt: Attempt,
        ending: Ending,
        *,
        late: bool = False,
        defer_hook: bool = False,
    ) -> None:
        """Account for ``ending`` of ``attempt``; ``defer_hook`` runs its hook off this thread.

        ``late``: the ending of a timed-out attempt's abandoned run. It adds
        its observation and log line (and its hook if its write landed
        first), never the attempt's count or retirement: those are the
        attempt's own ending's. The success writer's and the claim loop's
        threads defer hooks (a hook is user code that may be slow); a pool
        thread runs the hook itself, before it takes the next item.
        """
        outcome = ending.outcome
        if outcome is Outcome.DEFERRED:
            return  # handed to the success writer, which settles it when written
        final = outcome is not Outcome.UNRECORDED
        if late and not final:
            return  # the abandoned run recorded nothing: the attempt's own ending decides
        handler, item = attempt.handler, attempt.item
        if outcome is Outcome.FENCED:
            logger.warning(
                "Discarded the outcome of work item %s (%s): %s",
                item.pk,
                handler.name,
                # A late ending is of a run abandoned by its own attempt, which recorded
                # the row's outcome then; otherwise the row was taken from this attempt.
                "its run was abandoned at its timeout, and the attempt ended then; "
                "this is the abandoned run's late outcome."
                if late
                else "the row is no longer claimed by this attempt (recovered as stale, "
                "and maybe re-claimed, meanwhile).",
            )
        if final:
            self.metrics.task_done(handler.name, outcome, ending.seconds)
        if late:
            if ending.status is not None:
                self.landed(attempt, ending, defer_hook=defer_hook)
            return
        first, hook_due = self.ledger.conclude(attempt, hook=listens(handler))
        if not first:
            return
        if final:
            with self._lock:
                self.outcomes[outcome] += 1
            # One line per item at DEBUG (run_workers -v 2); failures are
            # logged at WARNING/ERROR where they are recorded.
            logger.debug(
                "Work item %s (%s) attempt %d: %s.", item.pk, handler.name, item.attempts, outcome
            )
        if hook_due:
            self._hook(handler, item, ending.status, ending.error, defer=defer_hook)
        if outcome is Outcome.UNRECORDED and self.aborting.is_set():
            return  # still claimed under this attempt: released at shutdown
        self.ledger.retire(attempt)

    def settle_recovered(self, handler: WorkItemHandler, item: WorkItem) -> None:
        """A row stale recovery failed (its attempts ran out): its hook, from the recoverer.

        The attempt's own worker is gone; the recovering worker speaks for
        it, once the failure committed, with the row as it is now.
        """
        if listens(handler):
            self._hook(handler, item, Status.FAILED, WorkerLost(item.last_error), defer=True)

    def _hook(
        self,
        handler: WorkItemHandler,
        item: WorkItem,
        status: str | None,
        error: BaseException | None,
        *,
        defer: bool,
    ) -> None:
        call = functools.partial(_run_hook, handler, item, status, error)
        if defer:
            self.hooks.submit(call)
        else:
            call()


def listens(handler: WorkItemHandler) -> bool:
    """Whether ``handler`` has an ``attempt_recorded`` hook (most handlers do not)."""
    return type(handler).attempt_recorded is not WorkItemHandler.attempt_recorded


def _run_hook(
    handler: WorkItemHandler, item: WorkItem, status: str | None, error: BaseException | None
) -> None:
    """``handler.attempt_recorded(...)``; nothing it raises (``BaseException`` included) leaves.

    A sensitive handler's hook may quote its payload in what it raises: then
    only the redacted summary is logged, without the traceback.
    """
    try:
        handler.attempt_recorded(item, status, error)
    except BaseException as exc:
        name = type(handler).__qualname__
        if handler.sensitive:
            logger.error(
                "%s.attempt_recorded raised for work item %s: %s",
                name,
                item.pk,
                errortext.error_summary(exc, sensitive=True),
            )
        else:
            logger.exception("%s.attempt_recorded raised for work item %s.", name, item.pk)
