"""Flow-controlled claims that every vendor shares: a ``FlowLock`` row lock, the rate window.

``claim_rated`` is the claim of a rate-limited handler: in one short
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
is its claim and its transaction (``VendorOperations.claim_rated``). Never
runs handler code; holds the lock only for the claim.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Min
from django.db.models.functions import Now

from django_dbworker.db.types import Claimed
from django_dbworker.models import FlowLock, RateStart, WorkItem

#: Seconds added to a rate limit's period when its window is counted at a
#: claim (the default of ``VendorOperations.rate_allowance``). A claim
#: counts as the row's start, but the handler starts a few milliseconds
#: later (the claim's commit, dispatch to a thread), and the claims that
#: follow a full window come in bursts as the window's earliest starts
#: leave it: without an allowance, two bursts one period apart at the claim
#: could start less than one period apart in the handlers. 20 ms costs 2%
#: of a "N/s" limit's throughput and nothing measurable of "N/m" or "N/h".
RATE_ALLOWANCE = 0.02


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
    *,
    using: str,
    transaction: Callable[[], AbstractContextManager[Any]],
    claim: Callable[[int], Claimed[WorkItem]],
    handler: str,
    starts: int,
    period: float,
    limit: int,
    allowance: float = RATE_ALLOWANCE,
) -> Claimed[WorkItem]:
    """Claim up to ``limit`` rows of ``handler``, allowed ``starts`` starts per ``period`` seconds.

    The window counted is one period plus ``allowance`` seconds. Rows beyond
    the limit stay pending and use no attempt. ``full_for`` says when the
    window frees up, so that the worker can leave the handler out of its
    claims until then (and claim other handlers' rows meanwhile).
    """
    if limit <= 0:
        return Claimed()
    # Nothing of the handler ready: one indexed read, no transaction, no lock
    # (idle processes took the FlowLock row at every poll, docs/scale.md). A
    # superset of what the claim could take (any queue): a row enqueued after
    # it is the next poll's or wake-up's, as after any claim that found none.
    if not WorkItem.objects.using(using).ready().filter(handler=handler).exists():
        return Claimed()
    window = timedelta(seconds=period + allowance)
    with transaction():
        now = lock_flow(using, f"rate:{handler}")
        since = now - window
        counted = (
            RateStart.objects.using(using)
            .filter(handler=handler, started_at__gt=since)
            .aggregate(n=Count("id"), first=Min("started_at"))
        )
        used, first = int(counted["n"]), counted["first"]
        room = max(0, starts - used)
        items = claim(min(limit, room)) if room else Claimed[WorkItem]()
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


# -- the keyed claim's decisions (per-key concurrency limits) ------------------

#: A claim candidate of the keyed claim: ``(id, handler, concurrency_key,
#: concurrency_limit)``, as the vendors' candidate statements return it.
Candidate = tuple[int, str, str | None, int | None]

FLOW_LOCK_NAME_MAX = 255  # FlowLock.name's width


def flow_lock_name(handler: str, key: str) -> str:
    """The ``FlowLock`` row that serialises the claims of one (handler, concurrency_key).

    Readable when it fits the column, a digest otherwise. Pairs that share a
    name (``"a:b"``/``"c"``, ``"a"``/``"b:c"``) only share a lock, not counts.
    """
    name = f"key:{handler}:{key}"
    if len(name) <= FLOW_LOCK_NAME_MAX:
        return name
    digest = hashlib.sha256(f"{handler}\0{key}".encode()).hexdigest()
    return f"key#{digest}"


def current_limits(candidates: Sequence[Candidate], limits: Mapping[str, int]) -> list[Candidate]:
    """``candidates`` with each keyed row's limit its handler's current one (None: unlimited)."""
    return [(pk, h, key, None if key is None else limits.get(h)) for pk, h, key, _ in candidates]


def within_limits(
    candidates: Sequence[Candidate], held: dict[tuple[str, str], int]
) -> tuple[list[int], int]:
    """The ids to claim of ``candidates`` (in claim order), and how many are held back.

    ``held``: claimed rows per (handler, key), counted under the keys' locks.
    A candidate without a limit is taken; one with a limit (its handler's
    current one) while its key holds fewer rows, counting those taken before.
    """
    taken: dict[tuple[str, str], int] = {}
    ids: list[int] = []
    throttled = 0
    for pk, handler, key, limit in candidates:
        if key is None or limit is None:
            ids.append(pk)
            continue
        slot = (handler, key)
        used = held.get(slot, 0) + taken.get(slot, 0)
        if used < limit:
            taken[slot] = taken.get(slot, 0) + 1
            ids.append(pk)
        else:
            throttled += 1
    return ids, throttled
