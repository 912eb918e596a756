"""Connection hygiene for long-lived worker threads.

Django closes connections at the end of each request; a worker thread has
no requests, so it tidies after every job instead. With ``CONN_MAX_AGE`` set,
connections are recycled between jobs exactly as Django recycles them
between requests. With the default ``CONN_MAX_AGE = 0`` they are kept open
(a reconnect per job would cost more than most jobs), but a connection that
errored and is unusable, or that user code left outside autocommit, is
reset so the next job starts clean.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dbworker.db.errors import is_transient

logger = logging.getLogger("django_dbworker.worker")

T = TypeVar("T")

#: A thread's connection idle for longer than this is checked before the next job.
IDLE_CHECK_AFTER = 1.0
_last_used = threading.local()


def tidy(using: str = DEFAULT_DB_ALIAS, conn: BaseDatabaseWrapper | None = None) -> None:
    """Leave this thread's connection ready for the next job.

    ``conn`` is ``connections[using]`` if the caller has it at hand (the
    lookup goes through a thread-local and costs more than the rest when
    there is nothing to tidy).
    """
    conn = conn or connections[using]
    if conn.connection is None:
        return
    try:
        if conn.in_atomic_block:
            # Only reachable if user code entered atomic() without leaving it.
            conn.close()
            return
        if not conn.get_autocommit():
            conn.rollback()
            conn.set_autocommit(True)
        if conn.settings_dict.get("CONN_MAX_AGE"):
            # The project asked for connection recycling: honour it between jobs
            # exactly as Django does between requests.
            conn.close_if_unusable_or_obsolete()
        elif conn.errors_occurred and not conn.is_usable():
            conn.close()
        conn.errors_occurred = False
    except Exception:
        logger.debug("Closing a connection that could not be tidied.", exc_info=True)
        close_quietly(using)
    setattr(_last_used, using, time.monotonic())


def refresh_if_idle(using: str = DEFAULT_DB_ALIAS, conn: BaseDatabaseWrapper | None = None) -> None:
    """Before a job: drop this thread's connection if it died while idle.

    A connection killed between jobs (a failover, ``pg_terminate_backend``,
    a proxy's idle timeout) would fail the next job's first query and cost
    it an attempt. Django checks at request start only with
    ``CONN_HEALTH_CHECKS``; a worker checks a connection that sat idle for
    more than ``IDLE_CHECK_AFTER`` seconds, so a busy worker pays nothing.
    """
    conn = conn or connections[using]
    if conn.connection is None or conn.in_atomic_block:
        return
    last = getattr(_last_used, using, None)
    if last is not None and time.monotonic() - last < IDLE_CHECK_AFTER:
        return
    try:
        usable = conn.is_usable()
    except Exception:
        usable = False
    if not usable:
        close_quietly(using)


def guarded(using: str, write: Callable[[], T]) -> T:
    """``write`` in a savepoint when a caller's transaction is open.

    A statement the database refuses aborts the whole transaction on
    PostgreSQL; inside ``run_until_empty`` in a test's transaction the
    fallback write must still be possible. In autocommit (the worker) no
    savepoint is needed and none is paid for.
    """
    if not connections[using].in_atomic_block:
        return write()
    with transaction.atomic(using=using):
        return write()


def tidy_unless_in_transaction(using: str) -> None:
    """``tidy`` for code that may run inside a caller's transaction (leave it alone)."""
    if not connections[using].in_atomic_block:
        tidy(using)


def close_quietly(using: str = DEFAULT_DB_ALIAS) -> None:
    try:
        connections[using].close()
    except Exception:
        logger.debug("Ignoring an error while closing a broken connection.", exc_info=True)


def close_thread_connections() -> None:
    for conn in connections.all(initialized_only=True):
        try:
            conn.close()
        except Exception:
            logger.debug("Ignoring an error while closing a connection.", exc_info=True)


class Backoff:
    """Exponential delays for reconnect attempts: 0.1 s doubling up to ``cap``."""

    def __init__(self, first: float = 0.1, cap: float = 10.0) -> None:
        self.first = first
        self.cap = cap
        self.delay = first

    def next(self) -> float:
        delay = self.delay
        self.delay = min(self.cap, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first


def run_until_stopped(
    step: Callable[[], float],
    *,
    stopped: threading.Event,
    first_delay: float,
    backoff: Backoff,
    what: str,
    using: str,
    on_error: Callable[[], None] | None = None,
    wait: Callable[[threading.Event, float], bool] = threading.Event.wait,
) -> None:
    """Call ``step`` until ``stopped`` is set, sleeping the seconds it returns.

    For helper threads that must not die of an error (the heartbeat, the
    scheduler): every exception is logged, the connection closed and the
    step retried after ``backoff``; what cannot be caught (a
    ``BaseException``) ends the thread, and the worker's watchdog notices.
    """
    delay = first_delay
    try:
        while not wait(stopped, delay):
            try:
                delay = step()
            except Exception as exc:
                if on_error is not None:
                    on_error()
                delay = backoff.next()
                logger.warning(
                    "%s failed (%s: %s); retrying in %.1fs.",
                    what,
                    type(exc).__name__,
                    str(exc).strip()[:300],
                    delay,
                )
                close_quietly(using)
            else:
                backoff.reset()
    finally:
        close_thread_connections()


def persist(
    fn: Callable[[], T],
    *,
    what: str,
    give_up: threading.Event | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> T:
    """Run a database write until it goes through or ``give_up`` is set.

    Used for outcome records: a job that ran must not be re-run just because
    the database blinked while its result was being written. Retrying is
    safe because every outcome write is fenced by the claim token. Errors
    that retrying cannot cure (the database refuses a value) are raised at
    once for the caller's fallback.
    """
    backoff = Backoff()
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc) or (give_up is not None and give_up.is_set()):
                raise
            delay = backoff.next()
            logger.warning("Database error while %s (%s); retrying in %.1fs.", what, exc, delay)
            close_quietly(using)
            if give_up is not None:
                if give_up.wait(delay):
                    raise
            else:
                time.sleep(delay)
