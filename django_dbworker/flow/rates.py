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
A start is counted when it is taken, and the handler starts when the take returns: the
window is counted ``rate_allowance`` longer than the period for that gap (the commit, the
return to the thread). A thread that waits longer for Python's lock (CPU-bound handlers in
the same process) starts its handler that much later than its count, and a window's
starts can bunch by as much; refusing such late starts livelocked a busy process.
The statements are the ORM's, the same on every vendor. Never runs handler code.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db.models import F, Max, Min, Sum
from django.db.models.functions import Now

from django_dbworker.db import VendorOperations
from django_dbworker.flow.models import FlowLock, RateStart

#: Buckets a window is counted in: the cost of a take, and a limit's loss (one bucket).
RATE_BUCKETS = 100


def lock_flow(using: str, name: str) -> datetime:
    """Lock the ``FlowLock`` row ``name`` (made on first use) until commit; the DB time after.

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
    now: datetime = locks.filter(name=name).annotate(now=Now()).values_list("now", flat=True)[0]
    return now


def take_start(ops: VendorOperations, *, handler: str, starts: int, period: float) -> float | None:
    """Take one start of ``handler``'s window (``starts`` per ``period`` seconds) now.

    None when it was taken; else the seconds (by the database clock) until the window's
    earliest start leaves it, and nothing was taken. A deadlock or lock wait timeout
    (MySQL) runs the transaction again.
    """
    return ops.retrying(lambda: _take_start(ops, handler, starts, period), "rate-limiting")


def _take_start(ops: VendorOperations, handler: str, starts: int, period: float) -> float | None:
    using = ops.using
    # The window as counted: the period, and the time from this take to the handler's start
    # (the commit, the return to the thread: ``rate_allowance``).
    window = timedelta(seconds=period + ops.rate_allowance)
    width = period / RATE_BUCKETS
    with ops.ending_transaction():
        now = lock_flow(using, f"rate:{handler}")
        epoch = now.timestamp()
        bucket = datetime.fromtimestamp(epoch - epoch % width, UTC)
        mine = RateStart.objects.using(using).filter(handler=handler)
        # A bucket counts whole: every bucket that may hold a start of the window.
        since = now - window - timedelta(seconds=width)
        mine.filter(started_at__lte=since).delete()
        counted = mine.aggregate(used=Sum("count"), first=Min("started_at"), last=Max("started_at"))
        used = int(counted["used"] or 0)
        if counted["last"] is not None and counted["last"] > bucket:
            # Starts dated ahead of the clock (it stepped back) count as this bucket's.
            ahead = mine.filter(started_at__gt=bucket)
            _add(using, handler, bucket, int(ahead.aggregate(n=Sum("count"))["n"] or 0))
            ahead.delete()
            counted["first"] = min(counted["first"], bucket)
        if used >= starts:
            first = counted["first"] or bucket
            leaves = first + timedelta(seconds=width) + window
            return max(0.0, (leaves - now).total_seconds())
        _add(using, handler, bucket, 1)
    return None


def _add(using: str, handler: str, bucket: datetime, count: int) -> None:
    """``count`` starts in ``handler``'s bucket ``bucket``: on one row of it (workers before
    the development snapshots before 0.1 wrote a row per start, at any time), or a new one."""
    if not count:
        return
    rows = RateStart.objects.using(using).filter(handler=handler, started_at=bucket)
    pk = rows.order_by("pk").values_list("pk", flat=True).first()
    if pk is None:
        RateStart.objects.using(using).create(handler=handler, started_at=bucket, count=count)
    else:
        RateStart.objects.using(using).filter(pk=pk).update(count=F("count") + count)
