"""Rate limits: a rate-limited handler's starts, counted cluster-wide as they happen.

A rate limit promises that a handler starts at most N times in any window of its period,
across every worker (SPEC "Flow control"). So the window counts starts, not claims: a
worker claims a rate-limited handler's rows like any others, and just before a thread runs
one it takes a start (``take_start``); a start the window does not allow is not taken, and
the row goes back to pending without using an attempt (``worker/running.py``).

``take_start`` is one short transaction: lock the handler's ``FlowLock`` row
``rate:<handler>``, read the database clock, count the window's starts, and add this one.
Takers of one handler decide one after the other, at READ COMMITTED whatever the project's
isolation (``ending_transaction``: each sees what the lock's previous holder committed), so
two of them never both take the window's last start. Row locks only, released at commit:
nothing holds a session, so PgBouncer's transaction mode keeps working.

The starts are kept in buckets of a hundredth of the period (``RateStart`` rows with a
count): a take reads at most about a hundred rows whatever the limit ("3600000/h" included),
and a bucket counts whole, so the window counted is at most a bucket longer than the period
(a limit loses at most 1% of its rate, never exceeds it). Starts dated after the database's
"now" (its clock stepped back: an NTP step, a restored VM, a failover to a lagging replica)
count as now: they leave the window a period later instead of when the clock catches up.
A start is counted from a moment before the handler starts; the handler starts within
``rate_allowance`` of it or not at all (the window counted is that much longer), so the
handlers' own starts keep the limit too, on a loaded host as well.
The statements are the ORM's, the same on every vendor. Never runs handler code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import F, Min, Sum
from django.db.models.functions import Now

from django_dbworker.db import VendorOperations
from django_dbworker.flow.models import FlowLock, RateStart

#: Buckets a window is counted in: the cost of a take, and a limit's loss (one bucket).
RATE_BUCKETS = 100


def lock_flow(using: str, name: str) -> tuple[datetime, float]:
    """Lock the ``FlowLock`` row ``name`` (made on first use) until commit; the DB time after,
    and this host's ``time.time()`` once the lock was held (before that DB time).

    Insert-or-ignore, then ``SELECT ... FOR UPDATE``, only when the row is
    missing: it exists after the first claim, and a lock taken straight
    away never meets MySQL's shared lock of a duplicate insert (two such
    would deadlock on the upgrade). The clock is read once the lock is
    held, so the times of successive holders follow the order in which
    they held it. (SQLite has no row locks: the transaction holds the
    database's write lock with ``transaction_mode = "IMMEDIATE"``, which
    the system check W003 asks for.)
    """
    locks = FlowLock.objects.using(using)
    if not list(locks.select_for_update().filter(name=name).values_list("name", flat=True)):
        locks.bulk_create([FlowLock(name=name)], ignore_conflicts=True)
        list(locks.select_for_update().filter(name=name).values_list("name", flat=True))
    locked_at = time.time()
    now: datetime = locks.filter(name=name).annotate(now=Now()).values_list("now", flat=True)[0]
    return now, locked_at


@dataclass(frozen=True)
class Take:
    """What ``take_start`` answered."""

    #: None when the start was taken; else the seconds (by the database clock) until the
    #: window's earliest start leaves it, and nothing was taken.
    full_for: float | None
    #: This host's clock (``time.time()``) once the handler's lock was held, which is
    #: before the database's "now" that dated the start: the handler must start within
    #: ``rate_allowance`` of it, or the start it took goes unused (``worker/claim.py``).
    locked_at: float


def take_start(ops: VendorOperations, *, handler: str, starts: int, period: float) -> Take:
    """Take one start of ``handler``'s window (``starts`` per ``period`` seconds) now.

    A deadlock or lock wait timeout (MySQL) runs the transaction again.
    """
    return ops.retrying(lambda: _take_start(ops, handler, starts, period), "rate-limiting")


def _take_start(ops: VendorOperations, handler: str, starts: int, period: float) -> Take:
    using = ops.using
    # The window as counted: the period, and the time from this take to the handler's start
    # (the commit, the return to the thread: ``rate_allowance``).
    window = timedelta(seconds=period + ops.rate_allowance)
    width = period / RATE_BUCKETS
    with ops.ending_transaction():
        now, locked_at = lock_flow(using, f"rate:{handler}")
        epoch = now.timestamp()
        bucket = datetime.fromtimestamp(epoch - epoch % width, UTC)
        mine = RateStart.objects.using(using).filter(handler=handler)
        # Starts dated ahead of the clock (it stepped back) count as this bucket's.
        mine.filter(started_at__gt=bucket).update(started_at=bucket)
        # A bucket counts whole: every bucket that may hold a start of the window.
        since = now - window - timedelta(seconds=width)
        mine.filter(started_at__lte=since).delete()
        counted = mine.aggregate(used=Sum("count"), first=Min("started_at"))
        used = int(counted["used"] or 0)
        if used >= starts:
            first = counted["first"] or bucket
            leaves = first + timedelta(seconds=width) + window
            return Take(max(0.0, (leaves - now).total_seconds()), locked_at)
        if not mine.filter(started_at=bucket).update(count=F("count") + 1):
            RateStart.objects.using(using).create(handler=handler, started_at=bucket, count=1)
    return Take(None, locked_at)
