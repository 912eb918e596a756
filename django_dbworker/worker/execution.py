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

This module decides and writes; it *returns* what happened (an
``Ending``) and accounts for nothing: metrics of finished tasks, the
``attempt_recorded`` hook, counters and the fenced log line are
``settle.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connections, transaction

from django_dbworker import errortext, tracing, transitions
from django_dbworker.db.errors import is_transient
from django_dbworker.errors import Cancelled
from django_dbworker.handlers import (
    ATTEMPT_ATTR,
    WorkItemHandler,
    cancel_was_requested,
    running_async_attempt,
    running_attempt,
    runs_async,
)
from django_dbworker.metrics import WorkerMetrics, default_metrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.outcomes import Outcome
from django_dbworker.worker import endings
from django_dbworker.worker.abandoned import AbandonedThreads
from django_dbworker.worker.config import CANCEL_GRACE
from django_dbworker.worker.connections import (
    close_thread_connections,
    guarded,
    refresh_all_if_idle,
    tidy_all,
)
from django_dbworker.worker.endings import SILENT, Ending, Observer
from django_dbworker.worker.failures import record_failure, record_refused_result

logger = logging.getLogger("django_dbworker.worker")

#: Seconds a failed async attempt waits for Django's thread for sync code to tidy its
#: connections (``_tidy_sync_thread``) before it is recorded anyway.
SYNC_TIDY_WAIT = 1.0

#: Hands a success to the success writer: (item, result as JSON text or
#: None). The writer records it and its ending is settled from there; it
#: answers how it ended if it knows at once (inline, or a quick write), else None.
RecordSuccess = Callable[[WorkItem, "str | None"], "Outcome | None"]
#: Runs a sync call (database work, a sync hook) off the event loop and awaits it.
Offload = Callable[..., Awaitable[Any]]


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
    observer: Observer = SILENT,
) -> Ending:
    """Run ``item`` and record its outcome; returns how the attempt ended.

    Never raises for anything the handler does (``BaseException`` included):
    the caller's slot and loop must survive any user code. Each attempt is
    one CONSUMER span. Non-atomic successes go to ``record_success`` (the
    worker's success writer; the ending is then ``DEFERRED``); atomic
    handlers write theirs in their own transaction, through the same
    ``transitions.succeed``.
    ``observer`` hears what happens as it happens (``endings.Observer``):
    the outcome about to be written, each write that landed, a timeout
    and how the abandoned run ended.
    """
    metrics = metrics or default_metrics()
    ready = _Recording(observer.recording)
    started = time.perf_counter()
    ending: Ending | None = None
    try:
        with metrics.running(handler.name), tracing.processing(item, handler) as attempt:
            ending = _execute(
                item,
                handler,
                give_up=give_up,
                enforce_timeout=enforce_timeout,
                record_success=record_success,
                abandoned=abandoned,
                ready=ready,
                observer=observer,
            )
            _report(attempt, ending, ready)
    except BaseException as exc:
        # Our own code (or a tracing SDK) failed around the handler. If no
        # outcome was recorded yet, the attempt still needs one.
        _log_unexpected(item, handler, exc)
        if ending is None:
            ready()
            ending = record_failure(
                item, handler, exc, retriable=True, give_up=give_up, landed=observer.landed
            )
    return _timed(ending, started)


def _report(attempt: Any, ending: Ending, ready: _Recording) -> None:
    """Tell the attempt's span its outcome (a deferred success: what the writer reported)."""
    if ending.outcome == Outcome.DEFERRED:
        attempt.outcome(ready.reported or Outcome.SUCCEEDED)
    else:
        attempt.outcome(ending.outcome)


def _log_unexpected(item: WorkItem, handler: WorkItemHandler, exc: BaseException) -> None:
    """Our own code (or a tracing SDK) failed around the handler: say so, never a secret."""
    logger.error(
        "Unexpected error around work item %s (%s): %s",
        item.pk,
        handler.name,
        errortext.error_summary(exc, sensitive=handler.sensitive),
        exc_info=not handler.sensitive,
    )


