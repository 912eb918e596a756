"""``manage.py dbworker_prune``: delete old finished rows in batches."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_dbworker.db import setup_problem
from django_dbworker.models import FINISHED_STATUSES
from django_dbworker.retention import prune
from django_dbworker.routing import work_db_for_write
from django_dbworker.validation import InvalidValue, queue_name

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` or plain seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise CommandError(f"--older-than {text!r}: use a number with s, m, h, d or w (e.g. 7d).")
    return timedelta(seconds=float(match.group(1)) * UNITS[match.group(2) or "s"])


class Command(BaseCommand):
    help = "Delete finished work items older than --older-than (never pending or claimed)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            required=True,
            metavar="AGE",
            help="Age of finished_at, e.g. 7d, 12h, 30m.",
        )
        parser.add_argument(
            "--status",
            action="append",
            choices=[s.value for s in FINISHED_STATUSES],
            help="Only these statuses (repeatable; default: all finished).",
        )
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="QUEUE",
            help="Only rows of this queue (repeatable; default: every queue).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the rows that would be deleted; delete nothing.",
        )
        parser.add_argument("--batch-size", type=int, default=1000)
        parser.add_argument(
            "--database",
            help="Database alias holding the work (default: the routers' db_for_write(WorkItem)).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        age = parse_age(options["older_than"])
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1.")
        statuses = options["status"] or [s.value for s in FINISHED_STATUSES]
        queues = options["queues"]
        for queue in queues or ():
            try:
                queue_name(queue)
            except InvalidValue as exc:
                raise CommandError(f"--queue {exc}.") from None
        using = work_db_for_write(options["database"])
        try:
            count = prune(
                older_than=age,
                statuses=statuses,
                batch_size=options["batch_size"],
                using=using,
                queues=queues,
                dry_run=options["dry_run"],
            )
        except DatabaseError as exc:
            # Not migrated, or a SQLite file in a missing folder: one line.
            problem = setup_problem(using, exc)
            if problem is None:
                raise
            raise CommandError(problem) from exc
        where = f" in queue(s) {', '.join(queues)}" if queues else ""
        verb = "Would delete" if options["dry_run"] else "Deleted"
        self.stdout.write(
            f"{verb} {count} work item(s) ({', '.join(statuses)}){where} "
            f"finished more than {options['older_than']} ago."
        )
