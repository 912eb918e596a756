"""Recording an attempt that raised: retry, failure, snooze or cancel, and their fallbacks.

A ``Snooze`` puts the row back without using an attempt (the 101st fails
it); an attempt whose cancel was requested (the heartbeat said so, or the
database's fenced write finds the request) or that raised ``Cancelled``
ends ``cancelled``, never retried. Whatever the handler raised, however
its exception prints, whatever its ``backoff`` answers and whatever value
the database refuses, an outcome is written (falling back to a plain
fenced failure), or the attempt is reported ``UNRECORDED`` so that its
owner releases it. Returns an ``Ending``; the accounting is ``settle.py``'s.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from django_dbworker import errortext, tracing, transitions
from django_dbworker.backoff import exponential_backoff
from django_dbworker.conf import dbworker_settings
from django_dbworker.db.errors import is_transient
from django_dbworker.errors import MAX_SNOOZES, Cancelled, Snooze
from django_dbworker.handlers import WorkItemHandler, cancel_was_requested
from django_dbworker.models import Status, WorkItem
from django_dbworker.outcomes import Outcome
from django_dbworker.worker import endings
from django_dbworker.worker.connections import guarded, persist
from django_dbworker.worker.endings import Ending

logger = logging.getLogger("django_dbworker.worker")

#: The longest retry delay a ``backoff()`` may ask for (ten years): any
#: datetime arithmetic of every supported database stays in range.
MAX_RETRY_DELAY = 10 * 365 * 86400.0
#: Prefix of ``last_error`` when the database refused the handler's result.
RESULT_NOT_STORED = "result could not be stored: "
#: Prefix of ``last_error`` of an attempt that ended ``cancelled`` after a request.
CANCELLED_BY_REQUEST = "cancelled by request: "


#: Told of each outcome write that landed, at once (``endings.Observer.landed``).
Landed = Callable[[Ending], None]


def _landed(ending: Ending, landed: Landed | None) -> Ending:
    """Tell ``landed`` before anything else happens (its hook is due from this thread)."""
    if landed is not None:
        landed(ending)
    return ending


def _guarded(item: WorkItem, write: Callable[[], bool]) -> bool:
    return guarded(item._state.db or "default", write)


def _guarded_status(item: WorkItem, write: Callable[[], str | None]) -> str | None:
    return guarded(item._state.db or "default", write)


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
        problem = f"raised {errortext.error_summary(exc)}"
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


def record_failure(
    item: WorkItem,
    handler: WorkItemHandler,
    exc: BaseException,
    *,
    retriable: bool,
    give_up: threading.Event | None,
    label: Outcome | None = None,
    text: str | None = None,
    landed: Landed | None = None,
) -> Ending:
    """Record the attempt that raised ``exc`` (or timed out: ``label``, ``text``).

    After a cancel request the attempt ends ``cancelled``, whatever it
    raised (a timeout included); a ``Snooze`` is ``record_snooze``'s.
    """
    asked = cancel_was_requested(item)
    if isinstance(exc, Snooze) and not asked:
        return record_snooze(item, handler, exc, give_up=give_up, landed=landed)
    sensitive = handler.sensitive
    error = text if text is not None else errortext.format_error(exc, sensitive=sensitive)
    try:
        tracing.record_failure(exc, sensitive=sensitive)
    except Exception:
        logger.debug("Could not record the failure on the span.", exc_info=True)
    shown = errortext.error_summary(exc, sensitive=sensitive)
    attempts, max_attempts = item.attempts, item.max_attempts
    cancel = asked or isinstance(exc, Cancelled)
    retry = retriable and attempts < max_attempts and not cancel
    delay = retry_delay(handler, attempts) if retry else 0.0

    error_class = errortext.exception_class_path(exc)

    def write() -> str | None:
        if cancel:
            cancelled = transitions.cancel_running(
                item,
                error=errortext.clean_error_text(CANCELLED_BY_REQUEST + error) if asked else error,
                error_class=error_class,
            )
            return Status.CANCELLED if cancelled else None
        if retry:
            if transitions.retry_later(item, delay=delay, error=error, error_class=error_class):
                return Status.PENDING
        elif transitions.fail(
            item, error=error, error_class=error_class, unless_cancel_requested=True
        ):
            return Status.FAILED
        return _cancelled_instead(item, error, error_class)

    try:
        status = _write_outcome(item, handler, write, give_up=give_up)
    except Exception as exc_write:
        return _unrecorded(item, handler, exc_write)
    if status is None:
        return endings.FENCED
    if status == Status.CANCELLED:
        ending = _landed(Ending(Outcome.CANCELLED, status, exc), landed)
        logger.warning(
            "Work item %s (%s) cancelled on attempt %d/%d%s: %s",
            item.pk,
            handler.name,
            attempts,
            max_attempts,
            " (by request)" if asked or not isinstance(exc, Cancelled) else "",
            shown,
        )
        return ending
    if status == Status.FAILED and retry:
        # The retry was refused: a plain failure was written.
        return _landed(Ending(label or Outcome.FAILED, status, exc), landed)
    ending = _landed(
        Ending(label or (Outcome.RETRIED if retry else Outcome.FAILED), status, exc), landed
    )
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
        return ending
    logger.error(
        "Work item %s (%s) failed on attempt %d/%d%s: %s",
        item.pk,
        handler.name,
        attempts,
        max_attempts,
        "" if retriable else " (not retryable)",
        shown,
    )
    return ending


def _cancelled_instead(item: WorkItem, error: str, error_class: str) -> str | None:
    """The write the row's cancel request refused, as ``cancelled``; None if fenced out.

    A request the worker had not heard of yet: the fenced retry, snooze or
    failure matched no row, and this write tells a request from a lost claim.
    """
    text = errortext.clean_error_text(CANCELLED_BY_REQUEST + error)
    if transitions.cancel_running(item, error=text, error_class=error_class, requested=True):
        return Status.CANCELLED
    return None


def record_snooze(
    item: WorkItem,
    handler: WorkItemHandler,
    snooze: Snooze,
    *,
    give_up: threading.Event | None,
    landed: Landed | None = None,
) -> Ending:
    """The handler raised ``Snooze``: pending again, due later, its attempt not counted.

    The write is fenced like a retry's. It matches no row when a cancel was
    requested meanwhile (the attempt then ends ``cancelled``) or when the
    row snoozed ``MAX_SNOOZES`` times already (it then fails).
    """
    error_class = errortext.exception_class_path(snooze)
    error = errortext.format_error(snooze, include_traceback=False)
    too_many = f"{error_class}: snoozed more than {MAX_SNOOZES} times (the last one: {snooze})"

    def write() -> str | None:
        if transitions.snooze(item, delay=snooze.seconds):
            return Status.PENDING
        cancelled = _cancelled_instead(item, error, error_class)
        if cancelled is not None:
            return cancelled
        if transitions.fail(item, error=too_many, error_class=error_class):
            return Status.FAILED
        return None

    try:
        status = _write_outcome(item, handler, write, give_up=give_up)
    except Exception as exc_write:
        return _unrecorded(item, handler, exc_write)
    if status is None:
        return endings.FENCED
    if status == Status.PENDING:
        ending = _landed(Ending(Outcome.SNOOZED, status), landed)
        logger.debug("Work item %s (%s) snoozed for %gs.", item.pk, handler.name, snooze.seconds)
        return ending
    outcome = Outcome.CANCELLED if status == Status.CANCELLED else Outcome.FAILED
    ending = _landed(Ending(outcome, status, snooze), landed)
    if outcome is Outcome.FAILED:
        logger.error("Work item %s (%s) failed: %s.", item.pk, handler.name, too_many)
    else:
        logger.warning("Work item %s (%s) cancelled (by request).", item.pk, handler.name)
    return ending


def record_refused_result(
    item: WorkItem,
    handler: WorkItemHandler,
    cause: BaseException,
    *,
    give_up: threading.Event | None,
    landed: Landed | None = None,
) -> Ending:
    """The handler finished but its result cannot be stored: record ``failed``.

    Not retried: a new attempt would compute the same result (and repeat the
    handler's side effects) only to be refused again.
    """
    reason = errortext.error_summary(cause, sensitive=handler.sensitive, limit=2_000)
    error = errortext.clean_error_text(RESULT_NOT_STORED + reason)
    error_class = errortext.exception_class_path(cause)
    try:
        status = _write_outcome(
            item,
            handler,
            lambda: (
                Status.FAILED
                if transitions.fail(item, error=error, error_class=error_class)
                else None
            ),
            give_up=give_up,
        )
    except Exception as exc_write:
        return _unrecorded(item, handler, exc_write)
    if status is None:
        return endings.FENCED
    ending = _landed(Ending(Outcome.FAILED, status, cause), landed)
    logger.error(
        "Work item %s (%s) finished but its result could not be stored, recorded as failed: %s",
        item.pk,
        handler.name,
        reason,
    )
    return ending


def _write_outcome(
    item: WorkItem,
    handler: WorkItemHandler,
    write: Callable[[], str | None],
    *,
    give_up: threading.Event | None,
) -> str | None:
    """``write`` until it lands; if the database refuses it, a plain fenced failure.

    ``write`` answers the row's status it wrote, or None if it matched no
    row. Returns the row's status now (``write``'s, or ``failed`` if the
    plain failure was written instead), or None if the attempt was fenced out.
    Raises only when even the plain failure cannot be written (or the worker
    is stopping at once while the database is away).
    """
    db = item._state.db or "default"
    try:
        return persist(
            lambda: _guarded_status(item, write),
            what="recording an outcome",
            give_up=give_up,
            using=db,
        )
    except Exception as exc:
        if is_transient(exc):
            raise
        refusal = errortext.error_summary(exc)
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
            lambda: transitions.fail(item, error=errortext.clean_error_text(plain), history=False),
        ),
        what="recording a plain failure",
        give_up=give_up,
        using=db,
    )
    return Status.FAILED if landed else None


def _unrecorded(item: WorkItem, handler: WorkItemHandler, exc: BaseException) -> Ending:
    logger.error(
        "Could not record any outcome of work item %s (%s): %s. It stays claimed under "
        "this attempt until it is released or recovered as stale.",
        item.pk,
        handler.name,
        errortext.error_summary(exc),
    )
    return endings.UNRECORDED