def _timed(ending: Ending, started: float) -> Ending:
    """The ending with its run time; a deferred success's comes with the writer's answer."""
    if ending.outcome is Outcome.DEFERRED:
        return ending
    return ending.took(time.perf_counter() - started)


def _execute(
    item: WorkItem,
    handler: WorkItemHandler,
    *,
    give_up: threading.Event | None,
    enforce_timeout: bool,
    record_success: RecordSuccess,
    abandoned: AbandonedThreads | None,
    ready: _Recording,
    observer: Observer,
) -> Ending:
    timeout = handler.timeout
    if timeout is None or not enforce_timeout:
        return _run_and_record(item, handler, give_up, record_success, ready, observer)

    box: dict[str, Any] = {}
    tracker = abandoned or AbandonedThreads()
    finished, gone = tracker.track()

    def target() -> None:
        started = time.perf_counter()
        ending: Ending | None = None
        try:
            ending = box["ending"] = _run_and_record(
                item, handler, give_up, record_success, ready, observer
            )
        except BaseException as exc:  # our bug: the attempt still needs an outcome
            box["error"] = exc
        finally:
            close_thread_connections()
            late = tracker.finish(finished, gone)
            if late and ending is not None:
                # Abandoned: the caller reported the timeout, and only this
                # thread knows how the late run ended (usually fenced).
                observer.late(ending.took(time.perf_counter() - started))

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
        if "ending" in box:
            ending: Ending = box["ending"]
            return ending
        ready()
        return record_failure(
            item, handler, box["error"], retriable=True, give_up=give_up, landed=observer.landed
        )
    observer.abandoned()
    error = TimeoutError(f"{handler.name} ran longer than its timeout of {timeout:g}s")
    ready()
    return record_failure(
        item,
        handler,
        error,
        retriable=True,
        label=Outcome.TIMEOUT,
        give_up=give_up,
        text=errortext.format_error(error, include_traceback=False),
        landed=observer.landed,
    )


def _run_and_record(
    item: WorkItem,
    handler: WorkItemHandler,
    give_up: threading.Event | None,
    record_success: RecordSuccess,
    ready: _Recording,
    observer: Observer,
) -> Ending:
    db = item._state.db or "default"
    conn = connections[db]
    # Tidy the connection between steps only if we own its state: a caller
    # inside a transaction (run_until_empty in a TestCase) keeps it as it is.
    owned = not conn.in_atomic_block

    def tidy_if_owned() -> None:
        if owned:
            tidy_all(db, conn)

    if owned:
        refresh_all_if_idle(db, conn)
    # Failures are recorded after the except blocks, not in them: the
    # handler's exception is then no longer "being handled", so nothing that
    # runs while recording (the attempt_recorded hook, signal receivers that
    # log with sys.exc_info()) can print it; a sensitive handler's messages
    # may quote its payload.
    refused: _ResultRefused | None = None
    failure: BaseException | None = None
    try:
        # ``handler.cancel_requested`` reads the attempt of the thread that
        # runs it: one handler instance serves every thread of the process.
        with running_attempt(item):
            try:
                handler.attempt_started(item)
                if handler.atomic:
                    with transaction.atomic(using=db):
                        result = _call(handler, item)
                        encoded = _encode_result(result)
                        ready()
                        if not _succeed_or_refuse(item, encoded):
                            raise _FencedOut
                    succeeded = Ending(Outcome.SUCCEEDED, Status.SUCCEEDED)
                    observer.landed(succeeded)
                    return succeeded
                encoded = _encode_result(_call(handler, item))
                ready()
            except _FencedOut:
                return endings.FENCED
            except _ResultRefused as exc:
                refused = exc
            except BaseException as exc:
                failure = exc
        if refused is not None:
            ready()
            tidy_if_owned()
            return record_refused_result(
                item, handler, refused.cause, give_up=give_up, landed=observer.landed
            )
        if failure is not None:
            ready()
            tidy_if_owned()
            return record_failure(
                item,
                handler,
                failure,
                retriable=isinstance(failure, handler.retry_on),
                give_up=give_up,
                landed=observer.landed,
            )
        tidy_if_owned()
        # The success writer owns the write (and its fallbacks) from here.
        ready.reported = record_success(item, encoded)
        return endings.DEFERRED
    finally:
        tidy_if_owned()


