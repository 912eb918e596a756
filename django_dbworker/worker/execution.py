"""Running one claimed ``WorkItem`` through its handler and recording the outcome.

Never runs inside the claim transaction and never holds row locks while
user code runs: the claim committed already, and outcome writes are short
fenced UPDATEs. For ``atomic`` handlers the handler's own writes and the
success record share one transaction, which rolls back when the fence
fails, so those writes commit exactly once per job.

Every attempt ends in exactly one recorded outcome: whatever the handler
raises or returns, however its exception prints, whatever its ``backoff``
answers, and whatever value the database refuses, an outcome is written
(falling back to a plain fenced failure), or the attempt is reported
``Outcome.UNRECORDED`` so that its owner releases it.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connections, transaction

from django_dbworker import tracing, transitions
from django_dbworker.backoff import exponential_backoff
from django_dbworker.conf import dbworker_settings
from django_dbworker.db.errors import is_transient
from django_dbworker.handlers import WorkItemHandler, mark_attempt_recorded
from django_dbworker.metrics import WorkerMetrics, default_metrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.outcomes import Outcome
from django_dbworker.worker.abandoned import AbandonedThreads
from django_dbworker.worker.connections import (
    close_thread_connections,
    guarded,
    persist,
    refresh_if_idle,
    tidy,
)

logger = logging.getLogger("django_dbworker.worker")

#: Hands a success to the success writer: (item, result as JSON text or
#: None). The writer records and reports the outcome; it answers how it
#: ended if it knows at once (inline, or a quick write), else None.
RecordSuccess = Callable[[WorkItem, "str | None"], "Outcome | None"]


#: The longest retry delay a ``backoff()`` may ask for (ten years): any
#: datetime arithmetic of every supported database stays in range.
MAX_RETRY_DELAY = 10 * 365 * 86400.0
#: Prefix of ``last_error`` when the database refused the handler's result.
RESULT_NOT_STORED = "result could not be stored: "


class _Recording:
    """Tells the owner, once, that the attempt's outcome is about to be written."""

    def __init__(self, callback: Callable[[], None] | None) -> None:
        self._callback = callback
        #: How a handed-over success ended, if the recorder knew at once.
        self.reported: Outcome | None = None

    def __call__(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class _FencedOut(Exception):
    """Rolls back an atomic handler's transaction whose claim was lost."""


class _ResultRefused(Exception):
    """The handler's result cannot be stored; retrying would produce it again."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def execute(
    item: WorkItem,
    handler: WorkItemHandler,
    *,
    give_up: threading.Event | None = None,
    enforce_timeout: bool = True,
    metrics: WorkerMetrics | None = None,
    record_success: RecordSuccess,
    abandoned: AbandonedThreads | None = None,
    on_recording: Callable[[], None] | None = None,
) -> Outcome:
    """Run ``item`` and record its outcome; returns one of the outcome labels.

    Never raises for anything the handler does (``BaseException`` included):
    the caller's slot and loop must survive any user code. Each attempt is
    one CONSUMER span and one observation of the task metrics.
    Non-atomic successes go to ``record_success`` (the worker's success
    writer); atomic handlers write theirs in their own transaction, through
    the same ``transitions.succeed``.
    ``on_recording`` is told when the handler is done and its outcome is
    about to be written (a heartbeat that misses the row after that point
    raced the write; it did not lose the claim).
    """
    metrics = metrics or default_metrics()
    ready = _Recording(on_recording)
    started = time.perf_counter()
    outcome: Outcome | None = None
    try:
        with metrics.running(handler.name), tracing.processing(item, handler) as attempt:
            outcome = _execute(
                item,
                handler,
                give_up=give_up,
                enforce_timeout=enforce_timeout,
                record_success=record_success,
                abandoned=abandoned,
                ready=ready,
                metrics=metrics,
            )
            if outcome == Outcome.DEFERRED:
                attempt.outcome(ready.reported or Outcome.SUCCEEDED)
            else:
                attempt.outcome(outcome)
    except BaseException as exc:
        # Our own code (or a tracing SDK) failed around the handler. If no
        # outcome was recorded yet, the attempt still needs one.
        logger.error(
            "Unexpected error around work item %s (%s): %s",
            item.pk,
            handler.name,
            transitions.error_summary(exc, sensitive=handler.sensitive),
            exc_info=not handler.sensitive,
        )
        if outcome is None:
            ready()
            outcome = _record_failure(item, handler, exc, retriable=True, give_up=give_up)
    if outcome in (Outcome.FENCED, Outcome.UNRECORDED):
        notify_recorded(handler, item, None, None)
    if outcome.final:
        metrics.task_done(handler.name, outcome, time.perf_counter() - started)
    return outcome


def listens(handler: WorkItemHandler) -> bool:
    """Whether ``handler`` has an ``attempt_recorded`` hook (most handlers do not)."""
    return type(handler).attempt_recorded is not WorkItemHandler.attempt_recorded


def notify_recorded(
    handler: WorkItemHandler, item: WorkItem, status: str | None, error: BaseException | None
) -> None:
    """``handler.attempt_recorded(...)``, once per attempt, never changing how it ended.

    Once (``mark_attempt_recorded``): a timed-out attempt is recorded by the
    thread that waited for it, and its abandoned run may still end (fenced)
    later; the first word is the attempt's. Nothing the hook raises
    (``BaseException`` included) leaves it.
    """
    if not listens(handler) or not mark_attempt_recorded(item):
        return
    try:
        handler.attempt_recorded(item, status, error)
    except BaseException:
        logger.exception(
            "%s.attempt_recorded raised for work item %s.", type(handler).__qualname__, item.pk
        )


def _execute(
    item: WorkItem,
    handler: WorkItemHandler,
    *,
    give_up: threading.Event | None,
    enforce_timeout: bool,
    record_success: RecordSuccess,
    abandoned: AbandonedThreads | None,
    ready: _Recording,
    metrics: WorkerMetrics,
) -> Outcome:
    timeout = handler.timeout
    if timeout is None or not enforce_timeout:
        return _run_and_record(item, handler, give_up, record_success, ready)

    box: dict[str, Any] = {}
    tracker = abandoned or AbandonedThreads()
    finished, gone = tracker.track()

    def target() -> None:
        started = time.perf_counter()
        outcome: Outcome | None = None
        try:
            outcome = box["outcome"] = _run_and_record(
                item, handler, give_up, record_success, ready
            )
        except BaseException as exc:  # our bug: the attempt still needs an outcome
            box["error"] = exc
        finally:
            close_thread_connections()
            late = tracker.finish(finished, gone)
            if late and outcome is not None and outcome.final:
                # Abandoned: the caller reported the timeout, and only this
                # thread knows how the late run ended (usually fenced).
                metrics.task_done(handler.name, outcome, time.perf_counter() - started)

    # Python cannot stop a thread, so a handler that overruns is abandoned:
    # its attempt is recorded as timed out now, and whatever it records
    # later is discarded by fencing.
    # The runner carries this thread's context: its spans nest under ours.
    context = contextvars.copy_context()
    runner = threading.Thread(
        target=context.run, args=(target,), name=f"dbworker-item-{item.pk}", daemon=True
    )
    runner.start()
    runner.join(timeout)
    if not tracker.abandon(finished, gone):
        runner.join()  # it ended just now: its own outcome stands
        if "outcome" in box:
            return Outcome(box["outcome"])
        ready()
        return _record_failure(item, handler, box["error"], retriable=True, give_up=give_up)
    error = TimeoutError(f"{handler.name} ran longer than its timeout of {timeout:g}s")
    ready()
    return _record_failure(
        item,
        handler,
        error,
        retriable=True,
        label=Outcome.TIMEOUT,
        give_up=give_up,
        text=transitions.format_error(error, include_traceback=False),
    )


def _run_and_record(
    item: WorkItem,
    handler: WorkItemHandler,
    give_up: threading.Event | None,
    record_success: RecordSuccess,
    ready: _Recording,
) -> Outcome:
    db = item._state.db or "default"
    conn = connections[db]
    # Tidy the connection between steps only if we own its state: a caller
    # inside a transaction (run_until_empty in a TestCase) keeps it as it is.
    owned = not conn.in_atomic_block

    def tidy_if_owned() -> None:
        if owned:
            tidy(db, conn)

    if owned:
        refresh_if_idle(db, conn)
    # Failures are recorded after the except blocks, not in them: the
    # handler's exception is then no longer "being handled", so nothing that
    # runs while recording (the attempt_recorded hook, signal receivers that
    # log with sys.exc_info()) can print it; a sensitive handler's messages
    # may quote its payload.
    refused: _ResultRefused | None = None
    failure: BaseException | None = None
    try:
        try:
            handler.attempt_started(item)
            if handler.atomic:
                with transaction.atomic(using=db):
                    result = handler.handle_item(item)
                    encoded = _encode_result(result)
                    ready()
                    if not _succeed_or_refuse(item, encoded):
                        raise _FencedOut
                notify_recorded(handler, item, Status.SUCCEEDED, None)
                return Outcome.SUCCEEDED
            encoded = _encode_result(handler.handle_item(item))
            ready()
        except _FencedOut:
            log_fenced(item, handler)
            return Outcome.FENCED
        except _ResultRefused as exc:
            refused = exc
        except BaseException as exc:
            failure = exc
        if refused is not None:
            ready()
            tidy_if_owned()
            return record_refused_result(item, handler, refused.cause, give_up=give_up)
        if failure is not None:
            ready()
            tidy_if_owned()
            return _record_failure(
                item,
                handler,
                failure,
                retriable=isinstance(failure, handler.retry_on),
                give_up=give_up,
            )
        tidy_if_owned()
        # The success writer owns the write (and its fallbacks) from here.
        ready.reported = record_success(item, encoded)
        return Outcome.DEFERRED
    finally:
        tidy_if_owned()


def _encode_result(result: Any) -> str | None:
    """The result as JSON text for the ``result`` column; None (SQL NULL) for None."""
    if result is None:
        return None
    try:
        return transitions.ensure_json(result, "The handler's return value")
    except TypeError as exc:
        raise _ResultRefused(exc) from None


def _guarded(item: WorkItem, write: Callable[[], bool]) -> bool:
    return guarded(item._state.db or "default", write)


def _succeed_or_refuse(item: WorkItem, encoded: str | None) -> bool:
    """The one success write (``transitions.succeed``) for a single attempt.

    Raises ``_ResultRefused`` when the database will not store the result.
    """
    assert item.claim_token is not None
    attempt = [(item.pk, item.claim_token, encoded)]
    try:
        return _guarded(item, lambda: bool(transitions.succeed(attempt, using=item._state.db)))
    except DatabaseError as exc:
        if is_transient(exc):
            raise
        raise _ResultRefused(exc) from exc


def retry_delay(handler: WorkItemHandler, attempt: int) -> float:
    """The handler's ``backoff(attempt)``, or the default one if it misbehaves.

    ``backoff`` is user code: it may raise, or answer infinity, NaN or
    something that is not a number; none of that may keep a failure from
    being recorded.
    """
    try:
        delay = float(handler.backoff(attempt))
        problem = None if math.isfinite(delay) else f"returned {delay!r}"
    except BaseException as exc:
        problem = f"raised {transitions.error_summary(exc)}"
    if problem is not None:
        logger.error(
            "%s.backoff(%d) %s; using the default backoff.",
            type(handler).__qualname__,
            attempt,
            problem,
        )
        delay = exponential_backoff(
            attempt,
            base=float(dbworker_settings.RETRY_BACKOFF),
            cap=float(dbworker_settings.RETRY_BACKOFF_MAX),
        )
    return min(max(0.0, delay), MAX_RETRY_DELAY)


def _record_failure(
    item: WorkItem,
    handler: WorkItemHandler,
    exc: BaseException,
    *,
    retriable: bool,
    give_up: threading.Event | None,
    label: Outcome | None = None,
    text: str | None = None,
) -> Outcome:
    sensitive = handler.sensitive
    error = text if text is not None else transitions.format_error(exc, sensitive=sensitive)
    try:
        tracing.record_failure(exc, sensitive=sensitive)
    except Exception:
        logger.debug("Could not record the failure on the span.", exc_info=True)
    shown = transitions.error_summary(exc, sensitive=sensitive)
    attempts, max_attempts = item.attempts, item.max_attempts
    retry = retriable and attempts < max_attempts
    delay = retry_delay(handler, attempts) if retry else 0.0

    error_class = transitions.exception_class_path(exc)

    def write() -> bool:
        if retry:
            return transitions.retry_later(item, delay=delay, error=error, error_class=error_class)
        return transitions.fail(item, error=error, error_class=error_class)

    try:
        status = _write_outcome(
            item,
            handler,
            write,
            give_up=give_up,
            intended=Status.PENDING if retry else Status.FAILED,
        )
    except Exception as exc_write:
        return _unrecorded(item, handler, exc_write)
    if status is None:
        log_fenced(item, handler)
        return Outcome.FENCED
    notify_recorded(handler, item, status, exc)
    if status == Status.FAILED and retry:
        return label or Outcome.FAILED  # the retry was refused: a plain failure was written
    if retry:
        logger.warning(
            "Work item %s (%s) failed attempt %d/%d, retrying in %.1fs: %s",
            item.pk,
            handler.name,
            attempts,
            max_attempts,
            delay,
            shown,
        )
        return label or Outcome.RETRIED
    logger.error(
        "Work item %s (%s) failed on attempt %d/%d%s: %s",
        item.pk,
        handler.name,
        attempts,
        max_attempts,
        "" if retriable else " (not retryable)",
        shown,
    )
    return label or Outcome.FAILED


def record_refused_result(
    item: WorkItem,
    handler: WorkItemHandler,
    cause: BaseException,
    *,
    give_up: threading.Event | None,
) -> Outcome:
    """The handler finished but its result cannot be stored: record ``failed``.

    Not retried: a new attempt would compute the same result (and repeat the
    handler's side effects) only to be refused again.
    """
    reason = transitions.error_summary(cause, sensitive=handler.sensitive, limit=2_000)
    error = transitions.clean_error_text(RESULT_NOT_STORED + reason)
    error_class = transitions.exception_class_path(cause)
    try:
        status = _write_outcome(
            item,
            handler,
            lambda: transitions.fail(item, error=error, error_class=error_class),
            give_up=give_up,
            intended=Status.FAILED,
        )
    except Exception as exc_write:
        return _unrecorded(item, handler, exc_write)
    if status is None:
        log_fenced(item, handler)
        return Outcome.FENCED
    notify_recorded(handler, item, status, cause)
    logger.error(
        "Work item %s (%s) finished but its result could not be stored, recorded as failed: %s",
        item.pk,
        handler.name,
        reason,
    )
    return Outcome.FAILED


def _write_outcome(
    item: WorkItem,
    handler: WorkItemHandler,
    write: Callable[[], bool],
    *,
    give_up: threading.Event | None,
    intended: str,
) -> str | None:
    """``write`` until it lands; if the database refuses it, a plain fenced failure.

    Returns the row's status now (``intended``, or ``failed`` if the plain
    failure was written instead), or None if the attempt was fenced out.
    Raises only when even the plain failure cannot be written (or the worker
    is stopping at once while the database is away).
    """
    db = item._state.db or "default"
    try:
        landed = persist(
            lambda: _guarded(item, write), what="recording an outcome", give_up=give_up, using=db
        )
        return intended if landed else None
    except Exception as exc:
        if is_transient(exc):
            raise
        refusal = transitions.error_summary(exc)
    logger.error(
        "The database refused the outcome of work item %s (%s): %s; "
        "recording a plain failure instead.",
        item.pk,
        handler.name,
        refusal,
    )
    plain = f"The outcome could not be recorded: {refusal}"
    landed = persist(
        lambda: _guarded(
            item,
            # Without the history: whatever the database refused, this
            # write asks the least of it.
            lambda: transitions.fail(
                item, error=transitions.clean_error_text(plain), history=False
            ),
        ),
        what="recording a plain failure",
        give_up=give_up,
        using=db,
    )
    return Status.FAILED if landed else None


def _unrecorded(item: WorkItem, handler: WorkItemHandler, exc: BaseException) -> Outcome:
    logger.error(
        "Could not record any outcome of work item %s (%s): %s. It stays claimed under "
        "this attempt until it is released or recovered as stale.",
        item.pk,
        handler.name,
        transitions.error_summary(exc),
    )
    return Outcome.UNRECORDED


def log_fenced(item: WorkItem, handler: WorkItemHandler) -> None:
    logger.warning(
        "Discarded the outcome of work item %s (%s): the row is no longer claimed by "
        "this attempt (recovered as stale, and maybe re-claimed, meanwhile).",
        item.pk,
        handler.name,
    )
