"""Running one claimed ``WorkItem`` through its handler and recording the outcome.

Never runs inside the claim transaction and never holds row locks while
user code runs: the claim committed already, and outcome writes are short
fenced UPDATEs. For ``atomic`` handlers the handler's own writes and the
success record share one transaction, which rolls back when the fence
fails, so those writes commit exactly once per job.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections, transaction

from django_dbworker import tracing, transitions
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.metrics import WorkerMetrics, default_metrics
from django_dbworker.models import WorkItem
from django_dbworker.worker.connections import close_thread_connections, persist, tidy

logger = logging.getLogger("django_dbworker.worker")

#: Records a success: (item, result as JSON text or None) -> still ours? None
#: means "handed over": the recorder reports the outcome itself, later.
RecordSuccess = Callable[[WorkItem, "str | None"], "bool | None"]

SUCCEEDED = "succeeded"
FAILED = "failed"
RETRIED = "retried"
TIMEOUT = "timeout"
#: The outcome was discarded because the row was recovered and re-claimed meanwhile.
FENCED = "fenced"
#: The success was handed to a writer that reports it later (see RecordSuccess).
DEFERRED = "deferred"


class _FencedOut(Exception):
    """Rolls back an atomic handler's transaction whose claim was lost."""


def execute(
    item: WorkItem,
    handler: WorkItemHandler,
    *,
    give_up: threading.Event | None = None,
    enforce_timeout: bool = True,
    metrics: WorkerMetrics | None = None,
    record_success: RecordSuccess | None = None,
) -> str:
    """Run ``item`` and record its outcome; returns one of the outcome labels.

    Never raises for anything the handler does (``BaseException`` included):
    the caller's slot and loop must survive any user code. Each attempt is
    one CONSUMER span and one observation of the task metrics.
    ``record_success`` replaces the single-row success write (the worker
    passes its batching writer); atomic handlers always write their own.
    """
    metrics = metrics or default_metrics()
    started = time.perf_counter()
    with metrics.running(handler.name), tracing.processing(item, handler) as attempt:
        outcome = _execute(
            item,
            handler,
            give_up=give_up,
            enforce_timeout=enforce_timeout,
            record_success=record_success,
        )
        attempt.outcome(SUCCEEDED if outcome == DEFERRED else outcome)
    if outcome != DEFERRED:
        metrics.task_done(handler.name, outcome, time.perf_counter() - started)
    return outcome


def _execute(
    item: WorkItem,
    handler: WorkItemHandler,
    *,
    give_up: threading.Event | None,
    enforce_timeout: bool,
    record_success: RecordSuccess | None,
) -> str:
    timeout = handler.timeout
    if timeout is None or not enforce_timeout:
        return _run_and_record(item, handler, give_up, record_success)

    box: dict[str, str] = {}

    def target() -> None:
        try:
            box["outcome"] = _run_and_record(item, handler, give_up, record_success)
        finally:
            close_thread_connections()

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
    if not runner.is_alive():
        return box.get("outcome", FAILED)
    error = TimeoutError(f"{handler.name} ran longer than its timeout of {timeout:g}s")
    return _record_failure(
        item,
        handler,
        error,
        retriable=True,
        label=TIMEOUT,
        give_up=give_up,
        text=transitions.format_error(error, include_traceback=False),
    )


def _run_and_record(
    item: WorkItem,
    handler: WorkItemHandler,
    give_up: threading.Event | None,
    record_success: RecordSuccess | None,
) -> str:
    db = item._state.db or "default"
    # Tidy the connection between steps only if we own its state: a caller
    # inside a transaction (run_until_empty in a TestCase) keeps it as it is.
    owned = not connections[db].in_atomic_block

    def tidy_if_owned() -> None:
        if owned:
            tidy(db)

    try:
        try:
            if handler.atomic:
                with transaction.atomic(using=db):
                    result = handler.handle(item.payload)
                    transitions.ensure_json(result, "The handler's return value")
                    if not transitions.succeed(item, result):
                        raise _FencedOut
                return SUCCEEDED
            result = handler.handle(item.payload)
            encoded = transitions.ensure_json(result, "The handler's return value")
        except _FencedOut:
            log_fenced(item, handler)
            return FENCED
        except BaseException as exc:
            tidy_if_owned()
            return _record_failure(
                item, handler, exc, retriable=isinstance(exc, handler.retry_on), give_up=give_up
            )
        tidy_if_owned()
        if record_success is not None:
            recorded = record_success(item, None if result is None else encoded)
            if recorded is None:
                return DEFERRED
        else:
            recorded = persist(
                lambda: transitions.succeed(item, result),
                what="recording a success",
                give_up=give_up,
                using=db,
            )
        if recorded:
            return SUCCEEDED
        log_fenced(item, handler)
        return FENCED
    finally:
        tidy_if_owned()


def _record_failure(
    item: WorkItem,
    handler: WorkItemHandler,
    exc: BaseException,
    *,
    retriable: bool,
    give_up: threading.Event | None,
    label: str | None = None,
    text: str | None = None,
) -> str:
    db = item._state.db or "default"
    error = text if text is not None else transitions.format_error(exc)
    attempts, max_attempts = item.attempts, item.max_attempts
    tracing.record_failure(exc, sensitive=handler.sensitive)
    # A sensitive handler's exception message may quote its payload.
    shown: Any = type(exc).__name__ if handler.sensitive else f"{type(exc).__name__}: {exc}"
    if retriable and attempts < max_attempts:
        delay = handler.backoff(attempts)
        recorded = persist(
            lambda: transitions.retry_later(item, delay=delay, error=error),
            what="recording a retry",
            give_up=give_up,
            using=db,
        )
        if recorded:
            logger.warning(
                "Work item %s (%s) failed attempt %d/%d, retrying in %.1fs: %s",
                item.pk,
                handler.name,
                attempts,
                max_attempts,
                delay,
                shown,
            )
            return label or RETRIED
    else:
        recorded = persist(
            lambda: transitions.fail(item, error=error),
            what="recording a failure",
            give_up=give_up,
            using=db,
        )
        if recorded:
            logger.error(
                "Work item %s (%s) failed on attempt %d/%d%s: %s",
                item.pk,
                handler.name,
                attempts,
                max_attempts,
                "" if retriable else " (not retryable)",
                shown,
            )
            return label or FAILED
    log_fenced(item, handler)
    return FENCED


def log_fenced(item: WorkItem, handler: WorkItemHandler) -> None:
    logger.warning(
        "Discarded the outcome of work item %s (%s): its claim was recovered and "
        "re-claimed meanwhile, so a newer attempt owns the row.",
        item.pk,
        handler.name,
    )
