"""``manage.py dbworker_health --file PATH``: the probe of a worker's health file.

Exit status 0 with one line when the file that ``run_workers --health-file
PATH`` keeps fresh was written within ``--max-age`` seconds, 1 with one
line saying why not otherwise (missing: the worker is not running or has
stopped; stale: it is stuck or unhealthy, and its log says why). It reads
only the file: no database query, no Django setup beyond the command's
own, so a probe every few seconds costs the database nothing. The file must
be a regular file of the probing user (or of anyone, for root): a link at
the path, or a file another user wrote there, is not the worker's.
"""

from __future__ import annotations

import json
import os
import stat
import time
from argparse import ArgumentTypeError
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

#: Default ``--max-age``: a few of the worker's write intervals (5 s at most).
MAX_AGE = 30.0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


class Command(BaseCommand):
    help = "Exit 0 if the worker's --health-file is fresh, 1 (saying why) if not."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--file", required=True, metavar="PATH", help="The worker's file.")
        parser.add_argument(
            "--max-age",
            type=_positive,
            default=MAX_AGE,
            metavar="SECONDS",
            help=f"Oldest acceptable write (default {MAX_AGE:g}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["file"])
        try:
            found = path.lstat()
            if not stat.S_ISREG(found.st_mode):
                what = "a link" if stat.S_ISLNK(found.st_mode) else "not a regular file"
                raise CommandError(
                    f"Unhealthy: {path} is {what}, not the worker's file.", returncode=1
                )
            if os.geteuid() not in (0, found.st_uid):
                raise CommandError(
                    f"Unhealthy: {path} belongs to another user, not to the worker's.",
                    returncode=1,
                )
            age = time.time() - found.st_mtime
            body = json.loads(path.read_text())
        except FileNotFoundError:
            raise CommandError(
                f"Unhealthy: {path} does not exist (the worker is not running, or stopped).",
                returncode=1,
            ) from None
        except (OSError, ValueError) as exc:
            raise CommandError(f"Unhealthy: cannot read {path}: {exc}.", returncode=1) from None
        who = f"pid {body.get('pid', '?')} on {body.get('host', '?')}"
        if age > options["max_age"]:
            raise CommandError(
                f"Unhealthy: {path} ({who}) was last written {age:.0f} s ago, more than "
                f"{options['max_age']:g} s; the worker's log says why.",
                returncode=1,
            )
        self.stdout.write(f"Healthy: {who}, written {age:.1f} s ago.")