def _call(handler: WorkItemHandler, item: WorkItem) -> Any:
    """``handle_item`` in this thread; an async handler's coroutine run to its end here.

    The threaded worker runs async handlers on its event loop
    (``execute_async``); this is the inline worker's way (``run_until_empty``).
    """
    if runs_async(type(handler)):
        from asgiref.sync import async_to_sync

        async def awaited() -> Any:
            return await handler.handle_item(item)

        return async_to_sync(awaited)()
    return handler.handle_item(item)


async def execute_async(
    item: WorkItem,
    handler: WorkItemHandler,
    *,
    offload: Offload,
    track: Callable[[asyncio.Task[Any]], None],
    give_up: threading.Event | None,
    metrics: WorkerMetrics,
    record_success: RecordSuccess,
    observer: Observer = SILENT,
) -> Ending:
    """``execute`` for an async handler, on the worker's event loop.

    The handler's coroutine runs in a task of its own, which the timeout,
    a cancel request or a lost claim cancel (``track`` hands it to the
    loop's cancel poll); its outcome is recorded only once that task has
    ended, so nothing of it runs after its outcome is written. Every write
    goes through ``offload`` (the loop never waits on the database) or to
    the success writer. A stop that cancels this coroutine leaves the
    attempt unrecorded: shutdown releases its row.
    """
    ready = _Recording(observer.recording)
    started = time.perf_counter()
    ending: Ending | None = None
    try:
        with metrics.running(handler.name), tracing.processing(item, handler) as attempt:
            ending = await _execute_async(
                item, handler, offload, track, give_up, record_success, ready, observer, started
            )
            _report(attempt, ending, ready)
    except asyncio.CancelledError:
        raise  # a stop: shutdown releases the row
    except Exception as exc:
        _log_unexpected(item, handler, exc)
        if ending is None:
            ready()
            ending = await _finish(
                offload(
                    record_failure,
                    item,
                    handler,
                    exc,
                    retriable=True,
                    give_up=give_up,
                    landed=observer.landed,
                )
            )
    return _timed(ending, started)


async def _execute_async(
    item: WorkItem,
    handler: WorkItemHandler,
    offload: Offload,
    track: Callable[[asyncio.Task[Any]], None],
    give_up: threading.Event | None,
    record_success: RecordSuccess,
    ready: _Recording,
    observer: Observer,
    started: float,
) -> Ending:
    running_async_attempt(item)  # this task's, and the handler's task's (a copy)
    failure: BaseException | None = None
    try:
        if type(handler).attempt_started is not WorkItemHandler.attempt_started:
            await offload(handler.attempt_started, item)  # a hook of the handler's (signals)
        task: asyncio.Task[Any] = asyncio.ensure_future(_contained(handler.handle_item(item)))
    except Exception as exc:
        failure = exc
    else:
        track(task)
        timeout = handler.timeout
        remaining = None if timeout is None else max(0.0, started + timeout - time.perf_counter())
        try:
            done, _ = await asyncio.wait({task}, timeout=remaining)
        except asyncio.CancelledError:
            await _stop(task, item, handler)
            raise
        if not done:
            await _stop(task, item, handler, observer=observer)
            await _tidy_sync_thread(item)
            assert timeout is not None
            error = TimeoutError(f"{handler.name} ran longer than its timeout of {timeout:g}s")
            ready()
            return await _finish(
                offload(
                    record_failure,
                    item,
                    handler,
                    error,
                    retriable=True,
                    label=Outcome.TIMEOUT,
                    give_up=give_up,
                    text=errortext.format_error(error, include_traceback=False),
                    landed=observer.landed,
                )
            )
        try:
            encoded = _encode_result(task.result())
        except asyncio.CancelledError as exc:
            # Cancelled by the loop's poll: a cancel request (ends ``cancelled``), or a
            # claim lost meanwhile (the write is fenced out). A CancelledError of the
            # handler's own (an awaited task cancelled inside it) is a plain failure.
            attempt = item.__dict__.get(ATTEMPT_ATTR)
            stopped = cancel_was_requested(item) or bool(getattr(attempt, "lost", False))
            failure = Cancelled("cancelled by request while running") if stopped else exc
        except _ResultRefused as exc:
            ready()
            return await _finish(
                offload(
                    record_refused_result,
                    item,
                    handler,
                    exc.cause,
                    give_up=give_up,
                    landed=observer.landed,
                )
            )
        except _Escaped as exc:
            failure = exc.cause
        except BaseException as exc:
            failure = exc
        else:
            ready()
            ready.reported = record_success(item, encoded)
            return endings.DEFERRED
        await _tidy_sync_thread(item)
    ready()
    return await _finish(
        offload(
            record_failure,
            item,
            handler,
            failure,
            retriable=isinstance(failure, handler.retry_on),
            give_up=give_up,
            landed=observer.landed,
        )
    )


