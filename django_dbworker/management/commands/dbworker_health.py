"""``manage.py dbworker_health --file PATH``: the probe of a worker's health file.

Exit status 0 with one line when the file that ``run_workers --health-file
PATH`` keeps fresh was written within ``--max-age`` seconds, 1 with one
line saying why not otherwise (missing: the worker is not running or has
stopped; stale: it is stuck or unhealthy, and its log says why). It reads
only the file: no database query, no Django setup beyond the command's
own, so a probe every few seconds costs the database nothing. The file must
be a regular file of the probing user (or of anyone, for root): a link at
the path, or a file another user wrote there, is not the worker's. The answer
is ``django_dbworker.probe``'s, which a liveness probe can run without Django.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbworker.probe import DESCRIPTION, add_arguments, probe


class Command(BaseCommand):
    help = DESCRIPTION
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        healthy, line = probe(Path(options["file"]), options["max_age"])
        if not healthy:
            raise CommandError(line, returncode=1)
        self.stdout.write(line)
