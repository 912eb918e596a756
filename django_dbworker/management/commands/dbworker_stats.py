"""``manage.py dbworker_stats``: counts by queue and status, queue lag, orphans."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_dbworker.stats import orphaned_handlers, queue_stats, status_columns


class Command(BaseCommand):
    help = (
        "Show work item counts by queue and status, the oldest claimable item's age, "
        "and pending work of handlers this process does not register."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            help="Database alias holding the work (default: the routers' db_for_read(WorkItem)).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        stats = queue_stats(using=options["database"])
        if not stats:
            self.stdout.write("No work items.")
            return
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

    def _table(self, header: list[str], rows: list[list[str]]) -> None:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            self.stdout.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
