"""Connection hygiene for long-lived worker threads.

Django closes connections at the end of each request; a worker thread has
no requests, so it tidies after every job instead. With ``CONN_MAX_AGE`` set,
connections are recycled between jobs exactly as Django recycles them
between requests. With the default ``CONN_MAX_AGE = 0`` they are kept open
(a reconnect per job would cost more than most jobs), but a connection that
errored and is unusable, or that user code left outside autocommit, is
reset so the next job starts clean.

It also says, once for the whole process, when the database is lost and
when it is back (``DatabaseOutage``): the claim loop, the heartbeat, the
scheduler, the wake-up listener and the outcome writers all notice an
outage, and each would otherwise log every retry.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.dispatch import receiver

from django_dbworker.db.errors import is_connection_error, is_transient

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


def tidy_all(using: str, conn: BaseDatabaseWrapper | None = None) -> None:
    """``tidy`` the work alias's connection and every other one this thread opened.

    A handler of a project whose work lives on a database of its own writes
    to ``default`` (or any alias): that connection needs the same care, or a
    server that dropped it fails every later job of the thread, and
    ``CONN_MAX_AGE`` is never honoured there. Another alias inside an atomic
    block, or with autocommit off, is left alone: it may be a caller's
    transaction (a test's around ``run_until_empty``).
    """
    tidy(using, conn)
    if not _other_aliases(using):
        return
    for other in connections.all(initialized_only=True):
        if other.alias == using or other.in_atomic_block or other.connection is None:
            continue
        if other.get_autocommit():  # not a caller's manual transaction (set_autocommit)
            tidy(other.alias, other)


def refresh_all_if_idle(using: str, conn: BaseDatabaseWrapper | None = None) -> None:
    """``refresh_if_idle`` for the work alias's connection and every other one of this thread."""
    refresh_if_idle(using, conn)
    if not _other_aliases(using):
        return
    for other in connections.all(initialized_only=True):
        if other.alias != using:
            refresh_if_idle(other.alias, other)


def _other_aliases(using: str) -> bool:
    """Whether DATABASES has aliases besides ``using``: a one-database project (most)
    pays nothing per job for looking at the others (the thread-local lookups cost
    more than the tidying)."""
    return len(connections.settings) > 1 or using not in connections.settings


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


#: Seconds between the "still unreachable" reminders of one outage.
OUTAGE_REMINDER_EVERY = 30.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class _Outage:
    began: float
    #: The number of the last connection opened before it began.
    opened: int = 0
    #: When it was last said at WARNING; None while it may still be a blip.
    reported: float | None = None


class DatabaseOutage:
    """What the process says about an unreachable database: lost once, reminders, back once.

    Every component that meets a connection error reports it here
    (``lost``) instead of logging it. The first report of an outage is a
    DEBUG line: one connection that the server closed while it sat idle (a
    restart that is over, a proxy's timeout) heals on its retry, and the
    worker reconnects without anybody needing to know. The second, from any
    component, is one WARNING with the error's first line; later ones are
    DEBUG lines, and a WARNING reminder is logged at most every
    ``OUTAGE_REMINDER_EVERY`` seconds. The first success that reaches the
    database after a WARNING (``back``, from any component: they share the
    database) is one INFO line. Per database alias; thread-safe.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._down: dict[str, _Outage] = {}

    def is_down(self, using: str) -> bool:
        return using in self._down

    def lost(self, using: str, what: str, exc: BaseException) -> None:
        """A connection error of ``what`` ("claiming"); logs as the outage's state says."""
        now = self.clock()
        with self._lock:
            down = self._down.get(using)
            if down is None:
                down = self._down[using] = _Outage(began=now, opened=_last_opened)
                say = "blip"
            elif down.reported is None:
                down.reported = now
                say = "lost"
            elif now - down.reported >= OUTAGE_REMINDER_EVERY:
                down.reported = now
                say = "reminder"
            else:
                say = "quiet"
        if say == "lost":
            logger.warning(
                "Database %r is unreachable (%s: %s); retrying until it is back.",
                using,
                what,
                _first_line(exc),
            )
        elif say == "reminder":
            logger.warning(
                "Database %r is still unreachable after %.0fs (%s); retrying.",
                using,
                now - down.began,
                _first_line(exc),
            )
        else:
            logger.debug("Database %r unreachable (%s: %s)", using, what, _first_line(exc))

    def back(self, using: str, *, reached: bool = False) -> None:
        """A step succeeded: ends the outage, if there was one, if it reached the database.

        It did if this thread opened a connection since the outage began
        (after an error each component closes its connection; a step with
        nothing to do, a heartbeat with no running items, a claim loop with
        no free thread, succeeds on an old connection without a query), or
        if the caller says so (``reached``: the wake-up listener has a
        connection of its own).
        """
        down = self._down.get(using)
        if down is None:  # the common case: no lock, no clock
            return
        if not reached and getattr(_opened_here, using, -1) <= down.opened:
            return
        with self._lock:
            down = self._down.pop(using, None)
        if down is None:
            return
        took = self.clock() - down.began
        if down.reported is None:
            logger.debug("Database %r reached again after %.1fs (one error only).", using, took)
        else:
            logger.info("Database %r is reachable again after %.0fs.", using, took)


#: The process's outage reporter (a worker process runs one worker).
outage = DatabaseOutage()
#: Connections opened by this process, numbered in order (itertools.count
#: is atomic under the GIL); per thread and alias, the number of the last.
_numbers = itertools.count(1)
_last_opened = 0
_opened_here = threading.local()


@receiver(connection_created, dispatch_uid="django_dbworker.worker.connections")
def _note_connection(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    # Sent in the thread that opened it (Django's connections are per thread).
    global _last_opened
    number = _last_opened = next(_numbers)
    setattr(_opened_here, connection.alias, number)


def report_error(using: str, what: str, exc: BaseException) -> bool:
    """Report ``exc`` to the outage reporter if it is a connection error; True if it was.

    Callers log other errors themselves, as before.
    """
    if not is_connection_error(exc):
        return False
    outage.lost(using, what, exc)
    return True


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
                if not report_error(using, what.lower(), exc):
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
                outage.back(using)
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
            result = fn()
        except Exception as exc:
            if not is_transient(exc) or (give_up is not None and give_up.is_set()):
                raise
            delay = backoff.next()
            if not report_error(using, what, exc):
                logger.warning("Database error while %s (%s); retrying in %.1fs.", what, exc, delay)
            close_quietly(using)
            if give_up is not None:
                if give_up.wait(delay):
                    raise
            else:
                time.sleep(delay)
        else:
            outage.back(using)
            return result
