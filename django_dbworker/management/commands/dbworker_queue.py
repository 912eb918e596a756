"""``manage.py dbworker_queue pause|resume QUEUE [--by WHO]`` and ``dbworker_queue list``.

Parses flags and calls ``django_dbworker.flow.queues``; nothing else. A bad or
unknown queue name, an unknown ``--database``, or a database not migrated is
one line on stderr and exit status 1 (CommandError), never a traceback.
"""

from __future__ import annotations

import getpass
from datetime import UTC
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections

from django_dbworker.db import setup_problem
from django_dbworker.flow.queues import UnknownQueue, pause_queue, queue_list, resume_queue
from django_dbworker.routing import work_db_for_read, work_db_for_write


def _default_by() -> str:
    """Who runs the command: the login name, so a pause always says who made it."""
    try:
        return f"{getpass.getuser()} (dbworker_queue)"
    except Exception:  # no login name (a container without passwd entry)
        return "dbworker_queue"


class Command(BaseCommand):
    help = (
        "Pause or resume a queue on every worker (stored in the database, so it holds across "
        "restarts), or list the queues with their pause and live counts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            help="Database alias holding the work (default: the routers' choice for WorkItem).",
        )
        actions = parser.add_subparsers(dest="action", required=True, metavar="pause|resume|list")
        for name, text in (
            ("pause", "Stop every worker from claiming the queue's items (running ones finish)."),
            ("resume", "Let workers claim the queue's items again."),
        ):
            sub = actions.add_parser(name, help=text)
            sub.add_argument("queue", help="The queue's name.")
            sub.add_argument("--by", default=None, help="Who does it (default: your login name).")
            if name == "pause":
                sub.add_argument(
                    "--new",
                    action="store_true",
                    help="Pause a queue nothing names yet (ahead of the deploy that adds it).",
                )
        actions.add_parser("list", help="Every known queue: paused or not, pending and claimed.")

    def handle(self, *args: Any, **options: Any) -> None:
        action, using = options["action"], options["database"]
        if using is not None and using not in connections.settings:
            raise CommandError(f"No database {using!r} in DATABASES.")
        try:
            self._act(action, using, options)
        except DatabaseError as exc:
            # Not migrated, or a SQLite file in a missing folder: one line.
            db = work_db_for_read(using) if action == "list" else work_db_for_write(using)
            problem = setup_problem(db, exc)
            if problem is None:
                raise
            raise CommandError(problem) from exc

    def _act(self, action: str, using: str | None, options: dict[str, Any]) -> None:
        if action == "list":
            self._list(using)
            return
        by = options["by"] if options["by"] is not None else _default_by()
        try:
            if action == "pause":
                state = pause_queue(options["queue"], by=by, using=using, new=options["new"])
            else:
                state = resume_queue(options["queue"], by=by, using=using)
        except UnknownQueue as exc:
            ahead = " To pause it before anything names it: pause --new." * (action == "pause")
            raise CommandError(f"{exc}{ahead}") from None
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if state.paused:
            self.stdout.write(f"Queue {state.name!r} is paused (by {state.paused_by or '-'}).")
        else:
            self.stdout.write(f"Queue {state.name!r} is running.")

    def _list(self, using: str | None) -> None:
        header = ["queue", "state", "pending", "claimed", "paused at (UTC)", "paused by"]
        rows = [
            [
                q.name,
                "paused" if q.paused else "running",
                str(q.pending),
                str(q.claimed),
                q.paused_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if q.paused_at else "-",
                q.paused_by or "-",
            ]
            for q in queue_list(using)
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
            self.stdout.write(line.rstrip())