async def _tidy_sync_thread(item: WorkItem) -> None:
    """After a failed async attempt, ``tidy_all`` on Django's one thread for sync code.

    Handlers' ORM calls (``sync_to_async``, Django's async ORM) share that
    thread's connections: one the server dropped would fail every later
    attempt, as a pool thread's would without its tidying between items.
    A thread held by another handler's long call is not waited for.
    """
    tidying = sync_to_async(tidy_all)(item._state.db or "default")
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(tidying, timeout=SYNC_TIDY_WAIT)


class _Escaped(Exception):
    """A SystemExit or KeyboardInterrupt a handler's coroutine raised, carried as a plain
    error: asyncio re-raises those two out of the loop itself, which would end the loop's
    thread and strand every attempt on it."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


async def _contained(coro: Awaitable[Any]) -> Any:
    """Await the handler's coroutine; its SystemExit or KeyboardInterrupt stays in its
    task (``_Escaped``) and fails its attempt only."""
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _Escaped(exc) from exc


async def _finish(write: Awaitable[Ending]) -> Ending:
    """The write of an attempt's outcome, once begun, ends and is settled, whatever stop
    cancels the coroutine meanwhile: its attempt is recording (never released), and
    shutdown waits for it."""
    inner = asyncio.ensure_future(write)
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        return await inner


async def _stop(
    task: asyncio.Task[Any],
    item: WorkItem,
    handler: WorkItemHandler,
    *,
    observer: Observer = SILENT,
) -> None:
    """Cancel the handler's task and wait (CANCEL_GRACE at most) for it to end."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE)
    if done:
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning
        return
    observer.abandoned()
    logger.error(
        "Work item %s (%s) did not stop within %gs of being cancelled (does its handler "
        "catch CancelledError?); its attempt is recorded without it, and whatever it "
        "records later is discarded.",
        item.pk,
        handler.name,
        CANCEL_GRACE,
    )


def _encode_result(result: Any) -> str | None:
    """The result as JSON text for the ``result`` column; None (SQL NULL) for None."""
    if result is None:
        return None
    if inspect.isawaitable(result):
        # A forgotten ``await`` (or an async function called from handle): the
        # work never ran, and a retry would return another coroutine.
        close = getattr(result, "close", None)
        if close is not None:
            close()  # no "never awaited" warning: the failure says it
        raise _ResultRefused(
            TypeError(
                f"The handler returned a coroutine ({type(result).__name__}) without running "
                "it: its handle is a plain def, which the worker runs on a thread and does "
                "not await. Declare it async def to run it on the worker's event loop, or "
                "await the call inside it with asgiref.sync.async_to_sync."
            )
        )
    try:
        return errortext.ensure_json(result, "The handler's return value")
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
    linked = transitions.linked_rows([item])
    try:
        return _guarded(
            item,
            lambda: bool(transitions.succeed(attempt, using=item._state.db, linked=linked)),
        )
    except DatabaseError as exc:
        if is_transient(exc):
            raise
        raise _ResultRefused(exc) from exc
