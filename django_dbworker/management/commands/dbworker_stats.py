"""``manage.py dbworker_stats``: counts by queue and status, queue lag, the live workers,
paused queues, cancel requests and snoozes, orphans, open batches and waiting rows,
schedules."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_dbworker.batches.stats import open_batches, waiting_count
from django_dbworker.conf import dbworker_settings
from django_dbworker.db import setup_problem
from django_dbworker.fleet.register import live_workers
from django_dbworker.flow.queues import queue_list
from django_dbworker.routing import work_db_for_read
from django_dbworker.stats import (
    busiest_fair_keys,
    flow_stats,
    keys_at_limit,
    orphaned_handlers,
    queue_stats,
    schedule_stats,
    status_columns,
)

#: The columns of the open batches' table.
BATCH_COLUMNS = ["batch", "callback", "created", "ended/total"]
BATCH_COLUMNS += ["succeeded", "failed", "cancelled", "pending"]
#: The columns of the live workers' table.
WORKER_COLUMNS = ["host", "pid", "queues", "handlers", "concurrency", "claimed"]
WORKER_COLUMNS += ["last heartbeat", "started at", "version"]
#: Up to this many handler names are listed; more are counted.
HANDLERS_LISTED = 4


class Command(BaseCommand):
    help = (
        "Show work item counts by queue and status, the oldest claimable item's age, "
        "the live workers, and pending work of handlers this process does not register."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            help="Database alias holding the work (default: the routers' db_for_read(WorkItem)).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            self._stats(options)
        except DatabaseError as exc:
            # Not migrated, or a SQLite file in a missing folder: one line.
            problem = setup_problem(work_db_for_read(options["database"]), exc)
            if problem is None:
                raise
            raise CommandError(problem) from exc

    def _stats(self, options: dict[str, Any]) -> None:
        stats = queue_stats(using=options["database"])
        if not stats:
            self.stdout.write("No work items.")
        else:
            self._queues(stats, options)
        self._workers(options)
        self._paused(options)
        self._batches(options)
        self._schedules(options)

    def _queues(self, stats: Any, options: dict[str, Any]) -> None:
        statuses = status_columns(stats)
        header = ["queue", *statuses, "oldest pending"]
        rows = []
        for queue, entry in sorted(stats.items()):
            age = entry["oldest_pending_age"]
            rows.append(
                [
                    queue,
                    *(str(entry["counts"].get(s, 0)) for s in statuses),
                    "-" if age is None else f"{age:.1f}s",
                ]
            )
        self._table(header, rows)
        flow = flow_stats(using=options["database"])
        if flow["cancel_requested"] or flow["snoozed"]:
            self.stdout.write("")
            self.stdout.write(
                f"Running items asked to cancel: {flow['cancel_requested']}; "
                f"pending items that snoozed: {flow['snoozed']}."
            )
        orphans = orphaned_handlers(using=options["database"])
        if orphans:
            self.stdout.write("")
            self.stdout.write(
                "Pending work of handlers not registered in this process (no worker with "
                "the same code will run it):"
            )
            self._table(
                ["handler", "pending", "oldest enqueued"],
                [[o["handler"], str(o["pending"]), f"{o['oldest_age']:.1f}s ago"] for o in orphans],
            )
        full, total = keys_at_limit(using=options["database"])
        if full:
            self.stdout.write("")
            shown = "" if total == len(full) else f", the {len(full)} busiest shown"
            self.stdout.write(
                f"Concurrency keys at their limit ({total}{shown}; their pending items wait):"
            )
            self._table(
                ["handler", "concurrency key", "claimed", "limit"],
                [[k["handler"], k["key"], str(k["claimed"]), str(k["limit"])] for k in full],
            )
        fair = busiest_fair_keys(using=options["database"])
        if fair:
            self.stdout.write("")
            self.stdout.write("Fair keys with the most ready work (claims take turns across them):")
            self._table(
                ["fair key", "ready", "weight"],
                [[k["key"] or "(no key)", str(k["ready"]), f"{k['weight']:g}"] for k in fair],
            )

    def _workers(self, options: dict[str, Any]) -> None:
        """The live ``run_workers`` processes (heartbeat younger than STALE_AFTER)."""
        workers = live_workers(using=options["database"])
        self.stdout.write("")
        if not workers:
            self.stdout.write(
                "Workers: none live (no run_workers process wrote a heartbeat in the last "
                f"{float(dbworker_settings.STALE_AFTER):g}s)."
            )
            return
        self.stdout.write(f"Workers: {len(workers)} live (times in UTC):")
        rows = []
        for w in workers:
            handlers = ",".join(w.handlers)
            rows.append(
                [
                    w.host,
                    "-" if w.pid is None else str(w.pid),
                    ",".join(w.queues) if w.queues else "all",
                    handlers
                    if len(w.handlers) <= HANDLERS_LISTED
                    else f"{len(w.handlers)} handlers",
                    str(w.concurrency),
                    str(w.claimed),
                    f"{w.heartbeat_age:.1f}s ago",
                    _when(w.started_at),
                    w.version or "-",
                ]
            )
        self._table(WORKER_COLUMNS, rows)

    def _paused(self, options: dict[str, Any]) -> None:
        paused = [q for q in queue_list(using=options["database"]) if q.paused]
        if not paused:
            return
        self.stdout.write("")
        self.stdout.write("Paused queues (no worker claims their items; dbworker_queue resume Q):")
        self._table(
            ["queue", "pending", "paused at (UTC)", "paused by"],
            [
                [
                    q.name,
                    str(q.pending),
                    _when(q.paused_at),
                    q.paused_by or "-",
                ]
                for q in paused
            ],
        )

    def _batches(self, options: dict[str, Any]) -> None:
        """Open batches (how many, the oldest few) and the rows waiting for their parents."""
        found = open_batches(using=options["database"])
        waiting = waiting_count(using=options["database"])
        if found.count:
            self.stdout.write("")
            shown = "" if found.count == len(found.oldest) else f", the {len(found.oldest)} oldest"
            self.stdout.write(f"Open batches: {found.count}{shown} (times in UTC):")
            self._table(
                BATCH_COLUMNS,
                [
                    [
                        f"#{b.pk}",
                        b.on_complete,
                        _when(b.created_at),
                        f"{p.done}/{p.total}",
                        str(p.succeeded),
                        str(p.failed),
                        str(p.cancelled),
                        str(p.pending),
                    ]
                    for b, p in found.oldest
                ],
            )
        if waiting:
            self.stdout.write("")
            self.stdout.write(f"Items waiting for their parents (after=): {waiting}.")

    def _schedules(self, options: dict[str, Any]) -> None:
        schedules = schedule_stats(using=options["database"])
        if not schedules:
            return
        self.stdout.write("")
        self.stdout.write("Schedules (periodic handlers; times in UTC):")
        rows = []
        for entry in schedules:
            if entry["last_status"] is not None:
                last = f"{entry['last_status']} (item {entry['last_item_id']})"
            elif entry["last_item_id"] is not None:
                last = f"pruned (item {entry['last_item_id']})"
            else:
                last = "-"
            rows.append(
                [
                    entry["name"],
                    entry["schedule"] or "(not registered here)",
                    _when(entry["last_slot"]),
                    last,
                    str(entry["skipped"]),
                    _when(entry["next_slot"]),
                ]
            )
        self._table(["handler", "schedule", "last slot", "last run", "skipped", "next slot"], rows)

    def _table(self, header: list[str], rows: list[list[str]]) -> None:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            self.stdout.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
