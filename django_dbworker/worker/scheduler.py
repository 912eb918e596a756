"""The scheduler: enqueues each due slot of the periodic handlers a worker runs.

Every ``run_workers`` process that runs a ``PeriodicHandler`` runs one
scheduler thread; they do not coordinate and none is a leader. The
database decides: each periodic handler has a ``PeriodicSchedule`` row
whose ``last_slot`` is advanced by a compare-and-set UPDATE (``last_slot <
slot``) in the same transaction that inserts the slot's WorkItem. Exactly
one process wins a slot; the others' UPDATE matches no row (on PostgreSQL
it waits for the winner's row lock, then re-reads the advanced value).
Since the marker is the schedule row, not the WorkItem, a slot whose item
finished long ago, or was pruned, is never enqueued again.

After downtime only the latest missed slot is taken (catch-up once); a slot
that comes due while the previous slot's item is still pending or claimed
is taken but skipped (counted in ``periodic_worker_skipped_total`` and on
the row), so slow runs never pile up.

Times are the database's clock: each pass reads the schedule rows with the
database's ``now``, and a slot's item is due (``run_after``) at the slot,
so a host whose clock runs ahead can never start a run early. Never runs
handler code; holds a schedule row's lock only for one short transaction.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from django_dbworker import enqueuing
from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import ACTIVE_STATUSES, PeriodicSchedule, WorkItem
from django_dbworker.periodic.handler import (
    PeriodicHandler,
    periodic_handlers,
    slot_key,
    taken_until,
)
from django_dbworker.worker.connections import Backoff, run_until_stopped

logger = logging.getLogger("django_dbworker.worker")

#: Longest sleep between two passes, in seconds: a pass re-reads the rows
#: (and the database clock) at least this often, whatever the schedules.
MAX_WAIT = 30.0
#: Shortest sleep: a pass that woke a hair before its slot (by the database
#: clock) tries again this soon.
MIN_WAIT = 0.005
#: Slept past a slot's instant so that the database clock has reached it.
WAKE_MARGIN = 0.002


class SlotOutcome(StrEnum):
    #: This process won the slot and inserted its WorkItem.
    ENQUEUED = "enqueued"
    #: This process won the slot, but the previous run was still live: no item.
    SKIPPED = "skipped"
    #: Another process (or an earlier pass) took the slot, or a later one.
    TAKEN = "taken"


@dataclass(frozen=True)
class DueSlot:
    handler: type[PeriodicHandler]
    slot: datetime
    #: Earlier slots passed untaken (no worker ran them): this one is the catch-up.
    caught_up: bool


def ensure_schedules(names: Iterable[str], *, using: str) -> None:
    """Create the missing schedule rows (concurrent creators are fine)."""
    PeriodicSchedule.objects.using(using).bulk_create(
        [PeriodicSchedule(name=name) for name in names], ignore_conflicts=True
    )


def due_slots(
    handlers: Sequence[type[PeriodicHandler]], *, using: str
) -> tuple[list[DueSlot], datetime, datetime | None]:
    """The slots due now (one per handler at most), the database's now, and the next slot.

    One query, which also reads the database clock; the rows are created
    first if any is missing.
    """
    names = [cls.name for cls in handlers]
    rows = _read(names, using)
    if len(rows) < len(names):
        ensure_schedules(names, using=using)
        rows = _read(names, using)
    now: datetime = next(iter(rows.values())).db_now  # type: ignore[attr-defined]
    due: list[DueSlot] = []
    upcoming: datetime | None = None
    for cls in handlers:
        row = rows[cls.name]
        schedule = cls.get_schedule()
        baseline = taken_until(schedule, row.last_slot, row.created_at)
        slot = schedule.latest(now)
        if slot is not None and slot > baseline:
            first_missed = schedule.following(baseline)
            caught_up = first_missed is not None and first_missed < slot
            due.append(DueSlot(cls, slot, caught_up=caught_up))
        following = schedule.following(now)
        if following is not None and (upcoming is None or following < upcoming):
            upcoming = following
    return due, now, upcoming


def _read(names: Sequence[str], using: str) -> dict[str, PeriodicSchedule]:
    rows = PeriodicSchedule.objects.using(using).filter(name__in=names).annotate(db_now=Now())
    return {row.name: row for row in rows}


def take_slot(
    cls: type[PeriodicHandler],
    slot: datetime,
    *,
    using: str,
    metrics: WorkerMetrics | None = None,
    caught_up: bool = False,
    missed_while: str = "no worker ran it",
) -> SlotOutcome:
    """Advance the schedule to ``slot`` and enqueue its WorkItem, in one transaction.

    The compare-and-set UPDATE decides: if ``last_slot`` is already at or
    past ``slot``, someone else took it and nothing is written. Otherwise
    the slot's item is inserted (``unique_key`` = the slot) in the same
    transaction, so the marker and the item commit together or not at all;
    unless the previous slot's item is still pending or claimed, in which
    case the slot is skipped and counted. ``missed_while`` says, for a
    catch-up, why the earlier slots passed.
    """
    key = slot_key(slot)
    schedules = PeriodicSchedule.objects.using(using).filter(name=cls.name)
    with transaction.atomic(using=using):
        won = schedules.filter(Q(last_slot__isnull=True) | Q(last_slot__lt=slot)).update(
            last_slot=slot, updated_at=Now()
        )
        if not won:
            return SlotOutcome.TAKEN
        # The row is ours (locked on PostgreSQL, the write lock on SQLite)
        # until commit: nobody else can read a half-taken slot.
        previous = schedules.values_list("last_item_id", flat=True).get()
        live = (
            previous is not None
            and WorkItem.objects.using(using)
            .filter(pk=previous, status__in=ACTIVE_STATUSES)
            .exists()
        )
        if live:
            schedules.update(skipped=F("skipped") + 1)
        else:
            jitter = cls.get_jitter()
            run_after = slot + timedelta(seconds=random.uniform(0.0, jitter)) if jitter else slot
            item = enqueuing.enqueue(
                cls, {"slot": key}, run_after=run_after, unique_key=key, using=using
            )
            schedules.update(last_item_id=item.pk)
    if live:
        if metrics is not None:
            metrics.slot_skipped(cls.name)
        logger.warning(
            "Skipped slot %s of periodic handler %r: its previous run (work item %s) is "
            "still pending or running.",
            key,
            cls.name,
            previous,
        )
        return SlotOutcome.SKIPPED
    if caught_up:
        logger.info(
            "Periodic handler %r missed slots while %s; running only the latest, %s "
            "(work item %s).",
            cls.name,
            missed_while,
            key,
            item.pk,
        )
    else:
        logger.debug("Enqueued slot %s of %r as work item %s.", key, cls.name, item.pk)
    return SlotOutcome.ENQUEUED


class Scheduler(threading.Thread):
    """Wakes at each slot (by the database clock) and tries to take the due ones.

    Like the heartbeat, it must not die of an error: every failure is logged,
    backed off and retried (the worker's watchdog notices if it dies anyway).
    """

    def __init__(
        self,
        handlers: Sequence[type[PeriodicHandler]],
        *,
        using: str,
        metrics: WorkerMetrics | None = None,
        on_enqueued: Callable[[], None] | None = None,
        max_wait: float = MAX_WAIT,
    ) -> None:
        super().__init__(name="dbworker-scheduler", daemon=True)
        self.handlers = list(handlers)
        self.using = using
        self.metrics = metrics
        self.on_enqueued = on_enqueued
        self.max_wait = max_wait
        self.stopped = threading.Event()
        #: Slots this process took, by outcome (tests and logs read it).
        self.taken: dict[SlotOutcome, int] = dict.fromkeys(SlotOutcome, 0)
        #: Whether the last pass failed: slots that passed meanwhile were
        #: missed while this worker ran but could not reach the database.
        self._failed = False

    def run(self) -> None:
        run_until_stopped(
            self._pass,
            stopped=self.stopped,
            first_delay=0.0,
            backoff=Backoff(first=0.2, cap=10.0),
            what="Scheduling periodic work",
            using=self.using,
        )

    def _pass(self) -> float:
        try:
            wait = self.tick()
        except Exception:
            self._failed = True
            raise
        self._failed = False
        return wait

    def tick(self) -> float:
        """One pass: take every due slot; returns the seconds to sleep until the next."""
        missed_while = (
            "the database was unreachable or failing" if self._failed else "no worker ran it"
        )
        due, now, upcoming = due_slots(self.handlers, using=self.using)
        enqueued = False
        for entry in due:
            outcome = take_slot(
                entry.handler,
                entry.slot,
                using=self.using,
                metrics=self.metrics,
                caught_up=entry.caught_up,
                missed_while=missed_while,
            )
            self.taken[outcome] += 1
            enqueued = enqueued or outcome == SlotOutcome.ENQUEUED
        if enqueued and self.on_enqueued is not None:
            self.on_enqueued()  # this process's claim loop need not wait for a poll
        if upcoming is None:
            return self.max_wait
        wait = (upcoming - now).total_seconds() + WAKE_MARGIN
        return min(max(wait, MIN_WAIT), self.max_wait)

    def stop(self) -> None:
        self.stopped.set()


def start_scheduler(
    handlers: Iterable[Any],
    *,
    using: str,
    queues: Sequence[str] | None,
    burst: bool,
    metrics: WorkerMetrics | None = None,
    on_enqueued: Callable[[], None] | None = None,
) -> Scheduler | None:
    """The scheduler for the periodic handlers among ``handlers``, started; or None.

    Only handlers whose queue this worker claims are scheduled (an item
    nobody here would run is left to the workers of its queue). In burst
    mode the slots due now are taken once, in the calling thread, and no
    thread is started.
    """
    periodic = [cls for cls in periodic_handlers(handlers) if not queues or cls.queue in queues]
    if not periodic:
        return None
    scheduler = Scheduler(periodic, using=using, metrics=metrics, on_enqueued=on_enqueued)
    if burst:
        try:
            scheduler.tick()
        except Exception as exc:
            logger.warning("Could not enqueue the due periodic slots: %s", exc)
        return None
    scheduler.start()
    return scheduler
