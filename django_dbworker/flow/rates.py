"""Rate limits: the claim of a rate-limited handler, within its window, cluster-wide.

``claim_rated`` is the claim of a rate-limited handler (the claim route's,
``worker/claim.py``): in one short
transaction, lock the handler's ``FlowLock`` row ``rate:<handler>``, read
the database clock, count the handler's ``RateStart`` rows of the last
period, claim at most what is left (the vendor's own claim statement,
restricted to the handler, passed in as ``claim``), write one
``RateStart`` per row claimed and delete the handler's starts that left
the window. Claimers of one handler decide one after the other, so two of
them never both take the window's last start: the window is exact in any
period, cluster-wide. Row locks only, released at commit: nothing holds a
session, so PgBouncer's transaction mode keeps working.

The statements are the ORM's, the same on every vendor; the vendor's part
is its claim (``VendorOperations.claim``), its transaction
(``ending_transaction``: reads after the lock see the previous holder's
commit, whatever the isolation level) and its ``rate_allowance``. Never runs
handler code; holds the lock only for the claim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from django.db.models import Count, Min
from django.db.models.functions import Now

from django_dbworker.db import VendorOperations
from django_dbworker.db.types import Claimed
from django_dbworker.flow.models import FlowLock, RateStart
from django_dbworker.models import WorkItem


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


def claim_rated(
    ops: VendorOperations,
    *,
    handler: str,
    starts: int,
    period: float,
    limit: int,
    queues: Sequence[str] | None,
    worker: str,
    limits: Mapping[str, int] | None = None,
) -> Claimed[WorkItem]:
    """Claim up to ``limit`` rows of ``handler``, allowed ``starts`` starts per ``period`` seconds.

    The window counted is one period plus the vendor's ``rate_allowance``.
    Rows beyond the limit stay pending and use no attempt (``held_back``).
    ``full_for`` says when the window frees up, so that the worker can leave
    the handler out of its claims until then (and claim other handlers' rows
    meanwhile). ``limits``: the handler's concurrency limit, when it has one.
    A deadlock or lock wait timeout (MySQL) runs the transaction again.
    """
    return ops.retrying(
        lambda: _claim_rated(
            ops, handler, starts, period, limit, queues=queues, worker=worker, limits=limits
        ),
        "claiming",
    )


def _claim_rated(
    ops: VendorOperations,
    handler: str,
    starts: int,
    period: float,
    limit: int,
    *,
    queues: Sequence[str] | None,
    worker: str,
    limits: Mapping[str, int] | None,
) -> Claimed[WorkItem]:
    using = ops.using
    if limit <= 0:
        return Claimed()
    # Nothing of the handler ready: one indexed read, no transaction, no lock
    # (idle processes took the FlowLock row at every poll, docs/scale.md). A
    # superset of what the claim could take (any queue): a row enqueued after
    # it is the next poll's or wake-up's, as after any claim that found none.
    if not WorkItem.objects.using(using).ready().filter(handler=handler).exists():
        return Claimed()
    window = timedelta(seconds=period + ops.rate_allowance)
    with ops.ending_transaction():
        now = lock_flow(using, f"rate:{handler}")
        since = now - window
        counted = (
            RateStart.objects.using(using)
            .filter(handler=handler, started_at__gt=since)
            .aggregate(n=Count("id"), first=Min("started_at"))
        )
        used, first = int(counted["n"]), counted["first"]
        room = max(0, starts - used)
        items = (
            ops.claim(
                limit=min(limit, room),
                handlers=[handler],
                queues=queues,
                worker=worker,
                limits=limits,
            )
            if room
            else Claimed[WorkItem]()
        )
        if items:
            RateStart.objects.using(using).bulk_create(
                [RateStart(handler=handler, started_at=now) for _ in items]
            )
        RateStart.objects.using(using).filter(handler=handler, started_at__lte=since).delete()
    full_for = None
    if used + len(items) >= starts:
        leaves = (first if first is not None else now) + window
        full_for = max(0.0, (leaves - now).total_seconds())
    # Asked for more than the window allowed, and took all it allowed: rows
    # were (probably) left pending by the limit.
    capped = room < limit and len(items) == room
    return Claimed(
        items, items.throttled, held_back=limit - len(items) if capped else 0, full_for=full_for
    )
