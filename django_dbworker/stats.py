"""Aggregates over the work table: counts by queue and status, queue lag, orphans,
concurrency keys at their limit, and the last hour of finished work
(throughput per minute, run times, failures).

Live rows (pending, claimed) and failed rows are always counted exactly:
they are what operators act on, and the status index keeps those counts
cheap. Finished rows (succeeded, cancelled) can be millions; on a large
PostgreSQL table they are estimated from the planner's statistics instead
of counted, and marked as estimates. What finished recently is read for
the last hour only (``RECENT``), by range scans of ``dbworker_finished_idx``,
so its cost follows the hour's traffic, not the table's size. Ages use the
database clock. Reads go to the routers' read alias unless ``using`` says
otherwise (``routing.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

from django.db.models import Case, Count, F, Max, Min, Q, TextField, Value, When
from django.db.models.functions import Left, Now, StrIndex, Substr, TruncMinute
from django.utils import timezone

from django_dbworker.db import operations
from django_dbworker.db.types import RunTimes
from django_dbworker.errortext import error_pattern
from django_dbworker.flow.models import FairKey
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import PeriodicSchedule, Status, WorkItem, live_or_failed
from django_dbworker.periodic.handler import PeriodicHandler, periodic_handlers
from django_dbworker.periodic.schedules import taken_until
from django_dbworker.registry import registry
from django_dbworker.routing import work_db_for_read

#: Below this many rows (planner estimate) everything is counted exactly.
EXACT_BELOW = 200_000
ESTIMATED_STATUSES = (Status.SUCCEEDED, Status.CANCELLED)


class QueueStats(TypedDict):
    counts: dict[str, int]
    #: Statuses whose count is a planner estimate.
    estimated: set[str]
    oldest_pending_age: float | None


def status_columns(stats: dict[str, QueueStats]) -> list[str]:
    """The statuses to show: the known ones in life-cycle order, then any others found.

    A row may carry a status this version does not know (written by a newer
    version, or by hand); it is shown under its own name, not dropped.
    """
    known = [s.value for s in Status]
    found = {status for entry in stats.values() for status in entry["counts"]}
    return known + sorted(found - set(known))


def queue_stats(using: str | None = None) -> dict[str, QueueStats]:
    """``{queue: {"counts": {status: n}, "estimated": {...}, "oldest_pending_age": s}}``."""
    db = work_db_for_read(using)
    estimate = operations(db).table_estimate(["queue", "status"])
    approximate = estimate is not None and estimate.rows >= EXACT_BELOW
    stats: dict[str, QueueStats] = {}

    def entry(queue: str) -> QueueStats:
        return stats.setdefault(
            queue, {"counts": {}, "estimated": set(), "oldest_pending_age": None}
        )

    rows = WorkItem.objects.using(db).order_by()
    if approximate:
        rows = rows.filter(live_or_failed())
    for row in rows.values("queue", "status").annotate(n=Count("id")):
        entry(row["queue"])["counts"][row["status"]] = row["n"]
    if approximate:
        assert estimate is not None
        queue_col, status_col = estimate.columns["queue"], estimate.columns["status"]
        queues = set(stats) | set(queue_col.frequencies)
        for queue in queues:
            for status in ESTIMATED_STATUSES:
                guess = estimate.rows * queue_col.frequency(queue) * status_col.frequency(status)
                if guess >= 0.5:
                    item = entry(queue)
                    item["counts"][status.value] = round(guess)
                    item["estimated"].add(status.value)
    lag: Any = (
        WorkItem.objects.using(db)
        .ready()
        .order_by()
        .values("queue")
        .annotate(oldest=Min("run_after"), now=Now())
    )
    for row in lag:
        entry(row["queue"])["oldest_pending_age"] = max(
            0.0, (row["now"] - row["oldest"]).total_seconds()
        )
    return stats


class FlowStats(TypedDict):
    #: Claimed rows asked to stop (``item.cancel()`` on running work).
    cancel_requested: int
    #: Pending rows that snoozed at least once (``raise Snooze``).
    snoozed: int


def flow_stats(using: str | None = None) -> FlowStats:
    """Running rows asked to cancel, and pending rows that snoozed: one query over live rows."""
    db = work_db_for_read(using)
    counts = (
        WorkItem.objects.using(db)
        .filter(Q(status=Status.PENDING) | Q(status=Status.CLAIMED))
        .aggregate(
            cancel_requested=Count(
                "id", filter=Q(status=Status.CLAIMED, cancel_requested_at__isnull=False)
            ),
            snoozed=Count("id", filter=Q(status=Status.PENDING, snoozes__gt=0)),
        )
    )
    return {"cancel_requested": counts["cancel_requested"], "snoozed": counts["snoozed"]}


class OrphanedHandler(TypedDict):
    handler: str
    pending: int
    #: Seconds since the oldest of these rows was enqueued (database clock).
    oldest_age: float


def orphaned_handlers(using: str | None = None) -> list[OrphanedHandler]:
    """Handler names with pending rows that no WorkItemHandler here registers, by name.

    Nothing runs such rows: the handler was renamed or removed, or its
    ``workers`` module is not installed in this process. They would wait
    forever without a sign, so the stats and the admin list them. Only this
    process's registry is known; a name registered only in the workers'
    deployment shows up here too, and is worth fixing anyway (the admin
    cannot tell whether its payloads are sensitive). One query over the
    pending rows, grouped by handler; not-yet-due rows count too.
    """
    runnable = [name for name, cls in registry.items() if issubclass(cls, WorkItemHandler)]
    rows: Any = (
        WorkItem.objects.using(work_db_for_read(using))
        .pending()
        .exclude(handler__in=runnable)
        .order_by()
        .values("handler")
        .annotate(n=Count("id"), oldest=Min("created_at"), now=Now())
        .order_by("handler")
    )
    return [
        {
            "handler": row["handler"],
            "pending": row["n"],
            "oldest_age": max(0.0, (row["now"] - row["oldest"]).total_seconds()),
        }
        for row in rows
    ]


class KeyAtLimit(TypedDict):
    handler: str
    key: str
    claimed: int
    limit: int


#: Keys at their limit listed, most claimed first.
KEYS_AT_LIMIT = 20


def keys_at_limit(using: str | None = None) -> tuple[list[KeyAtLimit], int]:
    """Concurrency keys whose claimed rows fill their limit (at most ``KEYS_AT_LIMIT``), and
    how many such keys there are.

    Read from the claimed keyed rows only (the partial ``dbworker_key_slots_idx``
    on PostgreSQL and SQLite), so its cost follows the work running now.
    Their pending rows wait for a slot.
    """
    db = work_db_for_read(using)
    rows: Any = (
        WorkItem.objects.using(db)
        .filter(status=Status.CLAIMED, concurrency_key__isnull=False)
        .order_by()
        .values("handler", "concurrency_key")
        .annotate(n=Count("id"), limit=Min("concurrency_limit"))
        .filter(limit__isnull=False, n__gte=F("limit"))
        .order_by("-n", "handler", "concurrency_key")
    )
    found: list[KeyAtLimit] = [
        {
            "handler": r["handler"],
            "key": r["concurrency_key"],
            "claimed": r["n"],
            "limit": r["limit"],
        }
        for r in rows
    ]
    return found[:KEYS_AT_LIMIT], len(found)


class ReadyFairKey(TypedDict):
    #: The fair key; ``""``: the rows without one (they take turns as one key).
    key: str
    ready: int
    weight: float


#: Fair keys with the most ready work listed.
FAIR_KEYS_SHOWN = 10


def busiest_fair_keys(using: str | None = None) -> list[ReadyFairKey]:
    """The fair keys with the most ready rows (at most ``FAIR_KEYS_SHOWN``), with their
    weights; empty when no fair key was ever used (no ``FairKey`` row).

    A count of the ready rows by key (``dbworker_fair_idx``): its cost follows the
    backlog, as the queues' counts do. The rows without a key count only beside keyed ones.
    """
    db = work_db_for_read(using)
    weights = dict(FairKey.objects.using(db).values_list("key", "weight"))
    if not weights:
        return []
    rows: Any = (
        WorkItem.objects.using(db)
        .ready()
        .order_by()
        .values("fair_key")
        .annotate(n=Count("id"))
        .order_by("-n", "fair_key")
    )
    found: list[ReadyFairKey] = []
    for r in rows[: FAIR_KEYS_SHOWN + 1]:
        key = r["fair_key"] or ""
        found.append({"key": key, "ready": r["n"], "weight": weights.get(key, 1.0)})
    keyed = [f for f in found if f["key"]]
    return found[:FAIR_KEYS_SHOWN] if keyed else []


class ScheduleStats(TypedDict):
    name: str
    #: The schedule in words; "" for a schedule row no handler here declares.
    schedule: str
    queue: str
    #: Whether a handler registered in this process declares it.
    registered: bool
    #: The latest slot taken (enqueued or skipped), None before the first.
    last_slot: datetime | None
    #: The WorkItem of the latest slot enqueued: id and status (None: never,
    #: or pruned since: see ``last_item_id``).
    last_item_id: int | None
    last_status: str | None
    last_finished_at: datetime | None
    #: The next slot to be enqueued (one that is already due if no worker took it yet).
    next_slot: datetime | None
    skipped: int
    now: datetime


def schedule_stats(using: str | None = None) -> list[ScheduleStats]:
    """Every periodic handler registered here, and every schedule row, by name.

    Two queries: the schedule rows (with the database clock) and the
    WorkItems of their latest slots, by primary key.
    """
    db = work_db_for_read(using)
    rows = {row.name: row for row in PeriodicSchedule.objects.using(db).annotate(db_now=Now())}
    now: datetime = next(iter(rows.values())).db_now if rows else timezone.now()
    item_ids = [row.last_item_id for row in rows.values() if row.last_item_id is not None]
    items = {
        item.pk: item
        for item in WorkItem.objects.using(db)
        .filter(pk__in=item_ids)
        .only("id", "status", "finished_at")
    }
    declared = {cls.name: cls for cls in periodic_handlers(registry.values())}
    found: list[ScheduleStats] = []
    for name in sorted(set(declared) | set(rows)):
        cls = declared.get(name)
        row = rows.get(name)
        item = items.get(row.last_item_id) if row and row.last_item_id is not None else None
        found.append(
            {
                "name": name,
                "schedule": _describe(cls),
                "queue": cls.queue if cls is not None else "",
                "registered": cls is not None,
                "last_slot": row.last_slot if row else None,
                "last_item_id": row.last_item_id if row else None,
                "last_status": item.status if item else None,
                "last_finished_at": item.finished_at if item else None,
                "next_slot": _next_slot(cls, row, now),
                "skipped": row.skipped if row else 0,
                "now": now,
            }
        )
    return found


def _describe(cls: type[PeriodicHandler] | None) -> str:
    if cls is None:
        return ""
    try:
        return cls.get_schedule().describe()
    except Exception as exc:  # a bad declaration: the system check says more
        return f"invalid: {exc}"


def _next_slot(
    cls: type[PeriodicHandler] | None, row: PeriodicSchedule | None, now: datetime
) -> datetime | None:
    """The slot a worker will enqueue next: a due one not yet taken, else the following one."""
    if cls is None:
        return None
    try:
        schedule = cls.get_schedule()
    except Exception:
        return None
    due = schedule.latest(now)
    taken = taken_until(schedule, row.last_slot, row.created_at) if row is not None else None
    if due is not None and taken is not None and due > taken:
        return due
    return schedule.following(now)


#: The window of the dashboard's "recent" figures: every query about finished
#: work is bounded by ``finished_at >= now - RECENT``.
RECENT = timedelta(hours=1)
#: Where the database has no percentile function (SQLite), run times come
#: from at most this many of the latest succeeded rows.
RUN_TIME_SAMPLE = 5_000
#: Error groups listed, most frequent first.
FAILURE_GROUPS = 20
#: Distinct (handler, first line) pairs read to make them: the most frequent
#: first, then the latest. Messages that carry ids are each their own pair,
#: so the groups are folded from these in Python (``error_pattern``).
FAILURE_SAMPLE = 2_000
#: Characters of an error's first line that tell one error from another.
ERROR_HEAD = 200


class Throughput(TypedDict):
    #: The database clock when the rows were read (the server's if none were).
    now: datetime
    #: The start of each minute of the window, oldest first; the last one is
    #: the current, partial minute.
    minutes: list[datetime]
    #: ``{queue: [(succeeded, failed) per minute, aligned with minutes]}``.
    queues: dict[str, list[tuple[int, int]]]
    #: ``{queue: (succeeded, failed)}`` over the whole window: the minutes
    #: drawn and the part of the oldest minute that is not.
    totals: dict[str, tuple[int, int]]


def throughput(using: str | None = None, minutes: int = 60) -> Throughput:
    """Rows that succeeded or failed per queue and minute, over the last ``minutes``.

    One query, grouped by queue, minute of ``finished_at`` and status. A row
    counts once, in the minute it reached its final state: an attempt that
    failed and was retried is not a failure here (it shows as the retry's
    outcome). Minutes are UTC minutes of the database clock.
    """
    db = work_db_for_read(using)
    rows: Any = (
        WorkItem.objects.using(db)
        .filter(
            finished_at__gte=Now() - timedelta(minutes=minutes),
            status__in=(Status.SUCCEEDED, Status.FAILED),
        )
        .order_by()
        .annotate(minute=TruncMinute("finished_at", tzinfo=UTC))
        .values("queue", "minute", "status")
        .annotate(n=Count("id"), now=Now())
    )
    rows = list(rows)
    now: datetime = rows[0]["now"] if rows else timezone.now()
    last = now.astimezone(UTC).replace(second=0, microsecond=0)
    starts = [last - timedelta(minutes=minutes - 1 - i) for i in range(minutes)]
    index = {start: i for i, start in enumerate(starts)}
    queues: dict[str, list[tuple[int, int]]] = {}
    totals: dict[str, tuple[int, int]] = {}
    for row in rows:
        queue, n, succeeded = row["queue"], row["n"], row["status"] == Status.SUCCEEDED
        total = totals.get(queue, (0, 0))
        totals[queue] = (total[0] + n, total[1]) if succeeded else (total[0], total[1] + n)
        counts = queues.setdefault(queue, [(0, 0)] * minutes)
        # The oldest partial minute (now - 60 min .. its minute's end) is
        # counted but not drawn: the chart shows whole minutes and the current one.
        i = index.get(row["minute"].astimezone(UTC))
        if i is not None:
            s, f = counts[i]
            counts[i] = (s + n, f) if succeeded else (s, f + n)
    return {"now": now, "minutes": starts, "queues": queues, "totals": totals}


def run_times(using: str | None = None) -> list[RunTimes]:
    """p50/p95 run time per handler over the last hour (see ``VendorOperations.run_times``)."""
    db = work_db_for_read(using)
    return operations(db).run_times(RECENT, RUN_TIME_SAMPLE)


class FailureGroup(TypedDict):
    handler: str
    #: The first line of ``last_error`` (the exception type and message), or
    #: its pattern (``error_pattern``) when different messages fold into it.
    error: str
    count: int
    last_seen: datetime
    #: How many different first lines the group holds, and its latest one.
    messages: int
    example: str
    #: True when the read stopped at ``FAILURE_SAMPLE`` pairs: counts may be low.
    sampled: bool


def failure_groups(using: str | None = None) -> list[FailureGroup]:
    """Rows that failed in the last hour, grouped by handler and normalised first line of error.

    The first line is cut in the database (``last_error`` holds up to 10 kB
    of traceback each), and grouped there by its exact text: one query,
    reading at most ``FAILURE_SAMPLE`` groups. Those fold here into groups
    of one pattern (``error_pattern``: ids, numbers and quoted values
    replaced), so "Order 12 not found" and "Order 99 not found" are one
    failure; the ``FAILURE_GROUPS`` most frequent are returned.
    """
    db = work_db_for_read(using)
    first_line = Case(
        When(newline__gt=0, then=Substr("last_error", 1, F("newline") - 1)),
        default=F("last_error"),
        output_field=TextField(),
    )
    rows: Any = list(
        WorkItem.objects.using(db)
        .filter(finished_at__gte=Now() - RECENT, status=Status.FAILED)
        .order_by()
        .annotate(newline=StrIndex("last_error", Value("\n")))
        .annotate(error=Left(first_line, ERROR_HEAD))
        .values("handler", "error")
        .annotate(n=Count("id"), last_seen=Max("finished_at"))
        .order_by("-n", "-last_seen", "handler")[:FAILURE_SAMPLE]
    )
    sampled = len(rows) >= FAILURE_SAMPLE
    groups: dict[tuple[str, str], FailureGroup] = {}
    for row in rows:
        error = row["error"] or ""
        key = (row["handler"], error_pattern(error))
        group = groups.get(key)
        if group is None:
            groups[key] = {
                "handler": row["handler"],
                "error": row["error"],
                "count": row["n"],
                "last_seen": row["last_seen"],
                "messages": 1,
                "example": row["error"],
                "sampled": sampled,
            }
            continue
        group["count"] += row["n"]
        group["messages"] += 1
        group["error"] = key[1]
        if row["last_seen"] > group["last_seen"]:
            group["last_seen"], group["example"] = row["last_seen"], row["error"]
    ordered = sorted(
        groups.values(), key=lambda g: (-g["count"], -g["last_seen"].timestamp(), g["handler"])
    )
    return ordered[:FAILURE_GROUPS]
